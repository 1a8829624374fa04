"""Measure this project's own step costs on the machine at hand and fit a profile.

The engine is the one the workers run (engine/engine.py, the embedded SmolLM2
unless a model is given, the workers' default dtype), with the workers'
threads and, where the machine allows, pinned to one core as the benchmarks pin
each worker. What is timed is `Engine.step()` itself:

- prefill: one fresh prompt of N tokens in one step, for N up to the chunk;
  and chunks that follow a prefix already computed (a long prompt's later
  chunks), for the attention over that prefix;
- decode: B requests decoding together, each step's time against B and the
  step's total context, at two prompt lengths;
- KV transfer: a prompt's KV of N tokens (every layer, the engine's layout)
  through kv_transfer's TCP path (`KVSender` into a `KVReceiver`, as
  bench/transfer.py measures it), start to the receiver's confirmation.

Each figure is the median of a few repetitions; `fit_profile` turns the points
into the models the simulator reads.

A served token costs more than `Engine.step()`: the worker's engine loop hands
each step's tokens to its gRPC streams, the router detokenizes and relays them,
the client parses them, and on a machine this small the router and the client
share the workers' cores. `serving_points` measures that on a running system
(bench plan-check's, started as it runs its loads): `bench serve` sends B
requests per worker at once (equal short prompts, fixed output, EOS ignored),
and while all of them decode together, every gap a client saw between two
tokens is set against the engine-alone decode step at the same batch and
context (the fitted model above). `with_serving` (plan/profile.py) fits the
difference as a per-step and a per-token cost.

A served prefill also costs more than the engine's while other requests decode:
on a machine this small the router relaying their tokens and the client reading
them run on the cores the prefill needs. `prefill_load_points` measures that on
a running system: prompts of assorted lengths sent one at a time (`bench serve
--max-concurrency 1`) beside 0, 2 and 6 requests decoding, each first token's
time set against the cost model's step for that prompt; `with_prefill_load`
(plan/profile.py) fits the measured seconds as the modelled ones times a multiplier
plus a cost per request, each linear in the decoding count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from splitserve.plan.costs import mixed_step_s
from splitserve.plan.profile import Profile, ProfileCosts, engine_decode_step_s, fit_profile

SERVE_BATCHES = (1, 2, 4, 8)  # requests decoding together per worker
SERVE_PROMPT_TOKENS = 64  # short: B of them prefill in one step, so all decode together soon
# Long enough that every request of the largest batch decodes together for a while: 8 chat prompts
# of ~104 tokens per worker prefill in two 512-token steps (~2.6 s here), the first of them decoding
# meanwhile; at 48 tokens (~1.7 s at batch 8) the first could finish before the last began.
SERVE_OUTPUT_TOKENS = 96
# requests decoding in the cluster while the prompts are sent; the fit is not extrapolated past the
# last, and ShareGPT at 1.5 req/s on one decode worker here runs 10 to 14 at once
PREFILL_LOAD_STREAMS = (0, 2, 6, 12)
PREFILL_LOAD_PROMPTS = 8  # prompts per count, one at a time, 38 to 474 tokens of random text

# Prefill lengths timed (fresh prompts, one step each). A prefill's cost is not a straight line in
# its tokens: engine/kernels/linear.py runs x @ W.T on its own kernel up to MAX_ROWS_F32 (fp32;
# MAX_ROWS for bf16) rows, 32, and on F.linear (oneDNN) from 33, and every projection of a
# prefill chunk has one row per new token. Measured (SmolLM2-135M, fp32, one thread, core 0,
# the median of 5): 32 tokens 53.2 ms, 33 tokens 104.4 ms; with SPLITSERVE_NO_KERNELS=1 (F.linear
# everywhere) 105.2 and 112.0 ms, no step. That is the step bench serve's chat prompts show between
# 48 and 49 tokens: the chat template's first 24 tokens are the same in every prompt, so a worker
# finds its first block (16) cached and computes 32 new tokens of a 48-token prompt, 33 of a 49.
# Every 8 tokens up to 128, 33 beside 32 to put that edge where it is, then coarser to the chunk.
PREFILL_TOKENS: tuple[int, ...] = (8, 16, 24, 32, 33, *range(40, 129, 8), 160, 192, 256, 320, 384, 448, 512)


# The speed probe's work (see `SpeedProbe`)
PROBE_PREFILL_TOKENS = 128
PROBE_BATCH = 4
PROBE_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class CalibrationConfig:
    model: str | None = None  # GGUF file or HF directory; None: the embedded SmolLM2
    dtype: str = "float32"  # the CPU workers' default
    threads: int = 1  # torch threads, as each benchmark worker runs
    core: int | None = None  # pin this process to it while measuring; None: leave the affinity
    max_num_batched_tokens: int = 512  # the workers' default chunk
    # every 8 up to 128, where the cost is not a straight line in the tokens, then coarser; see PREFILL_TOKENS
    prefill_tokens: tuple[int, ...] = PREFILL_TOKENS
    cached_prefills: tuple[tuple[int, int], ...] = ((128, 512), (512, 512), (256, 1024), (512, 1024))  # (new, cached)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_prompts: tuple[int, ...] = (64, 512)
    decode_steps: int = 12  # timed steps per (batch, prompt): their spread is kept as well as their fit
    transfer_tokens: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 3
    # the speed probe before and after the measurements may differ by this share at most, else they
    # are taken again (a shared VM here ran the probe 1.3x slower before a calibration than after it)
    max_probe_drift: float = 0.1
    attempts: int = 3

    def __post_init__(self) -> None:
        if self.threads < 1 or self.repeats < 1 or self.decode_steps < 1 or self.attempts < 1:
            raise ValueError("threads, repeats, decode_steps and attempts must be >= 1")
        if max(self.prefill_tokens) > self.max_num_batched_tokens:
            raise ValueError("a measured prefill must fit one step (the chunk)")
        if any(c % self.max_num_batched_tokens or n > self.max_num_batched_tokens for n, c in self.cached_prefills):
            raise ValueError("a cached prefix is whole chunks, and the timed chunk fits one step")


PROBE_DECODE = CalibrationConfig(decode_steps=6)


def calibrate(cfg: CalibrationConfig, log: Callable[[str], None] = print) -> Profile:
    """The engine's costs measured on this machine and fitted (see the module's note). The speed
    probe runs before and after the measurements; while the two differ by more than
    `cfg.max_probe_drift` the machine's speed moved under them, and they are taken again, at most
    `cfg.attempts` times in all (the steadiest attempt kept, and said so when none was steady)."""
    from splitserve.measure.hw import cpu_name

    with _pinned(cfg.core):
        engine = _open_engine(cfg)
        layout = engine.layout
        kv_per_token = layout.num_layers * layout.bytes_per_block // layout.block_size
        name = engine.model_cfg.name
        log(
            f"calibrating {name}, {cfg.dtype}, {cfg.threads} torch thread(s), chunk {cfg.max_num_batched_tokens}, "
            f"core {cfg.core if cfg.core is not None else 'unpinned'}; KV {kv_per_token} B/token"
        )
        runner = _Runner(engine)
        runner.speed_probe()  # warm-up: first-use costs stay out of the figures
        m = steadiest(lambda: _measure(runner, cfg, kv_per_token, layout, log), cfg, log)
    where = f"core {cfg.core}" if cfg.core is not None else "unpinned"
    description = f"{name}, {cfg.dtype}, {cfg.threads} torch thread(s) {where}, on {platform.machine()} {cpu_name()}"
    profile = fit_profile(
        description,
        cfg.max_num_batched_tokens,
        layout.num_layers,
        kv_per_token,
        m.prefill,
        m.cached,
        m.decode,
        m.transfer,
    )
    return replace(profile, probe_s=(m.probe_before + m.probe_after) / 2)


def steadiest(measure: Callable[[], _Measured], cfg: CalibrationConfig, log: Callable[[str], None]) -> _Measured:
    """`measure()` until its speed probes before and after agree within `cfg.max_probe_drift`, at most
    `cfg.attempts` times; the attempt whose probes agreed best."""
    best: tuple[float, _Measured] | None = None
    for attempt in range(1, cfg.attempts + 1):
        got = measure()
        drift = abs(got.probe_after - got.probe_before) / min(got.probe_before, got.probe_after)
        if best is None or drift < best[0]:
            best = (drift, got)
        if drift <= cfg.max_probe_drift:
            return got
        log(f"the machine's speed moved by {drift:.0%} during attempt {attempt} of {cfg.attempts}")
    assert best is not None  # attempts >= 1
    log(f"no attempt was steady: keeping the steadiest (its speed moved by {best[0]:.0%})")
    return best[1]


class _Measured(NamedTuple):
    prefill: list[tuple[int, float]]
    cached: list[tuple[int, int, float]]
    decode: list[tuple[int, int, float]]
    transfer: list[tuple[int, float]]
    probe_before: float
    probe_after: float


def _measure(
    runner: _Runner, cfg: CalibrationConfig, kv_per_token: int, layout: Any, log: Callable[[str], None]
) -> _Measured:
    """One pass of every calibration measurement, between two speed probes."""
    probe_before = runner.speed_probe()
    prefill = [(n, statistics.median(runner.prefill(n) for _ in range(cfg.repeats))) for n in cfg.prefill_tokens]
    log("prefill: " + ", ".join(f"{n} tok {s * 1e3:.1f} ms" for n, s in prefill))
    cached = [
        (n, c, statistics.median(runner.chunk_after(n, c) for _ in range(cfg.repeats))) for n, c in cfg.cached_prefills
    ]
    log("prefill after a prefix: " + ", ".join(f"{n} after {c}: {s * 1e3:.1f} ms" for n, c, s in cached))
    decode = [pt for b in cfg.decode_batches for p in cfg.decode_prompts for pt in runner.decode(b, p, cfg)]
    log("decode: " + ", ".join(f"b{b} ctx {c}: {s * 1e3:.1f} ms" for b, c, s in decode[:: cfg.decode_steps]))
    transfer = [(n * kv_per_token, _transfer_s(layout, n, cfg.repeats)) for n in cfg.transfer_tokens]
    log("transfer: " + ", ".join(f"{b / 2**20:.1f} MiB {s * 1e3:.1f} ms" for b, s in transfer))
    probe_after = runner.speed_probe()
    log(f"speed probe: {probe_before * 1e3:.1f} ms before the measurements, {probe_after * 1e3:.1f} ms after")
    return _Measured(prefill, cached, decode, transfer, probe_before, probe_after)


class SpeedProbe:
    """How fast this machine runs the engine now, against when a profile was measured: the same
    fixed piece of work (`_Runner.speed_probe`) on an engine of the calibration's config, on its
    core. A shared VM's speed moves by 30 to 40% within minutes here (a colocated worker's served
    gap at batch 4: 34 ms in one check, 50 ms in the next, 16 minutes later), so bench plan-check
    takes it before each measurement and compares the simulator with the machine as it was then."""

    def __init__(self, cfg: CalibrationConfig) -> None:
        self.cfg = cfg
        with _pinned(cfg.core):
            self._runner = _Runner(_open_engine(cfg))
            self._runner.speed_probe()  # warm-up, as calibrate's

    def seconds(self) -> float:
        with _pinned(self.cfg.core):
            return self._runner.speed_probe()


def at_calibration_speed(records: Sequence[Any], factor: float) -> list[Any]:
    """bench serve RequestRecords as the calibrated machine would have timed them: every time divided
    by `factor`, the machine's time for the speed probe then over the calibration's."""
    if factor == 1.0:
        return list(records)
    return [
        dataclasses.replace(
            r,
            start_s=r.start_s / factor,
            ttft_s=r.ttft_s / factor,
            itl_s=[g / factor for g in r.itl_s],
            latency_s=r.latency_s / factor,
        )
        for r in records
    ]


@contextlib.contextmanager
def _pinned(core: int | None) -> Iterator[None]:
    """This process on `core` (None: as it is) for the block."""
    restore = os.sched_getaffinity(0) if core is not None else None
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        if restore is not None:
            os.sched_setaffinity(0, restore)


def _open_engine(cfg: CalibrationConfig) -> Any:
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine

    torch.set_num_threads(cfg.threads)
    ecfg = EngineConfig(
        dtype=cfg.dtype,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_blocks=4096,
        enable_prefix_caching=False,  # every timed prompt is computed, never found
    )
    engine, _ = Engine.from_path(cfg.model, ecfg, progress=False)
    return engine


class _Runner:
    """Requests through the engine, each step timed."""

    def __init__(self, engine: object) -> None:
        from splitserve.engine.engine import Engine

        assert isinstance(engine, Engine)
        self.engine = engine
        self.n = 0
        self.vocab = min(engine.model_cfg.vocab_size, 32000)

    def _prompt(self, n: int) -> list[int]:
        self.n += 1  # a distinct prompt each time (no cache anyway; the ids vary the input)
        return [(self.n * 7919 + i * 104729) % (self.vocab - 256) + 256 for i in range(n)]

    def _add(self, n: int, max_tokens: int) -> str:
        from splitserve.engine.sampling import SamplingParams

        rid = f"cal-{self.n}"
        self.engine.add_request(rid, self._prompt(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _timed_step(self) -> float:
        t = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t

    def _drain(self) -> None:
        while self.engine.has_work:
            self.engine.step()

    def prefill(self, n: int) -> float:
        self._add(n, 1)
        s = self._timed_step()
        self._drain()
        return s

    def chunk_after(self, n: int, cached: int) -> float:
        """A chunk of n tokens after `cached` of the same prompt (cached a multiple of the chunk)."""
        chunk = self.engine.cfg.max_num_batched_tokens
        if cached % chunk:
            raise ValueError(f"cached ({cached}) must be a multiple of the chunk ({chunk})")
        self._add(cached + n, 1)
        for _ in range(cached // chunk):
            self.engine.step()
        s = self._timed_step()
        self._drain()
        return s

    def speed_probe(self) -> float:
        """Seconds of a fixed piece of work, the median of three rounds: a 128-token prefill (compute
        bound) and six batch-4 decode steps (bound by reading the weights)."""
        rounds = []
        for _ in range(3):
            t = time.perf_counter()
            self.prefill(PROBE_PREFILL_TOKENS)
            self.decode(PROBE_BATCH, PROBE_PROMPT_TOKENS, PROBE_DECODE)
            rounds.append(time.perf_counter() - t)
        return statistics.median(rounds)

    def decode(self, batch: int, prompt: int, cfg: CalibrationConfig) -> list[tuple[int, int, float]]:
        """(batch, total context, seconds) for each timed step of `batch` requests decoding together."""
        sched = self.engine.scheduler
        chunk = self.engine.cfg.max_num_batched_tokens
        enough = batch * prompt // chunk + cfg.decode_steps + 8  # nobody finishes before the timed steps end
        rids = [self._add(prompt, enough) for _ in range(batch)]
        while sched.waiting or any(len(s) - s.num_computed_tokens > 1 for s in sched.running):
            self.engine.step()  # the prefills, chunk by chunk
        self.engine.step()  # one untimed decode step
        out = []
        for _ in range(cfg.decode_steps):
            context = sum(len(s) for s in sched.running)
            out.append((len(sched.running), context, self._timed_step()))
        for rid in rids:
            self.engine.abort(rid)
        return out


def _transfer_s(layout: object, tokens: int, repeats: int) -> float:
    """A prompt's KV of `tokens` (all layers) over kv_transfer's TCP path, to the receiver's confirmation."""
    import torch

    from splitserve.engine.kv_cache import KVCache, KVLayout
    from splitserve.kv_transfer import Completed, KVReceiver, KVSender

    assert isinstance(layout, KVLayout)
    blocks = -(-tokens // layout.block_size)
    src, dst = KVCache(layout, blocks), KVCache(layout, blocks)
    src.tensor.copy_(torch.randn(src.tensor.shape).to(src.tensor.dtype))
    ids = list(range(blocks))
    times = []
    with KVReceiver(dst, transport="tcp") as rx:
        sender = KVSender(src)
        for _ in range(repeats + 1):  # the first is a warm-up (connection, page faults)
            r = rx.reserve("calibrate", ids, lease_s=60)
            t = time.perf_counter()
            stream = sender.open(r)
            for layer in range(layout.num_layers):
                stream.send_layer(layer, ids)
            stream.finish(1, timeout=60)
            if rx.wait(r.ticket, 10) != Completed(1):
                raise RuntimeError("calibration transfer not confirmed")
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def serving_load_flags(batch: int, workers: int, seed: int) -> tuple[str, ...]:
    """`bench serve` flags of one serving measurement: `batch` requests per worker, all at once."""
    return (
        "--dataset",
        "random",
        "--num-prompts",
        str(batch * workers),
        "--random-input-len",
        str(SERVE_PROMPT_TOKENS),
        "--random-output-len",
        str(SERVE_OUTPUT_TOKENS),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
    )


def _decode_gaps(records: Sequence[Any], workers: int, profile: Profile) -> tuple[int, list[tuple[int, float, float]]]:
    """The batch per worker, and (context per worker, engine-alone step s, served gap s) of every
    gap while all requests decode (see `serving_point`)."""
    ok = [r for r in records if r.error is None and r.itl_s]
    if not ok or len(ok) % workers:
        raise ValueError(f"{len(ok)} completed requests do not spread evenly over {workers} workers")
    batch = len(ok) // workers
    times = []
    for r in ok:
        t = [r.start_s + r.ttft_s]
        for gap in r.itl_s:
            t.append(t[-1] + gap)
        times.append(t)
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    gaps = []
    for r, t in zip(ok, times, strict=True):
        for k in range(1, len(t)):
            if t[k - 1] >= lo and t[k] <= hi:
                context = batch * (r.prompt_len + k)  # the step that made token k+1 read k+prompt tokens each
                gaps.append((context, engine_decode_step_s(profile, batch, context), t[k] - t[k - 1]))
    if not gaps:
        raise ValueError("no gap while every request decoded (outputs too short?)")
    return batch, gaps


def serving_point(records: Sequence[Any], workers: int, profile: Profile) -> tuple[int, int, float, float]:
    """(batch per worker, context per worker, engine-alone step s, served gap s) of one run of
    `serving_load_flags`: `records` are its bench serve RequestRecords. Only the gaps while every
    request decodes count (after the last first token, before the first last token), so each is
    one decode step of the same batch on every worker (the router spreads requests sent at once
    evenly: least queued and running tokens). Both figures are medians over those gaps; the engine
    step of each gap is the profile's decode model at that gap's context."""
    batch, gaps = _decode_gaps(records, workers, profile)
    contexts, engine, served = zip(*gaps, strict=True)
    return batch, int(statistics.median(contexts)), statistics.median(engine), statistics.median(served)


def serving_gap_ratios(records: Sequence[Any], workers: int, profile: Profile) -> list[tuple[int, float]]:
    """(batch, ratio) of every gap `serving_point` reads: the gap over the engine-alone step at its
    context plus the batch's median overhead (median gap - median engine step). What the served
    model leaves unexplained, one gap at a time: the spread a simulated step is drawn from."""
    batch, gaps = _decode_gaps(records, workers, profile)
    overhead = statistics.median(s for *_, s in gaps) - statistics.median(e for _, e, _ in gaps)
    return [(batch, s / (e + overhead)) for _, e, s in gaps if e + overhead > 0]


def prefill_load_flags(seed: int) -> tuple[str, ...]:
    """`bench serve` flags of one prefill-under-load measurement: prompts of assorted lengths, one
    at a time (each alone on its worker but for the decoding streams), one output token beyond the
    first so each ends right after it."""
    return (
        "--dataset",
        "random",
        "--num-prompts",
        str(PREFILL_LOAD_PROMPTS),
        "--random-input-len",
        "256",
        "--random-range-ratio",
        "0.85",
        "--random-output-len",
        "2",
        "--max-concurrency",
        "1",
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
    )


def prefill_load_points(
    records: Sequence[Any],
    decoding: int,
    batch_per_worker: int,
    context_per_stream: int,
    cached_tokens: int,
    profile: Profile,
) -> list[tuple[int, float, float]]:
    """(decoding, modelled s, measured TTFT s) of each completed prompt of a `prefill_load_flags`
    run beside `decoding` streams: modelled is the served cost model's step that prefills it (its
    chat template's first `cached_tokens` found cached) beside the `batch_per_worker` decodes its
    worker runs (0 on a prefill worker) over `context_per_stream` tokens each."""
    costs = ProfileCosts(profile)
    out = []
    for r in records:
        if r.error is not None or r.ttft_s <= 0 or r.prompt_len <= cached_tokens:
            continue
        modelled = mixed_step_s(
            costs, r.prompt_len - cached_tokens, cached_tokens, batch_per_worker, batch_per_worker * context_per_stream
        )
        out.append((decoding, modelled, r.ttft_s))
    return out
