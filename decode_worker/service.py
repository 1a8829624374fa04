"""The decode worker's gRPC service: admit, reserve, receive KV, decode, stream.

One `Decode` call is one request from admission to finish. In REMOTE mode the
engine reserves the blocks the request lacks (its cached prefix is reused) and
the kv_transfer receiver is told to accept exactly those blocks until the
lease ends; the reservation goes back to the router as the first event. When
the receiver reports the KV complete, the request joins the running batch with
the first token the prefill worker sampled. Every way out (finish, client
cancel, lease expiry, a failed transfer) frees the blocks, exactly once, and
only after the receiver has promised that no transfer can still write them
(`_release`). The call owns its request id on this worker until then
(worker/request_ids.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.decode_worker import metrics
from splitserve.engine.block_hash import block_hashes
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.engine.sequence import Sequence
from splitserve.kv_transfer import Completed, KVReceiver
from splitserve.kv_transfer import Reservation as KVReservation
from splitserve.kv_transfer.frame import REQUEST_ID_BYTES
from splitserve.kv_transfer.receiver import Outcome
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.worker.blocks import stream_block_events
from splitserve.worker.config import WorkerConfig
from splitserve.worker.request_ids import RequestIds

log = logging.getLogger(__name__)

_FINISH = {
    "stop": wpb.FINISH_REASON_STOP,
    "length": wpb.FINISH_REASON_LENGTH,
    "abort": wpb.FINISH_REASON_ABORTED,
}


class _Finish(Exception):
    """Ends a Decode stream with a Finish event."""

    def __init__(self, reason: int, message: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class _Cancelled:
    """Put on a call's event queue when its client (the router) goes away, to wake the handler."""


_CANCELLED = _Cancelled()
_RECEIVER_CODES = {"lease_expired": wpb.FINISH_REASON_LEASE_EXPIRED}

Event = StepOutput | _Finish | _Cancelled


class _Admission:
    """One Decode call's hold on its request: what it must give back, and whether to stop.

    `lock` makes "reserve unless cancelled" and "cancel, then see what was reserved" two
    atomic moves, so a cancel at any moment (before, during or after the reservation)
    finds either nothing reserved, or the ticket to cancel it by.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.cancelled = False
        self.ticket: bytes | None = None  # the KV reservation's, once it exists
        self.seq: Sequence | None = None  # the engine's sequence, once admitted (to abort exactly this one)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
        self.events.put(_CANCELLED)


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, receiver: KVReceiver) -> None:
        self.cfg = cfg
        self.loop = loop
        self.receiver = receiver
        self.block_size = loop.engine.cfg.block_size
        self.admissions: RequestIds[_Admission] = RequestIds()

    # ---- Decode ----

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.DecodeEvent]:  # noqa: N802
        rid = request.request_id
        try:
            if not rid:
                raise ValueError("request_id is empty")
            if len(rid.encode()) > REQUEST_ID_BYTES:
                raise ValueError(f"request_id is longer than the KV frame's {REQUEST_ID_BYTES} bytes")
            if request.prefill_mode not in (wpb.PREFILL_MODE_LOCAL, wpb.PREFILL_MODE_REMOTE):
                raise ValueError("prefill_mode must be LOCAL or REMOTE")
            params = convert.sampling_from_proto(request.sampling)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        adm = _Admission(rid)
        if not self.admissions.claim(rid, adm):
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use on this worker")
        self.loop.set_sink(rid, adm.events.put)
        try:
            if not context.add_callback(adm.cancel):
                return  # the call is over already
            prompt, prior = list(request.prompt_token_ids), list(request.output_token_ids)
            if request.prefill_mode == wpb.PREFILL_MODE_LOCAL:
                first = self._admit_local(adm, prompt, prior, params, context)
            else:
                lease_s = (request.lease_ms or self.cfg.lease_ms) / 1000.0
                first = self._admit_remote(adm, prompt, prior, params, lease_s, context)
            if first is None:
                return
            yield first
            yield from self._stream(adm, params.logprobs)
        finally:
            self._release(adm)
            self.loop.drop_sink(rid, adm.events.put)
            self.admissions.release(rid, adm)

    def _admit_local(self, adm, prompt, prior, params, context) -> wpb.DecodeEvent | None:  # type: ignore[no-untyped-def]
        def admit(engine: Engine) -> int | None:
            with adm.lock:
                if adm.cancelled:
                    return None
                engine.add_request(adm.request_id, prompt, params, output_token_ids=prior)
                adm.seq = engine.requests[adm.request_id]
            ctx = prompt + prior
            return len(engine.blocks.cached_prefix(block_hashes(ctx, self.block_size), len(ctx))) * self.block_size

        cached = self._call(admit, context)
        if cached is None:
            return None
        return wpb.DecodeEvent(local_prefill=wpb.LocalPrefill(num_cached_tokens=cached))

    def _admit_remote(self, adm, prompt, prior, params, lease_s, context) -> wpb.DecodeEvent | None:  # type: ignore[no-untyped-def]
        rid = adm.request_id

        def on_done(r: KVReservation, outcome: Outcome) -> None:
            # on a receiver thread, once no write into the blocks can still land: hand over to the engine thread
            if isinstance(outcome, Completed):
                def commit(engine: Engine) -> None:
                    if engine.awaiting_kv.get(rid) is adm.seq:
                        out = engine.commit_kv(rid, outcome.first_token)
                        if out.finished:  # the router has the first token from the prefill worker already
                            adm.events.put(out._replace(token_id=-1))

                self.loop.call(commit)
            else:
                self.loop.call(lambda engine: self._free_reservation(engine, adm))
                code = _RECEIVER_CODES.get(outcome.code, wpb.FINISH_REASON_ABORTED)
                adm.events.put(_Finish(code, f"KV transfer failed: {outcome.reason}"))

        def reserve(engine: Engine) -> tuple[KVReservation, int] | bool:
            with adm.lock:
                if adm.cancelled:
                    return False
                res = engine.reserve(rid, prompt, params, output_token_ids=prior)
                if res is None:
                    return True
                adm.seq = engine.awaiting_kv[rid]
                try:
                    kv = self.receiver.reserve(rid, res.block_ids, lease_s, on_done=on_done)
                except Exception as e:  # the engine's blocks are free and unreserved: a worker bug, not the request's
                    engine.cancel_reservation(rid)
                    raise RuntimeError(f"KV reservation failed: {e}") from None
                adm.ticket = kv.ticket
                return kv, res.num_cached_tokens

        got = self._call(reserve, context)
        if got is False:
            return None
        if got is True:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks for this request now")
        kv, cached = got
        return wpb.DecodeEvent(reservation=convert.reservation_to_proto(kv, cached))

    def _stream(self, adm: _Admission, logprobs: bool) -> Iterator[wpb.DecodeEvent]:
        events = adm.events
        try:
            item = events.get(timeout=self.cfg.request_timeout_s)
        except queue.Empty:
            yield wpb.DecodeEvent(finish=wpb.Finish(reason=wpb.FINISH_REASON_ABORTED, message="request timed out"))
            return
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while True:
            if isinstance(item, _Cancelled):
                return  # nobody listens; the finally gives everything back
            if isinstance(item, _Finish):
                yield wpb.DecodeEvent(finish=wpb.Finish(reason=item.reason, message=str(item)))
                return
            # coalesce whatever else is ready into one Tokens event
            outs = [item]
            pending: Event | None = None
            while not outs[-1].finished:
                try:
                    nxt = events.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, StepOutput):
                    pending = nxt
                    break
                outs.append(nxt)
            sampled = [o for o in outs if o.token_id >= 0]
            toks = [o.token_id for o in sampled]
            if toks:
                lps = [o.logprob or 0.0 for o in sampled] if logprobs else []
                yield wpb.DecodeEvent(tokens=wpb.Tokens(token_ids=toks, logprobs=lps))
            last = outs[-1]
            if last.finished:
                yield wpb.DecodeEvent(finish=wpb.Finish(reason=_FINISH.get(last.finish_reason or "", wpb.FINISH_REASON_ABORTED)))
                return
            if pending is not None:
                item = pending
                continue
            try:
                item = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                yield wpb.DecodeEvent(finish=wpb.Finish(reason=wpb.FINISH_REASON_ABORTED, message="request timed out"))
                return

    def _call(self, fn, context):  # type: ignore[no-untyped-def]
        try:
            return self.loop.call(fn).result(timeout=self.cfg.admit_timeout_s)
        except ValueError as e:  # the engine refused what the request asked for
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "engine did not admit the request in time")
        except RuntimeError as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))

    # ---- giving everything back ----

    def _release(self, adm: _Admission) -> None:
        """Free what the call holds, exactly once, and return only when it is free.

        The KV reservation goes first: `receiver.cancel` returns once no write into its
        blocks can still land, and only then may the engine free them. If it does not
        return in time, the blocks stay with the reservation and its `on_done` frees
        them later: a leak for a while is better than a block written after it was freed.
        """
        with adm.lock:
            adm.cancelled = True
            ticket = adm.ticket
        if ticket is not None:
            try:
                self.receiver.cancel(ticket, timeout=self.cfg.admit_timeout_s)
            except TimeoutError:
                log.error("request %s: a write into its cancelled reservation did not stop; "
                          "its blocks are freed when it does", adm.request_id)
                return
        try:
            self.loop.call(lambda engine: self._abort(engine, adm)).result(timeout=self.cfg.admit_timeout_s)
        except (TimeoutError, RuntimeError) as e:  # a stopped loop frees nothing any more
            log.warning("request %s: engine abort did not run: %s", adm.request_id, e)

    def _abort(self, engine: Engine, adm: _Admission) -> None:
        rid = adm.request_id
        if adm.seq is None:
            return
        if engine.awaiting_kv.get(rid) is adm.seq:
            self._free_reservation(engine, adm)
        elif engine.requests.get(rid) is adm.seq:
            engine.abort(rid)

    def _free_reservation(self, engine: Engine, adm: _Admission) -> None:
        """On the engine thread: free a reserved request's blocks, which no transfer may still write."""
        seq = engine.awaiting_kv.get(adm.request_id)
        if seq is None or seq is not adm.seq:
            return
        live = self.receiver.live_blocks(list(seq.block_table))
        if live:  # the invariant the whole ownership scheme exists for; counted so tests and alerts see it
            metrics.BLOCKS_FREED_WHILE_RESERVED.inc(len(live))
            log.error("request %s: freeing blocks %s that a live KV reservation may still write",
                      adm.request_id, live[:8])
        engine.cancel_reservation(adm.request_id)

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        """Ends the request's Decode call, which gives everything back (the one way to free it)."""
        adm = self.admissions.owner(request.request_id)
        if adm is not None:
            adm.cancel()
        return wpb.CancelResponse(found=adm is not None)

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        return convert.stats_to_proto(self.cfg.worker_id, self.loop.stats, self.block_size)

    def BlockEvents(self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext) -> Iterator[wpb.BlockEventBatch]:  # noqa: N802
        return stream_block_events(self.loop, context)
