"""The OpenAI-compatible HTTP front door: `POST /v1/chat/completions`,
`POST /v1/completions` (streaming as server-sent events or whole), `GET
/v1/models`, `GET /health` (200 once ready, router/readiness.py; 503 naming
what it waits for; either naming the workers that do not answer), `GET
/metrics` (the router's Prometheus metrics).

Each request is translated into the public `GenerateRequest` (router/openai/translate.py)
and goes through exactly the gRPC path: the same admission, validation, routing and
streaming. The answer's choices are shaped in router/openai/choices.py, the same way streamed
(router/openai/streaming.py) or whole; a failure is answered with its gRPC status as an HTTP
one (router/openai/errors.py).

No client body reaches a 500: the API key is checked first, then the bytes are
read as JSON by `json_body` (size, charset, UTF-8, depth), then `from_openai`
checks every field's type and range before anything is put into a protobuf
(which raises on an int32 out of range or a lone surrogate). A 500 means a
fault of the server's own, and is logged. A client that goes away cancels its
request at once (handler cancellation), wherever the handler is waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Generic

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from splitserve.router.auth import OPEN_HTTP_PATHS, UNAUTHENTICATED
from splitserve.router.openai.choices import Answer, Piece, usage_json, whole_choices
from splitserve.router.openai.errors import error_response, failed_response
from splitserve.router.openai.fields import BadRequest
from splitserve.router.openai.generation import AdmissionT, Generation
from splitserve.router.openai.json_body import BodyError, parse_json_body
from splitserve.router.openai.json_value import JsonObject
from splitserve.router.openai.logprobs import TokenText
from splitserve.router.openai.streaming import stream_answer
from splitserve.router.openai.translate import OpenAIRequest, from_openai
from splitserve.router.readiness import Readiness
from splitserve.router.request import RequestFailed
from splitserve.router.tenants import PRIORITY_KEY
from splitserve.runtime import tracing
from splitserve.runtime.tls import RELOAD_CHECK_S, ReloadingSSLContext

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


class OpenAIServer(Generic[AdmissionT]):
    """The door on one port, in front of the gRPC service `generation` (router/server.py's
    `GenerationService`, seen through the `Generation` protocol)."""

    def __init__(
        self,
        generation: Generation[AdmissionT],
        model_name: str,
        ready: Callable[[], Readiness],
        registry: CollectorRegistry,
        may_read_metrics: Callable[[str | None], bool],
    ) -> None:
        self.generation = generation
        self.model_name = model_name
        self.ready = ready  # Router.readiness
        self.registry = registry  # the router's metrics
        self.may_read_metrics = may_read_metrics  # Router.may_read_metrics: a tenant's key or --metrics-key
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._require_key])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        self._runner: web.AppRunner | None = None
        self._reload: asyncio.Task[None] | None = None  # follows a TLS certificate's files
        self._token_text: TokenText | None = None

    @web.middleware
    async def _require_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route behind the key but /health (router/auth.py), an unknown path too: without
        the key, 401 is all a stranger learns. /metrics also answers --metrics-key
        (`may_read_metrics`)."""
        if request.path in OPEN_HTTP_PATHS or not self.generation.keys.required:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        if request.path == "/metrics":
            allowed = self.may_read_metrics(authorization)
        else:
            allowed = self.generation.keys.tenant(authorization) is not None
        if not allowed:
            return error_response(401, UNAUTHENTICATED, "authentication_error")
        return await handler(request)

    async def start(
        self, host: str, port: int, tls: ReloadingSSLContext | None = None, reuse_port: bool = False
    ) -> int:
        """Listen (HTTPS with `tls`, its certificate followed as it rotates); the bound port.
        `reuse_port`: share it with other router replicas (SO_REUSEPORT)."""
        # handler_cancellation: a client that disconnects cancels its handler at once, wherever it
        # waits (for the next token, or for a whole answer), which cancels the worker calls
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host, port, ssl_context=tls.context if tls is not None else None, reuse_port=reuse_port
        )
        await site.start()
        if tls is not None:
            self._reload = asyncio.create_task(_follow_certificate(tls))
        return int(self._runner.addresses[0][1])  # the bound port (port 0 picks one)

    async def stop(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "splitserve"}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        r = self.ready()
        body: JsonObject = {"status": "ok"} if r.ready else {"status": r.code, "reason": r.reason}
        if r.unreachable:  # ready or not: a worker that does not answer is worth a look
            body["unreachable"] = dict(r.unreachable)
        return web.json_response(body, status=200 if r.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics, on the HTTP port too (no separate port to open)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _read(self, request: web.Request) -> object:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # (counted after decompression too)
            raise BodyError(413, f"the body is larger than the limit of {MAX_BODY_BYTES} bytes", close=True) from None
        except web.RequestPayloadError as e:  # the payload itself is broken: a content-encoding that does not decode
            # Nothing more can be read from it: marked ended, aiohttp does not try to drain it after the
            # answer (which re-raises this error and logs it as an unhandled exception).
            request.content.feed_eof()
            why = " ".join(str(e).split())
            raise BodyError(400, f"the body could not be read ({why})", close=True) from None
        return parse_json_body(raw, request.headers.get("Content-Type"))

    @property
    def token_text(self) -> TokenText:
        """Token ids' texts for logprobs, cached for the server's life (made at first use: the
        tokenizer is the service's)."""
        if self._token_text is None:
            self._token_text = TokenText(self.generation.tokenizer)
        return self._token_text

    def _decode(self, ids: list[int]) -> str:
        detok = self.generation.tokenizer.detokenizer(())
        return "".join([detok.feed(t) for t in ids]) + detok.flush()

    def _translate(self, body: object, chat: bool) -> OpenAIRequest:
        try:
            tok = self.generation.tokenizer
            return from_openai(body, chat, tok.vocab_size, self._decode, tok.tool_format)
        except BadRequest:
            raise
        except Exception as e:  # a check from_openai lacks; still the client's body, but worth a look
            log.warning("an HTTP body failed translation outside the checks", exc_info=True)
            raise BadRequest(f"request: not a valid request ({type(e).__name__})") from None

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        # a stranger's body is never read: `_require_key` answered 401 before this; the key is
        # read again here for its tenant (GenerationService.admit)
        authorization = request.headers.get("Authorization")
        try:
            oreq = self._translate(await self._read(request), chat)
            trace_parent = tracing.extract(request.headers)  # the client's traceparent, if it sent one
            priority = request.headers.get(PRIORITY_KEY)
            admitted = await self.generation.admit(
                oreq.generate, authorization, None, trace_parent, front_door="http", priority=priority
            )
        except BodyError as e:
            resp = error_response(e.status, str(e))
            if e.close:
                resp.force_close()
            return resp
        except BadRequest as e:
            return error_response(400, str(e))
        except RequestFailed as e:  # a grammar that does not compile too: "sampling.grammar: ...", 400
            return failed_response(e)
        try:
            if oreq.stream:
                return await self._stream(request, admitted, oreq)
            return await self._whole(admitted, oreq)
        finally:  # (the stream gives it back itself; this is for an answer that never started one)
            self.generation.release(admitted)

    async def _whole(self, run: AdmissionT, oreq: OpenAIRequest) -> web.Response:
        created = int(time.time())
        rid, chat = oreq.generate.request_id, oreq.shape.chat
        answer = Answer(oreq.shape, self.token_text)
        pieces: list[Piece] = []
        try:
            async with contextlib.aclosing(self.generation.stream(run)) as responses:
                async for r in responses:
                    pieces.append(answer.update(r))
        except RequestFailed as e:
            return failed_response(e, "server_error")
        except asyncio.CancelledError:  # the client went away while the answer was being made
            log.info("request %s: the client disconnected before its answer; request cancelled", rid)
            raise
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": whole_choices(pieces, chat),
                "usage": usage_json(answer.usage),
            }
        )

    async def _stream(self, request: web.Request, run: AdmissionT, oreq: OpenAIRequest) -> web.StreamResponse:
        async with contextlib.aclosing(self.generation.stream(run)) as responses:
            answer = Answer(oreq.shape, self.token_text)
            return await stream_answer(request, responses, run.run.admitted, oreq, answer, self.model_name)


async def _follow_certificate(tls: ReloadingSSLContext) -> None:
    """Load a rotated certificate into the listening context: the next handshake serves it, and
    the connections already open (their streams) keep theirs."""
    while True:
        await asyncio.sleep(RELOAD_CHECK_S)
        if tls.maybe_reload():
            log.info("TLS certificate %s reloaded", tls.files.certfile)
