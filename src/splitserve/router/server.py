"""The router's gRPC front door: splitserve.v1.Generation and grpc.health.v1.Health.

`Router` owns the server, the worker set, the prefix index and the metrics;
`GenerationService.Generate` admits a call (API key, in-flight bound,
validation, the tenant's limits) and hands it to a `RequestRun`. Overload is
answered at once with RESOURCE_EXHAUSTED; beyond --max-running-requests a
request waits for a seat (router/seats.py).

Generate is registered to receive the request's raw bytes: the API key is
checked (router/auth.py's interceptor) before anything of the body is looked
at, and bytes that are not a
GenerateRequest (or carry invalid UTF-8 in a string field) are answered with
INVALID_ARGUMENT, not with the UNKNOWN and traceback of a failing deserializer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from splitserve.engine.prefill_order import Share
from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.auth import KeyInterceptor
from splitserve.router.config import RouterConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.readiness import Readiness, readiness
from splitserve.router.request import RETRY_AFTER_KEY, RequestFailed, RequestRun
from splitserve.router.seats import Seats
from splitserve.router.status import status_details
from splitserve.router.tenant_limits import TenantLimits
from splitserve.router.tenants import PRIORITY_KEY, KeyRing, Tenant, priority_band
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.validation import ValidationError, ValidRequest, validate
from splitserve.router.workers import WorkerSet
from splitserve.runtime import tracing
from splitserve.runtime.tls import ReloadingSSLContext, grpc_server_credentials

if TYPE_CHECKING:  # imported when the HTTP front door starts: aiohttp loads only then
    from splitserve.router.openai.door import OpenAIServer

log = logging.getLogger(__name__)

SERVICE_NAME = "splitserve.v1.Generation"
# a request this large (its prompt, mostly) is validated on a thread: tokenizing it takes milliseconds
_HEAVY_REQUEST_BYTES = 16_384
_CHECK_THREADS = 2
HEALTH_DETAILS_KEY = "splitserve-health-details"  # a health Check's trailer: readiness's details, for people


def parse_request(raw: bytes) -> pb.GenerateRequest:
    """A GenerateRequest from the wire; RequestFailed(INVALID_ARGUMENT) if the bytes are not one."""
    try:
        return pb.GenerateRequest.FromString(raw)
    except Exception as e:  # DecodeError mostly (bad wire format, invalid UTF-8); any parse failure is the bytes'
        raise RequestFailed(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid GenerateRequest ({type(e).__name__}: {e})"
        ) from None


@dataclass
class Admitted:
    """A request past admission: its run, and what it holds of its tenant's until it ends."""

    run: RequestRun
    tenant: Tenant
    band: int
    tokens: int  # taken from the tenant's tokens per minute: prompt + n x max_tokens
    released: bool = False


class GenerationService:
    def __init__(
        self,
        cfg: RouterConfig,
        tokenizer: RouterTokenizer,
        workers: WorkerSet,
        metrics: RouterMetrics,
        rng: random.Random,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.workers = workers
        self.metrics = metrics
        self.rng = rng
        self.inflight = 0
        self.draining = False  # set by Router.drain: new requests are refused, running ones go on
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._active: set[str] = set()  # request ids in flight
        self._checks = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="router-checks")  # see `admit`
        self.keys = KeyRing(cfg.all_tenants())
        self.tenant_limits = TenantLimits(time.monotonic)
        self.seats = Seats(cfg.limits.max_running)

    def check_key(self, authorization: str | None) -> Tenant:
        """The tenant whose key the call carries; RequestFailed(UNAUTHENTICATED) when it carries
        none that is known (keys are compared in constant time: router/tenants.py). The first
        check of a call."""
        tenant = self.keys.tenant(authorization)
        if tenant is None:
            raise RequestFailed(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization: Bearer <key>)"
            )
        return tenant

    async def admit(
        self,
        request: pb.GenerateRequest,
        authorization: str | None,
        time_remaining: float | None,
        trace_parent: Context | None = None,
        front_door: str = "grpc",
        priority: str | None = None,
    ) -> Admitted:
        """Everything a request must pass before it runs, for both front doors (gRPC and HTTP).

        Raises RequestFailed with the status to answer: UNAUTHENTICATED, RESOURCE_EXHAUSTED
        (the router's or the tenant's limits; with a retry-after where one is known),
        INVALID_ARGUMENT (naming the field) or ALREADY_EXISTS; INTERNAL (logged) if validation
        itself fails. What the request holds of its tenant's limits is given back by `stream`
        when it ends, or by `release` if it never runs.

        The request's trace starts here: its span (router.generate, under the client's
        `trace_parent` when it sent a traceparent) ends with `stream`, or here if it is refused.

        A request with a grammar or a long prompt is validated on a thread of the router's own:
        checking the grammar and tokenizing the prompt run with the GIL released there, so the
        event loop goes on sending every other stream's tokens meanwhile.
        """
        tenant = self.check_key(authorization)
        span = tracing.start_span(
            "router.generate",
            trace_parent or Context(),
            {"splitserve.request_id": request.request_id[:128], "splitserve.front_door": front_door},
            kind=SpanKind.SERVER,
        )
        try:
            heavy = request.sampling.HasField("grammar") or request.ByteSize() > _HEAVY_REQUEST_BYTES
            if heavy:
                valid = await asyncio.get_running_loop().run_in_executor(self._checks, self._validate, request)
            else:
                valid = self._validate(request)
            try:
                band = priority_band(tenant, priority)
            except ValueError as e:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            run = self._admit(valid, time_remaining, span, Share(tenant.name, tenant.weight, band))
            tokens = len(valid.prompt_token_ids) + valid.sampling.n * valid.sampling.max_tokens
            refusal = self.tenant_limits.admit(tenant, tokens)
            if refusal is not None:
                self.metrics.tenant_refusals.labels(tenant.name).inc()
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if refusal.retry_after_s is not None else None
                raise RequestFailed(code or grpc.StatusCode.INVALID_ARGUMENT, refusal.message, refusal.retry_after_s)
            return Admitted(run, tenant, band, tokens)
        except RequestFailed as e:
            span.set_attribute("rpc.grpc.status_code", e.code.value[0])
            tracing.end_span(span, status_details(str(e)))
            raise

    def _validate(self, request: pb.GenerateRequest) -> ValidRequest:
        self._check_room()
        try:
            return validate(request, self.cfg.limits, self.tokenizer)
        except ValidationError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Exception:  # validation must name a field for every bad request; this is its bug, not the client's
            log.exception("validating request %r failed", request.request_id[:128])
            raise RequestFailed(grpc.StatusCode.INTERNAL, "internal error in the router") from None

    def _check_room(self) -> None:
        """Refusals that cost nothing to find, before the request's own checks."""
        if self.draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the router is shutting down: retry on another replica")
        max_inflight = self.cfg.limits.max_inflight
        if self.inflight >= max_inflight:
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"router at its limit of {max_inflight} requests in flight"
            )

    def _admit(self, req: ValidRequest, time_remaining: float | None, span: Span, share: Share) -> RequestRun:
        self._check_room()  # again, after a validation on the thread: others may have come in meanwhile
        if req.request_id in self._active:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {req.request_id!r} is already in flight")
        timeout = self.cfg.deadlines.request_timeout_s
        if time_remaining is not None:
            timeout = min(time_remaining, timeout)
        return RequestRun(
            req,
            self.cfg,
            self.tokenizer,
            self.workers,
            self.metrics,
            self.rng,
            deadline=time.monotonic() + timeout,
            span=span,
            share=share,
        )

    def release(self, admitted: Admitted) -> None:
        """Give back what the request holds of its tenant's limits (once; `stream` does it at its end)."""
        if admitted.released:
            return
        admitted.released = True
        run = admitted.run
        used = len(run.req.prompt_token_ids) + run.response.completion_tokens
        self.tenant_limits.release(admitted.tenant, admitted.tokens - used)
        self.metrics.tenant_tokens.labels(admitted.tenant.name, "prompt").inc(len(run.req.prompt_token_ids))
        self.metrics.tenant_tokens.labels(admitted.tenant.name, "completion").inc(run.response.completion_tokens)

    async def stream(self, admitted: Admitted) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Run an admitted request, counted in flight, once a seat is its (router/seats.py);
        failures come out as RequestFailed. Ends the request's span, and gives back its seat and
        its tenant's share."""
        run = admitted.run
        rid = run.req.request_id
        error: str | None = None
        code = grpc.StatusCode.OK
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()
        self._active.add(rid)
        seated = False
        try:
            await self._take_seat(admitted)
            seated = True
            async for resp in run.run():
                yield resp
        except RequestFailed as e:
            code, error = e.code, status_details(str(e))
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code, error = grpc.StatusCode.CANCELLED, "cancelled"
            raise
        except Exception:  # a bug here must not look like the client's fault
            log.exception("request %s failed", rid)
            code, error = grpc.StatusCode.INTERNAL, "internal error in the router"
            raise RequestFailed(code, error) from None
        finally:
            if run.span.is_recording():
                run.span.set_attributes(
                    {
                        "rpc.grpc.status_code": code.value[0],
                        "splitserve.prompt_tokens": len(run.req.prompt_token_ids),
                        "splitserve.completion_tokens": run.response.completion_tokens,
                        "splitserve.cached_tokens": run.response.cached_tokens or 0,
                    }
                )
            tracing.end_span(run.span, error)
            if seated:
                self.seats.give_back(admitted.tenant)
            self.release(admitted)
            self.metrics.tenant_requests.labels(admitted.tenant.name, code.name).inc()
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()
            self.metrics.inflight.dec()
            self._active.discard(rid)

    async def _take_seat(self, admitted: Admitted) -> None:
        waiting = self.metrics.tenant_waiting.labels(admitted.tenant.name)
        waiting.inc()
        try:
            await self.seats.take(admitted.tenant, admitted.tokens, admitted.band)
        finally:
            waiting.dec()

    def close(self) -> None:
        """Stop the validation threads (a check still running finishes on its own)."""
        self._checks.shutdown(wait=False, cancel_futures=True)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether nothing is in flight within `timeout_s` (for a graceful stop)."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    async def Generate(  # noqa: N802 (the gRPC method name)
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The RPC, on the request's raw bytes (see `generation_handler`)."""
        code = grpc.StatusCode.OK
        try:
            try:
                metadata = dict(context.invocation_metadata() or ())
                value = metadata.get("authorization")
                authorization = value if isinstance(value, str) else None  # only "-bin" keys carry bytes
                trace_parent = tracing.extract(context.invocation_metadata())
                priority = metadata.get(PRIORITY_KEY)
                admitted = await self.admit(
                    parse_request(request),
                    authorization,
                    context.time_remaining(),
                    trace_parent,
                    priority=priority if isinstance(priority, str) else None,
                )
                try:
                    async for resp in self.stream(admitted):
                        yield resp
                finally:
                    self.release(admitted)
            except RequestFailed as e:
                code = e.code
                if e.retry_after_s is not None:
                    context.set_trailing_metadata(((RETRY_AFTER_KEY, str(math.ceil(e.retry_after_s))),))
                await context.abort(e.code, status_details(str(e)))
            except Exception:  # the router's own fault: logged, and INTERNAL rather than grpc's bare UNKNOWN
                log.exception("Generate failed")
                code = grpc.StatusCode.INTERNAL
                await context.abort(code, "internal error in the router")
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.metrics.requests.labels(code.name).inc()


def generation_handler(service: GenerationService) -> dict[str, grpc.RpcMethodHandler]:
    """splitserve.v1.Generation's methods, Generate without a request deserializer (it gets bytes)."""
    return {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
    }


class HealthService(health_pb2_grpc.HealthServicer):
    """SERVING while the router is ready (router/readiness.py): every required pool has a ready
    worker and the router is not draining. Check's trailing metadata (HEALTH_DETAILS_KEY) says, for
    people, what the router waits for and which workers do not answer."""

    def __init__(self, ready: Callable[[], Readiness]) -> None:
        self.ready = ready
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    def _status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus:
        if service not in ("", SERVICE_NAME):
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        if self.ready().ready:
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE_NAME):
            await context.abort(grpc.StatusCode.NOT_FOUND, status_details(f"unknown service {request.service!r}"))
        r = self.ready()
        if r.details:  # what it waits for and which workers do not answer (gRPC sends no details with OK)
            details = status_details(r.details).encode("ascii", "backslashreplace").decode()  # metadata is ASCII
            context.set_trailing_metadata(((HEALTH_DETAILS_KEY, details),))
        status = health_pb2.HealthCheckResponse.SERVING if r.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self._status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            self._changed.clear()
            await self._changed.wait()


class Router:
    """The front door process's parts, started and stopped together.

    router = Router(cfg, tokenizer, decode=["10.0.0.5:7001"], prefill=["10.0.0.6:7101"])
    port = await router.start()
    router.workers.add("10.0.0.7:7001", "decode")   # the pool manager's interface
    ...
    await router.stop()
    """

    def __init__(
        self,
        cfg: RouterConfig,
        tokenizer: RouterTokenizer,
        decode: Iterable[str] = (),
        prefill: Iterable[str] = (),
        rng: random.Random | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = PrefixIndex()
        self.metrics = metrics or RouterMetrics(cfg)
        self.workers = WorkerSet(cfg, self.index, on_health_change=self._health_changed)
        self.health = HealthService(self.readiness)
        self.generation = GenerationService(cfg, tokenizer, self.workers, self.metrics, rng or random.Random())
        self._initial = (list(decode), list(prefill))
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.http: OpenAIServer[Admitted] | None = None
        self.http_port = 0
        self._stop_metrics: Callable[[], None] | None = None  # the --metrics-port server, when there is one

    def may_read_metrics(self, authorization: str | None) -> bool:
        """Whether a scrape with this Authorization header reads /metrics: any tenant's key, or
        --metrics-key ("" opens them); anyone where the router has no keys."""
        key = self.cfg.listeners.metrics_key
        if key == "" or not self.generation.keys.required:
            return True
        if key is not None and hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode()):
            return True
        return self.generation.keys.tenant(authorization) is not None

    def _health_changed(self) -> None:
        self.health.notify()

    def readiness(self) -> Readiness:
        """Whether to take requests now, and if not, why (gRPC health and GET /health both ask this)."""
        ready: dict[str, int] = {}
        known: dict[str, int] = {}
        unreachable: dict[str, str] = {}
        for w in self.workers.all():
            known[w.role] = known.get(w.role, 0) + 1
            if w.healthy and not w.draining:
                ready[w.role] = ready.get(w.role, 0) + 1
            if w.unreachable is not None:
                unreachable[w.address] = w.unreachable
        return readiness(ready, known, self.cfg.required_pools, self.generation.draining, unreachable)

    def drain(self) -> None:
        """Stop taking requests (health turns NOT_SERVING; new calls get UNAVAILABLE); in-flight
        ones go on. The first step of a graceful stop: see `drained`."""
        self.generation.draining = True
        self.health.notify()

    async def drained(self, timeout_s: float) -> bool:
        """Whether every request in flight finished within `timeout_s` (after `drain`)."""
        return await self.generation.wait_idle(timeout_s)

    async def start(self, port: int | None = None) -> int:
        """Bind (port 0 picks a free one), start serving, start watching the workers; returns the port."""
        lis = self.cfg.listeners
        shared = int(lis.replicas > 1)  # replicas share the port (router/replicas.py); a lone router holds it
        self.server = grpc.aio.server(
            interceptors=(KeyInterceptor(self.generation.keys),), options=(("grpc.so_reuseport", shared),)
        )
        handlers = generation_handler(self.generation)  # as add_GenerationServicer_to_server registers them
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.server.add_registered_method_handlers(SERVICE_NAME, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{lis.host}:{lis.grpc_port if port is None else port}"
        if lis.tls is not None:
            self.port = self.server.add_secure_port(address, grpc_server_credentials(lis.tls))
        else:
            self.port = self.server.add_insecure_port(address)
        await self.server.start()
        if lis.http_port is not None:
            from splitserve.router.openai.door import OpenAIServer

            self.http = OpenAIServer(
                self.generation, lis.model_name, self.readiness, self.metrics.registry, self.may_read_metrics
            )
            tls = ReloadingSSLContext(lis.tls) if lis.tls is not None else None
            self.http_port = await self.http.start(lis.host, lis.http_port, tls, reuse_port=lis.replicas > 1)
            log.info("OpenAI-compatible HTTP%s on %s:%d", "S" if tls else "", lis.host, self.http_port)
        decode, prefill = self._initial
        self.workers.add_all(decode, "decode")
        self.workers.add_all(prefill, "prefill")
        if lis.metrics_port:
            from splitserve.runtime.metrics_http import serve_metrics_http

            _, self._stop_metrics = serve_metrics_http(
                lis.host, lis.metrics_port, self.metrics.registry, authorize=self.may_read_metrics
            )
        log.info("router listening on %s:%d", lis.host, self.port)
        return self.port

    async def wait_for_workers(self, timeout_s: float = 10.0) -> None:
        """Until every worker handed in so far has answered a stats poll (for tests and startup)."""
        end = time.monotonic() + timeout_s
        while any(not w.healthy for w in self.workers.all()):
            if time.monotonic() > end:
                raise TimeoutError("workers did not become healthy")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._stop_metrics is not None:
            self._stop_metrics()
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.workers.close()
        self.generation.close()
