"""One controller for both pools (`serve --scaling joint --slo-ttft-ms T --slo-itl-ms I`).

The per-pool policy (cluster/scaling.py) waits for a queue to stay over a target for seconds and
sizes each pool alone. This one reads the token rates that load each pool, predicts them one
horizon ahead, and sizes both pools for the SLOs the user states:

- prefill: uncached prompt tokens arriving per second (the router's routed prompt blocks less
  its prefix hits), against a prefill worker's measured speed (its stats' prefill_tokens_per_s).
  A prompt of mean length takes t = tokens / speed on a worker; with the TTFT SLO's budget b
  (0.8 x SLO: the rest for the transfer and the first step), queueing in front of it must stay
  within w = b - t. An M/D/1 queue waits rho t / (2 (1 - rho)) on average (the planner's
  arithmetic, plan/decision.prefill_queue_wait_s), so a worker may run at rho = 2w / (2w + t)
  (at most 0.9) and the pool needs ceil(rate / (speed x rho)) workers.
- decode: context tokens in flight (running and queued on the decode workers), against what one
  worker holds within the ITL SLO's budget (0.8 x SLO). It starts at `decode_tokens_per_worker`
  and moves only on what an interval proves: workers holding c tokens each within the budget
  hold at least c (it rises to c); workers holding c over it, at an inter-token latency l, hold
  at most c x budget / l (it falls to that: a step's time is a fixed part plus a part that grows
  with the context, so scaling through zero overstates what fits, and one more reading lowers it
  again). A step's fixed part never lowers it: a reading within the budget, however small its
  context, only ever raises it, so the decode pool cannot chase its own shrinking load per worker.

Both rates are predicted with Holt's linear smoothing (a level and a trend), `horizon_s` ahead,
and never below the rate just seen: a burst is believed at once, a lull only slowly. The
hysteresis is the asymmetry: a pool grows to its target at once (a standby worker makes that
one stats poll, cluster/pool.py); it shrinks by one worker only after the target computed with
`shrink_headroom` more load has stayed below its size for `shrink_after_s`, and `cooldown_s`
after its last shrink.

A pure function of its arguments: the pool manager builds an `Observation` every `interval_s`
and acts on the `JointDecision`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar

from splitserve.cluster.scaling import least_loaded
from splitserve.router.policy import WorkerLoad

BUDGET = 0.8  # of each SLO, the share the pools are sized to; the rest covers transfers and noise
MAX_RHO = 0.9  # a prefill worker never planned busier than this
MIN_CONTEXT_TO_LEARN = 256  # context tokens per decode worker below which a step's time says little


@dataclass(frozen=True)
class JointConfig:
    slo_ttft_s: float
    slo_itl_s: float
    prefill_min: int = 1
    prefill_max: int = 1
    decode_min: int = 1
    decode_max: int = 1
    interval_s: float = 1.0
    horizon_s: float = 5.0  # how far ahead the rates are predicted
    level_weight: float = 0.5  # Holt's alpha: the share of a new reading in the level
    trend_weight: float = 0.2  # Holt's beta: the share of a new slope in the trend
    decode_tokens_per_worker: int = 16384  # a decode worker's context at the ITL SLO, until measured
    shrink_after_s: float = 30.0
    shrink_headroom: float = 1.25  # a pool shrinks only while it would hold this much more load
    cooldown_s: float = 30.0  # between two shrinks of a pool
    drain_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_itl_s", "interval_s", "horizon_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"JointConfig.{name} must be finite and positive, got {v!r}")
        if not (1 <= self.prefill_min <= self.prefill_max and 1 <= self.decode_min <= self.decode_max):
            raise ValueError("JointConfig needs 1 <= min <= max for each pool")
        if not (0 < self.level_weight <= 1 and 0 <= self.trend_weight <= 1 and self.shrink_headroom >= 1):
            raise ValueError("JointConfig: weights in (0, 1], shrink_headroom at least 1")


class Observation(NamedTuple):
    """What the pool manager reads each interval."""

    now: float
    prompt_tokens: int  # uncached prompt tokens routed since start (a counter)
    requests: int  # requests routed since start (a counter)
    prefill_tokens_per_s: float  # a prefill worker's measured speed, their mean (0: not measured yet)
    decode_context_tokens: int  # running and queued context tokens over the decode pool now
    itl_s: float  # mean inter-token latency over the last interval (0: no token sent)
    prefill_workers: int  # routable, plus starting
    decode_workers: int


@dataclass(frozen=True)
class Smoothed:
    """Holt's linear smoothing of one rate."""

    level: float = 0.0
    trend: float = 0.0  # per second

    def update(self, value: float, dt: float, cfg: JointConfig) -> Smoothed:
        guess = self.level + self.trend * dt
        level = cfg.level_weight * value + (1 - cfg.level_weight) * guess
        trend = cfg.trend_weight * (level - self.level) / dt + (1 - cfg.trend_weight) * self.trend
        return Smoothed(level, trend)

    def ahead(self, horizon_s: float, seen: float) -> float:
        return max(self.level + self.trend * horizon_s, seen, 0.0)


@dataclass(frozen=True)
class JointState:
    last: Observation | None = None
    prompt_rate: Smoothed = Smoothed()
    context: Smoothed = Smoothed()
    mean_prompt: float = 0.0  # uncached prompt tokens per request, lately
    decode_capacity: float | None = None  # context tokens a decode worker holds at the ITL budget (learned)
    prefill_below_since: float | None = None
    decode_below_since: float | None = None
    prefill_shrunk: float | None = None
    decode_shrunk: float | None = None


class JointDecision(NamedTuple):
    prefill: int  # workers the pool should have (routable and starting)
    decode: int
    reason: str  # the arithmetic with its numbers, for the log


def prefill_rho(mean_prompt: float, speed: float, slo_ttft_s: float) -> float:
    """The busiest a prefill worker may run with the TTFT budget kept on average (M/D/1)."""
    service = mean_prompt / speed
    wait = BUDGET * slo_ttft_s - service
    if wait <= 0:  # the prompt alone takes the budget: keep queues short, the SLO is out of reach
        return 0.5
    return min(MAX_RHO, 2 * wait / (2 * wait + service))


def decide(cfg: JointConfig, obs: Observation, state: JointState) -> tuple[JointDecision, JointState]:
    """One application of the controller: both pools' targets, and what it remembers."""
    last = state.last
    if last is None or obs.now <= last.now:  # the first reading: a rate needs two
        first = JointDecision(
            _clamp(obs.prefill_workers, cfg.prefill_min, cfg.prefill_max),
            _clamp(obs.decode_workers, cfg.decode_min, cfg.decode_max),
            "first reading",
        )
        return first, replace(state, last=obs)
    dt = obs.now - last.now
    rate = max(0, obs.prompt_tokens - last.prompt_tokens) / dt
    requests = obs.requests - last.requests
    mean_prompt = state.mean_prompt
    if requests > 0:
        seen = (obs.prompt_tokens - last.prompt_tokens) / requests
        mean_prompt = seen if mean_prompt == 0 else 0.5 * seen + 0.5 * mean_prompt
    prompt_rate = state.prompt_rate.update(rate, dt, cfg)
    context = state.context.update(obs.decode_context_tokens, dt, cfg)
    capacity = _learn_capacity(cfg, obs, state.decode_capacity)

    prefill, prefill_shrink, prefill_why = _prefill_demand(
        cfg, obs, prompt_rate.ahead(cfg.horizon_s, rate), rate, mean_prompt
    )
    decode, decode_shrink, decode_why = _decode_demand(
        cfg, obs, context.ahead(cfg.horizon_s, obs.decode_context_tokens), capacity
    )
    p, p_since, p_shrunk = _size(
        obs.prefill_workers,
        prefill,
        prefill_shrink,
        cfg.prefill_min,
        cfg.prefill_max,
        obs.now,
        state.prefill_below_since,
        state.prefill_shrunk,
        cfg,
    )
    dec, d_since, d_shrunk = _size(
        obs.decode_workers,
        decode,
        decode_shrink,
        cfg.decode_min,
        cfg.decode_max,
        obs.now,
        state.decode_below_since,
        state.decode_shrunk,
        cfg,
    )
    new_state = JointState(obs, prompt_rate, context, mean_prompt, capacity, p_since, d_since, p_shrunk, d_shrunk)
    return JointDecision(p, dec, f"{prefill_why}; {decode_why}"), new_state


def _prefill_demand(
    cfg: JointConfig, obs: Observation, want_rate: float, rate: float, mean_prompt: float
) -> tuple[int, int, str]:
    """The prefill workers `want_rate` uncached prompt tokens a second need, and with the shrink's
    headroom, and the arithmetic said; the pool as it is while no speed is measured."""
    if obs.prefill_tokens_per_s <= 0 or mean_prompt <= 0:
        return obs.prefill_workers, obs.prefill_workers, f"prefill speed not measured yet: {obs.prefill_workers}"
    rho = prefill_rho(mean_prompt, obs.prefill_tokens_per_s, cfg.slo_ttft_s)
    per_worker = obs.prefill_tokens_per_s * rho
    want = math.ceil(want_rate / per_worker)
    why = (
        f"prefill {want_rate:.0f} tok/s predicted ({rate:.0f} seen) / ({obs.prefill_tokens_per_s:.0f} tok/s "
        f"x rho {rho:.2f}) = {want}"
    )
    return want, math.ceil(want_rate * cfg.shrink_headroom / per_worker), why


def _decode_demand(
    cfg: JointConfig, obs: Observation, want_context: float, capacity: float | None
) -> tuple[int, int, str]:
    """The decode workers `want_context` tokens in flight need, and with the shrink's headroom, and
    the arithmetic said."""
    per_worker = capacity if capacity is not None else float(cfg.decode_tokens_per_worker)
    want = math.ceil(want_context / per_worker)
    why = (
        f"decode {want_context:.0f} context tokens predicted ({obs.decode_context_tokens} now) / "
        f"{per_worker:.0f} a worker at ITL {obs.itl_s * 1e3:.1f} ms (SLO {cfg.slo_itl_s * 1e3:g} ms) = {want}"
    )
    return want, math.ceil(want_context * cfg.shrink_headroom / per_worker), why


R = TypeVar("R", bound=str)  # a pool's role


def resize(target: int, have: int, loads: Mapping[str, WorkerLoad]) -> tuple[int, str | None]:
    """A decision acted on for one pool of `have` workers (routed and starting), `loads` its routed
    ones: (workers to start, the worker to drain). Below the target the pool grows to it at once;
    above it, its least-loaded worker drains (one a decision: `decide` shrinks by one)."""
    if target > have:
        return target - have, None
    if target < have and loads:
        return 0, least_loaded(loads, "work_tokens")
    return 0, None


def switch(plans: Mapping[R, tuple[int, str | None]]) -> tuple[R, str] | None:
    """Both pools' `resize` plans (role -> (workers to start, the worker to drain)): when one pool
    grows while the other drains, (the draining pool, its worker), which then moves to the growing
    pool in its own process (a switchable worker) instead of one process stopping while another
    starts. None when they do not cross."""
    for role, (_, victim) in plans.items():
        if victim is not None and any(grow for other, (grow, _) in plans.items() if other != role):
            return role, victim
    return None


def _learn_capacity(cfg: JointConfig, obs: Observation, known: float | None) -> float | None:
    """A decode worker's context at the ITL budget, moved by what this interval proves (see the
    module's doc); None until an interval proves anything."""
    per_worker = obs.decode_context_tokens / max(1, obs.decode_workers)
    if obs.itl_s <= 0 or per_worker < MIN_CONTEXT_TO_LEARN:
        return known
    budget = BUDGET * cfg.slo_itl_s
    start = known if known is not None else float(cfg.decode_tokens_per_worker)
    if obs.itl_s <= budget:
        return max(start, per_worker)
    return min(start, per_worker * budget / obs.itl_s)


def _size(
    have: int,
    want: int,
    want_with_headroom: int,
    least: int,
    most: int,
    now: float,
    below_since: float | None,
    shrunk: float | None,
    cfg: JointConfig,
) -> tuple[int, float | None, float | None]:
    """A pool's size: up to its target at once; down by one after the window and the cooldown.
    Returns (size, since when it could shrink, when it last shrank)."""
    want, want_with_headroom = _clamp(want, least, most), _clamp(want_with_headroom, least, most)
    if want > have or have < least:
        return max(want, least), None, shrunk
    if have > most:
        return most, None, now
    if want_with_headroom >= have:
        return have, None, shrunk
    since = below_since if below_since is not None else now
    cooled = shrunk is None or now - shrunk >= cfg.cooldown_s
    if now - since >= cfg.shrink_after_s and cooled:
        return have - 1, None, now
    return have, since, shrunk


def _clamp(n: int, least: int, most: int) -> int:
    return max(least, min(most, n))
