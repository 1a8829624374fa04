"""Workloads for the simulator and the sweeps over them: request rates, and the
prefill:decode split of a GPU budget.

    lengths = [(r.prompt_len, r.output_len) for r in run.requests]     # or from a distribution
    results = sweep_rates([1, 2, 4], lengths, spec, costs, slo, seed=0)
    search = best_split(poisson_requests(4.0, lengths, random.Random(0)), 256, spec, costs, slo, seed=0)
    search.best.prefill_gpus, search.best.result.goodput

A split search simulates a coarse grid of splits, then halves the grid's step
around the best one until it is one worker: goodput against the prefill share
rises while the prefill pool is the bottleneck and falls once decode is, so the
peak is found in O(log budget) simulations rather than one per split.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from splitserve.measure.results import RunResult
from splitserve.plan.costs import CostModel, StepSpread
from splitserve.plan.sim.simulate import ClusterSpec, Request, SimResult, Slo, simulate


def poisson_requests(
    rate: float, lengths: Sequence[tuple[int, int]], rng: random.Random, cached_tokens: int = 0
) -> list[Request]:
    """One request per (prompt, output) of `lengths`, in that order, with exponential gaps at `rate`
    req/s (infinite: all at once); `cached_tokens` of each prompt already cached (at most all but one)."""
    t = 0.0
    out = []
    for prompt, output in lengths:
        out.append(Request(t, prompt, output, min(cached_tokens, prompt - 1)))
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return out


def requests_from_run(run: RunResult, cached_tokens: int = 0) -> list[Request]:
    """The arrivals and lengths of a `bench serve` run (its JSON's records), to replay;
    `cached_tokens` of each prompt found in the cache (at most all but one), as `poisson_requests`,
    or more where the server said it found more (its usage's cached tokens: a burst's steady
    streams repeat their prompts)."""
    out = []
    for r in run.requests:
        prompt = max(1, r.prompt_len)
        cached = max(cached_tokens, r.cached_len)
        out.append(Request(r.start_s, prompt, max(1, r.output_len), min(cached, prompt - 1)))
    return out


def sweep_rates(
    rates: Sequence[float],
    lengths: Sequence[tuple[int, int]],
    spec: ClusterSpec,
    costs: CostModel,
    slo: Slo | None,
    seed: int,
    cached_tokens: int = 0,
    prefill_costs: CostModel | None = None,
    spread: StepSpread | None = None,
) -> list[SimResult]:
    """One simulation per rate, each on its own Poisson arrivals of the same lengths (seeded by `seed`)."""
    out = []
    for rate in rates:
        reqs = poisson_requests(rate, lengths, random.Random(seed), cached_tokens)
        out.append(simulate(reqs, spec, costs, random.Random(seed), slo, rate, prefill_costs, spread))
    return out


ATTAINMENT_TIE = 0.005  # SLO attainments this close are a tie, broken by the lower TTFT p90


class SplitPoint(NamedTuple):
    prefill_gpus: int
    decode_gpus: int
    result: SimResult


class SplitSearch(NamedTuple):
    best: SplitPoint
    points: list[SplitPoint]  # every split simulated, by prefill GPUs


def best_split(
    requests: Sequence[Request],
    gpus: int,
    spec: ClusterSpec,
    costs: CostModel,
    slo: Slo,
    seed: int,
    prefill_costs: CostModel | None = None,
    prefill_gpus_per_worker: int | None = None,
    grid: int = 8,
    spread: StepSpread | None = None,
) -> SplitSearch:
    """The prefill:decode split of `gpus` with the most goodput (within ATTAINMENT_TIE: the lower TTFT p90) for a
    disaggregated (or auto) `spec`, whose worker counts are replaced. `prefill_gpus_per_worker`:
    the prefill workers' tensor-parallel size when it differs from spec.gpus_per_worker."""
    if spec.mode == "colocated":
        raise ValueError("a split search needs mode disaggregated or auto")
    d_size = spec.gpus_per_worker
    p_size = prefill_gpus_per_worker or d_size
    max_p = (gpus - d_size) // p_size
    if max_p < 1:
        raise ValueError(f"{gpus} GPUs hold no prefill worker of {p_size} beside a decode worker of {d_size}")
    seen: dict[int, SplitPoint] = {}

    def at(p: int) -> SplitPoint:
        if p not in seen:
            d = (gpus - p * p_size) // d_size
            cluster = replace(spec, prefill_workers=p, decode_workers=d)
            result = simulate(requests, cluster, costs, random.Random(seed), slo, math.nan, prefill_costs, spread)
            seen[p] = SplitPoint(p * p_size, d * d_size, result)
        return seen[p]

    def better(a: SplitPoint, b: SplitPoint) -> bool:
        # every split serves the same requests, so the share that meets the SLOs ranks them by goodput
        # without the noise of when the last request happened to finish (goodput's denominator)
        ga, gb = a.result.slo_attainment, b.result.slo_attainment
        if abs(ga - gb) > ATTAINMENT_TIE:
            return ga > gb
        return a.result.ttft.p90 < b.result.ttft.p90

    step = max(1, max_p // grid)
    for p in range(1, max_p + 1, step):
        at(p)
    at(max_p)
    best = max(seen)  # any start; the loop below picks the best
    for p in seen:
        if better(seen[p], seen[best]):
            best = p
    while True:  # climb at this step until no neighbour is better, then halve it
        moved = True
        while moved:
            moved = False
            for p in (best - step, best + step):
                if 1 <= p <= max_p and better(at(p), seen[best]):
                    best, moved = p, True
                    break
        if step == 1:
            break
        step = max(1, step // 2)
    return SplitSearch(seen[best], [seen[p] for p in sorted(seen)])
