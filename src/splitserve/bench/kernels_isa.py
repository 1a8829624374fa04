"""The CPU kernels' paths side by side: what each ISA level this CPU has buys, in one run.

    splitserve bench kernels-isa [--batches 1,8] [--contexts 256,1024,2048] [--rounds 5]
                                 [--results bench/results/kernels-isa-cpu.txt]

The kernels pick their path from the CPU's flags (the header states them); here every path the
CPU can run is timed on the same work, the paths interleaved round by round and each reporting
its fastest round (the least disturbed on a shared machine), against the path the engine takes:

- linear.cpp on a SmolLM2-135M decode step's bf16 weights (30 layers of qkv, o, gate_up, down,
  then lm_head: 269 MB), at each of --batches rows: AVX2+FMA, AVX-512F (both widen bf16 to fp32
  and multiply-add) and AVX-512 BF16 (vdpbf16ps on bf16 pairs), as GB/s of weights;
- decode.cpp's paged attention over a batch of 8 sequences at each of --contexts tokens, 30
  layers of SmolLM2's heads (9 query heads, 3 KV heads of 64), for each KV dtype (the model's
  bf16, int8, fp8 e4m3): x86-64, AVX2+FMA and AVX-512, as ms per step of attention (the read
  alone: the write is the same few rows on every path).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splitserve.bench.results_file import with_results
from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.kernels import decode as kd
from splitserve.engine.kernels import linear as kl
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.measure.hw import load_average, machine_line

# SmolLM2-135M: [N, K] per matrix as nn.Linear stores it; its attention heads.
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
KV_DTYPES = ("bfloat16", "int8", "fp8_e4m3")
ATTENTION_BATCH = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8", help="rows of x for the linear kernel's paths")
    p.add_argument("--contexts", default="256,1024,2048", help="context tokens per sequence for attention's paths")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every path once, interleaved")
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"bench kernels-isa: {flag} takes comma-separated counts, not {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"bench kernels-isa: {flag} needs positive counts, got {text!r}")
    return values


def _run(args: argparse.Namespace) -> int:
    batches, contexts = _ints(args.batches, "--batches"), _ints(args.contexts, "--contexts")
    if args.rounds < 1:
        raise SystemExit("bench kernels-isa: --rounds must be at least 1")
    print(f"# splitserve bench kernels-isa --batches {args.batches} --contexts {args.contexts} --rounds {args.rounds}")
    print(machine_line())
    kernels = kd.decode_kernels()
    if kl.best_isa() == 0 or kernels is None:
        print("the C++ kernels are not available here (disabled or unbuildable): nothing to compare")
        return 1
    with torch.inference_mode():
        _linear_paths(batches, args.rounds)
        _attention_paths(kernels, contexts, args.rounds)
    print(f"load average at the end: {load_average()}")
    return 0


def _best(fns: dict[int, Callable[[], object]], rounds: int) -> dict[int, float]:
    """Each function's fastest of `rounds` rounds (seconds), all of them run once per round, in turn."""
    for fn in fns.values():
        fn()  # untimed: first-touch and code paths warm
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def _linear_paths(batches: list[int], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(LAYERS) for n, k in LAYER_SHAPES.values()]
    weights.append(torch.randn(*LM_HEAD, generator=gen).bfloat16())
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    paths = range(1, kl.best_isa() + 1)
    print(
        f"\nlinear.cpp, a SmolLM2-135M decode step's bf16 weights ({nbytes / 1e6:.0f} MB), x in bf16; "
        f"fastest of {rounds} rounds; the engine takes {kl.ISA_NAMES[kl.best_isa()]}:"
    )
    for batch in batches:
        xs = {k: torch.randn(batch, k, generator=gen).bfloat16() for k in {w.shape[1] for w in weights}}
        best = _best({isa: _linear_pass(weights, xs, isa) for isa in paths}, rounds)
        top = best[kl.best_isa()]
        cells = [
            f"{kl.ISA_NAMES[isa]} {best[isa] * 1e3:.2f} ms = {nbytes / best[isa] / 1e9:.1f} GB/s "
            f"({best[isa] / top:.2f}x)"
            for isa in paths
        ]
        print(f"  batch {batch:>2}: " + " | ".join(cells))


def _linear_pass(weights: list[torch.Tensor], xs: dict[int, torch.Tensor], isa: int) -> Callable[[], object]:
    return lambda: [kl.linear_on(xs[w.shape[1]], w, isa) for w in weights]


def _attention_case(kind: str, ctx: int) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A cache of LAYERS layers whose ATTENTION_BATCH sequences hold ctx tokens of random K/V each."""
    per_seq = -(-ctx // BLOCK)
    cache = KVCache(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, kind), ATTENTION_BATCH * per_seq + 1).tensor
    gen = torch.Generator().manual_seed(ctx)
    raw = cache.view(torch.uint8)
    if kind == "bfloat16":
        cache.normal_(generator=gen)
    else:  # values of every magnitude, then scales: the format's tail of each block is its fp32 scales
        values = 2 * BLOCK * KV_HEADS * HEAD_DIM
        raw[..., :values] = torch.randint(0, 256, raw[..., :values].shape, generator=gen, dtype=torch.uint8)
        raw[..., :values][raw[..., :values] % 128 == 127] = 0  # no e4m3 NaN codes
        raw[..., values:].view(torch.float32).fill_(0.01)
    tables = torch.arange(1, ATTENTION_BATCH * per_seq + 1).view(ATTENTION_BATCH, per_seq)
    ctxs = torch.full((ATTENTION_BATCH,), ctx)
    last = ctxs - 1
    slots = tables[torch.arange(ATTENTION_BATCH), last // BLOCK].contiguous()
    meta = AttentionMetadata(slots, last % BLOCK, tables, ctxs, [1] * ATTENTION_BATCH, [ctx] * ATTENTION_BATCH, True)
    qkv = torch.randn(ATTENTION_BATCH, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    return cache, meta, qkv


def _attention_paths(kernels: kd.DecodeKernels, contexts: list[int], rounds: int) -> None:
    paths = range(1, kernels.best_isa + 1)
    print(
        f"\ndecode.cpp's paged attention, batch {ATTENTION_BATCH}, {LAYERS} layers of {HEADS} query / {KV_HEADS} KV "
        f"heads of {HEAD_DIM}, model bf16; ms per step of attention, fastest of {rounds} rounds; the engine takes "
        f"{kd.ISA_NAMES[kernels.best_isa]}; in brackets each against the same path over bfloat16 KV:"
    )
    for ctx in contexts:
        fns: dict[int, Callable[[], object]] = {}
        cases = {kind: _attention_case(kind, ctx) for kind in KV_DTYPES}
        for j, (kind, (cache, meta, qkv)) in enumerate(cases.items()):
            for isa in paths:
                fns[j * 10 + isa] = _attend_all_layers(kernels.with_isa(isa), kind, cache, meta, qkv)
        best = _best(fns, rounds)
        for j, kind in enumerate(KV_DTYPES):
            cells = [
                f"{kd.ISA_NAMES[isa]} {best[j * 10 + isa] * 1e3:.2f} ms ({best[j * 10 + isa] / best[isa]:.2f}x)"
                for isa in paths
            ]
            print(f"  context {ctx:>5} {kind:<9} KV: " + " | ".join(cells))


def _attend_all_layers(
    kernels: kd.DecodeKernels, kind: str, cache: torch.Tensor, meta: AttentionMetadata, qkv: torch.Tensor
) -> Callable[[], object]:
    """One step's attention over every layer (read only: the new token's K/V are the cache's already)."""
    b, bf16 = ATTENTION_BATCH, torch.bfloat16
    step = kernels.step(
        torch.zeros(b, 8, dtype=bf16),
        cache,
        meta,
        torch.ones(b, HEAD_DIM, dtype=bf16),
        torch.zeros(b, HEAD_DIM, dtype=bf16),
        num_heads=HEADS,
        scale=HEAD_DIM**-0.5,
        eps=1e-5,
        intermediate_size=8,
        kv_heads=0 if kind == "bfloat16" else KV_HEADS,
    )
    return lambda: [step.attention(i, qkv, write=False) for i in range(LAYERS)]
