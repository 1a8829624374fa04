"""The prefill worker's gRPC service: compute a context's KV, stream it layer by
layer into a decode worker's reservation, return the first token.

The engine runs the request in prefill-only mode (chunked, batched with other
prompts, reusing this worker's own prefix cache); its KV connector
(prefill_worker/connector.py) streams each layer as it lands. The service only
validates, opens the stream, admits through the engine loop and waits for the
first token; every way out ends in one `engine.abort`. The first token goes back to the router as soon as
it is sampled; the stream's confirmation and the release of this worker's
blocks finish in the background.

Traced under the router's Prefill call (tracing.py): prefill.queue and
prefill.compute (the `prefill_queue` and `prefill_compute` phases, on the
engine's timestamps: admitted, first scheduled, first token), and prefill.kv_send
from opening the KV stream to the decode worker's confirmation, with an event per
layer queued (prefill_worker/connector.py) and under it prefill.kv_transfer_tail
(the `kv_transfer_tail` phase: the last layer computed to the confirmation).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span

from splitserve.engine.blocks import blocks_to_fill
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.engine.stats import RequestTimes
from splitserve.kv_transfer import KVSender, KVStream, TransferError
from splitserve.kv_transfer.frame import REQUEST_ID_BYTES
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.runtime import tracing
from splitserve.workers.common.admission import QueueFull, check_room
from splitserve.workers.common.blocks import stream_block_events
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.common.grpc_abort import refuse
from splitserve.workers.common.metrics import WorkerMetrics
from splitserve.workers.common.request_ids import RequestIds
from splitserve.workers.prefill.connector import Outbound, SenderConnector

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """A Prefill call ends before its first token: cancelled by the router, or its KV stream broke."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class _Job:
    """One Prefill call's hold on its request id; `first` resolves with the first token or _Stopped."""

    def __init__(self, request_id: str, ticket: bytes) -> None:
        self.request_id = request_id
        self.ticket = ticket  # the reservation's: the KV transfer's id
        self.first: Future[StepOutput] = Future()
        self.lock = threading.Lock()
        self.cancelled = False
        # for the trace: the KV span, and what the engine thread hands over at admission
        self.kv_span: Span = INVALID_SPAN
        self.times: RequestTimes | None = None
        self.outbound: Outbound | None = None

    def resolve(self, out: StepOutput) -> None:
        with self.lock:
            if not self.first.done():
                self.first.set_result(out)

    def stop(self, message: str, code: grpc.StatusCode = grpc.StatusCode.CANCELLED) -> None:
        with self.lock:
            self.cancelled = True
            if not self.first.done():
                self.first.set_exception(_Stopped(message, code))

    def cancel(self) -> None:
        """gRPC's callback when the call ends; before the first token that means the router went away."""
        self.stop("cancelled by the router")


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig, sender: KVSender, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.sender = sender
        self.queue_time = metrics.phase("prefill_queue") if metrics is not None else None
        self.compute_time = metrics.phase("prefill_compute") if metrics is not None else None
        self.tail_time = metrics.phase("kv_transfer_tail") if metrics is not None else None
        self.jobs: RequestIds[_Job] = RequestIds()
        self.finisher = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-finish")
        self.loop: EngineLoop | None = None

    def attach(self, loop: EngineLoop, connector: SenderConnector) -> None:
        self.loop = loop
        self.connector = connector
        self.block_size = loop.engine.cfg.block_size

    # ---- Prefill ----

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResult:  # noqa: N802
        assert self.loop is not None
        rid = request.request_id
        parent = tracing.extract(context.invocation_metadata())
        prompt = list(request.prompt_token_ids)
        prior = list(request.output_token_ids)
        try:
            if not rid:
                raise ValueError("request_id is empty")
            if len(rid.encode()) > REQUEST_ID_BYTES:
                raise ValueError(f"request_id is longer than the KV frame's {REQUEST_ID_BYTES} bytes")
            params = convert.sampling_from_proto(request.sampling)
            kv = convert.reservation_from_proto(request.reservation)
            first_index = self._check_reservation(request.reservation, len(prompt) + len(prior))
        except ValueError as e:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        job = _Job(rid, kv.ticket)
        if not self.jobs.claim(rid, job):
            refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use on this worker")
        stream: KVStream | None = None
        handed_off = False
        try:
            # Before anything is queued: a cancel from here on stops the job wherever it is.
            if not context.add_callback(job.cancel):
                job.cancel()
            job.kv_span = tracing.start_span(
                "prefill.kv_send",
                parent,
                {
                    "splitserve.attempt_id": rid,
                    "splitserve.kv_endpoint": kv.endpoint,
                    "splitserve.blocks": len(kv.block_ids),
                },
            )
            try:
                stream = self.sender.open(kv)
            except TransferError as e:
                code = (
                    grpc.StatusCode.FAILED_PRECONDITION if e.code == "layout_mismatch" else grpc.StatusCode.UNAVAILABLE
                )
                refuse(context, code, f"KV stream to {kv.endpoint}: {e}")
            opened = stream

            def admit(engine: Engine) -> None:
                with job.lock:
                    if job.cancelled:
                        return  # the router went away while this call waited for the step to end
                    check_room(engine, self.cfg.waiting_limit)
                    seq = engine.add_request(rid, prompt, params, prefill_only=True, output_token_ids=prior)
                    seq.transfer_id = kv.ticket
                    job.times = seq.times
                    job.outbound = self.connector.add(rid, opened, kv.ticket, first_index, job.kv_span)

            self.loop.set_sink(rid, job.resolve)
            try:
                self.loop.call(admit).result(timeout=self.cfg.admit_timeout_s)
            except ValueError as e:
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except QueueFull as e:
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except TimeoutError:
                refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not admit the request in time")
            try:
                out = job.first.result(timeout=self.cfg.prefill_timeout_s)
            except TimeoutError:
                refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
            except _Stopped as e:
                refuse(context, e.code, str(e))
            if out.finish_reason == "abort":
                refuse(context, grpc.StatusCode.ABORTED, "prefill aborted")
            if out.finish_reason != "prefill_done":  # a failure code of its KV stream
                refuse(context, grpc.StatusCode.UNAVAILABLE, f"KV stream failed: {out.finish_reason}")
            self._trace_prefill(job, parent, out)
            self.finisher.submit(self._finish, job, stream, out.token_id)
            handed_off = True
            result = wpb.PrefillResult(first_token_id=out.token_id, num_cached_tokens=out.num_cached_tokens)
            if out.logprob is not None:
                result.first_token_logprob = out.logprob
            return result
        finally:
            if not handed_off:
                self._drop(job, stream, "prefill stopped before its first token")

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

    def _trace_prefill(self, job: _Job, parent: Context, out: StepOutput) -> None:
        """The prefill_queue and prefill_compute phases, from the engine's times (set by now: the
        first token came after them)."""
        t = job.times
        if t is None or t.scheduled is None or t.first_token is None:
            return
        attributes: tracing.Attributes = {
            "splitserve.attempt_id": job.request_id,
            "splitserve.prompt_tokens": out.num_prompt_tokens,
            "splitserve.cached_tokens": out.num_cached_tokens,
        }
        tracing.record_phase("prefill.queue", parent, self.queue_time, t.arrival, t.scheduled, attributes)
        tracing.record_phase("prefill.compute", parent, self.compute_time, t.scheduled, t.first_token, attributes)

    def _finish(self, job: _Job, stream: KVStream, first_token: int) -> None:
        try:
            stream.finish(first_token, timeout=self.cfg.prefill_timeout_s)
            confirmed = time.monotonic()
            computed = job.outbound.computed_at if job.outbound is not None else None
            if computed is not None:
                tail = tracing.child(job.kv_span)
                tracing.record_phase("prefill.kv_transfer_tail", tail, self.tail_time, computed, confirmed)
            tracing.end_span(job.kv_span)
        except TransferError as e:
            log.warning("request %s: KV not confirmed: %s", job.request_id, e)
            tracing.end_span(job.kv_span, f"KV not confirmed: {e}")
        finally:
            self._forget(job)

    def _drop(self, job: _Job, stream: KVStream | None, reason: str) -> None:
        tracing.end_span(job.kv_span, reason)
        job.stop(reason)
        if stream is not None:
            stream.abort(reason)
        self._forget(job)

    def _forget(self, job: _Job) -> None:
        """Free the job's blocks (running or held) and, once they are free, its request id."""
        rid = job.request_id

        def forget(engine: Engine) -> None:
            self.connector.remove(rid, job.ticket)
            engine.abort(rid)  # waiting, running or held: its blocks go back (the id is this job's alone)
            self.jobs.release(rid, job)

        assert self.loop is not None
        self.loop.drop_sink(rid, job.resolve)

        def after(f: Future[None]) -> None:
            if f.exception() is not None:  # a stopped loop: nothing is left to free, but the id goes back
                self.jobs.release(rid, job)

        self.loop.call(forget).add_done_callback(after)

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        """Stops the request's Prefill call, which gives everything back."""
        job = self.jobs.owner(request.request_id)
        if job is not None:
            job.stop("cancelled")
        return wpb.CancelResponse(found=job is not None)

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        assert self.loop is not None
        return convert.stats_to_proto(self.cfg.worker_id, self.loop.stats, self.block_size)

    def BlockEvents(  # noqa: N802
        self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.BlockEventBatch]:
        assert self.loop is not None
        return stream_block_events(self.loop, context)
