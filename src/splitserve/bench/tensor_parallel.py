"""Prefill time and decode step time at tensor-parallel size N against 1, same model,
same machine, alternating which goes first each repetition; medians.

    python -m splitserve.bench.tensor_parallel --tp 3            # SmolLM2-135M, fp32
    python -m splitserve.bench.tensor_parallel --tp 2 --tiny     # a tiny random model

On a CPU the ranks share the machine's cores (each rank besides 0 takes
threads / N of them), so the figures say what the lockstep, the all-reduces and
the split cost here, not what N devices would gain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.engine import Engine
from splitserve.engine.quant.weight import floats
from splitserve.engine.sampling import SamplingParams
from splitserve.measure.hw import machine_line


def prefill_s(engine: Engine, prompt_len: int, vocab: int, seed: int) -> float:
    """Seconds for one prompt's prefill (one step: the chunk is the whole prompt) and its first token."""
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


def decode_step_s(engine: Engine, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> float:
    """Median seconds of a decode step of `batch` sequences, after their prefill."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{seed}-{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.requests.values()):
        engine.step()  # prefill until every request has its first token
    times = []
    while engine.has_work:
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.bench.tensor_parallel", description=__doc__)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size to compare with 1")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (4 heads, 2 KV heads) instead of SmolLM2")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads of rank 0 and of TP 1 (0: default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg: ModelConfig
    if a.tiny:
        from splitserve.engine.random_model import random_weights, tiny_model_config

        cfg = tiny_model_config(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
        weights = random_weights(cfg)
    else:
        from splitserve.engine.weights import load_model

        loaded = load_model(None, torch.float32, progress=False)
        cfg, weights = loaded.config, floats(loaded.weights)
    chunk = max(512, -(-a.prompt_len // 16) * 16)
    prefill: dict[int, list[float]] = {1: [], a.tp: []}
    decode: dict[int, list[float]] = {1: [], a.tp: []}
    for rep in range(a.reps):
        for tp in (1, a.tp) if rep % 2 == 0 else (a.tp, 1):
            ecfg = EngineConfig(
                num_blocks=1024, max_num_batched_tokens=chunk, enable_prefix_caching=False, tensor_parallel_size=tp
            )
            engine = Engine(cfg, weights, ecfg)
            try:
                prefill_s(engine, a.prompt_len, cfg.vocab_size, seed=1000 + rep)  # warm-up: lazy builds
                prefill[tp].append(prefill_s(engine, a.prompt_len, cfg.vocab_size, seed=rep))
                decode[tp].append(decode_step_s(engine, a.batch, a.prompt_len, a.steps, cfg.vocab_size, seed=rep))
            finally:
                engine.close()
    threads = torch.get_num_threads()
    print(machine_line())
    print(
        f"{cfg.name}, fp32, {a.reps} repetitions (medians); TP 1 on {threads} torch threads, "
        f"TP {a.tp} on {max(1, threads // a.tp)} per rank"
    )
    for tp in (1, a.tp):
        pf, dc = statistics.median(prefill[tp]), statistics.median(decode[tp])
        print(
            f"TP {tp}: prefill of {a.prompt_len} tokens {pf * 1e3:.1f} ms; "
            f"decode step at batch {a.batch} {dc * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
