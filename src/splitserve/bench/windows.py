"""What a windowed model's cache of pages buys (engine/kv_groups.py), against holding the whole
context for every layer, in one run.

    splitserve bench windows [--model gemma3-270m] [--dtype bfloat16] [--pool-mib 160]
                             [--requests 8] [--context 4096] [--tokens 256] [--chunk 512]
                             [--results bench/results/windows-cpu.txt]

On a model of windowed and global layers (the embedded Gemma 3 270M: 15 layers with a window of
512 tokens, 3 global), two engines with the same KV pool in bytes (--pool-mib, --kv-cache-bytes):

- "paged": the default, the windowed layers' pages go back to the pool behind the window;
- "plain": one row per layer (EngineConfig.hybrid_kv_cache=False), every layer holds its whole
  context until the request ends.

--requests prompts of --context tokens, each asking for --tokens more, arrive together; each
engine's figure is the most sequences running at once and the steps it took, and the ratio of
the two. Each request decodes for longer than its prefill takes, so that memory, not the
prefill's pace, decides how many run at once.

Then the bytes a KV transfer sends (every global layer's blocks, each windowed layer's from
`window_start` on, as the prefill connector sends them) against the whole context's, for a
range of contexts: arithmetic from the same function, not a timed run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from splitserve.bench.results_file import with_results
from splitserve.engine.blocks import cdiv, window_start
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.measure.hw import machine_line

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
MODES = {"plain": False, "paged": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma3-270m", help="a model of windowed and global layers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pool-mib", type=float, default=160.0, help="the fixed KV pool, MiB (--kv-cache-bytes)")
    p.add_argument("--requests", type=int, default=8, help="prompts arriving together")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of each request")
    p.add_argument("--tokens", type=int, default=256, help="tokens each request asks for")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (--max-num-batched-tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    print(
        f"# splitserve bench windows --model {args.model} --dtype {args.dtype} --pool-mib {args.pool_mib:g} "
        f"--requests {args.requests} --context {args.context} --tokens {args.tokens} --chunk {args.chunk} "
        f"--block-size {args.block_size}"
    )
    print(machine_line())
    pool = int(args.pool_mib * 2**20)
    most: dict[str, int] = {}
    windows: tuple[int, ...] = ()
    for name, paged in MODES.items():
        cfg = EngineConfig(
            dtype=args.dtype,
            kv_cache_bytes=pool,
            num_blocks=1,
            block_size=args.block_size,
            max_num_seqs=256,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,  # the prompts' shared beginning would be held once for all
            hybrid_kv_cache=paged,
        )
        engine, tok = Engine.from_path(args.model, cfg, progress=False)
        try:
            windows = engine.layout.windows
            if name == "plain":
                kinds = sorted({w for w in windows})
                print(f"model: {len(windows)} layers, windows {kinds} (0: global); pool {pool} B")
            text = tok.encode(TEXT.read_text())
            prompt = (text * (1 + args.context // max(1, len(text))))[: args.context - 1]  # the text, repeated
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            for i in range(args.requests):
                engine.add_request(f"w{i}", [*prompt, 1 + i], params)
            peak = steps = 0
            t0 = time.perf_counter()
            while engine.has_work:
                engine.step()
                steps += 1
                peak = max(peak, engine.stats().running_requests)
            most[name] = peak
            bm = engine.blocks
            print(
                f"  {name}: {bm.num_pages} pages of {engine.kv_cache.rows} layer rows ({bm.num_blocks} blocks with "
                f"every layer's KV); most sequences running at once {peak}; {steps} steps, "
                f"{engine.scheduler.num_preemptions} preemptions, {time.perf_counter() - t0:.0f} s"
            )
        finally:
            engine.close()
    print(f"paged against plain: {most['paged'] / max(1, most['plain']):.2f}x the sequences running at once")
    _transfer_bytes(windows, args.block_size)
    return 0


def _transfer_bytes(windows: tuple[int, ...], block_size: int) -> None:
    """Layer-blocks a transfer sends against the whole context's, at a few contexts (arithmetic)."""
    print("KV bytes a transfer sends against the whole context's (window_start, as the prefill connector sends):")
    for context in (512, 1024, 4096, 32768):
        blocks = cdiv(context, block_size)
        sent = sum(blocks - window_start(context, w, block_size) for w in windows)
        print(f"  {context:>6} tokens: {sent / (blocks * len(windows)):.0%}")
