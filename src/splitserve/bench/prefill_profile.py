"""`splitserve bench prefill-profile`: where a lone long prompt's time goes.

Issue 22: a lone ~1,000-token prompt waited 1.3-1.45x longer on splitserve than
on vLLM, which spreads it over every core. This runs one prompt alone through the
engine (no server: the prefill itself) at each thread count, side by side in one
run, and prints per thread count:

- the time to the first token (median of --repeats, after an untimed pass), the
  steps it took and the speed-up over the first thread count;
- one profiled pass: the self time of each torch op (the matmuls, the CPU flash
  attention, the elementwise rest), its share of the pass and its call count;
- the FLOP rate of the pass: the model's linear layers and the causal attention
  over the prompt, counted from the shapes, against the time;
- the attention alone at the prompt's chunks, side by side: engine/kernels/prefill.py's
  kernel (where the CPU has AVX-512 BF16) against torch's SDPA on the same q and cache,
  one layer's heads, median of --repeats, and the kernel's speed-up.

    splitserve bench prefill-profile --threads 1,2 --results bench/results/prefill-profile-cpu.txt
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.bench.results_file import with_results

if TYPE_CHECKING:
    from splitserve.engine.config import ModelConfig
    from splitserve.engine.engine import Engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default=None, help="default: the machine's tuned dtype (engine/tuned.py)")
    p.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens")
    p.add_argument("--threads", default="1,2", help="comma list of torch thread counts, run side by side")
    p.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens: the prefill chunk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=8, help="ops listed per profile")
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.tuned import detect_machine, tuned_defaults

    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    dtype = args.dtype or tuned_defaults(detect_machine()).dtype
    cfg = EngineConfig(dtype=dtype, max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
    engine, _ = Engine.from_path(args.model, cfg, progress=False)
    prompt = [(i * 7919) % (engine.model_cfg.vocab_size - 200) + 100 for i in range(args.prompt_len)]
    flops = prefill_flops(engine.model_cfg, args.prompt_len)
    print(
        f"one {args.prompt_len}-token prompt alone, {engine.model_cfg.name} in {dtype}, chunk {args.chunk}; "
        f"{flops / 1e9:.1f} GFLOP (linear layers + causal attention)"
    )
    base = None
    for t in threads:
        torch.set_num_threads(t)
        _prefill(engine, prompt)  # untimed: first-use costs of this thread count
        times = [_prefill(engine, prompt) for _ in range(args.repeats)]
        ttft = statistics.median(s for s, _ in times)
        base = base or ttft
        print(
            f"\n{t} thread(s): TTFT {ttft * 1e3:.0f} ms (runs {', '.join(f'{s * 1e3:.0f}' for s, _ in times)}), "
            f"{times[0][1]} steps, {base / ttft:.2f}x the first, {flops / ttft / 1e9:.0f} GFLOP/s"
        )
        _profile(engine, prompt, args.top)
        _attention_side_by_side(engine.model_cfg, args.prompt_len, args.chunk, args.repeats)
    return 0


def _attention_side_by_side(cfg: ModelConfig, prompt_len: int, chunk: int, repeats: int) -> None:
    """One layer's attention for each chunk of the prompt: the kernel against SDPA, same inputs."""
    import torch

    from splitserve.engine.kernels.prefill import prefill_attention, prefill_kernel_available, sdpa_reference

    if not prefill_kernel_available():
        print("  attention: no prefill kernel on this CPU (no AVX-512 BF16): SDPA is the path")
        return
    gen = torch.Generator().manual_seed(0)
    bs = 16
    blocks = -(-prompt_len // bs)
    cache = torch.randn(blocks, 2, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int64)
    scale = cfg.head_dim**-0.5
    for start in range(0, prompt_len, chunk):
        ctx = min(prompt_len, start + chunk)
        q = torch.randn(ctx - start, cfg.num_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
        ours = _median_s(functools.partial(prefill_attention, q, cache, table, ctx, scale), repeats)
        theirs = _median_s(functools.partial(sdpa_reference, q, cache, table, ctx, scale, torch.bfloat16), repeats)
        pairs = (ctx - start) * (start + ctx + 1) / 2  # query-key pairs under the causal mask
        gflop = 4 * cfg.num_heads * cfg.head_dim * pairs / 1e9
        print(
            f"  attention, one layer, queries {start}..{ctx - 1}: kernel {ours * 1e3:.2f} ms "
            f"({gflop / ours:.0f} GFLOP/s), SDPA {theirs * 1e3:.2f} ms ({gflop / theirs:.0f} GFLOP/s): "
            f"{theirs / ours:.2f}x"
        )


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # untimed: first use
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prefill(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    from splitserve.engine.sampling import SamplingParams

    request_id = f"p{time.perf_counter_ns()}"  # unique: the engine refuses a duplicate id
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def _profile(engine: Engine, prompt: list[int], top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _prefill(engine, prompt)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    print(f"  profiled pass: {total / 1e3:.0f} ms of op self time")
    for e in ops[:top]:
        share = e.self_cpu_time_total / total
        print(f"  {e.key:<52} {e.self_cpu_time_total / 1e3:8.1f} ms  {share:6.1%}  {e.count:5d} calls")


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """A prefill's arithmetic: every linear layer over n tokens, the LM head over the last one, and
    causal attention (QK^T and PV over the n(n+1)/2 query-key pairs of each head)."""
    per_token = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_token += 3 * cfg.hidden_size * cfg.intermediate_size
    linear = 2 * n * per_token * cfg.num_layers + 2 * cfg.vocab_size * cfg.hidden_size
    attention = 4 * cfg.num_heads * cfg.head_dim * (n * (n + 1) / 2) * cfg.num_layers
    return float(linear + attention)
