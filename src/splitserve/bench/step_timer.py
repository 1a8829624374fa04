"""The decode step's wall time, as the engine benchmarks measure it side by side.

One function that every benchmark timing a batch's decode step shares (bench kv-dtype,
bench structured), so that their figures mean the same thing: only pure decode steps of the
whole batch count, never a step that still carries a prompt's chunk.
"""

from __future__ import annotations

import statistics
import time

from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams


def decode_step_ms(
    engine: Engine, prompt: list[int], params: SamplingParams, batch: int, steps: int, tag: str
) -> float:
    """Median wall time (ms) of up to `steps` pure decode steps of `batch` requests over `prompt`.

    Each request is the prompt with a token of its own appended, so that none is a prefix-cache hit
    of another. Every prefill is run first, chunked ones to the end (a step that carries a prompt's
    chunk is no decode step); the timing stops at the first step that is not the whole batch or that
    finishes a request, and the requests (ids `tag`-0 ..) are aborted after. `params.max_tokens`
    must leave room for `steps` steps.
    """
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [*prompt, 1 + i], params)
    sched = engine.scheduler
    while sched.waiting or any(len(s) - s.num_computed_tokens > 1 for s in sched.running):
        engine.step()  # the prefills
    times: list[float] = []
    while engine.has_work and len(times) < steps:
        t0 = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - t0
        if len(outs) != batch or any(o.finished for o in outs):
            break
        times.append(elapsed)
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    if not times:
        raise RuntimeError(f"no pure decode step of batch {batch} to time (max_tokens {params.max_tokens})")
    return statistics.median(times) * 1e3
