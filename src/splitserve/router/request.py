"""One client request through the workers: route, Decode (and Prefill when the
decode worker reserves blocks for a remote prefill), stream tokens back with
incremental detokenization and stop strings, and move the request to another
decode worker if its worker dies (migration: prompt plus the tokens already
sent, so the client's stream just goes on).

Every internal wait has a deadline. Client cancellation arrives as
CancelledError at whichever await is pending; the `finally` blocks cancel the
worker calls, which the workers treat as an abort.

A failed attempt is one of three things, told apart by gRPC status code, never
by message text (`classify`):
- the worker's fault (transport errors, missed deadlines, a broken stream): the
  worker leaves routing until its next stats poll succeeds, and the request
  moves on;
- the request's fault, known for certain (INVALID_ARGUMENT and the like): the
  request fails alone with that status, and the worker stays in routing;
- unclear (INTERNAL, UNKNOWN, an aborted finish): the request is tried on
  another worker, but a request that has failed like this on
  `max_request_faults` workers is not tried on another (query-of-death
  protection), so one poisonous request cannot walk through the pool.

Each request is one trace (tracing.py): under the front door's span (`span`),
a span for routing (which is also the `routing` phase), one for each decode
attempt and one for each Prefill call, whose contexts go to the workers in the
calls' metadata.

Workers never see the client's request id: each attempt gets an id of the
router's own (`attempt_id`), so a client that reuses an id, or sends one longer
than the KV plane's frames hold, cannot collide with state a worker still holds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from enum import Enum

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from splitserve.engine.block_hash import block_hashes
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router import policy
from splitserve.router.config import RouterConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.stop import StopMatcher
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.validation import ValidRequest
from splitserve.router.workers import WorkerSet
from splitserve.runtime import tracing

log = logging.getLogger(__name__)

_FINISH: dict[wpb.FinishReason, pb.FinishReason] = {
    wpb.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
    wpb.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH,
}


class RequestFailed(Exception):
    """The request cannot go on; the server answers with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Fault(Enum):
    """Whose fault a failed worker call was."""

    WORKER = "worker"  # transport error or missed deadline: stop routing to it for now
    REQUEST = "request"  # the worker refused what the request asked for: the request fails alone
    UNCLEAR = "unclear"  # it failed on the worker for a reason the code does not say: retry elsewhere, counted
    BUSY = "busy"  # not admitted for lack of room: retry elsewhere, nobody's fault


_FAULTS = {
    grpc.StatusCode.INVALID_ARGUMENT: Fault.REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: Fault.REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: Fault.REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Fault.BUSY,
    grpc.StatusCode.INTERNAL: Fault.UNCLEAR,
    grpc.StatusCode.UNKNOWN: Fault.UNCLEAR,
    grpc.StatusCode.ABORTED: Fault.UNCLEAR,
    grpc.StatusCode.ALREADY_EXISTS: Fault.UNCLEAR,  # attempt ids are unique, so a bug somewhere: not the worker's
}


def classify(code: grpc.StatusCode) -> Fault:
    """A worker call's status -> whose fault; anything not listed (UNAVAILABLE, DEADLINE_EXCEEDED,
    CANCELLED by a stopping server, ...) is the worker's or its link's."""
    return _FAULTS.get(code, Fault.WORKER)


def attempt_id() -> str:
    """The id workers know one attempt by: unique, and within the KV frame's 64 bytes."""
    return uuid.uuid4().hex


class _Retry(Exception):
    """This attempt failed; try again.

    exclude: not on this decode worker again (for this request);
    fault: whose fault it was (Fault.WORKER stops routing to the worker until its stats poll succeeds;
        Fault.UNCLEAR counts towards the query-of-death limit);
    force_local: prefill on the decode worker this time.
    """

    def __init__(
        self, message: str, exclude: bool = True, fault: Fault = Fault.WORKER, force_local: bool = False
    ) -> None:
        super().__init__(message)
        self.exclude = exclude
        self.fault = fault
        self.force_local = force_local


class RequestRun:
    def __init__(
        self,
        req: ValidRequest,
        cfg: RouterConfig,
        tokenizer: RouterTokenizer,
        workers: WorkerSet,
        metrics: RouterMetrics,
        rng: random.Random,
        deadline: float,  # time.monotonic() by which the whole request must end
        span: Span | None = None,  # the request's own (tracing.py), ended by whoever streams it
    ) -> None:
        self.req = req
        self.cfg = cfg
        self.workers = workers
        self.metrics = metrics
        self.rng = rng
        self.deadline = deadline
        self.span = span if span is not None else INVALID_SPAN
        self.trace = tracing.child(self.span)  # what this request's spans and worker calls hang under
        self.detok = tokenizer.detokenizer(req.prompt_token_ids)
        self.stopper = StopMatcher(req.sampling.stop)
        self.generated: list[int] = []
        self.cached_tokens: int | None = None
        self.finished = False
        self.unclear_failures = 0  # attempts that failed on a worker for an unclear reason (query of death)
        self.start = time.monotonic()
        self.last_token_at = 0.0
        # the internal sampling message; max_tokens is set per attempt (it shrinks after a migration)
        self._sampling = convert.sampling_to_proto(req.sampling)

    # ---- the attempt loop

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        excluded: list[str] = []
        force_local = False
        moves = 0
        last_error = ""
        all_busy = True  # every attempt so far was refused for lack of room (or there was none)
        while True:
            busy = bool(excluded) and all_busy
            if not busy and not self.workers.healthy("decode"):
                # the whole decode pool is down (its last worker died, or it is still starting):
                # wait for the replacement within the deadline instead of failing every stream
                await self.workers.wait_for_decode(min(self.cfg.no_decode_wait_s, self._remaining_s()))
            worker, mode = self._route(excluded, force_local, last_error, busy=busy)
            try:
                async for resp in self._attempt(worker, mode):
                    yield resp
                return
            except _Retry as e:
                log.warning("request %s on %s: %s", self.req.request_id, worker, e)
                last_error = f"{worker}: {e}"
                if e.exclude:
                    excluded.append(worker)
                all_busy = all_busy and e.fault is Fault.BUSY
                if e.fault is Fault.WORKER:
                    self.workers.mark_failed(worker)
                elif e.fault is Fault.UNCLEAR:
                    self._count_unclear_failure(e)
                force_local = force_local or e.force_local
                moves += 1
                if moves > self.cfg.max_migrations:
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED if all_busy else grpc.StatusCode.UNAVAILABLE
                    raise RequestFailed(code, f"gave up after {moves} attempts: {e}") from None
                if self.generated:
                    self.metrics.migrations.inc()

    def _count_unclear_failure(self, e: Exception) -> None:
        self.unclear_failures += 1
        if self.unclear_failures >= self.cfg.max_request_faults:
            self.metrics.queries_of_death.inc()
            raise RequestFailed(
                grpc.StatusCode.INTERNAL,
                f"the request failed on {self.unclear_failures} workers and is not tried on another "
                f"(query-of-death protection); last: {e}",
            ) from None

    def _route(
        self, exclude: list[str], force_local: bool, last_error: str, busy: bool = False
    ) -> tuple[str, policy.PrefillMode]:
        """`busy`: every worker tried so far refused for lack of room; if none is left, that is
        overload (RESOURCE_EXHAUSTED, HTTP 429: retry later), not an outage. Timed as the
        `routing` phase (span router.route)."""
        with tracing.phase("router.route", self.trace, self.metrics.routing_time) as span:
            worker, mode, overlap = self._choose(exclude, force_local, last_error, busy)
            if span.is_recording():
                span.set_attributes(
                    {
                        "splitserve.worker": worker,
                        "splitserve.prefill_mode": mode,
                        "splitserve.overlap_blocks": overlap,
                    }
                )
        return worker, mode

    def _choose(
        self, exclude: list[str], force_local: bool, last_error: str, busy: bool
    ) -> tuple[str, policy.PrefillMode, int]:
        loads = self.workers.decode_loads(exclude)
        if not loads:
            if busy:
                raise RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"every decode worker is full; retry later ({last_error})"
                )
            why = f" (last attempt: {last_error})" if last_error else ""
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no healthy decode worker{why}")
        context = [*self.req.prompt_token_ids, *self.generated]
        hashes = block_hashes(context, self.cfg.block_size)
        prefill = {} if force_local else self.workers.prefill_queued_tokens()
        r = policy.route(
            hashes, len(context), self.workers.index, loads, prefill, self.cfg, self.rng, self.workers.decode_chooser
        )
        self.workers.assigned(r.worker, r.uncached_tokens)
        self.metrics.routed(r.mode, len(hashes), r.overlap_blocks)
        return r.worker, r.mode, r.overlap_blocks

    def _remaining_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")
        return left

    def _check_deadline(self) -> None:
        """After a timeout: if it was the request's own deadline, that is no worker's fault."""
        if time.monotonic() >= self.deadline - 0.005:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")

    async def _attempt(self, address: str, mode: policy.PrefillMode) -> AsyncIterator[pb.GenerateResponse]:
        """One decode attempt, its span (router.decode_attempt) around it."""
        rid = attempt_id()
        span = tracing.start_span(
            "router.decode_attempt",
            self.trace,
            {
                "splitserve.worker": address,
                "splitserve.prefill_mode": mode,
                "splitserve.attempt_id": rid,
                "splitserve.prior_tokens": len(self.generated),
            },
            kind=SpanKind.CLIENT,
        )
        error: str | None = None
        try:
            async for resp in self._decode(address, mode, rid, tracing.child(span)):
                yield resp
        except (_Retry, RequestFailed) as e:
            error = str(e)
            raise
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        finally:
            tracing.end_span(span, error)

    async def _decode(
        self, address: str, mode: policy.PrefillMode, rid: str, trace: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        w = self.workers.get(address)
        if w is None:
            raise _Retry("worker was removed")
        cfg = self.cfg
        sampling = wpb.SamplingParams()
        sampling.CopyFrom(self._sampling)
        sampling.max_tokens = self.req.sampling.max_tokens - len(self.generated)
        call = w.decode_stub().Decode(
            wpb.DecodeRequest(
                request_id=rid,
                prompt_token_ids=self.req.prompt_token_ids,
                output_token_ids=self.generated,
                sampling=sampling,
                prefill_mode=wpb.PREFILL_MODE_REMOTE if mode == "remote" else wpb.PREFILL_MODE_LOCAL,
                lease_ms=cfg.lease_ms,
            ),
            timeout=min(cfg.request_timeout_s, self._remaining_s()),
            metadata=tracing.inject(cfg.auth_metadata, trace),
        )
        try:
            first = await self._next(call, cfg.admit_timeout_s, admitted=False)
            kind = first.WhichOneof("event")
            if kind == "reservation":
                result = await self._prefill(rid, first.reservation, sampling, trace)
                self._set_cached(result.num_cached_tokens)
                lp = [result.first_token_logprob] if result.HasField("first_token_logprob") else []
                resp = self._emit([result.first_token_id], lp)
                if resp is not None:
                    yield resp
            elif kind == "local_prefill":
                self._set_cached(first.local_prefill.num_cached_tokens)
            else:
                raise _Retry(f"protocol error: first event is {kind}, not a reservation or local_prefill")
            while not self.finished:
                ev = await self._next(call, cfg.token_timeout_s, admitted=True)
                kind = ev.WhichOneof("event")
                if kind == "tokens":
                    resp = self._emit(ev.tokens.token_ids, ev.tokens.logprobs)
                    if resp is not None:
                        yield resp
                elif kind == "finish":
                    reason = ev.finish.reason
                    if reason in _FINISH:
                        yield self._final(_FINISH[reason])
                        return
                    if reason == wpb.FINISH_REASON_LEASE_EXPIRED:
                        raise _Retry(
                            f"lease expired: {ev.finish.message}", exclude=False, fault=Fault.BUSY, force_local=True
                        )
                    raise _Retry(
                        f"worker ended the request: {wpb.FinishReason.Name(reason)} {ev.finish.message}",
                        fault=Fault.UNCLEAR,
                    )
                else:
                    raise _Retry(f"protocol error: {kind} event after the first")
        finally:
            call.cancel()  # no-op when the call is done; an abort for the worker otherwise

    async def _next(
        self, call: grpc.aio.UnaryStreamCall[wpb.DecodeRequest, wpb.DecodeEvent], timeout_s: float, admitted: bool
    ) -> wpb.DecodeEvent:
        try:
            async with asyncio.timeout(min(timeout_s, self._remaining_s())):
                ev = await call.read()
        except TimeoutError:
            self._check_deadline()
            raise _Retry(f"no event within {timeout_s:g}s" + (" of admission" if not admitted else "")) from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._check_deadline()
            fault = classify(e.code())
            if fault is Fault.REQUEST:
                raise RequestFailed(e.code(), f"the decode worker refused the request: {e.details()}") from None
            if fault is Fault.BUSY and not admitted:
                raise _Retry(f"not admitted: {e.details()}", fault=Fault.BUSY) from None
            raise _Retry(
                f"Decode failed: {e.code().name} {e.details()}", fault=Fault.WORKER if fault is Fault.BUSY else fault
            ) from None
        if not isinstance(ev, wpb.DecodeEvent):  # grpc.aio.EOF
            raise _Retry("Decode stream ended without a finish event")
        return ev

    async def _prefill(
        self, rid: str, reservation: wpb.Reservation, sampling: wpb.SamplingParams, trace: Context
    ) -> wpb.PrefillResult:
        """Prefill on the least-queued prefill worker; on failure, on another, same reservation.
        Each call is a span (router.prefill) under `trace`, the decode attempt's.

        A prefill worker is marked failed only for its own faults (Fault.WORKER); one that
        refuses the reservation (a layout it cannot map, say) stays in routing for others.
        """
        tried: list[str] = []
        request = wpb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=self.req.prompt_token_ids,
            output_token_ids=self.generated,
            sampling=sampling,
            reservation=reservation,
        )
        last = "no healthy prefill worker"
        for attempt in range(self.cfg.max_prefill_attempts):
            queued = self.workers.prefill_queued_tokens(exclude=tried)
            if not queued:
                break
            address = policy.choose_prefill_worker(queued, self.rng)
            tried.append(address)
            w = self.workers.get(address)
            if w is None:
                continue
            lease_left = (
                reservation.lease_deadline_unix_ms / 1000 - time.time() if reservation.lease_deadline_unix_ms else None
            )
            timeout = min(
                self.cfg.prefill_timeout_s, self._remaining_s(), *([lease_left] if lease_left is not None else [])
            )
            if timeout <= 0:
                last = "reservation lease passed"
                break
            if attempt:
                self.metrics.prefill_retries.inc()
            span = tracing.start_span(
                "router.prefill",
                trace,
                {"splitserve.worker": address, "splitserve.try": attempt},
                SpanKind.CLIENT,
            )
            error: str | None = "cancelled"
            try:
                self.workers.assigned(address, len(request.prompt_token_ids))
                metadata = tracing.inject(self.cfg.auth_metadata, tracing.child(span))
                result = await w.prefill_stub().Prefill(request, timeout=timeout, metadata=metadata)
                error = None
                return result
            except grpc.aio.AioRpcError as e:
                error = f"{e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._check_deadline()
                last = f"Prefill on {address} failed: {e.code().name} {e.details()}"
                log.warning("request %s: %s", self.req.request_id, last)
                fault = classify(e.code())
                if fault is Fault.WORKER:
                    self.workers.mark_failed(address)
                elif fault is Fault.UNCLEAR:
                    self._count_unclear_failure(RuntimeError(last))
            finally:
                tracing.end_span(span, error)
        # The decode worker is fine; it will prefill the request itself.
        raise _Retry(last, exclude=False, fault=Fault.BUSY, force_local=True)

    # ---- responses

    def _set_cached(self, n: int) -> None:
        if self.cached_tokens is None:  # the first attempt's count is the one the client paid for
            self.cached_tokens = min(n, len(self.req.prompt_token_ids))

    def _usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=len(self.generated),
        )

    def _emit(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> pb.GenerateResponse | None:
        room = self.req.sampling.max_tokens - len(self.generated)
        if room <= 0 or self.finished:
            return None
        ids = list(token_ids[:room])
        now = time.monotonic()
        if not self.generated:
            self.metrics.ttft.observe(now - self.start)
        elif ids:
            gap = (now - self.last_token_at) / len(ids)
            for _ in ids:
                self.metrics.itl.observe(gap)
        self.last_token_at = now
        self.generated.extend(ids)
        released = self.stopper.feed("".join([self.detok.feed(t) for t in ids]))
        resp = pb.GenerateResponse(
            request_id=self.req.request_id,
            text=released.text,
            token_ids=ids,
            logprobs=list(logprobs[: len(ids)]) if self.req.sampling.logprobs else [],
        )
        if released.stopped:
            resp.finish_reason = pb.FINISH_REASON_STOP
        elif len(self.generated) >= self.req.sampling.max_tokens:
            tail, stopped = self._drain()
            resp.text += tail
            resp.finish_reason = pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH
        if resp.finish_reason:
            self.finished = True
        if resp.finish_reason or self.req.continuous_usage:
            resp.usage.CopyFrom(self._usage())
        return resp

    def _drain(self) -> tuple[str, bool]:
        """The text still held by the detokenizer and the stop matcher, at the end of the stream."""
        released = self.stopper.feed(self.detok.flush())
        if released.stopped:
            return released.text, True
        return released.text + self.stopper.flush(), False

    def _final(self, reason: pb.FinishReason) -> pb.GenerateResponse:
        self.finished = True
        text, stopped = self._drain()
        return pb.GenerateResponse(
            request_id=self.req.request_id,
            text=text,
            finish_reason=pb.FINISH_REASON_STOP if stopped else reason,
            usage=self._usage(),
        )
