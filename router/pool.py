"""The pool manager: starts the prefill and decode pools as Ray actors, learns
each actor's addresses from the actor itself, hands them to the router's
WorkerSet, and replaces an actor that dies.

Each pool is a `PoolSpec`: how many workers, the Ray resources of each (CPUs,
GPUs, and custom resources so that a pool can be pinned to a node type), and
the worker config they run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from splitserve.router.workers import WorkerSet
from splitserve.worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSpec:
    role: str  # "prefill" | "decode"
    replicas: int
    worker: WorkerConfig
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {"prefill_node": 1}

    def __post_init__(self) -> None:
        if self.role != self.worker.role:
            raise ValueError(f"PoolSpec role {self.role!r} differs from its worker config's {self.worker.role!r}")
        if self.replicas < 0:
            raise ValueError("replicas must be >= 0")


@dataclass
class _Member:
    actor: Any
    grpc_address: str
    kv_endpoint: str | None


class PoolManager:
    """Owns the actors of every pool. Runs on the router's event loop."""

    def __init__(self, specs: list[PoolSpec], workers: WorkerSet, start_timeout_s: float = 300.0,
                 watch_interval_s: float = 2.0) -> None:
        import ray

        self._ray = ray
        self.specs = {s.role: s for s in specs}
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.watch_interval_s = watch_interval_s
        self.members: dict[str, list[_Member]] = {s.role: [] for s in specs}
        self._actor_cls = ray.remote(_actor_class())
        self._serial = 0
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start every pool's replicas together and wait until all listen."""
        starts = [self._start_one(spec) for spec in self.specs.values() for _ in range(spec.replicas)]
        for m, role in await asyncio.gather(*starts):
            self._register(role, m)
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _start_one(self, spec: PoolSpec) -> tuple[_Member, str]:
        self._serial += 1
        cfg = dataclasses.replace(spec.worker, worker_id=f"{spec.role}-{self._serial}")
        actor = self._actor_cls.options(
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=dict(spec.resources),
            name=cfg.worker_id, max_restarts=0,
        ).remote(cfg)
        grpc_address, kv = await asyncio.wait_for(_ray_get(actor.addresses.remote()), self.start_timeout_s)
        log.info("%s worker %s up: grpc %s kv %s", spec.role, cfg.worker_id, grpc_address, kv)
        return _Member(actor, grpc_address, kv), spec.role

    def _register(self, role: str, m: _Member) -> None:
        self.members[role].append(m)
        self.workers.add(m.grpc_address, role)  # type: ignore[arg-type]

    async def _watch_loop(self) -> None:
        """Ping every actor; replace the ones that died."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            for role, members in self.members.items():
                for m in list(members):
                    try:
                        await asyncio.wait_for(_ray_get(m.actor.ping.remote()), 10.0)
                    except Exception as e:
                        log.warning("%s worker %s is gone (%s); replacing it", role, m.grpc_address, type(e).__name__)
                        members.remove(m)
                        self.workers.remove(m.grpc_address)
                        try:
                            new, _ = await self._start_one(self.specs[role])
                            self._register(role, new)
                        except Exception:
                            log.exception("could not replace a %s worker", role)

    def addresses(self, role: str) -> list[tuple[str, str | None]]:
        return [(m.grpc_address, m.kv_endpoint) for m in self.members.get(role, [])]

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for members in self.members.values():
            for m in members:
                try:
                    await asyncio.wait_for(_ray_get(m.actor.stop.remote()), 10.0)
                except Exception:
                    pass
                self._ray.kill(m.actor)
            members.clear()


async def _ray_get(ref: Any) -> Any:
    # ObjectRefs are awaitable: the event loop stays free while Ray works
    return await ref


def _actor_class() -> type:
    from splitserve.worker.actor import WorkerActor

    return WorkerActor
