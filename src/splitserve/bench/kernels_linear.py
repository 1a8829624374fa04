"""Weight-streaming bandwidth of the linear kernel against F.linear and a plain read.

    python -m splitserve.bench.kernels_linear [--threads 1 2] [--batch 1 32] [--dtype bf16 fp32]

Every shape is run over distinct copies of its weight (30 by default, one per
layer, as a decode step sees them; more for small matrices, so that a pass
reads at least 96 MB, 3x the L3), so no weight is in cache when it is read.
GB/s is weight bytes over time. `--dtype` picks the weights: bf16 (x bf16) or
fp32 (x fp32, the kernel's fp32-W path). `read` sums the same copies viewed as fp32: the
memory-read roofline measured the same way. The methods run interleaved,
round by round, and each reports its fastest round (--stat median for the
median): on a machine shared with other jobs the fastest round is the one
least disturbed, and interleaving exposes all three to the same neighbours. `step` is a whole SmolLM2-135M decode step
(30 layers of qkv, o, gate_up, down, then lm_head: 269 MB of bf16, 538 MB of fp32).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from splitserve.engine.blocks import cdiv
from splitserve.engine.kernels.linear import _extension, _run

# SmolLM2-135M, [N, K] per matrix as nn.Linear stores it.
SMOLLM2_LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMOLLM2_LM_HEAD = (49152, 576)
SMOLLM2_LAYERS = 30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Row(NamedTuple):
    name: str
    mbytes: float
    kernel: float
    torch: float
    read: float


def _time_pass(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(weights: list[Tensor], xs: dict[int, Tensor], rounds: int, stat: str) -> tuple[float, float, float]:
    """GB/s of kernel, F.linear and plain read over one pass of `weights`, best or median of `rounds`."""
    ext = _extension()
    assert ext is not None, "the kernel did not build"
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def run_kernel() -> None:
        for w in weights:
            _run(ext, xs[w.shape[1]], w, None)

    def run_torch() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def run_read() -> None:
        for w in weights:
            (w if w.dtype == torch.float32 else w.view(torch.float32)).sum()

    methods = [run_kernel, run_torch, run_read] if ext is not None else [run_torch, run_read]
    for fn in methods:  # warm: page faults, thread pool, oneDNN's primitive cache
        fn()
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(rounds):
        for i, fn in enumerate(methods):
            times[i].append(_time_pass(fn))
    pick = min if stat == "best" else statistics.median
    gbs = [nbytes / pick(t) / 1e9 for t in times]
    return (gbs[0], gbs[1], gbs[2]) if ext is not None else (float("nan"), gbs[0], gbs[1])


def _copy_count(nbytes: int, copies: int) -> int:
    """`copies`, raised until a pass reads 3x the 32 MB L3, capped where one copy alone is past it."""
    floor = cdiv(96_000_000, nbytes)
    return max(floor, copies) if nbytes * copies < 200_000_000 else max(2, floor)


def _copies(n: int, k: int, count: int, dtype: torch.dtype) -> list[Tensor]:
    return [torch.randn(n, k, dtype=dtype) for _ in range(count)]


def bench(
    threads: int, batch: int, copies: int, rounds: int, stat: str = "best", dtype: torch.dtype = torch.bfloat16
) -> list[Row]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    size = torch.empty((), dtype=dtype).element_size()
    ks = {k for _, k in SMOLLM2_LAYER.values()} | {SMOLLM2_LM_HEAD[1]}
    xs = {k: torch.randn(batch, k, dtype=dtype) for k in ks}
    rows = []
    with torch.inference_mode():
        for name, (n, k) in [*SMOLLM2_LAYER.items(), ("lm_head", SMOLLM2_LM_HEAD)]:
            count = _copy_count(n * k * size, copies)
            ws = _copies(n, k, count, dtype)
            rows.append(Row(f"{name} {n}x{k}", n * k * size / 1e6, *_measure(ws, xs, rounds, stat)))
            del ws
        step = []
        for _ in range(SMOLLM2_LAYERS):
            step += [torch.randn(n, k, dtype=dtype) for n, k in SMOLLM2_LAYER.values()]
        step.append(torch.randn(*SMOLLM2_LM_HEAD, dtype=dtype))
        mb = sum(w.numel() * size for w in step) / 1e6
        rows.append(Row("step (all 121 matrices)", mb, *_measure(step, xs, rounds, stat)))
    return rows


def plain_read_gbs(threads: int, gib: float = 1.0, rounds: int = 5) -> float:
    """x.sum() over one fp32 tensor of `gib` GiB: the simplest read-bandwidth figure."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(_time_pass(x.sum) for _ in range(rounds))
    return x.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stat", choices=["best", "median"], default="best")
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        nargs="+",
        default=["bf16"],
        help="weight dtype (x the same): bf16, fp32 or both",
    )
    args = ap.parse_args(argv)
    ext = _extension()
    print(f"kernel: {'ISA level ' + str(ext.isa()) if ext is not None else 'unavailable (F.linear only)'}")
    for threads in args.threads:
        print(f"\nthreads={threads}: x.sum() over 1 GiB fp32: {plain_read_gbs(threads):.1f} GB/s")
        for dtype_name, batch in [(d, b) for d in args.dtype for b in args.batch]:
            print(
                f"  {dtype_name} B={batch:<3} {'matrix':<21}{'MB':>7}{'kernel':>9}{'F.linear':>10}{'read':>8}"
                f"{'kern/read':>11}{'kern/F':>8}"
            )
            for r in bench(threads, batch, args.copies, args.rounds, args.stat, DTYPES[dtype_name]):
                print(
                    f"        {r.name:<26}{r.mbytes:>7.1f}{r.kernel:>9.1f}{r.torch:>10.1f}{r.read:>8.1f}"
                    f"{r.kernel / r.read:>10.0%}{r.kernel / r.torch:>8.2f}"
                )


if __name__ == "__main__":
    main()
