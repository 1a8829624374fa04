"""How the pool manager (cluster/pool.py) runs a worker: start it and learn its addresses, ask
whether it is alive, stop it. `RayLauncher` runs each worker as a Ray actor (cluster/actor.py),
which is what `splitserve serve` does; a benchmark may hand the pool manager another launcher
(bench/autoscale.py's hands out mocker workers), so that the pool manager, the controllers and
the router are the real ones over workers that are not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from splitserve.cluster.actor import WorkerActor
    from splitserve.cluster.placement import NodeTypes
    from splitserve.workers.common.config import WorkerConfig

log = logging.getLogger("splitserve.cluster.pool")


class Unplaceable(RuntimeError):
    """A worker that no node of the Ray cluster, nor any node type of its autoscaler, can hold."""


class Pool(Protocol):
    """What a launcher reads of a pool (cluster/pool.py's PoolSpec): its role and what each of its
    workers asks for."""

    @property
    def role(self) -> str: ...
    @property
    def num_cpus(self) -> float: ...
    @property
    def num_gpus(self) -> float: ...
    @property
    def resources(self) -> dict[str, float]: ...


class Launcher(Protocol):
    async def start(self, spec: Pool, cfg: WorkerConfig, timeout_s: float) -> tuple[Any, str, str | None]:
        """A worker of `spec`'s pool running `cfg`, listening: (its handle, gRPC address, KV endpoint).
        Raises if it does not listen within `timeout_s`, leaving nothing behind."""
        ...

    async def ping(self, handle: Any) -> None:
        """Returns while the worker lives; raises once it does not."""
        ...

    async def stop(self, handle: Any) -> None:
        """A clean stop: the worker closes its server and KV endpoint."""
        ...

    def kill(self, handle: Any) -> None:
        """Gone now, whatever state it is in (never raises)."""
        ...

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Room for these workers (one bundle each: the pools' routed, starting and standby ones),
        asked ahead of their starts; each call replaces the last (never raises)."""
        ...


def worker_bundle(spec: Pool) -> dict[str, float]:
    """What one worker of `spec`'s pool asks a node for, as a Ray bundle."""
    asked = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
    return {name: float(n) for name, n in asked.items() if n > 0}


class RayLauncher:
    """Each worker a Ray actor, placed by its pool's resources."""

    def __init__(self, node_types: NodeTypes | None, start_timeout_s: float) -> None:
        """`node_types`: the Ray autoscaler's (name -> one node's resources), when the cluster has one:
        a worker that no node type can hold is then refused at once instead of queued in Ray."""
        import ray

        self._ray = ray
        self.node_types = node_types
        self.start_timeout_s = start_timeout_s
        self._actor_cls = ray.remote(_actor_class())
        self._requested: list[dict[str, float]] | None = None

    async def start(self, spec: Pool, cfg: WorkerConfig, timeout_s: float) -> tuple[Any, str, str | None]:
        self.check_placement(spec, cfg.worker_id)
        actor = self._actor_cls.options(
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            resources=dict(spec.resources),
            name=cfg.worker_id,
            max_restarts=0,
        ).remote(cfg)
        try:
            grpc_address, kv = await asyncio.wait_for(_ray_get(actor.addresses.remote()), timeout_s)
        except BaseException:
            # timed out (no room in the cluster, a slow load), failed or cancelled: never leave it behind
            self.kill(actor)
            raise
        return actor, grpc_address, kv

    async def ping(self, handle: Any) -> None:
        await _ray_get(handle.ping.remote())

    async def stop(self, handle: Any) -> None:
        await _ray_get(handle.stop.remote())

    def kill(self, handle: Any) -> None:
        try:
            self._ray.kill(handle)
        except Exception as e:  # already gone, or Ray itself shutting down
            log.debug("ray.kill: %s", e)

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """The Ray autoscaler's resource request (ray.autoscaler.sdk.request_resources): it keeps nodes
        for every worker the pools hold or want, so that the nodes for a grow are asked for when the
        target is set, not when an actor is found pending, and a standby worker's replacement has its
        node. Sent only when it changes (a shrink lowers it, and the autoscaler may then remove nodes)."""
        if bundles == self._requested:
            return
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception as e:  # no autoscaler to ask, or Ray shutting down: the starts go on as they would
            log.debug("request_resources: %s", e)
            return
        log.info("asked the Ray autoscaler for room for %d workers: %s", len(bundles), _summary(bundles))
        self._requested = [dict(b) for b in bundles]

    def check_placement(self, spec: Pool, worker_id: str) -> None:
        """Say at once why an actor will not start when no alive node can hold it. Ray queues such an
        actor silently until `start_timeout_s`: a pool pinned to a node type that the cluster lacks
        (or has lost, for a replacement) would otherwise look like a slow model load. Without the
        autoscaler's node types only said, not refused: an autoscaler may add the node. With them,
        the node type it waits for is named, and a worker that no node type can hold is refused
        (`Unplaceable`) before its actor is queued."""
        from splitserve.cluster.placement import (
            PoolAsk,
            alive_nodes,
            describe_nodes,
            node_types_to_add,
            placement_problems,
        )

        try:
            nodes = alive_nodes(self._ray.nodes())
        except Exception as e:  # a check for the log's sake: the start goes on without it
            log.debug("ray.nodes: %s", e)
            return
        ask = PoolAsk.of(spec.role, 1, spec.num_cpus, spec.num_gpus, spec.resources)
        if self.node_types is not None:
            problems = placement_problems([ask], nodes, self.node_types)
            if problems:
                raise Unplaceable(f"{spec.role} worker {worker_id} cannot be placed: {problems[0]}")
            if to_add := node_types_to_add(ask, nodes, self.node_types):
                log.info(
                    "%s worker %s waits (up to %.0f s) for the autoscaler to add a node of type %s",
                    spec.role,
                    worker_id,
                    self.start_timeout_s,
                    " or ".join(to_add),
                )
            return
        for problem in placement_problems([ask], nodes):
            log.warning(
                "%s worker %s waits (up to %.0f s) for a node that can hold it: %s; the cluster has %s",
                spec.role,
                worker_id,
                self.start_timeout_s,
                problem,
                describe_nodes(nodes),
            )


def _summary(bundles: list[dict[str, float]]) -> str:
    counts: dict[str, int] = {}
    for b in bundles:
        key = ", ".join(f"{k} {v:g}" for k, v in sorted(b.items())) or "nothing"
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n} x {{{k}}}" for k, n in counts.items())


async def _ray_get(ref: Any) -> Any:
    # ObjectRefs are awaitable: the event loop stays free while Ray works
    return await ref


def _actor_class() -> type[WorkerActor]:
    from splitserve.cluster.actor import WorkerActor

    return WorkerActor
