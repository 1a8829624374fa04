"""The workers the router can use: their addresses, channels, last stats and
health, and the background tasks that keep those fresh (a GetStats poll per
worker, a BlockEvents subscription per decode worker feeding the prefix index).

Whoever starts the router (the Ray pool manager, a test) hands it plain
"host:port" gRPC addresses with `add` and takes them away with `remove`. Both
must run on the router's event loop; from another thread use
`loop.call_soon_threadsafe(workers.add, address, "decode")`.

The set also keeps the decode chooser that routing uses (policy.decode_chooser,
selected once from the config): every request reaches the workers through it.

A worker about to be scaled away is first `drain`ed: routing no longer sees it,
its stats poll goes on, and `drained` says when it has finished its work.

A worker whose stats polls keep failing (a wrong address, a worker not started,
a wrong cluster token) is `unreachable`: logged at WARNING with the reason once
when it becomes so and at INFO when it answers again, never at every poll, and
named by the router's health (router/readiness.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from splitserve.engine.tier_cost import TierSpeeds
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.router.config import RouterConfig
from splitserve.router.policy import DecodeChooser, WorkerLoad, decode_chooser
from splitserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

Role = Literal["decode", "prefill"]
# a change of a worker set's membership: ("add", address, role), ("remove", address),
# ("drain", address) or ("expect", role, workers starting)
Membership = tuple[Any, ...]

DRAINED_AFTER_IDLE_POLLS = 2

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


_NO_STATS = wpb.WorkerStats()  # a worker not polled yet: nothing queued, no blocks (never written to)
_NO_SPEEDS = convert.speeds_from_proto(_NO_STATS)  # nothing measured (a NamedTuple: shared, never written)


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    channel: grpc.aio.Channel
    stub: wgrpc.DecodeWorkerStub | wgrpc.PrefillWorkerStub
    stats: wpb.WorkerStats | None = None
    # what its last stats say it measured, read once per stats answer: every routing decision
    # reads every worker's load, and converting the speeds each time cost 5 us a worker a decision
    speeds: TierSpeeds = _NO_SPEEDS
    healthy: bool = False  # routable: its last stats polls succeeded, its block size and model match
    failures: int = 0  # stats polls failed in a row
    # Calls to it that failed (mark_failed), counted: a stats answer to a poll that went out before
    # the last of them may have been written before the worker went away, so it does not make the
    # worker routable again (a dying worker's last stats put every retry back on it).
    failed_calls: int = 0
    # The router's view is the last stats plus what it knows happened since: tokens routed here
    # (so bursts spread) and tokens of its requests that ended here (so a worker that finished a
    # long prompt is chosen again at once, not a poll later), each kept until a poll that went out
    # after it answers. Issue 22: with endings counted only by the poll, a prefill worker that had
    # just finished looked busy for up to a stats interval and prompts went to the busier one.
    assigned_tokens: int = 0  # routed here to prefill, that its last stats may not show yet
    assigned_context: int = 0  # routed here as KV from a prefill worker: context it will hold, not queue
    ended_tokens: int = 0  # of this router's requests that ended here, that its last stats may still show
    draining: bool = False  # being scaled away: not routable, polled until idle
    # Stats polls in a row, sent since draining began, that found no work and no block in use. A
    # request routed just before the drain may still be on its way, so one idle poll is not proof.
    idle_polls: int = 0
    poll_now: asyncio.Event = field(default_factory=asyncio.Event)  # set: the next stats poll goes out at once
    # why its stats polls fail ("UNAVAILABLE: ..."), once they have failed enough in a row to take
    # it out of routing; None while it answers
    unreachable: str | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def decode_stub(self) -> wgrpc.DecodeWorkerStub:
        """The stub of a decode worker (its pool is where routing found it)."""
        if not isinstance(self.stub, wgrpc.DecodeWorkerStub):
            raise TypeError(f"{self.address} is a {self.role} worker, not a decode worker")
        return self.stub

    def prefill_stub(self) -> wgrpc.PrefillWorkerStub:
        """The stub of a prefill worker (its pool is where routing found it)."""
        if not isinstance(self.stub, wgrpc.PrefillWorkerStub):
            raise TypeError(f"{self.address} is a {self.role} worker, not a prefill worker")
        return self.stub

    def load(self) -> WorkerLoad:
        s = self.stats or _NO_STATS
        queued, running = s.queued_tokens + self.assigned_tokens, s.running_tokens + self.assigned_context
        # an ended prefill leaves the queue it was in; an ended decode leaves the running context
        if self.role == "prefill":
            queued = max(0, queued - self.ended_tokens)
        else:
            running = max(0, running - self.ended_tokens)
        return WorkerLoad(queued, running, s.free_blocks, s.total_blocks, self.speeds, s.running_requests)


class WorkerSet:
    def __init__(
        self, cfg: RouterConfig, index: PrefixIndex, on_health_change: Callable[[], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.index = index
        self._workers: dict[str, Worker] = {}
        self._on_health_change = on_health_change or (lambda: None)
        self._changed = asyncio.Event()  # replaced, after being set, at every change of health
        self._starting: dict[str, int] = {}  # role -> workers the pool manager is starting (`expect`)
        # removed workers' channels, closing once their calls in flight end
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._closed = False
        # the model every routable worker serves: the first fingerprint a worker reported
        self.model_fingerprint: bytes | None = None
        # selected once, here, because the round-robin baseline counts its turns across requests
        self.decode_chooser: DecodeChooser = decode_chooser(cfg.routing)
        # told every change of membership (add, remove, drain, expect) as a `Membership` op, after it
        # is made: router replicas (router/replicas.py) hold the same set by replaying them
        self.mirrors: list[Callable[[Membership], None]] = []

    def _mirror(self, op: Membership) -> None:
        for mirror in self.mirrors:
            mirror(op)

    def membership(self) -> list[Membership]:
        """The ops that build this set's membership from nothing (a new replica's first)."""
        ops: list[Membership] = [("add", w.address, w.role) for w in self._workers.values()]
        ops += [("drain", w.address) for w in self._workers.values() if w.draining]
        return ops + [("expect", role, n) for role, n in self._starting.items()]

    def apply(self, op: Membership) -> None:
        """One op of another set's membership, made here (a replica following its parent's set)."""
        if op[0] == "add":
            self.add(op[1], op[2])
        elif op[0] == "remove":
            self.remove(op[1])
        elif op[0] == "drain":
            self.drain(op[1])
        elif op[0] == "expect":
            self.expect(op[1], op[2])
        else:
            raise ValueError(f"not a membership op: {op!r}")

    # ---- membership (the pool manager's interface)

    def add(self, address: str, role: Role) -> None:
        if role not in ("decode", "prefill"):
            raise ValueError(f"role must be 'decode' or 'prefill', got {role!r}")
        if address in self._workers:
            return
        tls = self.cfg.listeners.internal_tls
        if tls is not None:  # mutual TLS: the worker must hold a certificate of the cluster's CA, and so must we
            channel = grpc.aio.secure_channel(
                address, tls.grpc_channel_credentials(), options=CHANNEL_OPTIONS + tls.CHANNEL_OPTIONS
            )
        else:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = wgrpc.DecodeWorkerStub(channel) if role == "decode" else wgrpc.PrefillWorkerStub(channel)
        w = Worker(address, role, channel, stub)
        self._workers[address] = w
        w.tasks.append(asyncio.get_running_loop().create_task(self._poll_stats(w)))
        if role == "decode":
            w.tasks.append(asyncio.get_running_loop().create_task(self._follow_blocks(w)))
        log.info("added %s worker %s", role, address)
        self._mirror(("add", address, role))

    def add_all(self, addresses: Iterable[str], role: Role) -> None:
        for a in addresses:
            self.add(a, role)

    def remove(self, address: str) -> None:
        w = self._workers.pop(address, None)
        if w is None:
            return
        for t in w.tasks:
            t.cancel()
        self.index.cleared(address)
        # No new call goes to it; the calls in flight finish (or fail on their own if it died), for
        # as long as a request may last. Closing at once cancelled them from under their requests,
        # which took the cancel for their client's: the stream dropped, or the call hung.
        grace = self.cfg.deadlines.request_timeout_s
        closing = asyncio.get_running_loop().create_task(w.channel.close(grace))
        self._retiring[closing] = w.channel
        closing.add_done_callback(lambda t: self._retiring.pop(t, None))
        log.info("removed %s worker %s", w.role, address)
        self._health_changed()
        self._mirror(("remove", address))

    async def close(self) -> None:
        self._closed = True
        tasks = [t for w in self._workers.values() for t in w.tasks]
        for t in tasks:
            t.cancel()
        for w in list(self._workers.values()):
            await w.channel.close()
        for channel in list(self._retiring.values()):  # the router stops: their calls end now
            await channel.close()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        # Waited for, not only cancelled: a poll cancelled inside a gRPC call is still pending
        # when close returns, and the loop's end would destroy it mid-cancel (asyncio logs that).
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()

    def _health_changed(self) -> None:
        self._on_health_change()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def expect(self, role: str, starting: int) -> None:
        """The pool manager's word: this many workers of `role` are on their way (starting,
        loading the model, warming up). A request waiting for a decode worker waits for them."""
        if self._starting.get(role, 0) != starting:
            self._starting[role] = starting
            self._health_changed()
            self._mirror(("expect", role, starting))

    def starting(self, role: str) -> int:
        return self._starting.get(role, 0)

    async def wait_for_decode(self, timeout_s: float, deadline_s: float | None = None) -> bool:
        """Until some decode worker is healthy (a replacement for a dead one, the first one at
        start); whether one is. While the pool manager says a decode worker is starting, up to
        `deadline_s` (the request's own: a replacement on a CPU may load for a minute); while
        none is, up to `timeout_s` (one set up by hand may come back). Woken by health changes
        and by the pool's word, not by polling."""
        now = asyncio.get_running_loop().time
        start = now()
        while not self.healthy("decode"):
            limit = deadline_s if deadline_s is not None and self.starting("decode") else timeout_s
            left = start + limit - now()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):  # then looked at again: the pool's word may have changed
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    # ---- what routing reads

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def healthy(self, role: Role, exclude: Iterable[str] = ()) -> list[Worker]:
        ex = set(exclude)
        return [
            w for w in self._workers.values() if w.role == role and w.healthy and not w.draining and w.address not in ex
        ]

    def decode_loads(self, exclude: Iterable[str] = ()) -> dict[str, WorkerLoad]:
        return {w.address: w.load() for w in self.healthy("decode", exclude)}

    def prefill_queued_tokens(self, exclude: Iterable[str] = ()) -> dict[str, int]:
        return {w.address: w.load().queued_tokens for w in self.healthy("prefill", exclude)}

    def assigned(self, address: str, tokens: int, queued: bool = True) -> None:
        """`tokens` routed to this worker: to prefill (`queued`), or to hold as context once their KV
        arrives from a prefill worker."""
        w = self._workers.get(address)
        if w is None:
            return
        if queued:
            w.assigned_tokens += tokens
        else:
            w.assigned_context += tokens

    def ended(self, address: str, tokens: int) -> None:
        """One of this router's requests (or Prefill calls) ended on this worker: its `tokens` leave the
        worker's load now, not at the next stats poll."""
        w = self._workers.get(address)
        if w is not None:
            w.ended_tokens += tokens

    def mark_failed(self, address: str) -> None:
        """A call to this worker failed: stop routing to it until a stats poll succeeds."""
        w = self._workers.get(address)
        if w is not None:
            w.failed_calls += 1
        if w is not None and w.healthy:
            w.healthy = False
            self._health_changed()

    def drain(self, address: str) -> None:
        """Stop routing new requests to this worker; its running ones finish (see `drained`)."""
        w = self._workers.get(address)
        if w is not None and not w.draining:
            w.draining, w.idle_polls = True, 0
            w.poll_now.set()
            log.info("draining %s worker %s", w.role, address)
            self._health_changed()
            self._mirror(("drain", address))

    def drained(self, address: str) -> bool:
        """A draining worker has answered two stats polls in a row with nothing queued, running or held."""
        w = self._workers.get(address)
        return w is not None and w.draining and w.idle_polls >= DRAINED_AFTER_IDLE_POLLS

    # ---- background

    async def _poll_stats(self, w: Worker) -> None:
        deadlines = self.cfg.deadlines
        while not self._closed:
            # Tokens routed before this poll went out will show in its stats; the ones
            # routed while it is in flight may not, so they stay counted (clearing them
            # all made a burst's load vanish for a poll and fooled the pool scaler).
            assigned_before, ended_before = (w.assigned_tokens, w.assigned_context), w.ended_tokens
            failed_before, draining_before = w.failed_calls, w.draining
            st: wpb.WorkerStats | grpc.aio.AioRpcError
            try:
                st = await w.stub.GetStats(
                    wpb.StatsRequest(), timeout=deadlines.stats_timeout_s, metadata=self.cfg.listeners.auth_metadata
                )
            except grpc.aio.AioRpcError as e:
                st = e
            # read after the call: a failed request can mark the worker unhealthy while the poll is in
            # flight; its answer may predate that failure, so only the next poll can make it healthy
            was = w.healthy
            if isinstance(st, grpc.aio.AioRpcError):
                self._poll_failed(w, st)
            elif w.failed_calls != failed_before:
                log.debug("stats from %s predate a failed call to it: the next poll decides", w.address)
                await asyncio.sleep(0)  # the next poll at once: a worker marked by mistake comes back now
                continue
            else:
                self._poll_answered(w, st, assigned_before, ended_before, draining_before)
            if w.healthy != was:
                log.info("%s worker %s is %s", w.role, w.address, "healthy" if w.healthy else "unhealthy")
                self._health_changed()
            interval = deadlines.drain_poll_interval_s if w.draining else deadlines.stats_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.poll_now.wait(), interval)
            w.poll_now.clear()

    def _poll_failed(self, w: Worker, e: grpc.aio.AioRpcError) -> None:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # the worker answered, at its own limit of concurrent calls: alive and busy, not dead
            log.debug("stats from %s refused: the worker is at its call limit", w.address)
            return
        w.failures += 1
        log.debug("stats from %s failed (%d in a row): %s", w.address, w.failures, e.code())
        if w.failures < self.cfg.retries.unhealthy_after_failures:
            return
        w.healthy = False
        why = f"{e.code().name}: {' '.join(str(e.details()).split())}"
        if w.unreachable is None:  # once per change of state: a dead address must not flood the log
            log.warning(
                "%s worker %s is unreachable (%d stats polls failed in a row): %s; no request goes to it "
                "until it answers (check the address and that the worker runs)",
                w.role,
                w.address,
                w.failures,
                why,
            )
        w.unreachable = why

    def _poll_answered(
        self,
        w: Worker,
        st: wpb.WorkerStats,
        assigned_before: tuple[int, int],
        ended_before: int,
        draining_before: bool,
    ) -> None:
        """`draining_before`: the worker was draining when the poll went out (only such an answer
        counts towards drained)."""
        if w.unreachable is not None:
            log.info("%s worker %s answers again", w.role, w.address)
            w.unreachable = None
        block_size = self.cfg.routing.block_size
        if st.block_size and st.block_size != block_size:
            if w.healthy or w.failures == 0:
                log.error(
                    "worker %s has block_size %d, the router %d: not routing to it",
                    w.address,
                    st.block_size,
                    block_size,
                )
            w.healthy, w.failures = False, 1
            return
        if not self._same_model(w, st.model_fingerprint):
            return
        w.stats, w.speeds, w.failures, w.healthy = st, convert.speeds_from_proto(st), 0, True
        w.assigned_tokens = max(0, w.assigned_tokens - assigned_before[0])
        w.assigned_context = max(0, w.assigned_context - assigned_before[1])
        w.ended_tokens = max(0, w.ended_tokens - ended_before)
        if w.draining and draining_before:
            w.idle_polls = w.idle_polls + 1 if _idle(st) else 0

    def _same_model(self, w: Worker, fingerprint: bytes) -> bool:
        """Whether `w` serves the cluster's model: the one the first worker to report a fingerprint
        serves. A worker of another model is never routed to, so no stream is prefilled by one
        model and decoded by another, nor migrated onto another (a KV transfer between two would
        be refused by its manifest; a migration recomputes the KV, so only this check stops it)."""
        if not fingerprint:
            return True  # a worker that does not say (an older one): its KV handshake still checks
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint
        if fingerprint == self.model_fingerprint:
            return True
        if w.healthy or w.failures == 0:
            log.error(
                "worker %s serves another model (fingerprint %s, the cluster's %s): not routing to it",
                w.address,
                fingerprint.hex(),
                self.model_fingerprint.hex(),
            )
        w.healthy, w.failures = False, 1
        return False

    async def _follow_blocks(self, w: Worker) -> None:
        deadlines = self.cfg.deadlines
        index = self.index
        while not self._closed:
            call = w.stub.BlockEvents(
                wpb.BlockEventsRequest(),
                timeout=deadlines.block_events_timeout_s,
                metadata=self.cfg.listeners.auth_metadata,
            )
            try:
                async for batch in call:
                    for ev in batch.events:
                        kind = ev.WhichOneof("kind")
                        if kind == "stored":
                            index.stored(w.address, ev.stored.block_hashes, convert.tier_name(ev.tier))
                        elif kind == "removed":
                            index.removed(w.address, ev.removed.block_hashes, convert.tier_name(ev.tier))
                        elif kind == "cleared":
                            index.cleared(w.address)
            except grpc.aio.AioRpcError as e:
                log.debug("block events from %s ended: %s", w.address, e.code())
            finally:
                call.cancel()
            # What we knew may be stale now; the next subscription starts with a snapshot.
            index.cleared(w.address)
            await asyncio.sleep(deadlines.reconnect_backoff_s)


def _idle(st: wpb.WorkerStats) -> bool:
    # free == total: no block reserved or in use (cached, evictable blocks count as free), so a
    # prefill worker has also seen its last KV transfer confirmed
    return (
        st.queued_tokens == st.running_tokens == st.queue_length == st.running_requests == 0
        and st.free_blocks == st.total_blocks
    )
