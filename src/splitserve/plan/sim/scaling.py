"""Pools that change size while the simulation runs: what a scaling policy sees each interval of
simulated time, what it may order, and what starting a worker costs.

The policy is passed in (`simulate(..., scaling=SimScaling(policy, ...))`): the simulator owns the
workers and the clock, the policy only reads a `PoolsView` and answers `Resize` orders, as the
pool manager (cluster/pool.py) reads the router's view of the workers and starts or drains them.
bench/autoscale_sim.py puts cluster/scaling.py's queue policy and cluster/joint.py's controller
behind this interface, so the simulator runs the same arithmetic as the real pool manager.

A start costs `cold_start_s` (a process start and a model load) unless a standby worker covers
it: `standby` workers per pool are started before the load and made routable in `activation_s`;
each one taken is replaced by a cold start in the background, as the pool manager does. A drained
worker leaves routing at once and its requests finish where they are; it is paid for until its
last one has. Worker-seconds count every worker started: routable, starting, on standby, draining.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from splitserve.router.policy import WorkerLoad

if TYPE_CHECKING:
    from splitserve.plan.sim.worker import SimWorker

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


class PoolsView(NamedTuple):
    """The cluster as a pool manager reads it at one interval."""

    now: float
    routable: Mapping[Role, Mapping[str, WorkerLoad]]  # by role: the routed workers' loads, by name
    starting: Mapping[Role, int]
    draining: Mapping[Role, int]
    standby: Mapping[Role, int]  # ready to activate
    prompt_tokens: int  # uncached prompt tokens routed so far (a counter, as the router's)
    requests: int  # requests routed so far
    itl_s: float  # mean gap between the tokens sent since the last interval (0: none sent)


class Resize(NamedTuple):
    """An order: start `start` workers of `role` (standby first), or drain the named ones."""

    role: Role
    start: int = 0
    drain: tuple[str, ...] = ()


ScalingPolicy = Callable[[PoolsView], Sequence[Resize]]


@dataclass(frozen=True)
class SimScaling:
    policy: ScalingPolicy
    interval_s: float = 1.0
    cold_start_s: float = 30.0
    activation_s: float = 0.1  # a standby worker's, until routed (bench standby measured 0.08 s)
    standby: tuple[int, int] = (0, 0)  # prefill, decode workers kept warm

    def __post_init__(self) -> None:
        for name in ("interval_s", "cold_start_s", "activation_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"SimScaling.{name} must be finite and not negative, got {v!r}")
        if self.interval_s <= 0 or min(self.standby) < 0:
            raise ValueError("SimScaling: a positive interval and no negative standby count")


class PoolsUsage(NamedTuple):
    """What scaling cost over the run."""

    worker_seconds: float  # every worker started, each for the time it was held
    peak: tuple[int, int]  # the most routable prefill and decode workers at once
    sizes: tuple[tuple[float, int, int], ...]  # (time, routable prefill, routable decode) at each interval


class ScaledCluster(Protocol):
    """What `SimPools` needs of the simulator's cluster (plan/sim/simulate.py's _Cluster)."""

    itl_samples: list[tuple[float, int]]
    prompt_tokens: int
    requests: int

    def later(self, t: float, fn: Callable[[float], None]) -> None: ...
    def work_left(self) -> bool: ...
    def routable(self, role: Role) -> Sequence[SimWorker]: ...
    def draining_count(self, role: Role) -> int: ...
    def add_worker(self, role: Role) -> None: ...
    def drain_worker(self, name: str) -> None: ...
    def retire_drained(self) -> None: ...


class SimPools:
    """A `SimScaling` applied to a simulated cluster: its intervals, its starts and standby workers,
    and what they cost."""

    def __init__(self, cluster: ScaledCluster, scaling: SimScaling) -> None:
        self.c, self.s = cluster, scaling
        self.starting: dict[Role, int] = {r: 0 for r in ROLES}
        self.standby: dict[Role, int] = dict(zip(ROLES, scaling.standby, strict=True))
        self.standby_starting: dict[Role, int] = {r: 0 for r in ROLES}
        self.paid = 0.0
        self.paid_until = 0.0
        self.peak = [0, 0]
        self.sizes: list[tuple[float, int, int]] = []
        self.itl_seen = 0

    def begin(self, now: float) -> None:
        self.paid_until = now
        self.c.later(now, self.tick)

    def tick(self, now: float) -> None:
        self._pay(now)
        self.c.retire_drained()
        for order in self.s.policy(self._view(now)):
            self._apply(order, now)
        routed = [len(self.c.routable(r)) for r in ROLES]
        self.peak = [max(a, b) for a, b in zip(self.peak, routed, strict=True)]
        self.sizes.append((now, routed[0], routed[1]))
        if self.c.work_left():
            self.c.later(now + self.s.interval_s, self.tick)

    def usage(self, end: float) -> PoolsUsage:
        self._pay(end)
        return PoolsUsage(self.paid, (self.peak[0], self.peak[1]), tuple(self.sizes))

    def _held(self) -> int:
        return sum(
            len(self.c.routable(r))
            + self.starting[r]
            + self.standby[r]
            + self.standby_starting[r]
            + self.c.draining_count(r)
            for r in ROLES
        )

    def _pay(self, now: float) -> None:
        self.paid += self._held() * max(0.0, now - self.paid_until)
        self.paid_until = max(self.paid_until, now)

    def _view(self, now: float) -> PoolsView:
        fresh = self.c.itl_samples[self.itl_seen :]
        self.itl_seen = len(self.c.itl_samples)
        tokens = sum(n for _, n in fresh)
        return PoolsView(
            now=now,
            routable={r: {w.name: w.load() for w in self.c.routable(r)} for r in ROLES},
            starting=dict(self.starting),
            draining={r: self.c.draining_count(r) for r in ROLES},
            standby=dict(self.standby),
            prompt_tokens=self.c.prompt_tokens,
            requests=self.c.requests,
            itl_s=sum(g * n for g, n in fresh) / tokens if tokens else 0.0,
        )

    def _apply(self, order: Resize, now: float) -> None:
        role = order.role
        for name in order.drain:
            self.c.drain_worker(name)
        warm = min(order.start, self.standby[role])
        self.standby[role] -= warm
        self.standby_starting[role] += warm
        self.starting[role] += order.start
        for k in range(order.start):
            self.c.later(now + (self.s.activation_s if k < warm else self.s.cold_start_s), self._ready(role))
        for _ in range(warm):  # each standby worker taken is replaced, from cold
            self.c.later(now + self.s.cold_start_s, self._standby_ready(role))

    def _ready(self, role: Role) -> Callable[[float], None]:
        def ready(_now: float) -> None:
            self.starting[role] -= 1
            self.c.add_worker(role)

        return ready

    def _standby_ready(self, role: Role) -> Callable[[float], None]:
        def ready(_now: float) -> None:  # held as before: starting, then ready
            self.standby_starting[role] -= 1
            self.standby[role] += 1

        return ready
