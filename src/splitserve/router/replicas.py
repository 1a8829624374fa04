"""Router replicas: one address, N router processes (`--routers N`).

A router is one Python process on one event loop, and one core of it relays a few thousand
streamed tokens a second (bench/results/router-load-*.txt). Replicas scale that with cores, as
the anchors run several routers: every replica listens on the same ports with SO_REUSEPORT and
the kernel spreads new connections over them by a hash of each connection's addresses. So one
client connection stays on one replica, and a client that wants the spread opens several (as
every HTTP client and a pool of gRPC channels do).

Each replica keeps its own view of the workers, the way a lone router does: it polls their
stats and subscribes to their KV block events itself, so every replica's prefix index is built
from the workers' own events, not relayed from another replica. Which workers exist (the pool
manager's adds, drains, removals and starting counts) is the first router's: a new replica is
handed that membership when it starts and then every change to it, over a pipe
(`WorkerSet.mirrors`).

The cluster's limits (requests in flight, seats, each tenant's concurrency and tokens a minute)
are split over the replicas by `per_replica`: each replica enforces its share, so with
connections spread evenly the shares add up to the limit. A limit smaller than the replica count
is rounded up to one per replica, and said at start.

A replica that dies takes its own connections' requests and no other's; the first router starts
another in its place on the same ports, with the membership as it is then. Stopping the first
stops the others, each draining its requests for the same grace; a second signal to the first
cuts every drain short.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from splitserve.router.config import RouterConfig
from splitserve.router.workers import Membership

if TYPE_CHECKING:
    from splitserve.router.server import Router
    from splitserve.router.tokenizer import RouterTokenizer

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a replica imports the router and loads the tokenizer: seconds on a slow CPU
RESTART_AFTER_S = 1.0  # a replica that died is started again after this: a crash loop costs a start a second


def _share(limit: int, replicas: int) -> int:
    return math.ceil(limit / replicas)


def per_replica(cfg: RouterConfig) -> tuple[RouterConfig, list[str]]:
    """Each replica's config for `cfg.listeners.replicas` replicas: the cluster's limits split over
    them (rounded up), and a line for each limit too small to split."""
    n = cfg.listeners.replicas
    if n == 1:
        return cfg, []
    notes: list[str] = []

    def split(limit: int | None, what: str) -> int | None:
        if limit is None:
            return None
        if limit < n:
            notes.append(f"{what} {limit} is below --routers {n}: each router replica allows 1 ({n} in all)")
        return _share(limit, n)

    limits = replace(
        cfg.limits,
        max_inflight=split(cfg.limits.max_inflight, "--max-inflight") or 1,
        max_running=split(cfg.limits.max_running, "--max-running-requests"),
    )
    tenants = tuple(
        replace(
            t,
            max_concurrent=split(t.max_concurrent, f"tenant {t.name!r} max_concurrent"),
            tokens_per_minute=split(t.tokens_per_minute, f"tenant {t.name!r} tokens_per_minute"),
        )
        for t in cfg.tenants
    )
    return replace(cfg, limits=limits, tenants=tenants), notes


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process needs to run a router like the first one (pickled to it)."""

    cfg: RouterConfig  # the first router's, with the ports it bound
    tokenizer: Callable[[], RouterTokenizer]  # builds the router's tokenizer in the replica's process
    index: int  # 1, 2, ...: the first router is 0; its --metrics-port is the first's plus this
    shutdown_grace_s: float
    otlp_traces_endpoint: str | None = None
    log_level: int = logging.INFO


class Replicas:
    """The replicas beside a started router (`router.cfg.listeners.replicas` - 1 processes).

    replicas = Replicas(router, tokenizer_factory, shutdown_grace_s=30)
    await replicas.start()      # each listening, with the router's workers
    ...
    replicas.terminate()        # each drains for its grace
    await replicas.join()
    """

    def __init__(
        self,
        router: Router,
        tokenizer: Callable[[], RouterTokenizer],
        shutdown_grace_s: float,
        otlp_traces_endpoint: str | None = None,
        log_level: int = logging.INFO,
    ) -> None:
        lis = router.cfg.listeners
        bound = replace(lis, grpc_port=router.port, http_port=router.http_port if router.http is not None else None)
        self._spec = ReplicaSpec(
            replace(router.cfg, listeners=bound), tokenizer, 0, shutdown_grace_s, otlp_traces_endpoint, log_level
        )
        self._workers = router.workers
        self._ctx = mp.get_context("spawn")  # a fork would copy gRPC's threads and the event loop mid-flight
        self.processes: dict[int, Any] = {}  # index -> its process (multiprocessing's spawn Process)
        self._conns: dict[int, Connection] = {}
        self._stopping = False
        self._signalled: set[int] = set()  # replicas told to drain (pids)
        self.restarts = 0
        self._workers.mirrors.append(self._send_all)

    @property
    def count(self) -> int:
        return self._spec.cfg.listeners.replicas - 1

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every replica started and listening (RuntimeError naming the one that is not in time)."""
        for i in range(1, self.count + 1):
            self._spawn(i)
        await asyncio.gather(*(self._listening(i, timeout_s) for i in self.processes))

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.pid is not None]

    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        spec = replace(self._spec, index=i)
        # the membership goes with the process's arguments, the changes after it down the pipe
        p = self._ctx.Process(
            target=serve_replica, args=(spec, self._workers.membership(), child), name=f"router-replica-{i}"
        )
        p.start()
        child.close()
        self.processes[i], self._conns[i] = p, parent
        asyncio.get_running_loop().add_reader(p.sentinel, self._exited, i)

    async def _listening(self, i: int, timeout_s: float) -> None:
        conn = self._conns[i]
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, conn.poll, timeout_s):
            raise RuntimeError(f"router replica {i} did not start listening within {timeout_s:g} s")
        try:
            said = conn.recv()
        except EOFError:
            raise RuntimeError(f"router replica {i} exited before it listened") from None
        log.info("router replica %d (pid %d) listening", i, said[1])

    def _send_all(self, op: Membership) -> None:
        for conn in self._conns.values():
            try:
                conn.send(op)
            except OSError:  # a replica that died: its successor starts from the membership then
                pass

    def _exited(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        p = self.processes[i]
        loop.remove_reader(p.sentinel)
        p.join()
        self._conns.pop(i).close()
        if self._stopping:
            return
        log.warning("router replica %d (pid %s) exited with code %s; starting another", i, p.pid, p.exitcode)
        self.restarts += 1
        loop.call_later(RESTART_AFTER_S, self._restart, i)

    def _restart(self, i: int) -> None:
        if not self._stopping:
            self._spawn(i)

    def terminate(self) -> None:
        """Tell every replica to drain and stop (SIGTERM), once: calling it again does nothing, since
        a second signal would cut a replica's drain short (that is `cut`)."""
        self._stopping = True
        for p in self.processes.values():
            if p.exitcode is None and p.pid is not None and p.pid not in self._signalled:
                self._signalled.add(p.pid)
                os.kill(p.pid, signal.SIGTERM)

    async def draining(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every replica told to stop says it is draining (RuntimeError past `timeout_s`)."""
        loop = asyncio.get_running_loop()
        for i, p in list(self.processes.items()):
            conn = self._conns.get(i)
            if conn is None or p.pid not in self._signalled:
                continue
            said: tuple[Any, ...] = ()
            while not said or said[0] != "draining":  # a replacement's "listening" first, not read at its start
                if not await loop.run_in_executor(None, conn.poll, timeout_s):
                    raise RuntimeError(f"router replica {i} did not start draining within {timeout_s:g} s")
                said = conn.recv()

    def cut(self) -> None:
        """Cut every replica's drain short (a second SIGTERM): the first router's own was cut."""
        self.terminate()
        for p in self.processes.values():
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    async def join(self, timeout_s: float | None = None) -> None:
        """Until every replica has ended (past `timeout_s` beyond its grace, killed)."""
        limit = self._spec.shutdown_grace_s + 5.0 if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        for p in list(self.processes.values()):
            await loop.run_in_executor(None, p.join, limit)
            if p.exitcode is None:
                p.kill()
                await loop.run_in_executor(None, p.join)
            loop.remove_reader(p.sentinel)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        if self._send_all in self._workers.mirrors:  # joined once already: nothing to follow
            self._workers.mirrors.remove(self._send_all)


async def start_replicas(
    router: Router, model: str | None, shutdown_grace_s: float, otlp_traces_endpoint: str | None
) -> Replicas | None:
    """The replicas `router`'s config asks for beside it (None: it is the only one), listening; a
    replica that does not start stops the others it started and raises."""
    if router.cfg.listeners.replicas == 1:
        return None
    from splitserve.router.engine_tokenizer import model_tokenizer

    replicas = Replicas(router, functools.partial(model_tokenizer, model), shutdown_grace_s, otlp_traces_endpoint)
    try:
        await replicas.start()
    except BaseException:
        replicas.terminate()
        await replicas.join(timeout_s=5.0)
        raise
    return replicas


def serve_replica(spec: ReplicaSpec, membership: Sequence[Membership], conn: Connection) -> None:
    """A replica's process: a router on the shared ports, its workers the parent's, until SIGTERM
    (then it drains) or until the parent is gone."""
    # Ctrl-C reaches the whole process group: the first router's signal is the one that stops it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s %(name)s[replica {spec.index}]: %(message)s"
    )
    from splitserve.router.event_loop import run

    run(_replica(spec, membership, conn))


async def _replica(spec: ReplicaSpec, membership: Sequence[Membership], conn: Connection) -> None:
    from splitserve.router.server import Router
    from splitserve.router.shutdown import drain
    from splitserve.runtime.tracing import setup_tracing

    setup_tracing(spec.otlp_traces_endpoint, "router")
    lis = spec.cfg.listeners
    metrics_port = lis.metrics_port + spec.index if lis.metrics_port else 0
    router = Router(replace(spec.cfg, listeners=replace(lis, metrics_port=metrics_port)), spec.tokenizer())
    await router.start()
    for op in membership:
        router.workers.apply(op)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def from_parent() -> None:
        try:
            while conn.poll():
                router.workers.apply(conn.recv())
        except (EOFError, OSError):  # the parent is gone, and with it whoever would stop us
            loop.remove_reader(conn.fileno())
            stop.set()

    loop.add_reader(conn.fileno(), from_parent)
    conn.send(("listening", os.getpid()))
    await stop.wait()
    with contextlib.suppress(OSError):  # the parent may be gone: then nobody asks
        conn.send(("draining", os.getpid()))
    await drain(router, spec.shutdown_grace_s, loop, log_prefix=f"splitserve router replica {spec.index}")
    await router.stop()
