"""One client request through the workers: route, Decode (and Prefill when the
decode worker reserves blocks for a remote prefill), hand the tokens to the
request's `ResponseShaper` (router/response.py, which makes what the client is
sent), and move the request to another decode worker if its worker dies
(migration: the Handoff carries the prompt and every unfinished sample with the
tokens already sent, so the client's streams just go on).

The request's n samples share one Decode call: the first tokens come from the
PrefillResult's handoff (REMOTE) or from Tokens events (LOCAL), every later one
from Tokens events by `index`; a sample ends at its Finish (STOP, LENGTH) or at
the router's own end of it (a stop string, its budget), and the request when
every sample has ended.

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
from collections.abc import AsyncIterator
from enum import Enum
from typing import Any

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.handoff import Handoff
from splitserve.engine.prefill_order import NO_TENANT, Share
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router import policy
from splitserve.router.config import RouterConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.response import ResponseShaper
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.validation import ValidRequest
from splitserve.router.workers import Worker, WorkerSet
from splitserve.runtime import tracing

log = logging.getLogger(__name__)

_FINISH: dict[wpb.FinishReason, pb.FinishReason] = {
    wpb.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
    wpb.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH,
}


RETRY_AFTER_KEY = "retry-after"  # trailing metadata of a refusal that may succeed later: whole seconds
# what a request the router gave up on for want of a worker is told to wait before trying again:
# long enough for a health poll to find a replacement, short against a client's patience
RETRY_UNAVAILABLE_S = 5.0


class RequestFailed(Exception):
    """The request cannot go on; the server answers with this gRPC status (and, where a retry
    may succeed after a known time, `retry_after_s`: HTTP's Retry-After, gRPC's retry-after)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


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


_DecodeCall = grpc.aio.UnaryStreamCall[wpb.DecodeRequest, wpb.DecodeEvent]


class RequestRun:
    """One admitted request's attempts: which worker, local or remote prefill, and what to do
    when an attempt fails. What the client is sent is `response`'s."""

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
        share: Share = NO_TENANT,  # its tenant and band, for the workers' prefill order
    ) -> None:
        self.req = req
        self.share = share
        self.cfg = cfg
        self.workers = workers
        self.metrics = metrics
        self.rng = rng
        self.deadline = deadline
        self.span = span if span is not None else INVALID_SPAN
        self.trace = tracing.child(self.span)  # what this request's spans and worker calls hang under
        self.response = ResponseShaper(req, tokenizer, metrics, start=time.monotonic())
        self.unclear_failures = 0  # attempts that failed on a worker for an unclear reason (query of death)
        # set once a decode worker has taken the request: from here a failure is one the request
        # may migrate past, and the HTTP door sends a stream's headers (router/openai/door.py)
        self.admitted = asyncio.Event()
        self._cancels: set[asyncio.Future[Any]] = set()  # one-sample cancels in flight (a reference keeps each)
        # a remote prefill's prompt, charged to the least-queued prefill worker's queue when it was
        # routed, until its Prefill call charges its own: (worker, tokens), or None
        self._prefill_charge: tuple[str, int] | None = None

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
                remaining = self._remaining_s()
                await self.workers.wait_for_decode(min(self.cfg.deadlines.no_decode_wait_s, remaining), remaining)
            worker, mode = self._route(excluded, force_local, last_error, busy=busy)
            try:
                async for resp in self._attempt(worker, mode):
                    yield resp
                return
            except _Retry as e:
                last_error = f"{worker}: {e}"
                if e.exclude:
                    excluded.append(worker)
                all_busy = all_busy and e.fault is Fault.BUSY
                force_local = force_local or e.force_local
                moves += 1
                self._after_failed_attempt(worker, e, moves, all_busy)

    def _after_failed_attempt(self, worker: str, e: _Retry, moves: int, all_busy: bool) -> None:
        """Account for a failed attempt; RequestFailed when the request is not to be tried again."""
        log.warning("request %s on %s: %s", self.req.request_id, worker, e)
        if e.fault is Fault.WORKER:
            self.workers.mark_failed(worker)
        elif e.fault is Fault.UNCLEAR:
            self._count_unclear_failure(e)
        if moves > self.cfg.retries.max_migrations:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if all_busy else grpc.StatusCode.UNAVAILABLE
            raise RequestFailed(code, f"gave up after {moves} attempts: {e}", RETRY_UNAVAILABLE_S) from None
        if self.response.completion_tokens:
            self.metrics.migrations.inc()

    def _count_unclear_failure(self, e: Exception) -> None:
        self.unclear_failures += 1
        if self.unclear_failures >= self.cfg.retries.max_request_faults:
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
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"every decode worker is full; retry later ({last_error})",
                    RETRY_UNAVAILABLE_S,
                )
            why = f" (last attempt: {last_error})" if last_error else ""
            if self.workers.starting("decode"):
                why += f"; {self.workers.starting('decode')} starting"
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no healthy decode worker{why}", RETRY_UNAVAILABLE_S)
        # a worker caches the prompt's blocks, and one sample's output after them: the output is part of
        # the context only when exactly one sample continues (several diverge right after the prompt)
        samples = self.response.handoff_samples()
        output = samples[0].output_token_ids if len(samples) == 1 else []
        context = [*self.req.prompt_token_ids, *output]
        hashes = block_hashes(context, self.cfg.routing.block_size)
        # Samples of different outputs have no one context for a prefill worker to fill (it refuses
        # them): the decode worker prefills each itself, every sample's output to compute.
        local = force_local or len(samples) > 1
        prefill = {} if local else self.workers.prefill_queued_tokens()
        r = policy.route(
            hashes,
            len(self.req.prompt_token_ids) + sum(len(s.output_token_ids) for s in samples),
            self.workers.index,
            loads,
            prefill,
            self.cfg.routing,
            self.rng,
            self.workers.decode_chooser,
        )
        self._charge(r, prefill)
        self.metrics.routed(r.mode, len(hashes), r.overlap_blocks)
        return r.worker, r.mode, r.overlap_blocks

    def _charge(self, r: policy.Route, prefill_queued: dict[str, int]) -> None:
        """The routed tokens into the router's view at once, where they will be: a local prefill's in
        the decode worker's queue; a remote one's in the prefill pool's queue (its least-queued worker,
        which `_prefill` then calls first) and, arriving as KV, in the decode worker's context. Issue
        22: charged to the decode worker's queue, the first prompt of a burst made the second look
        cheaper to send remote, and the pool's queue showed neither until their Prefill calls began
        (after a reservation on the decode worker, a step or more later)."""
        if r.mode == "local" or not prefill_queued:
            self.workers.assigned(r.worker, r.uncached_tokens)
            return
        self.workers.assigned(r.worker, r.uncached_tokens, queued=False)
        self._release_prefill_charge()
        address = policy.choose_prefill_worker(prefill_queued, self.rng)
        self.workers.assigned(address, r.uncached_tokens)
        self._prefill_charge = (address, r.uncached_tokens)

    def _release_prefill_charge(self) -> None:
        """Drop the routing-time charge of the prefill queue: the Prefill call charges its own from
        its start, or the attempt ended before one."""
        charge, self._prefill_charge = self._prefill_charge, None
        if charge is not None:
            self.workers.ended(*charge)

    def _remaining_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")
        return left

    def _check_deadline(self) -> None:
        """After a timeout: if it was the request's own deadline, that is no worker's fault."""
        if time.monotonic() >= self.deadline - 0.005:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")

    # ---- one decode attempt

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
                "splitserve.prior_tokens": self.response.completion_tokens,
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
            # the attempt's context leaves the worker's running load now, not at its next stats poll
            self.workers.ended(address, len(self.req.prompt_token_ids) + self.response.completion_tokens)
            self._release_prefill_charge()
            tracing.end_span(span, error)

    def _handoff(self) -> wpb.Handoff:
        """The request as the next attempt continues it: fresh (no samples) until something was sent,
        then every unfinished sample with the tokens (and logprobs) the client has of it. max_tokens
        stays the request's: it counts a sample's handed-over tokens too."""
        h = Handoff(
            list(self.req.prompt_token_ids),
            self.req.sampling,
            self.response.handoff_samples(),
            self.response.prompt_logprobs,
            self.share,
        )
        return convert.handoff_to_proto(h)

    async def _decode(
        self, address: str, mode: policy.PrefillMode, rid: str, trace: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        w = self.workers.get(address)
        if w is None:
            raise _Retry("worker was removed")
        deadlines = self.cfg.deadlines
        handoff = self._handoff()
        call = w.decode_stub().Decode(
            wpb.DecodeRequest(
                request_id=rid,
                handoff=handoff,
                prefill_mode=wpb.PREFILL_MODE_REMOTE if mode == "remote" else wpb.PREFILL_MODE_LOCAL,
                lease_ms=deadlines.lease_ms,
            ),
            timeout=min(deadlines.request_timeout_s, self._remaining_s()),
            metadata=tracing.inject(self.cfg.listeners.auth_metadata, trace),
        )
        try:
            first = await self._next(call, deadlines.admit_timeout_s, admitted=False)
            for resp in await self._admitted(first, rid, handoff, trace):
                yield resp
            while not self.response.finished:
                later = self._on_event(await self._next(call, deadlines.token_timeout_s, admitted=True))
                if later is not None:
                    self._stop_sample_if_ended(w, rid, later)
                    yield later
        finally:
            call.cancel()  # no-op when the call is done; an abort for the worker otherwise

    def _stop_sample_if_ended(self, w: Worker, rid: str, resp: pb.GenerateResponse) -> None:
        """A sample this router ended (a stop string) while others go on: the worker stops it too,
        so it neither decodes for nobody nor holds its blocks until the last sample ends. The
        worker's own finishes and the request's last sample (the call is cancelled) need none."""
        if not resp.finish_reason or self.response.finished or not self.response.stopped_here(resp.index):
            return
        request = wpb.CancelRequest(request_id=rid, index=resp.index)
        metadata = self.cfg.listeners.auth_metadata
        task = asyncio.ensure_future(
            w.decode_stub().Cancel(request, timeout=self.cfg.deadlines.admit_timeout_s, metadata=metadata)
        )
        self._cancels.add(task)
        task.add_done_callback(self._cancel_done)

    def _cancel_done(self, task: asyncio.Future[Any]) -> None:
        self._cancels.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the sample ends with the call anyway
            log.info("request %s: a sample's cancel failed: %s", self.req.request_id, task.exception())

    async def _admitted(
        self, first: wpb.DecodeEvent, rid: str, handoff: wpb.Handoff, trace: Context
    ) -> list[pb.GenerateResponse]:
        """The Decode call's first event: a reservation (prefill it remotely; each sample's first token
        comes from the prefill worker) or the decode worker's own prefill under way."""
        kind = first.WhichOneof("event")
        if kind in ("reservation", "local_prefill"):
            self.response.on_admitted()
            self.admitted.set()
        if kind == "reservation":
            result = await self._prefill(rid, first.reservation, handoff, trace)
            self.response.set_cached(result.num_cached_tokens)
            return self._first_tokens(result.handoff)
        if kind == "local_prefill":
            self.response.set_cached(first.local_prefill.num_cached_tokens)
            self.response.set_prompt_logprobs(
                [convert.logprob_from_proto(lp) for lp in first.local_prefill.prompt_logprobs]
            )
            return []
        raise _Retry(f"protocol error: first event is {kind}, not a reservation or local_prefill")

    def _first_tokens(self, h: wpb.Handoff) -> list[pb.GenerateResponse]:
        """The responses for the tokens a prefill worker sampled: its handoff holds each sample as the
        decode worker continues it, the tokens the client already has (after a migration) included,
        and the logprobs of its last tokens (those the prefill worker sampled)."""
        self.response.set_prompt_logprobs([convert.logprob_from_proto(lp) for lp in h.prompt_logprobs])
        out = []
        for s in h.samples:
            self._check_index(s.index)
            sent = self.response.sent(s.index)
            ids = list(s.output_token_ids)
            if len(ids) > sent:  # the whole sample: what is new is past what the client has
                ids = ids[sent:]
            # else only the new token came back: all of it is new
            lps = [convert.logprob_from_proto(lp) for lp in s.logprobs[max(0, len(s.logprobs) - len(ids)) :]]
            resp = self.response.emit(s.index, ids, lps)
            if resp is not None:
                out.append(resp)
        return out

    def _check_index(self, index: int) -> None:
        if index >= self.req.sampling.n:
            raise _Retry(f"protocol error: sample index {index} of a request with n={self.req.sampling.n}")

    def _on_event(self, ev: wpb.DecodeEvent) -> pb.GenerateResponse | None:
        """A Decode event after the first: one sample's tokens, or a finish (which ends a sample,
        or the attempt)."""
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            t = ev.tokens
            self._check_index(t.index)
            return self.response.emit(t.index, t.token_ids, [convert.logprob_from_proto(lp) for lp in t.logprobs])
        if kind != "finish":
            raise _Retry(f"protocol error: {kind} event after the first")
        reason = ev.finish.reason
        if reason in _FINISH:
            self._check_index(ev.finish.index)
            return self.response.final(ev.finish.index, _FINISH[reason])
        if reason == wpb.FINISH_REASON_LEASE_EXPIRED:
            raise _Retry(f"lease expired: {ev.finish.message}", exclude=False, fault=Fault.BUSY, force_local=True)
        raise _Retry(
            f"worker ended the request: {wpb.FinishReason.Name(reason)} {ev.finish.message}", fault=Fault.UNCLEAR
        )

    async def _next(self, call: _DecodeCall, timeout_s: float, admitted: bool) -> wpb.DecodeEvent:
        try:
            async with asyncio.timeout(min(timeout_s, self._remaining_s())):
                ev = await call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request is being cancelled (its client went away)
            # the call was, not this task: the worker was removed (its actor died, its pool shrank)
            # and WorkerSet.remove closed its channel, which cancels the calls in flight. Another
            # attempt goes on elsewhere, as for a worker that died mid-stream.
            raise _Retry("Decode call cancelled: the worker was removed", fault=Fault.WORKER) from None
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

    # ---- the remote prefill of a reservation

    async def _prefill(
        self, rid: str, reservation: wpb.Reservation, handoff: wpb.Handoff, trace: Context
    ) -> wpb.PrefillResult:
        """Prefill on the least-queued prefill worker; on failure, on another, same reservation.
        Each call is a span (router.prefill) under `trace`, the decode attempt's.

        A prefill worker is marked failed only for its own faults (Fault.WORKER); one that
        refuses the reservation (a layout it cannot map, say) stays in routing for others.
        """
        self._release_prefill_charge()
        tried: list[str] = []
        request = wpb.PrefillRequest(request_id=rid, handoff=handoff, reservation=reservation)
        last = "no healthy prefill worker"
        for attempt in range(self.cfg.retries.max_prefill_attempts):
            queued = self.workers.prefill_queued_tokens(exclude=tried)
            if not queued:
                break
            address = policy.choose_prefill_worker(queued, self.rng)
            tried.append(address)
            w = self.workers.get(address)
            if w is None:
                continue
            timeout = self._prefill_timeout_s(reservation)
            if timeout <= 0:
                last = "reservation lease passed"
                break
            if attempt:
                self.metrics.prefill_retries.inc()
            result = await self._prefill_on(w.prefill_stub(), address, request, timeout, attempt, trace)
            if isinstance(result, wpb.PrefillResult):
                return result
            last = result
        # The decode worker is fine; it will prefill the request itself.
        raise _Retry(last, exclude=False, fault=Fault.BUSY, force_local=True)

    def _prefill_timeout_s(self, reservation: wpb.Reservation) -> float:
        """One Prefill call's deadline: its own, the request's, and the reservation lease's, the soonest."""
        limits = [self.cfg.deadlines.prefill_timeout_s, self._remaining_s()]
        if reservation.lease_deadline_unix_ms:
            limits.append(reservation.lease_deadline_unix_ms / 1000 - time.time())
        return min(limits)

    async def _prefill_on(
        self,
        stub: wgrpc.PrefillWorkerStub,
        address: str,
        request: wpb.PrefillRequest,
        timeout_s: float,
        attempt: int,
        trace: Context,
    ) -> wpb.PrefillResult | str:
        """One Prefill call, in its span: the result, or why it failed (the worker marked failed
        when the fault is its own)."""
        span = tracing.start_span(
            "router.prefill", trace, {"splitserve.worker": address, "splitserve.try": attempt}, SpanKind.CLIENT
        )
        error: str | None = "cancelled"
        prompt_tokens = len(request.handoff.prompt_token_ids)
        try:
            self.workers.assigned(address, prompt_tokens)
            metadata = tracing.inject(self.cfg.listeners.auth_metadata, tracing.child(span))
            result = await stub.Prefill(request, timeout=timeout_s, metadata=metadata)
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
            return last
        finally:
            self.workers.ended(address, prompt_tokens)  # its queue is shorter now, not a poll later
            tracing.end_span(span, error)
