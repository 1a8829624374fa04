"""The pool controller's policy: given one pool's per-worker loads, how many
workers are booting or draining, the time now and what the controller
remembers, decide to grow the pool, shrink it by one worker, or hold.

A pure function of its arguments: no clock reads, no randomness, no I/O. The
pool manager (cluster/pool.py) calls it every `interval_s` and acts on the result.

    load(w)        = queued_tokens                       metric "queued_tokens" (prefill)
                   = queued_tokens + running_tokens      metric "work_tokens"   (decode)
    mean           = sum(load) / replicas
    desired        = ceil(sum(load) / target_tokens_per_worker), at least replicas + 1
                     under block pressure (mean free-block fraction < min_free_block_fraction)
    over           = mean > target_tokens_per_worker, or block pressure
    under          = mean < low_water_tokens_per_worker, no block pressure, nothing booting,
                     and sum(load) / (replicas - 1) <= target (one fewer would not be over at once)
    grow           = over for grow_after_s, cooldown passed: start min(desired, max) - replicas - pending
    shrink         = under for shrink_after_s, cooldown passed, replicas > min: drain the least-loaded worker

Replicas below min (counting workers starting) or above max are corrected at
once, without windows or cooldown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from splitserve.router.policy import WorkerLoad

METRICS = ("queued_tokens", "work_tokens")

Action = Literal["grow", "shrink", "hold"]


@dataclass(frozen=True)
class ScalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    metric: str = "queued_tokens"  # "queued_tokens" (prefill) | "work_tokens" (decode: queued + running)
    target_tokens_per_worker: int = 4096  # mean load above this is "over"
    low_water_tokens_per_worker: int = 512  # mean load below this is "under"
    # 0: off. Decode pools: a mean free-block fraction below this is "over" whatever the token load,
    # since a worker out of blocks queues requests that its token load does not show yet
    min_free_block_fraction: float = 0.0
    grow_after_s: float = 5.0  # "over" must hold this long (a one-poll spike does nothing)
    shrink_after_s: float = 60.0  # "under" must hold this long
    cooldown_s: float = 30.0  # after any change, the next waits this long
    interval_s: float = 1.0  # how often the pool manager applies the policy
    drain_timeout_s: float = 600.0  # a draining worker is stopped after this even if not idle

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"ScalingConfig.metric must be one of {METRICS}, got {self.metric!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"ScalingConfig needs 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}"
            )
        if self.target_tokens_per_worker <= 0:
            raise ValueError("ScalingConfig.target_tokens_per_worker must be positive")
        if not 0 <= self.low_water_tokens_per_worker < self.target_tokens_per_worker:
            raise ValueError("ScalingConfig.low_water_tokens_per_worker must be in [0, target_tokens_per_worker)")
        if not 0.0 <= self.min_free_block_fraction < 1.0:
            raise ValueError("ScalingConfig.min_free_block_fraction must be in [0, 1)")
        for name in ("grow_after_s", "shrink_after_s", "cooldown_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"ScalingConfig.{name} must be finite and >= 0")
        for name in ("interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"ScalingConfig.{name} must be finite and positive")

    @property
    def scales(self) -> bool:
        return self.max_replicas > self.min_replicas


@dataclass(frozen=True)
class ScalerState:
    """What the controller remembers between two applications of the policy."""

    over_since: float | None = None  # when "over" began holding (None: it does not hold)
    under_since: float | None = None  # when "under" began holding
    last_change: float | None = None  # when the last grow or shrink was decided


class ScalingDecision(NamedTuple):
    action: Action
    num_workers: int  # grow: workers to start; shrink: 1; hold: 0 (not `count`: that is tuple.count)
    worker: str | None  # shrink: the worker to drain
    reason: str  # the formula with the numbers filled in, for the log


def worker_load(load: WorkerLoad, metric: str) -> int:
    return load.queued_tokens if metric == "queued_tokens" else load.work_tokens


def free_block_fraction(loads: Mapping[str, WorkerLoad]) -> float:
    """Mean over workers that report blocks; 1.0 when none does (no pressure known)."""
    fractions = [w.free_blocks / w.total_blocks for w in loads.values() if w.total_blocks > 0]
    return sum(fractions) / len(fractions) if fractions else 1.0


def least_loaded(loads: Mapping[str, WorkerLoad], metric: str) -> str:
    """The worker whose drain costs least: least load, then least work, then most free blocks;
    the address breaks ties so the choice is deterministic."""
    return min(
        loads,
        key=lambda a: (
            worker_load(loads[a], metric),
            loads[a].work_tokens,
            loads[a].total_blocks - loads[a].free_blocks,
            a,
        ),
    )


class PoolLoad(NamedTuple):
    """The pool's load as the policy reads it, with the reading said as numbers for the log."""

    replicas: int  # routable workers
    total: int  # the metric summed over them
    mean: float
    free: float  # mean free block fraction
    pressure: bool  # free blocks below the floor: grow whatever the tokens say
    over: bool  # above target (or under pressure)
    under: bool  # below low water, and the others would stay within target with one fewer
    numbers: str


def measure(cfg: ScalingConfig, loads: Mapping[str, WorkerLoad], pending: int, draining: int) -> PoolLoad:
    """The pool's load against the config's targets (see `decide` for the arguments)."""
    replicas = len(loads)
    total = sum(worker_load(w, cfg.metric) for w in loads.values())
    mean = total / replicas if replicas else 0.0
    free = free_block_fraction(loads)
    pressure = cfg.min_free_block_fraction > 0 and free < cfg.min_free_block_fraction
    over = replicas > 0 and (mean > cfg.target_tokens_per_worker or pressure)
    under = (
        replicas > cfg.min_replicas
        and pending == 0
        and not pressure
        and mean < cfg.low_water_tokens_per_worker
        and total / (replicas - 1) <= cfg.target_tokens_per_worker
    )
    numbers = (
        f"{cfg.metric} {total} over {replicas} worker(s) (mean {mean:.0f}, target "
        f"{cfg.target_tokens_per_worker}, low water {cfg.low_water_tokens_per_worker}), free blocks "
        f"{free:.2f}, {pending} starting, {draining} draining"
    )
    return PoolLoad(replicas, total, mean, free, pressure, over, under, numbers)


def decide(
    cfg: ScalingConfig, loads: Mapping[str, WorkerLoad], pending: int, draining: int, now: float, state: ScalerState
) -> tuple[ScalingDecision, ScalerState]:
    """One application of the policy.

    `loads`: the routable workers of the pool (not booting, not draining), by address, so the
    pool's replica count is `len(loads)`. `pending`: workers starting (scale-ups and replacements
    of dead workers). `draining`: workers being drained, no longer routable."""
    m = measure(cfg, loads, pending, draining)
    replicas, numbers = m.replicas, m.numbers
    state = ScalerState(
        over_since=(state.over_since if state.over_since is not None else now) if m.over else None,
        under_since=(state.under_since if state.under_since is not None else now) if m.under else None,
        last_change=state.last_change,
    )
    changed = ScalerState(last_change=now)  # windows restart after a change

    if replicas + pending < cfg.min_replicas:
        n = cfg.min_replicas - replicas - pending
        return ScalingDecision("grow", n, None, f"below min_replicas {cfg.min_replicas}: {numbers}"), changed
    if replicas > cfg.max_replicas:
        w = least_loaded(loads, cfg.metric)
        return ScalingDecision("shrink", 1, w, f"above max_replicas {cfg.max_replicas}: {numbers}"), changed
    if draining:
        return ScalingDecision("hold", 0, None, f"a drain is in progress: {numbers}"), state
    if state.last_change is not None and now - state.last_change < cfg.cooldown_s:
        left = cfg.cooldown_s - (now - state.last_change)
        return ScalingDecision("hold", 0, None, f"cooldown ({left:.1f} s left): {numbers}"), state

    if m.over and state.over_since is not None and now - state.over_since >= cfg.grow_after_s:
        grow = _grow(cfg, m, pending, now - state.over_since)
        return grow, changed if grow.action == "grow" else state
    if m.under and state.under_since is not None and now - state.under_since >= cfg.shrink_after_s:
        w = least_loaded(loads, cfg.metric)
        return ScalingDecision(
            "shrink", 1, w, f"under low water for {now - state.under_since:.1f} s, draining {w}: {numbers}"
        ), changed
    window = (
        "over, waiting out the window" if m.over else "under, waiting out the window" if m.under else "within bounds"
    )
    return ScalingDecision("hold", 0, None, f"{window}: {numbers}"), state


def _grow(cfg: ScalingConfig, m: PoolLoad, pending: int, over_for_s: float) -> ScalingDecision:
    """Over for the whole window: the workers the load needs, within max_replicas, less those starting."""
    desired = math.ceil(m.total / cfg.target_tokens_per_worker)
    if m.pressure:
        desired = max(desired, m.replicas + 1)
    n = min(desired, cfg.max_replicas) - m.replicas - pending
    if n > 0:
        why = f"free blocks below {cfg.min_free_block_fraction:.2f}" if m.pressure else "over target"
        return ScalingDecision("grow", n, None, f"{why} for {over_for_s:.1f} s (want {desired}): {m.numbers}")
    limit = "at max_replicas" if m.replicas + pending >= cfg.max_replicas else "the workers starting cover it"
    return ScalingDecision("hold", 0, None, f"over, but {limit}: {m.numbers}")
