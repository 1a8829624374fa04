"""The decode worker's gRPC service: admit, reserve, decode, stream.

One `Decode` call is one request from admission to finish; the service only
validates, admits through the engine loop (typed commands: engine/commands.py)
and streams what the engine emits.
In REMOTE mode the engine reserves the blocks the request lacks (its cached
prefix is reused) through its KV connector (workers/decode/connector.py), and
the reservation goes back to the router as the first event; the request runs
once the engine loop's poll finds its KV arrived, with the first token the
prefill worker sampled. Every way out (finish, client cancel, lease expiry, a
failed transfer) ends in one `Abort` command, which frees the blocks exactly
once and only when no transfer can still write them. The call owns its request
id on this worker until then (workers/common/request_ids.py).

Traced under the router's attempt (tracing.py): decode.admission (the `admission`
phase: the engine's admission or reservation), then decode.stream until the call
ends, and under it decode.handover (the `handover` phase: the engine takes the
arrived KV, to the first token it samples), both on the engine's timestamps.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from opentelemetry.context import Context

from splitserve.engine.commands import Abort, Admit, Admitted, Command, QueueFull, Reserve
from splitserve.engine.engine import StepOutput
from splitserve.engine.handoff import Handoff, TokenLogprob
from splitserve.engine.loop import EngineLoop
from splitserve.engine.stats import RequestTimes
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.runtime import tracing
from splitserve.workers.common.blocks import stream_block_events
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.common.grpc_abort import refuse
from splitserve.workers.common.metrics import WorkerMetrics
from splitserve.workers.common.request_ids import RequestIds, check_request_id

log = logging.getLogger(__name__)

_FINISH = {
    "stop": wpb.FINISH_REASON_STOP,
    "length": wpb.FINISH_REASON_LENGTH,
    "abort": wpb.FINISH_REASON_ABORTED,
    "lease_expired": wpb.FINISH_REASON_LEASE_EXPIRED,
}

_CANCELLED = object()  # put on a call's event queue when the router goes away: wakes the handler
Events = queue.SimpleQueue  # StepOutput | _CANCELLED


class _CallTrace:
    """What one Decode call's trace needs: a remote-prefill request's times for the handover
    phase (noted on the engine thread), and how its stream ended."""

    def __init__(self) -> None:
        self.times: RequestTimes | None = None  # the engine's, set at reservation
        self.first_step: float | None = None  # when the first token this engine sampled joined the request
        self.handover_recorded = False  # (the handler's thread from here on)
        self.error: str | None = "cancelled"  # why the stream ended; None: it finished (stop, length)

    def sink(self, events: Events[Any]) -> Callable[[StepOutput], None]:
        """The call's sink (engine thread): notes the first sampled token's time, then queues the output."""

        def put(out: StepOutput) -> None:
            if self.first_step is None and out.token_id >= 0 and self.times is not None:
                self.first_step = self.times.last_token
            events.put(out)

        return put


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.loop = loop
        self.block_size = loop.engine.cfg.block_size
        self.calls: RequestIds[Events[Any]] = RequestIds()  # request id -> its call's event queue
        self.admission_time = metrics.phase("admission") if metrics is not None else None
        self.handover_time = metrics.phase("handover") if metrics is not None else None

    # ---- Decode ----

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.DecodeEvent]:  # noqa: N802
        rid = request.request_id
        parent = tracing.extract(context.invocation_metadata())
        try:
            check_request_id(rid)
            if request.prefill_mode not in (wpb.PREFILL_MODE_LOCAL, wpb.PREFILL_MODE_REMOTE):
                raise ValueError("prefill_mode must be LOCAL or REMOTE")
            handoff = convert.handoff_from_proto(request.handoff)
        except ValueError as e:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        events: Events[Any] = queue.SimpleQueue()
        if not self.calls.claim(rid, events):
            refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use on this worker")
        notes = _CallTrace()
        try:
            if not context.add_callback(lambda: events.put(_CANCELLED)):
                return  # the call is over already
            # Samples that went different lengths (a migrated n > 1 request) have no one context for a
            # prefill worker to fill: each is prefilled here, the prompt's blocks shared by the cache.
            remote = request.prefill_mode == wpb.PREFILL_MODE_REMOTE and len(handoff.samples) <= 1
            attributes = {"splitserve.attempt_id": rid, "splitserve.prefill_mode": "remote" if remote else "local"}
            with tracing.phase("decode.admission", parent, self.admission_time, attributes):
                first = self._admit(rid, handoff, remote, request.lease_ms, notes, notes.sink(events), context)
            ahead = None
            if not remote and handoff.params.prompt_logprobs:  # they come with the first token
                ahead = self._prompt_logprobs(first, events, context)
            yield first
            span = tracing.start_span("decode.stream", parent, attributes)
            try:
                yield from self._stream(events, handoff.params.logprobs, notes, tracing.child(span), ahead)
            finally:
                tracing.end_span(span, notes.error)
        finally:
            # Ordered after the admission on the engine thread: whatever it admitted is found here.
            try:
                self.loop.submit(Abort(rid)).result(timeout=self.cfg.admit_timeout_s)
            except (TimeoutError, RuntimeError) as e:  # a stopped loop frees nothing any more
                log.warning("request %s: engine abort did not run: %s", rid, e)
            self.calls.release(rid, events)

    def _admit(
        self,
        rid: str,
        handoff: Handoff,
        remote: bool,
        lease_ms: int,
        notes: _CallTrace,
        sink: Callable[[StepOutput], None],
        context: grpc.ServicerContext,
    ) -> wpb.DecodeEvent:
        """Admit the request (LOCAL) or reserve its blocks (REMOTE); the call's first event."""
        prompt, params = handoff.prompt_token_ids, handoff.params
        if not remote:
            admit = Admit(rid, prompt, params, samples=handoff.samples, share=handoff.share)
            admitted: Admitted = self._submit(admit, sink, context)
            return wpb.DecodeEvent(local_prefill=wpb.LocalPrefill(num_cached_tokens=admitted.num_cached_tokens))
        lease_s = (lease_ms or self.cfg.lease_ms) / 1000.0
        sample = handoff.sample_states()[0]
        reserve = Reserve(rid, prompt, params, lease_s, sample.output_token_ids, sample.index)
        reserved: Admitted | None = self._submit(reserve, sink, context)
        if reserved is None:
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks or seats for this request now")
        # Before the sink can see a sampled token: that needs the KV, which needs this reservation.
        notes.times = reserved.times
        return wpb.DecodeEvent(reservation=convert.reservation_to_proto(reserved.transfer, reserved.num_cached_tokens))

    def _prompt_logprobs(
        self, first: wpb.DecodeEvent, events: Events[Any], context: grpc.ServicerContext
    ) -> StepOutput | Any:
        """A local prefill's prompt logprobs into its LocalPrefill event: they come with the request's
        first output, which is taken here (and streamed after the event)."""
        try:
            item = events.get(timeout=self.cfg.request_timeout_s)
        except queue.Empty:
            refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the prompt was not prefilled in time")
        if isinstance(item, StepOutput) and item.prompt_logprobs:
            first.local_prefill.prompt_logprobs.extend(convert.logprob_to_proto(lp) for lp in item.prompt_logprobs)
        return item

    def _stream(
        self,
        events: Events[Any],
        logprobs: bool,
        notes: _CallTrace,
        trace: Context,
        ahead: StepOutput | Any = None,
    ) -> Iterator[wpb.DecodeEvent]:
        """The engine's outputs as events until every sample finished (how: `notes.error`); `ahead`:
        one taken off the queue already."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        started = False  # a token sent: the first event is not held for a group, the next ones are
        while True:
            try:
                item, ahead = (
                    (ahead, None)
                    if ahead is not None
                    else (events.get(timeout=max(0.0, deadline - time.monotonic())), None)
                )
            except queue.Empty:
                notes.error = "request timed out"
                yield wpb.DecodeEvent(finish=wpb.Finish(reason=wpb.FINISH_REASON_ABORTED, message="request timed out"))
                return
            if item is _CANCELLED:
                return  # nobody listens; the finally gives everything back
            outs = _coalesce(item, events, self.cfg.stream_interval if started else 1, deadline)
            if outs is None:
                return
            started = started or any(o.token_id >= 0 for o in outs)
            self._note_handover(outs, notes, trace)
            yield from _token_events(outs, logprobs)
            for out in outs:
                if not out.finished:
                    continue
                reason = out.finish_reason or ""
                message = "" if reason in ("stop", "length") else f"ended: {reason}"
                last = bool(message) or not out.remaining  # a failure ends every sample at once
                if last:
                    notes.error = message or None  # before the yield: the router may hang up after it
                finish = wpb.Finish(
                    reason=_FINISH.get(reason, wpb.FINISH_REASON_ABORTED), message=message, index=out.sample_index
                )
                yield wpb.DecodeEvent(finish=finish)
                if last:
                    return

    def _note_handover(self, outs: list[StepOutput], notes: _CallTrace, trace: Context) -> None:
        if notes.handover_recorded or notes.first_step is None or not any(o.token_id >= 0 for o in outs):
            return
        notes.handover_recorded = True
        times = notes.times
        if times is not None and times.scheduled is not None:  # set when the KV arrived
            tracing.record_phase("decode.handover", trace, self.handover_time, times.scheduled, notes.first_step)

    def _submit(self, command: Command, sink: Callable[[StepOutput], None], context: grpc.ServicerContext) -> Any:
        """The command's answer (engine/commands.py), or the call ends with the engine's refusal."""
        try:
            return self.loop.submit(command, sink).result(timeout=self.cfg.admit_timeout_s)
        except ValueError as e:  # the engine refused what the request asked for
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except TimeoutError:
            refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "engine did not admit the request in time")
        except RuntimeError as e:
            refuse(context, grpc.StatusCode.INTERNAL, str(e))

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        """Ends the request's Decode call, which gives everything back (the one way to free it)."""
        events = self.calls.owner(request.request_id)
        if events is not None and request.HasField("index"):  # one sample: the call goes on
            try:
                found = self.loop.submit(Abort(request.request_id, sample_index=request.index))
                return wpb.CancelResponse(found=bool(found.result(timeout=self.cfg.admit_timeout_s)))
            except (TimeoutError, RuntimeError) as e:
                refuse(context, grpc.StatusCode.UNAVAILABLE, f"the engine did not take the cancel: {e}")
        if events is not None:
            events.put(_CANCELLED)
        return wpb.CancelResponse(found=events is not None)

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        return convert.loop_stats(self.cfg.worker_id, self.loop)

    def BlockEvents(  # noqa: N802
        self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.BlockEventBatch]:
        return stream_block_events(self.loop, context)


def _coalesce(item: StepOutput, events: Events[Any], group: int = 1, deadline: float = 0.0) -> list[StepOutput] | None:
    """`item` and whatever else is ready, up to a finish that ends the request (None: cancelled);
    with fewer than `group` tokens, the next outputs waited for (until `deadline`, monotonic)."""
    outs: list[StepOutput] = [item]
    tokens = int(item.token_id >= 0)
    while not (outs[-1].finished and not outs[-1].remaining):
        try:
            nxt = events.get(timeout=max(0.0, deadline - time.monotonic())) if tokens < group else events.get_nowait()
        except queue.Empty:
            break
        if nxt is _CANCELLED:
            return None
        outs.append(nxt)
        tokens += nxt.token_id >= 0
    return outs


def _token_events(outs: list[StepOutput], logprobs: bool) -> Iterator[wpb.DecodeEvent]:
    """One Tokens event per sample with new tokens, in the order the samples first appear."""
    by_sample: dict[int, list[StepOutput]] = {}
    for o in outs:
        if o.token_id >= 0:
            by_sample.setdefault(o.sample_index, []).append(o)
    for index, sampled in by_sample.items():
        lps = [convert.logprob_to_proto(o.logprob or TokenLogprob(0.0)) for o in sampled] if logprobs else []
        yield wpb.DecodeEvent(tokens=wpb.Tokens(index=index, token_ids=[o.token_id for o in sampled], logprobs=lps))
