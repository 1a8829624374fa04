"""TTFT of a prefix loaded from the host or the disk tier against recomputing it, in one run.

    splitserve bench tiers [--context-tokens 1536] [--suffix-tokens 32] [--trials 3] [--dtype float32]

On the default model, one engine with both tiers (engine/kv_tiers.py) and a pool just larger than
one context. Each trial times the first token of three second turns (a context and a new suffix):
- recompute: a context this engine never saw (what a second turn costs when its context was evicted
  and nothing kept it);
- host: the context was prefilled, then a filler prompt took the whole pool, so its blocks went to
  the host tier;
- disk: as host, then a second filler pushed them on from the host tier (one context large) to disk;
  the page cache is dropped for the tier's files first (posix_fadvise DONTNEED after a sync), so the
  blocks come off the device, not from memory (--keep-page-cache: not).
The engine decides load or recompute itself from what it measured (tier bandwidths, prefill speed);
the blocks each hit loaded from each tier are printed beside it. The issue's targets: a host hit's
TTFT at most 0.3x recompute, a disk hit's at most 0.6x, neither slower than recompute.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine.blocks import cdiv
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_tier_blocks import DiskTier
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.measure.hw import code_version, cpu_flags, load_average, machine

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=1536, help="the shared context of a conversation")
    p.add_argument("--suffix-tokens", type=int, default=32, help="the new turn after it")
    p.add_argument("--trials", type=int, default=3, help="trials; each times recompute, a host hit, a disk hit")
    p.add_argument("--dtype", default="float32", help="the engine's dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--disk-dir", default="", help="the disk tier's directory (default: a temporary one)")
    p.add_argument("--keep-page-cache", action="store_true", help="leave the disk tier's files in the page cache")


def run(args: argparse.Namespace) -> int:
    _header(args)
    bs = args.block_size
    loaded = load_model(None, torch.float32 if args.dtype == "float32" else torch.bfloat16, progress=False)
    m = loaded.config
    elem = torch.tensor([], dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16).element_size()
    block_bytes = m.num_layers * 2 * bs * m.num_kv_heads * m.head_dim * elem
    ctx_blocks = cdiv(args.context_tokens + args.suffix_tokens + 1, bs)
    num_blocks = ctx_blocks + 16
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="splitserve-bench-tiers-")
    cfg = EngineConfig(
        dtype=args.dtype,
        block_size=bs,
        num_blocks=num_blocks,
        kv_host_tier_bytes=(ctx_blocks + 4) * block_bytes,
        kv_disk_tier_bytes=4 * ctx_blocks * (block_bytes + 64),
        kv_disk_tier_dir=disk_dir,
    )
    engine = Engine(m, loaded.weights, cfg, tuple(loaded.tokenizer.eos_token_ids))
    print(
        f"model {m.name}, {args.dtype}; pool {num_blocks} blocks of {bs} tokens ({num_blocks * block_bytes / 2**20:.1f}"
        f" MiB, {block_bytes / 2**10:.0f} KiB a block); host tier {cfg.kv_host_tier_bytes / 2**20:.1f} MiB (one "
        f"context); disk tier {cfg.kv_disk_tier_bytes / 2**20:.1f} MiB under {disk_dir}; page cache "
        f"{'kept' if args.keep_page_cache else 'dropped before each disk hit'}"
    )
    try:
        _ttft(engine, "warm-up", _tokens(random.Random(1), args.context_tokens, m.vocab_size))  # lazy builds
        rows = [_trial(engine, args, i, m.vocab_size) for i in range(args.trials)]
    finally:
        if not args.disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    _summary(engine, rows, args.context_tokens, block_bytes)
    return 0


def _header(args: argparse.Namespace) -> None:
    command = (
        f"splitserve bench tiers --context-tokens {args.context_tokens} --suffix-tokens {args.suffix_tokens} "
        f"--trials {args.trials} --dtype {args.dtype} --block-size {args.block_size}"
        + (" --keep-page-cache" if args.keep_page_cache else "")
    )
    now = datetime.datetime.now(datetime.UTC)
    print(f"# {command}   [code {code_version()}; {now:%Y-%m-%d %H:%M} UTC; CPU flags: {cpu_flags()}]")
    print(
        f"machine: {machine(torch.device('cpu'))}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load_average()}"
    )


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _ttft(engine: Engine, rid: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, FIRST)
    while engine.has_work:
        if any(o.request_id == rid for o in engine.step()):
            elapsed = time.perf_counter() - t0
            while engine.has_work:
                engine.step()
            return elapsed
    raise RuntimeError(f"{rid} gave no token")


def _hits(engine: Engine) -> dict[str, int]:
    assert engine.tiers is not None
    return {name: s.hits for name, s in engine.tiers.stats.items()}


def _hit(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, dict[str, int]]:
    before = _hits(engine)
    t = _ttft(engine, rid, prompt)
    after = _hits(engine)
    return t, {k: after[k] - before[k] for k in after}


def _drop_page_cache(directory: str) -> None:
    os.sync()
    for p in Path(directory).glob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _trial(engine: Engine, args: argparse.Namespace, i: int, vocab: int) -> dict[str, float]:
    rng = random.Random(1000 + i)
    ctx, sfx = args.context_tokens, args.suffix_tokens
    filler_len = engine.blocks.num_blocks * args.block_size - 1  # with its one token, every block of the pool
    recompute = _ttft(engine, f"r{i}", _tokens(rng, ctx + sfx, vocab))

    host_ctx = _tokens(rng, ctx, vocab)
    _ttft(engine, f"h{i}-1", host_ctx)
    _ttft(engine, f"h{i}-fill", _tokens(rng, filler_len, vocab))
    host, host_hits = _hit(engine, f"h{i}-2", host_ctx + _tokens(rng, sfx, vocab))

    disk_ctx = _tokens(rng, ctx, vocab)
    _ttft(engine, f"d{i}-1", disk_ctx)
    _ttft(engine, f"d{i}-fill", _tokens(rng, filler_len, vocab))
    _ttft(engine, f"d{i}-fill2", _tokens(rng, filler_len, vocab))
    assert engine.tiers is not None
    disk_tier = engine.tiers.tier("disk")
    assert isinstance(disk_tier, DiskTier)
    if not args.keep_page_cache:
        _drop_page_cache(str(disk_tier.dir))
    disk, disk_hits = _hit(engine, f"d{i}-2", disk_ctx + _tokens(rng, sfx, vocab))
    print(
        f"trial {i + 1}: TTFT recompute {recompute * 1e3:.0f} ms | host hit {host * 1e3:.0f} ms "
        f"({host / recompute:.2f}x; blocks loaded {_fmt(host_hits)}) | disk hit {disk * 1e3:.0f} ms "
        f"({disk / recompute:.2f}x; blocks loaded {_fmt(disk_hits)})"
    )
    return {"recompute": recompute, "host": host, "disk": disk}


def _fmt(hits: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in hits.items())


def _summary(engine: Engine, rows: list[dict[str, float]], context_tokens: int, block_bytes: int) -> None:
    assert engine.tiers is not None
    med = {k: statistics.median(r[k] for r in rows) for k in ("recompute", "host", "disk")}
    bw = engine.tiers.bandwidth.values
    speed = engine.tiers.prefill_tokens_per_s or 0.0
    blocks = context_tokens // engine.cfg.block_size
    print(
        f"measured by the engine (running averages): host tier {bw.get('host', 0) / 1e9:.2f} GB/s, disk tier "
        f"{bw.get('disk', 0) / 1e9:.2f} GB/s, prefill {speed:.0f} tokens/s; for the {context_tokens}-token context "
        f"that predicts load {blocks * block_bytes / bw.get('host', 1) * 1e3:.0f} ms (host), "
        f"{blocks * block_bytes / bw.get('disk', 1) * 1e3:.0f} ms (disk), recompute "
        f"{context_tokens / speed * 1e3 if speed else 0:.0f} ms"
    )
    for name, s in engine.tiers.stats.items():
        print(
            f"tier {name}: {s.hits} hits, {s.bytes_loaded / 2**20:.1f} MiB loaded in {s.load_seconds * 1e3:.0f} ms, "
            f"{s.recomputed_instead} recomputed instead, {s.checksum_failures} checksum failures, "
            f"{s.write_failures} write failures, {s.blocks} blocks held"
        )
    host, disk = med["host"] / med["recompute"], med["disk"] / med["recompute"]
    print(
        f"median TTFT over {len(rows)} trials: recompute {med['recompute'] * 1e3:.0f} ms, host hit "
        f"{med['host'] * 1e3:.0f} ms ({host:.2f}x), disk hit {med['disk'] * 1e3:.0f} ms ({disk:.2f}x)"
    )
    slower = any(r["host"] > r["recompute"] or r["disk"] > r["recompute"] for r in rows)
    print(
        f"targets: host hit <= 0.3x recompute: {'met' if host <= 0.3 else 'NOT met'}; disk hit <= 0.6x: "
        f"{'met' if disk <= 0.6 else 'NOT met'}; no hit slower than its trial's recompute: "
        f"{'NOT met' if slower else 'met'}"
    )
