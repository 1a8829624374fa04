"""The prefill worker's gRPC service: compute a context's KV, stream it layer by
layer into a decode worker's reservation, return the first token.

The engine runs the request in prefill-only mode (chunked, batched with other
prompts, reusing this worker's own prefix cache); the KV connector
(workers/prefill/connector.py) owns the send from opening the stream to the
decode worker's confirmation, and the engine frees the request's held blocks
when the connector reports the send confirmed (or ends the request when it
failed). The service only validates, opens the send, admits through the engine
loop and waits for the first token, which goes back to the router as soon as it
is sampled. Every way out before it ends in the connector's `abort` and one
`Abort` command; the call owns its request id on this worker until then
(workers/common/request_ids.py), and afterwards the engine does (a duplicate is
refused with ALREADY_EXISTS either way).

Traced under the router's Prefill call (runtime/tracing.py): prefill.queue and
prefill.compute (the `prefill_queue` and `prefill_compute` phases, on the
engine's timestamps: admitted, first scheduled, first token); the KV span and
its tail are the connector's.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
from opentelemetry.context import Context

from splitserve.engine.blocks import blocks_to_fill
from splitserve.engine.commands import Abort, Admit, Admitted, QueueFull
from splitserve.engine.engine import StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.engine.scheduler import DuplicateRequest
from splitserve.kv_transfer import FailureCode, TransferError
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.runtime import tracing
from splitserve.workers.common.blocks import stream_block_events
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.common.grpc_abort import refuse
from splitserve.workers.common.metrics import WorkerMetrics
from splitserve.workers.common.request_ids import RequestIds, check_request_id
from splitserve.workers.prefill.connector import SenderConnector

log = logging.getLogger(__name__)


class _Stop(NamedTuple):
    """Put on a call's event queue when it must end before its first token (the router went away,
    or cancelled it): wakes the handler."""

    message: str
    code: grpc.StatusCode = grpc.StatusCode.CANCELLED


Events = queue.SimpleQueue  # StepOutput | _Stop


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(
        self, cfg: WorkerConfig, loop: EngineLoop, connector: SenderConnector, metrics: WorkerMetrics | None = None
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.connector = connector
        self.block_size = loop.engine.cfg.block_size
        self.calls: RequestIds[Events[Any]] = RequestIds()  # request id -> its call's event queue
        self.queue_time = metrics.phase("prefill_queue") if metrics is not None else None
        self.compute_time = metrics.phase("prefill_compute") if metrics is not None else None

    # ---- Prefill ----

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResult:  # noqa: N802
        rid = request.request_id
        parent = tracing.extract(context.invocation_metadata())
        try:
            check_request_id(rid)
            handoff = convert.handoff_from_proto(request.handoff)
            if len(handoff.samples) > 1:
                raise ValueError("handoff.samples: a prefill continues one sample (or starts all n)")
            prior = handoff.samples[0].output_token_ids if handoff.samples else []
            kv = convert.reservation_from_proto(request.reservation)
            first_index = self._check_reservation(request.reservation, len(handoff.prompt_token_ids) + len(prior))
        except ValueError as e:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        events: Events[Any] = queue.SimpleQueue()
        if not self.calls.claim(rid, events):
            refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use on this worker")
        opened = handed_off = False
        try:
            # Before anything is queued: a cancel from here on stops the call wherever it is.
            if not context.add_callback(lambda: events.put(_Stop("cancelled by the router"))):
                refuse(context, grpc.StatusCode.CANCELLED, "cancelled by the router")
            try:
                self.connector.open(rid, kv, first_index, parent)
            except TransferError as e:
                mismatch = e.code == FailureCode.LAYOUT_MISMATCH
                code = grpc.StatusCode.FAILED_PRECONDITION if mismatch else grpc.StatusCode.UNAVAILABLE
                refuse(context, code, f"KV stream to {kv.endpoint}: {e}")
            opened = True
            admit = Admit(
                rid,
                handoff.prompt_token_ids,
                handoff.params,
                prefill_only=True,
                transfer_id=kv.ticket,
                samples=handoff.samples,
                share=handoff.share,
            )
            admitted = self._admit(admit, events, context)
            out = self._first_token(events, context)
            self._trace_prefill(rid, admitted, parent, out)
            handed_off = True  # the send and the held blocks are the connector's and the engine's now
            assert out.handoff is not None  # a prefill_done output carries it
            return wpb.PrefillResult(
                handoff=convert.handoff_to_proto(out.handoff), num_cached_tokens=out.num_cached_tokens
            )
        finally:
            if handed_off:
                self.calls.release(rid, events)
            else:
                self._drop(rid, kv.ticket, events, opened)

    def _check_reservation(self, r: wpb.Reservation, context_len: int) -> int:
        bs = self.block_size
        if r.num_cached_tokens % bs or r.num_cached_tokens >= context_len:
            raise ValueError(
                f"reservation.num_cached_tokens ({r.num_cached_tokens}) must be a multiple of {bs} "
                f"below the context length ({context_len})"
            )
        span = blocks_to_fill(context_len, r.num_cached_tokens, bs)
        if len(r.block_ids) != len(span):
            raise ValueError(f"reservation.block_ids has {len(r.block_ids)} blocks; the context needs {len(span)}")
        return span.start

    def _admit(self, admit: Admit, events: Events[Any], context: grpc.ServicerContext) -> Admitted:
        try:
            result: Admitted = self.loop.submit(admit, events.put).result(timeout=self.cfg.admit_timeout_s)
            return result
        except DuplicateRequest:  # a request handed off earlier still holds the id (its KV on its way)
            refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {admit.request_id!r} is in use on this worker")
        except ValueError as e:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except TimeoutError:
            refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not admit the request in time")

    def _first_token(self, events: Events[Any], context: grpc.ServicerContext) -> StepOutput:
        """The request's first token, or the call ends with why there is none."""
        try:
            item = events.get(timeout=self.cfg.prefill_timeout_s)
        except queue.Empty:
            refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        if isinstance(item, _Stop):
            refuse(context, item.code, item.message)
        out: StepOutput = item
        if out.finish_reason == "abort":
            refuse(context, grpc.StatusCode.ABORTED, "prefill aborted")
        if out.finish_reason != "prefill_done":  # a failure code of its KV stream
            refuse(context, grpc.StatusCode.UNAVAILABLE, f"KV stream failed: {out.finish_reason}")
        return out

    def _trace_prefill(self, rid: str, admitted: Admitted, parent: Context, out: StepOutput) -> None:
        """The prefill_queue and prefill_compute phases, from the engine's times (set by now: the
        first token came after them)."""
        t = admitted.times
        if t.scheduled is None or t.first_token is None:
            return
        attributes: tracing.Attributes = {
            "splitserve.attempt_id": rid,
            "splitserve.prompt_tokens": out.num_prompt_tokens,
            "splitserve.cached_tokens": out.num_cached_tokens,
        }
        tracing.record_phase("prefill.queue", parent, self.queue_time, t.arrival, t.scheduled, attributes)
        tracing.record_phase("prefill.compute", parent, self.compute_time, t.scheduled, t.first_token, attributes)

    def _drop(self, rid: str, ticket: bytes, events: Events[Any], opened: bool) -> None:
        """Stopped before its first token: give up the send, free the request's blocks (ordered after
        its admission on the engine thread) and then its id."""
        if not opened:  # nothing was admitted
            self.calls.release(rid, events)
            return
        self.connector.abort(ticket, "prefill stopped before its first token")
        # Only the request on this call's transfer: never a handed-off one that holds the same id.
        done = self.loop.submit(Abort(rid, transfer_id=ticket))
        done.add_done_callback(lambda _: self.calls.release(rid, events))  # a stopped loop: nothing left

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        """Stops the request's Prefill call, which gives everything back."""
        events = self.calls.owner(request.request_id)
        if events is not None:
            events.put(_Stop("cancelled"))
        return wpb.CancelResponse(found=events is not None)

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        return convert.loop_stats(self.cfg.worker_id, self.loop)

    def BlockEvents(  # noqa: N802
        self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.BlockEventBatch]:
        return stream_block_events(self.loop, context)
