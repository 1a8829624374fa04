"""The pool manager: starts the prefill and decode pools as Ray actors, learns
each actor's addresses from the actor itself, hands them to the router's
WorkerSet, replaces an actor that dies, and scales a pool on its queue.

Each pool is a `PoolSpec`: how many workers to start with, the Ray resources of
each (CPUs, GPUs, and custom resources so that a pool can be pinned to a node
type), the worker config they run, and optionally a `ScalingConfig`. With one,
a scale loop applies the policy of cluster/scaling.py every `interval_s`: a grow
starts actors; a shrink drains the chosen worker (no new requests; its running
ones finish, up to `drain_timeout_s`), then removes and stops it.

Workers starting (scale-ups and replacements alike) count as pending for the
policy, so a replacement keeps the pool's size and a booting worker is not
started twice; a worker being drained is not "dead" to the watch.

A pool may keep workers on standby (`PoolSpec.standby`): started ahead, the model
loaded and warmed up, listening, but not handed to the router. A grow or a
replacement takes a standby worker first: handed to the router, it is routable at
its first stats answer, so the pool grows in the time of one poll rather than a
process start and a model load (seconds to minutes). Another standby worker then
starts in the background, in its place. A standby worker idles: its engine loop
sleeps and it takes no request; it holds its weights and, on a CPU, only the KV
blocks its warm-up wrote (a host pool is resident only where written:
engine/kv_cache.untouched_zeros; a GPU's pool is reserved whole).

Workers that serve both roles (`WorkerConfig.switchable` in both pools' specs) may
move between the pools in their own process (`switch`): out of routing at once,
handed to the router in the other role once idle. The joint controller moves the
least-loaded worker of a pool it shrinks to a pool it grows in the same decision,
instead of draining one process while another starts.

With Ray's autoscaler, a worker that finds no room waits while Ray adds a node
of its type; given the autoscaler's node types, one that no type can hold is
refused (`Unplaceable`) before its actor is queued. The autoscaler is also asked,
ahead of any start, for room for every worker the pools hold or start
(`Launcher.request_capacity`), and the request falls as a pool drains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.cluster import joint
from splitserve.cluster.launcher import Unplaceable, worker_bundle
from splitserve.cluster.scaling import ScalerState, ScalingConfig, decide
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import WorkerLoad
from splitserve.router.workers import Role, WorkerSet
from splitserve.workers.common.config import WorkerConfig

if TYPE_CHECKING:  # Ray is imported when the pool starts
    from splitserve.cluster.launcher import Launcher
    from splitserve.cluster.placement import NodeTypes

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PoolSpec:
    role: Role
    replicas: int  # started at once; with scaling, the initial size
    worker: WorkerConfig
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {"prefill_node": 1}
    scaling: ScalingConfig | None = None  # None: a fixed size (dead workers are still replaced)
    standby: int = 0  # workers kept started and warm, not routed to, for the next grow or replacement

    def __post_init__(self) -> None:
        if self.role != self.worker.role:
            raise ValueError(f"PoolSpec role {self.role!r} differs from its worker config's {self.worker.role!r}")
        if self.replicas < 0 or self.standby < 0:
            raise ValueError("replicas and standby must be >= 0")
        s = self.scaling
        if s is not None and not s.min_replicas <= self.replicas <= s.max_replicas:
            raise ValueError(f"{self.role} pool: replicas {self.replicas} outside [{s.min_replicas}, {s.max_replicas}]")


@dataclass(eq=False)
class _Member:
    actor: Any
    worker_id: str
    grpc_address: str
    kv_endpoint: str | None
    draining: bool = False  # chosen by the scaler: being drained, then stopped (not dead)


class PoolManager:
    """Owns the actors of every pool. Runs on the router's event loop."""

    def __init__(
        self,
        specs: list[PoolSpec],
        workers: WorkerSet,
        start_timeout_s: float = 300.0,
        watch_interval_s: float = 2.0,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        node_types: NodeTypes | None = None,
        controller: joint.JointConfig | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        """`node_types`: the Ray autoscaler's (name -> one node's resources), when the cluster has one:
        a worker that no node type can hold is then refused at once instead of queued in Ray.
        `controller`: size both pools together for the SLOs (cluster/joint.py) instead of each
        on its own queue (the specs' scaling then gives only each pool's bounds). `launcher`: how a
        worker starts and stops (default: a Ray actor, cluster/launcher.py)."""
        from splitserve.cluster.launcher import RayLauncher

        self.launcher: Launcher = launcher or RayLauncher(node_types, start_timeout_s)
        self.specs = {s.role: s for s in specs}
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.watch_interval_s = watch_interval_s
        self.metrics = metrics or RouterMetrics(workers.cfg)
        self.clock = clock
        self.node_types = node_types
        self.controller = controller
        self._itl_seen = (0.0, 0)  # the router's ITL totals at the joint controller's last reading
        self.members: dict[Role, list[_Member]] = {s.role: [] for s in specs}
        self.pending: dict[Role, int] = {s.role: 0 for s in specs}  # actors starting
        self.standby: dict[Role, list[_Member]] = {s.role: [] for s in specs}  # started, warm, not routed to
        self.standby_pending: dict[Role, int] = {s.role: 0 for s in specs}  # standby actors starting
        # routed starts that a standby worker, up first, took the place of: they land on standby
        self._demoted: dict[Role, int] = {s.role: 0 for s in specs}
        self._moving: dict[Role, int] = {s.role: 0 for s in specs}  # of `pending`: workers switching in
        # role -> when each standby worker was last handed to the router (monotonic clock), for the logs
        self.activations: dict[Role, list[float]] = {s.role: [] for s in specs}
        self.switches: dict[Role, list[float]] = {s.role: [] for s in specs}  # ... and each switch in
        # both pools' workers serve both roles: a worker may move between them (`switch`)
        self.switchable = len(specs) == 2 and all(s.worker.switchable for s in specs)
        self._serial = 0
        self._loops: list[asyncio.Task[None]] = []  # the watch and the scale loops
        self._jobs: set[asyncio.Task[None]] = set()  # starts and drains in flight

    async def start(self) -> None:
        """Start every pool's initial replicas and standby workers together and wait until all listen."""
        specs = [(spec, False) for spec in self.specs.values() for _ in range(spec.replicas)]
        specs += [(spec, True) for spec in self.specs.values() for _ in range(spec.standby)]
        for spec, standby in specs:
            (self.standby_pending if standby else self.pending)[spec.role] += 1
        self._publish_sizes()  # the autoscaler asked for their room before the actors queue
        results = await asyncio.gather(*[self._start_one(spec) for spec, _ in specs], return_exceptions=True)
        for (spec, standby), r in zip(specs, results, strict=True):
            (self.standby_pending if standby else self.pending)[spec.role] -= 1
            if isinstance(r, _Member):
                self._register(spec.role, r, standby)
        self._publish_sizes()
        for r in results:
            if isinstance(r, BaseException):
                raise r  # the ones that did start are ours to stop
        loop = asyncio.get_running_loop()
        self._loops.append(loop.create_task(self._watch_loop()))
        if self.controller is not None:
            self._loops.append(loop.create_task(self._joint_loop(self.controller)))
            return
        for spec in self.specs.values():
            if spec.scaling is not None and spec.scaling.scales:
                self._loops.append(loop.create_task(self._scale_loop(spec.role, spec.scaling)))

    async def _start_one(self, spec: PoolSpec) -> _Member:
        self._serial += 1
        cfg = dataclasses.replace(spec.worker, worker_id=f"{spec.role}-{self._serial}")
        handle, grpc_address, kv = await self.launcher.start(spec, cfg, self.start_timeout_s)
        log.info("%s worker %s up: grpc %s kv %s", spec.role, cfg.worker_id, grpc_address, kv)
        return _Member(handle, cfg.worker_id, grpc_address, kv)

    def _register(self, role: Role, m: _Member, standby: bool = False) -> None:
        if standby:  # listening, not handed to the router
            self.standby[role].append(m)
            return
        self.members[role].append(m)
        self.workers.add(m.grpc_address, role)

    def _publish_sizes(self) -> None:
        for role, members in self.members.items():
            draining = sum(m.draining for m in members)
            g = self.metrics.pool_workers
            g.labels(role, "serving").set(len(members) - draining)
            g.labels(role, "draining").set(draining)
            g.labels(role, "starting").set(self.pending[role])
            g.labels(role, "standby").set(len(self.standby[role]))
            self.workers.expect(role, self.pending[role])  # a request waiting for one waits for these
        self.launcher.request_capacity(self._wanted_bundles())

    def _wanted_bundles(self) -> list[dict[str, float]]:
        """One bundle for each worker the pools hold or start: routed, starting, on standby (a
        draining one is left out: its node may go once it has finished)."""
        out = []
        for role, spec in self.specs.items():
            held = sum(not m.draining for m in self.members[role]) + self.pending[role]
            held += len(self.standby[role]) + self.standby_pending[role]
            out += [worker_bundle(spec)] * held
        return out

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    def grow(self, role: Role) -> None:
        """One more worker in the pool now, a standby one first (an operator's or a controller's call;
        the scale loop decides its own)."""
        self.metrics.scaling_decisions.labels(role, "grow").inc()
        self._add_worker(role)

    async def retire(self, role: Role, address: str, timeout_s: float = 60.0) -> None:
        """Drain the pool's worker at `address` (no new request; its running ones finish, up to
        `timeout_s`), then stop it."""
        (m,) = [m for m in self.members[role] if m.grpc_address == address and not m.draining]
        m.draining = True
        self._publish_sizes()
        await self._drain(role, m, timeout_s)

    def _add_worker(self, role: Role) -> None:
        """One more worker in the pool: a standby one at once (and another standby started in its
        place), else a new one, counted as pending from now until it is up (or failed)."""
        if self.standby[role]:
            m = self.standby[role].pop(0)
            self.activations[role].append(self.clock())
            log.info("%s worker %s activated from standby (%s)", role, m.worker_id, m.grpc_address)
            self._register(role, m)
            self._top_up_standby(role)
            return
        self.pending[role] += 1
        self._publish_sizes()
        self._spawn(self._boot(role))

    def _top_up_standby(self, role: Role) -> None:
        """Standby workers started in the background up to the pool's count. A scaling pool's count
        within its maximum: a pool at its maximum cannot grow, so it keeps none ready."""
        spec = self.specs[role]
        want = spec.standby
        if spec.scaling is not None:
            routed = len(self.members[role]) + self.pending[role]
            want = min(want, max(0, spec.scaling.max_replicas - routed))
        for _ in range(want - len(self.standby[role]) - self.standby_pending[role]):
            self.standby_pending[role] += 1
            self._spawn(self._boot(role, standby=True))
        self._publish_sizes()

    async def _boot(self, role: Role, standby: bool = False) -> None:
        try:
            m = await self._start_one(self.specs[role])
        except Unplaceable as e:  # a line of its own says it all
            log.error("%s", e)
            m = None
        except Exception:
            log.exception("could not start a %s worker", role)
            m = None
        finally:
            if not standby and self._demoted[role]:  # a standby worker took its place: it lands on standby
                self._demoted[role] -= 1
                standby = True
            (self.standby_pending if standby else self.pending)[role] -= 1
        if m is not None and standby and self.pending[role] > self._moving[role]:
            # A routed start is pending (a replacement, a grow that found no standby worker): this
            # worker, up first, serves now, and that start lands on standby when it comes. When a
            # node is lost with a pool's standby worker on it, its replacement serves as soon as the
            # first of the starts is up, not when the one started for it is.
            self.pending[role] -= 1
            self.standby_pending[role] += 1
            self._demoted[role] += 1
            standby = False
            log.info(
                "%s worker %s, started for standby, serves in place of a start still on its way", role, m.worker_id
            )
        if m is not None:
            self._register(role, m, standby)
        self._publish_sizes()

    def switch(self, role: Role, address: str, timeout_s: float = 60.0) -> None:
        """Move the `role` pool's worker at `address` to the other pool, in its own process: out of
        routing now, counted as starting in the other pool, and handed to the router in its other role
        once it has finished its requests (at `timeout_s`, its last ones finish while it serves the
        other role: the process serves both)."""
        if not self.switchable:
            raise ValueError("the pools' workers are not switchable (WorkerConfig.switchable)")
        (m,) = [m for m in self.members[role] if m.grpc_address == address and not m.draining]
        m.draining = True
        self.pending[_other(role)] += 1
        self._moving[_other(role)] += 1
        self._publish_sizes()
        self._spawn(self._move(role, m, timeout_s))

    async def _move(self, role: Role, m: _Member, timeout_s: float) -> None:
        to = _other(role)
        answering = await self._until_drained(role, m, timeout_s)
        self.workers.remove(m.grpc_address)
        self.members[role].remove(m)
        self.pending[to] -= 1
        self._moving[to] -= 1
        if not answering:  # it died on the way: the other pool grows the usual way
            await self._stop_actor(m)
            self._add_worker(to)
            return
        m.draining = False
        self._register(to, m)
        self.switches[to].append(self.clock())
        self._top_up_standby(role)
        log.info("%s worker %s (%s) now serves the %s pool", role, m.worker_id, m.grpc_address, to)

    # ---- the watch: dead workers are replaced

    async def _watch_loop(self) -> None:
        """Ping every actor; replace the ones that died."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            # all at once: a hung actor costs one ping timeout a round, not one per actor behind it
            watched = [(role, m) for role, members in self.members.items() for m in members if not m.draining]
            watched += [(role, m) for role, members in self.standby.items() for m in members]
            answers = await asyncio.gather(
                *(asyncio.wait_for(self.launcher.ping(m.actor), PING_TIMEOUT_S) for _, m in watched),
                return_exceptions=True,
            )
            for (role, m), answer in zip(watched, answers, strict=True):
                if not isinstance(answer, BaseException):
                    continue
                if m in self.standby[role]:  # never routed to: another takes its place
                    log.warning("standby %s worker %s is gone; starting another", role, m.worker_id)
                    self.standby[role].remove(m)
                    self.launcher.kill(m.actor)
                    self._top_up_standby(role)
                else:
                    self._replace(role, m, answer)

    def _replace(self, role: Role, m: _Member, why: BaseException) -> None:
        members = self.members[role]
        if m.draining or m not in members:
            return  # the scaler took it away while we asked
        log.warning(
            "%s worker %s (%s) is gone (%s); replacing it", role, m.worker_id, m.grpc_address, type(why).__name__
        )
        members.remove(m)
        self.workers.remove(m.grpc_address)
        self.launcher.kill(m.actor)  # hung rather than dead: make sure
        self.metrics.scaling_decisions.labels(role, "replace").inc()
        self._add_worker(role)

    # ---- the scaler

    async def _scale_loop(self, role: Role, cfg: ScalingConfig) -> None:
        state = ScalerState()
        while True:
            await asyncio.sleep(cfg.interval_s)
            state = self._scale_once(role, cfg, state)

    def _scale_once(self, role: Role, cfg: ScalingConfig, state: ScalerState) -> ScalerState:
        members = self.members[role]
        draining = sum(m.draining for m in members)
        d, state = decide(cfg, self._loads(role), self.pending[role], draining, self.clock(), state)
        if d.action == "hold":
            log.debug("%s pool: hold: %s", role, d.reason)
            return state
        log.info("%s pool: %s %d: %s", role, d.action, d.num_workers, d.reason)
        self.metrics.scaling_decisions.labels(role, d.action).inc()
        if d.action == "grow":
            for _ in range(d.num_workers):
                self._add_worker(role)
        else:
            (m,) = [m for m in members if m.grpc_address == d.worker]
            self._shrink(role, m, cfg.drain_timeout_s)
        return state

    # ---- the joint controller

    async def _joint_loop(self, cfg: joint.JointConfig) -> None:
        state = joint.JointState()
        while True:
            await asyncio.sleep(cfg.interval_s)
            state = self.joint_once(cfg, state)

    def observe(self) -> joint.Observation:
        """The pools' load as the joint controller reads it: the router's counters and the workers' stats."""
        requests, blocks, hits = self.metrics.routed_totals()
        itl_total, gaps = self.metrics.itl_totals()
        seen_total, seen_gaps = self._itl_seen
        self._itl_seen = (itl_total, gaps)
        speeds = [
            w.stats.prefill_tokens_per_s
            for w in self.workers.healthy("prefill")
            if w.stats is not None and w.stats.prefill_tokens_per_s > 0
        ]
        return joint.Observation(
            now=self.clock(),
            prompt_tokens=(blocks - hits) * self.workers.cfg.routing.block_size,
            requests=requests,
            prefill_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
            decode_context_tokens=sum(w.load().work_tokens for w in self.workers.healthy("decode")),
            itl_s=(itl_total - seen_total) / (gaps - seen_gaps) if gaps > seen_gaps else 0.0,
            prefill_workers=self._routed_or_starting("prefill"),
            decode_workers=self._routed_or_starting("decode"),
        )

    def _routed_or_starting(self, role: Role) -> int:
        return sum(not m.draining for m in self.members[role]) + self.pending[role]

    def joint_once(self, cfg: joint.JointConfig, state: joint.JointState) -> joint.JointState:
        """One reading and decision of the joint controller, acted on: a pool below its target grows
        at once (a worker the other pool gives up first, when they switch; then standby workers), one
        above it drains its least-loaded worker."""
        decision, state = joint.decide(cfg, self.observe(), state)
        targets: tuple[tuple[Role, int], ...] = (("prefill", decision.prefill), ("decode", decision.decode))
        plans = {
            role: joint.resize(target, self._routed_or_starting(role), self._loads(role)) for role, target in targets
        }
        moved = joint.switch(plans) if self.switchable else None
        if moved is not None:
            role, address = moved
            log.info("%s pool: switch 1 to the %s pool, %s: %s", role, _other(role), address, decision.reason)
            self.metrics.scaling_decisions.labels(_other(role), "switch").inc()
            self.switch(role, address, cfg.drain_timeout_s)
            plans = {role: (0, None), _other(role): (plans[_other(role)][0] - 1, None)}
        for role, (grow, victim) in plans.items():
            if grow:
                log.info("%s pool: grow %d: %s", role, grow, decision.reason)
                self.metrics.scaling_decisions.labels(role, "grow").inc()
                for _ in range(grow):
                    self._add_worker(role)
            elif victim is not None:
                (m,) = [m for m in self.members[role] if m.grpc_address == victim]
                log.info("%s pool: shrink 1, draining %s: %s", role, m.worker_id, decision.reason)
                self.metrics.scaling_decisions.labels(role, "shrink").inc()
                self._shrink(role, m, cfg.drain_timeout_s)
        return state

    def _loads(self, role: Role) -> dict[str, WorkerLoad]:
        """The pool's routed workers' loads, a draining one left out."""
        return {
            m.grpc_address: w.load()
            for m in self.members[role]
            if not m.draining and (w := self.workers.get(m.grpc_address)) is not None
        }

    def _shrink(self, role: Role, m: _Member, timeout_s: float) -> None:
        """`m` out of routing now, so the next decision already sees it draining; drained and
        stopped in the background (the per-pool scaler's shrink and the joint controller's)."""
        m.draining = True
        self._publish_sizes()
        self._spawn(self._drain(role, m, timeout_s))

    async def _drain(self, role: Role, m: _Member, timeout_s: float) -> None:
        """Until the worker has finished its requests (or the deadline), then remove and stop it."""
        await self._until_drained(role, m, timeout_s)
        self.workers.remove(m.grpc_address)
        await self._stop_actor(m)
        # a member until stopped, so that `members` never lists fewer actors than are alive
        self.members[role].remove(m)
        self._top_up_standby(role)  # a pool below its maximum again has room for one ready
        log.info("%s worker %s (%s) drained and stopped", role, m.worker_id, m.grpc_address)

    async def _until_drained(self, role: Role, m: _Member, timeout_s: float) -> bool:
        """No new request for the worker; until it has finished its requests, or the deadline.
        False if it stopped answering on the way."""
        workers = self.workers
        workers.drain(m.grpc_address)
        deadline = self.clock() + timeout_s
        while not workers.drained(m.grpc_address):
            w = workers.get(m.grpc_address)
            if w is None or w.failures >= workers.cfg.retries.unhealthy_after_failures:
                log.info("%s worker %s stopped answering while draining", role, m.worker_id)
                return False
            if self.clock() > deadline:
                log.warning(
                    "%s worker %s still busy after %.0f s of draining; going on (its requests end where they "
                    "are, or are retried elsewhere if it stops)",
                    role,
                    m.worker_id,
                    timeout_s,
                )
                return True
            await asyncio.sleep(workers.cfg.deadlines.drain_poll_interval_s)
        return True

    async def _stop_actor(self, m: _Member) -> None:
        """A clean stop first (the worker closes its server and KV endpoint), then the process goes."""
        try:
            await asyncio.wait_for(self.launcher.stop(m.actor), STOP_TIMEOUT_S)
        except Exception as e:
            log.debug("stopping %s: %s", m.worker_id, type(e).__name__)
        finally:
            self.launcher.kill(m.actor)

    # ----

    def addresses(self, role: Role) -> list[tuple[str, str | None]]:
        return [(m.grpc_address, m.kv_endpoint) for m in self.members.get(role, [])]

    async def stop(self) -> None:
        tasks = self._loops + list(self._jobs)
        for t in tasks:
            t.cancel()
        # a start cancelled here kills its half-started actor; a cancelled drain leaves its member to us
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops.clear()
        for members in (*self.members.values(), *self.standby.values()):
            for m in members:
                await self._stop_actor(m)
            members.clear()
        self.launcher.request_capacity([])  # a stopped deployment holds no nodes for the autoscaler


def _other(role: Role) -> Role:
    return "decode" if role == "prefill" else "prefill"
