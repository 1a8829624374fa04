"""`splitserve bench transfer --codec --lossless`: would a lossless stage pay on the KV wire?

The KV is real: the default model (SmolLM2-135M) prefills `--prompt-tokens` tokens of the shipped
text (bench/data/public_domain.txt, repeated to length) in `--dtype`, and the cache's blocks are
cut into the frames a sender sends (one layer of the prompt's blocks each). On one core (one torch
thread; the compressors are single-threaded), each compressor (zlib at level 1, and zstd and lz4
where their packages are installed) compresses every frame: as the cache's bytes, byte-shuffled
(the high bytes of every value, then the low ones: a bfloat16 value's sign and exponent vary far
less than its mantissa), and after the int8 codec (its payload). It prints the ratio and the
compress and decompress rates in raw cache bytes per second.

Then the cost model of codec.choose for each at a range of link rates: per raw byte, a stage
costs the slowest of compressing, sending what is left, and decompressing (the three overlap
frame by frame), against raw's one over the link; a stage pays where that is under
`codec.MARGIN` of raw's time. The int8 codec's row is there for comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from splitserve.kv_transfer import codec

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
LINK_GBPS = (0.1, 1.0, 10.0, 25.0, 100.0)

Compress = Callable[[bytes], bytes]


class Stage(NamedTuple):
    name: str
    ratio: float  # wire bytes over raw cache bytes
    compress_bps: float  # raw cache bytes per second
    decompress_bps: float


def _real_frames(a: argparse.Namespace) -> list[torch.Tensor]:
    """One prompt's KV as a sender's frames: per layer, `[blocks, 2, block_size, heads, head_dim]`."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.sampling import SamplingParams

    blocks = a.prompt_tokens // 16
    engine, tok = Engine.from_path(
        None, EngineConfig(dtype=a.dtype, num_blocks=blocks + 8, max_num_batched_tokens=512), progress=False
    )
    text = tok.encode(TEXT.read_text())
    ids = (text * math.ceil(a.prompt_tokens / len(text)))[: a.prompt_tokens]
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    cache = engine.kv_cache.tensor  # the freed blocks keep their KV (the prefix cache's)
    used = [b for b in range(cache.shape[1]) if bool(cache[0, b].abs().sum() > 0)][:blocks]
    idx = torch.tensor(used)
    return [cache[layer].index_select(0, idx).contiguous() for layer in range(cache.shape[0])]


def _shuffle(frame: torch.Tensor) -> bytes:
    """A frame's bytes, byte plane by byte plane (all the first bytes of each value, then the second...)."""
    raw = frame.contiguous().view(torch.uint8).view(-1, frame.element_size())
    return raw.t().contiguous().numpy().tobytes()


def _compressors() -> dict[str, tuple[Compress, Compress]]:
    """(compress, decompress) per compressor installed here."""
    out: dict[str, tuple[Compress, Compress]] = {
        "zlib-1": (lambda b: zlib.compress(b, 1), zlib.decompress),
    }
    # imported by name: optional packages, not the project's dependencies (untyped, absent on most machines)
    if importlib.util.find_spec("zstandard"):
        zstandard = importlib.import_module("zstandard")
        for level in (1, 3):
            c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            out[f"zstd-{level}"] = (c.compress, d.decompress)
    if importlib.util.find_spec("lz4"):
        lz4 = importlib.import_module("lz4.frame")
        out["lz4"] = (lz4.compress, lz4.decompress)
    return out


def _measure(name: str, payloads: list[bytes], raw_bytes: int, fns: tuple[Compress, Compress], reps: int) -> Stage:
    """Best of `reps` passes over every frame: the compressed ratio, and both rates per raw byte."""
    comp, decomp = fns
    best_c = best_d = math.inf
    wire = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        packed = [comp(p) for p in payloads]
        t1 = time.perf_counter()
        for p in packed:
            decomp(p)
        t2 = time.perf_counter()
        best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
        wire = sum(len(p) for p in packed)
    return Stage(name, wire / raw_bytes, raw_bytes / best_c, raw_bytes / best_d)


def _stages(frames: list[torch.Tensor], reps: int) -> list[Stage]:
    raw_bytes = sum(f.numel() * f.element_size() for f in frames)
    plain = [
        f.numpy().tobytes() if f.dtype != torch.bfloat16 else f.view(torch.int16).numpy().tobytes() for f in frames
    ]
    t0 = time.perf_counter()
    shuffled = [_shuffle(f) for f in frames]
    shuffle_s = time.perf_counter() - t0
    enc = codec.Int8Encoder()
    t0 = time.perf_counter()
    int8 = [enc.encode(f).numpy().tobytes() for f in frames]
    int8_s = time.perf_counter() - t0
    speed = codec.measure_speed(frames[0].dtype, frames[0].shape[-1])
    int8_ratio = sum(len(p) for p in int8) / raw_bytes
    stages = [Stage("int8 codec", int8_ratio, speed.encode_bps, speed.decode_bps)]
    for name, fns in _compressors().items():
        stages.append(_measure(name, plain, raw_bytes, fns, reps))
        s = _measure(name, shuffled, raw_bytes, fns, reps)  # the shuffle's cost added to compressing
        stages.append(
            Stage(f"shuffled+{name}", s.ratio, 1 / (1 / s.compress_bps + shuffle_s / raw_bytes), s.decompress_bps)
        )
        s = _measure(name, int8, raw_bytes, fns, reps)
        stages.append(
            Stage(
                f"int8+{name}",
                s.ratio,
                1 / (1 / s.compress_bps + int8_s / raw_bytes),
                1 / (1 / s.decompress_bps + 1 / speed.decode_bps),
            )
        )
    return stages


def _cost(stage: Stage, gbps: float) -> float:
    """The stage's time per raw byte over raw's, on a link of `gbps` (codec.choose's model)."""
    bps = gbps * 1e9 / 8
    return max(1 / stage.compress_bps, stage.ratio / bps, 1 / stage.decompress_bps) * bps


def run(a: argparse.Namespace) -> int:
    from splitserve.bench.results_file import with_results

    return with_results(a.out, lambda: _run(a), header=False)  # it prints its own command line


def _run(a: argparse.Namespace) -> int:
    import datetime

    from splitserve.measure.hw import code_version, cpu_flags, load_average

    torch.set_num_threads(1)
    now = datetime.datetime.now(datetime.UTC)
    print(
        f"$ splitserve bench transfer --codec --lossless --prompt-tokens {a.prompt_tokens} --dtype {a.dtype} "
        f"--repeats {a.repeats}   # at {code_version()}, {now:%Y-%m-%dT%H:%MZ}, flags {cpu_flags()}, "
        f"load average {load_average()} at start"
    )
    frames = _real_frames(a)
    mib = sum(f.numel() * f.element_size() for f in frames) / 2**20
    print(
        f"real KV: SmolLM2-135M prefilled {a.prompt_tokens} tokens of {TEXT.name} in {a.dtype}: {len(frames)} layer "
        f"frames of {tuple(frames[0].shape)}, {mib:.1f} MiB; one core; rates per raw cache byte, best of {a.repeats}"
    )
    stages = _stages(frames, a.repeats)
    head = "".join(f"{g:>9g}G" for g in LINK_GBPS)
    print(f"\n  {'stage':24s} {'x raw':>6s} {'comp MB/s':>10s} {'decomp MB/s':>11s}   time/raw's at{head}")
    for s in stages:
        costs = "".join(f"{_cost(s, g):10.2f}" for g in LINK_GBPS)
        rates = f"{s.compress_bps / 1e6:10.0f} {s.decompress_bps / 1e6:11.0f}"
        print(f"  {s.name:24s} {s.ratio:6.3f} {rates}   {'':13s}{costs}")
    _verdict(stages)
    print(f"load average {load_average()} at the end")
    return 0


def _verdict(stages: list[Stage]) -> None:
    lossless = [s for s in stages if s.name != "int8 codec" and not s.name.startswith("int8+")]
    int8 = stages[0]
    for g in LINK_GBPS:
        best = min(lossless, key=lambda s: _cost(s, g))
        pays = _cost(best, g) <= codec.MARGIN
        print(
            f"at {g:g} Gb/s: the best lossless stage {best.name} takes {_cost(best, g):.2f}x raw's time "
            f"({'pays' if pays else 'does not pay'} at the cost model's margin {codec.MARGIN}); the int8 codec "
            f"{_cost(int8, g):.2f}x"
        )
