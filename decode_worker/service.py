"""The decode worker's gRPC service: admit, reserve, receive KV, decode, stream.

One `Decode` call is one request from admission to finish. In REMOTE mode the
engine reserves the blocks the request lacks (its cached prefix is reused) and
the kv_transfer receiver is told to accept exactly those blocks until the
lease ends; the reservation goes back to the router as the first event. When
the receiver reports the KV complete, the request joins the running batch with
the first token the prefill worker sampled. Every way out (finish, client
cancel, lease expiry, a failed transfer) frees the blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.kv_transfer import Completed, KVReceiver
from splitserve.kv_transfer import Reservation as KVReservation
from splitserve.kv_transfer.receiver import Outcome
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.worker.blocks import stream_block_events
from splitserve.worker.config import WorkerConfig

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


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, receiver: KVReceiver) -> None:
        self.cfg = cfg
        self.loop = loop
        self.receiver = receiver
        self.block_size = loop.engine.cfg.block_size

    # ---- Decode ----

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.DecodeEvent]:  # noqa: N802
        rid = request.request_id
        try:
            if not rid:
                raise ValueError("request_id is empty")
            if request.prefill_mode not in (wpb.PREFILL_MODE_LOCAL, wpb.PREFILL_MODE_REMOTE):
                raise ValueError("prefill_mode must be LOCAL or REMOTE")
            params = convert.sampling_from_proto(request.sampling)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        prior = list(request.output_token_ids)
        events: queue.SimpleQueue[StepOutput | _Finish] = queue.SimpleQueue()
        self.loop.set_sink(rid, events.put)
        ticket: list[bytes] = []  # set once a KV reservation exists
        done = threading.Event()

        def on_cancel() -> None:
            if not done.is_set():
                self._cancel(rid, ticket)

        context.add_callback(on_cancel)
        try:
            if request.prefill_mode == wpb.PREFILL_MODE_LOCAL:
                first = self._admit_local(rid, prompt, prior, params, context)
            else:
                lease_s = (request.lease_ms or self.cfg.lease_ms) / 1000.0
                first = self._admit_remote(rid, prompt, prior, params, lease_s, events, ticket, context)
            yield first
            yield from self._stream(rid, params.logprobs, events, context)
        finally:
            done.set()
            self.loop.drop_sink(rid)

    def _admit_local(self, rid, prompt, prior, params, context) -> wpb.DecodeEvent:  # type: ignore[no-untyped-def]
        def admit(engine: Engine) -> int:
            engine.add_request(rid, prompt, params, output_token_ids=prior)
            ctx = prompt + prior
            return len(engine.blocks.cached_prefix(block_hashes(ctx, self.block_size), len(ctx))) * self.block_size

        cached = self._call(admit, context)
        return wpb.DecodeEvent(local_prefill=wpb.LocalPrefill(num_cached_tokens=cached))

    def _admit_remote(self, rid, prompt, prior, params, lease_s, events, ticket, context) -> wpb.DecodeEvent:  # type: ignore[no-untyped-def]
        def on_done(r: KVReservation, outcome: Outcome) -> None:
            # on a receiver thread: hand the outcome to the engine thread
            if isinstance(outcome, Completed):
                def commit(engine: Engine) -> None:
                    if rid in engine.awaiting_kv:
                        out = engine.commit_kv(rid, outcome.first_token)
                        if out.finished:  # the router has the first token from the prefill worker already
                            events.put(out._replace(token_id=-1))

                self.loop.call(commit)
            else:
                self.loop.call(lambda engine: engine.cancel_reservation(rid))
                code = wpb.FINISH_REASON_LEASE_EXPIRED if "lease" in outcome.reason else wpb.FINISH_REASON_ABORTED
                events.put(_Finish(code, f"KV transfer failed: {outcome.reason}"))

        def reserve(engine: Engine) -> tuple[KVReservation, int] | None:
            res = engine.reserve(rid, prompt, params, output_token_ids=prior)
            if res is None:
                return None
            try:
                kv = self.receiver.reserve(rid, res.block_ids, lease_s, on_done=on_done)
            except Exception:
                engine.cancel_reservation(rid)
                raise
            return kv, res.num_cached_tokens

        got = self._call(reserve, context)
        if got is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks for this request now")
        kv, cached = got
        ticket.append(kv.ticket)
        return wpb.DecodeEvent(reservation=convert.reservation_to_proto(kv, cached))

    def _stream(self, rid: str, logprobs: bool, events, context) -> Iterator[wpb.DecodeEvent]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while True:
            try:
                item = events.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if not context.is_active():
                    return
                if time.monotonic() >= deadline:
                    self._cancel(rid, [])
                    yield wpb.DecodeEvent(finish=wpb.Finish(reason=wpb.FINISH_REASON_ABORTED, message="request timed out"))
                    return
                continue
            if isinstance(item, _Finish):
                yield wpb.DecodeEvent(finish=wpb.Finish(reason=item.reason, message=str(item)))
                return
            # coalesce whatever else is ready into one Tokens event
            outs = [item]
            while not outs[-1].finished:
                try:
                    nxt = events.get_nowait()
                except queue.Empty:
                    break
                if isinstance(nxt, _Finish):
                    events.put(nxt)
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

    def _call(self, fn, context):  # type: ignore[no-untyped-def]
        try:
            return self.loop.call(fn).result(timeout=self.cfg.admit_timeout_s)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "engine did not admit the request in time")

    def _cancel(self, rid: str, ticket: list[bytes]) -> None:
        if ticket:
            try:
                self.receiver.cancel(ticket[0], timeout=self.cfg.admit_timeout_s)
            except (KeyError, TimeoutError):
                pass  # already finished, or the receiver reports it through on_done
        self.loop.call(lambda engine: engine.abort(rid))

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        found = self.loop.call(lambda engine: engine.abort(request.request_id)).result(timeout=self.cfg.admit_timeout_s)
        return wpb.CancelResponse(found=bool(found))

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        return convert.stats_to_proto(self.cfg.worker_id, self.loop.stats, self.block_size)

    def BlockEvents(self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext) -> Iterator[wpb.BlockEventBatch]:  # noqa: N802
        return stream_block_events(self.loop, context)
