"""The OpenAI-compatible HTTP front door: `POST /v1/chat/completions`,
`POST /v1/completions` (streaming as server-sent events or whole), `GET
/v1/models`, `GET /health` (200 once ready, router/readiness.py; 503 naming
what it waits for; either naming the workers that do not answer), `GET
/metrics` (the router's Prometheus metrics).

Each request is translated into the public `GenerateRequest` and goes through
exactly the gRPC path: the same admission, validation, routing and streaming.
Beyond OpenAI's sampling fields the body may ask for what vLLM's clients use, in
vLLM's spellings: structured output (`response_format`, `guided_json`/`_regex`/
`_choice`/`_grammar`, `structured_outputs`: router/openai/response_format.py), tools
(`tools`, `tool_choice`, `parallel_tool_calls`: router/openai/tools.py, the calls read
back by router/openai/tool_calls.py), `n` choices, log-probabilities (chat's `logprobs`
and `top_logprobs`, completions' `logprobs` and `echo`: router/openai/logprobs.py),
`logit_bias`, `min_tokens`, `stop_token_ids`. The answer's choices are shaped in
router/openai/choices.py, the same way streamed or whole.
gRPC statuses map to HTTP ones (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED
504), with an OpenAI-style error body that names what is wrong.

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
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, NamedTuple, cast

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from splitserve.engine.tool_call_format import ToolCallFormat
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.auth import OPEN_HTTP_PATHS, UNAUTHENTICATED
from splitserve.router.openai.choices import Answer, Piece, Shape, stream_choice, whole_choices
from splitserve.router.openai.fields import BadRequest, boolean, bounded, integer, number, set_field, string, unicode
from splitserve.router.openai.json_body import BodyError, parse_json_body
from splitserve.router.openai.logprobs import TokenText
from splitserve.router.openai.messages import chat_messages
from splitserve.router.openai.response_format import CONSTRAINT_FIELDS, output_constraint
from splitserve.router.openai.tools import TOOL_FIELDS, ToolChoice, parse_tool_choice, template_tools, tool_grammar
from splitserve.router.readiness import Readiness
from splitserve.router.request import RequestFailed
from splitserve.router.status import status_details
from splitserve.router.tenants import PRIORITY_KEY
from splitserve.runtime import tracing
from splitserve.runtime.tls import RELOAD_CHECK_S, ReloadingSSLContext

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
_INT32 = 2**31

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# OpenAI field -> GenerateRequest sampling field. Extensions beyond OpenAI's API
# (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, the guided_*
# constraints) are the ones vLLM accepts too, spelled as vLLM spells them.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed")
_COMMON = {
    "model",
    "user",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logprobs",
    "request_id",
    "ignore_eos",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    *CONSTRAINT_FIELDS,
    *_FLOATS,
    *_INTS,
}
_KNOWN = {  # by chat or not
    True: _COMMON | {"messages", "top_logprobs", *TOOL_FIELDS},
    False: _COMMON | {"prompt", "echo"},
}
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
_MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's bounds)


class OpenAIRequest(NamedTuple):
    """A checked OpenAI body: the request to run, and how to answer it."""

    generate: pb.GenerateRequest
    stream: bool
    include_usage: bool  # a last chunk with usage (streaming only)
    shape: Shape = Shape(chat=True)  # the choices' form: tool calls, logprobs, echo
    continuous_usage: bool = False  # usage on every chunk too (vLLM's continuous_usage_stats)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", retry_after_s: float | None = None
) -> web.Response:
    # json.dumps escapes non-ASCII, so a client's lone surrogate quoted back cannot break the encoding;
    # the length is bounded as gRPC's is, the same message either way
    body = {"error": {"message": status_details(message), "type": kind, "code": status}}
    headers = {"Retry-After": str(math.ceil(retry_after_s))} if retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)


def _failed(e: RequestFailed, kind: str = "invalid_request_error") -> web.Response:
    return _error(_HTTP_STATUS.get(e.code, 500), str(e), kind, e.retry_after_s)


def _token_ids(prompt: list[Any], vocab_size: int | None) -> list[int]:
    limit = vocab_size if vocab_size is not None else _INT32
    if all(type(t) is int for t in prompt) and 0 <= min(prompt) and max(prompt) < limit:
        return prompt
    for i, t in enumerate(prompt):  # only to name the bad one
        if type(t) is not int:
            raise BadRequest(f"prompt[{i}]: must be a token id (an integer)")
        if not 0 <= t < limit:
            what = "the vocabulary" if vocab_size is not None else "the token id range"
            raise BadRequest(f"prompt[{i}]: {t} is outside {what} [0, {limit})")
    raise AssertionError("unreachable")


def _prompt(req: pb.GenerateRequest, fields: dict[str, Any], vocab_size: int | None) -> None:
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        req.text = string(prompt, "prompt")
    elif isinstance(prompt, list) and prompt:
        req.token_ids.ids.extend(_token_ids(prompt, vocab_size))
    else:
        raise BadRequest("prompt: must be a string or a non-empty list of token ids")


def _sampling(sp: pb.SamplingParams, fields: dict[str, Any]) -> None:
    for name in _FLOATS:
        if name in fields:
            set_field(sp, name, number(fields[name], name), name)
    for name in _INTS:
        if name in fields:
            set_field(sp, name, integer(fields[name], name, integral_floats=True), name)
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if name in fields:
            set_field(sp, "max_tokens", integer(fields[name], name), name)
            break
    if "ignore_eos" in fields:
        sp.ignore_eos = boolean(fields["ignore_eos"], "ignore_eos")
    if "stop" in fields:
        stop = fields["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("stop: must be a string or a list of strings")
        sp.stop.extend(string(s, "stop" if isinstance(stop, str) else f"stop[{i}]") for i, s in enumerate(stops))
    if "n" in fields:
        set_field(sp, "n", bounded(fields["n"], "n", 1), "n")  # the upper bound is the server's (validation)
    if "min_tokens" in fields:
        set_field(sp, "min_tokens", bounded(fields["min_tokens"], "min_tokens", 0), "min_tokens")


def _token_lists(sp: pb.SamplingParams, fields: dict[str, Any], vocab_size: int | None) -> None:
    """stop_token_ids and logit_bias: token ids, each in the vocabulary (when it is known here)."""
    limit = vocab_size if vocab_size is not None else _INT32
    if "stop_token_ids" in fields:
        ids = fields["stop_token_ids"]
        if not isinstance(ids, list):
            raise BadRequest("stop_token_ids: must be a list of token ids")
        for i, t in enumerate(ids):
            sp.stop_token_ids.append(bounded(t, f"stop_token_ids[{i}]", 0, limit - 1))
    if "logit_bias" in fields:
        bias = fields["logit_bias"]
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias: must be an object of token id -> bias")
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else -1
            if not 0 <= token < limit:
                raise BadRequest(f"logit_bias: key {key[:32]!r} is not a token id in [0, {limit})")
            b = number(value, f"logit_bias[{key!r}]")
            if not -100 <= b <= 100:
                raise BadRequest(f"logit_bias[{key!r}]: must be in [-100, 100], got {b:g}")
            sp.logit_bias[token] = b


def _logprobs(req: pb.GenerateRequest, fields: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """Whether log-probabilities are asked for, and how many alternatives each token's come with:
    chat's logprobs (a boolean) and top_logprobs, completions' logprobs (a count; echo adds the
    prompt's)."""
    if chat:
        on = boolean(fields["logprobs"], "logprobs") if "logprobs" in fields else False
        top = 0
        if "top_logprobs" in fields:
            top = bounded(fields["top_logprobs"], "top_logprobs", 0, _MAX_TOP_LOGPROBS[True])
            if not on:
                raise BadRequest("top_logprobs: needs logprobs: true")
    else:
        v = fields.get("logprobs", False)
        on = v is not False
        top = int(v) if isinstance(v, bool) else bounded(v, "logprobs", 0, _MAX_TOP_LOGPROBS[False])
        if on and fields.get("echo") is True:
            req.sampling.prompt_logprobs = top + 1  # the prompt token's own and `top` others
    if on:
        req.sampling.logprobs = True
    if top:
        req.sampling.top_logprobs = top
    return on, top


def _constraint(sp: pb.SamplingParams, fields: dict[str, Any], tools: ToolChoice | None) -> None:
    """The output constraint: response_format or a guided_* field, or the one a forced tool call
    puts (only one of them)."""
    found = output_constraint(fields)
    forced = tool_grammar(tools) if tools is not None else None
    if found is not None and forced is not None:
        raise BadRequest(f"tool_choice and {found[0]}: only one output constraint per request")
    grammar = forced if forced is not None else found[1] if found is not None else None
    if grammar is not None:
        sp.grammar.CopyFrom(grammar)


def _stream_options(fields: dict[str, Any]) -> dict[str, bool]:
    opts = fields.get("stream_options", {})
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: must be an object")
    unknown = set(opts) - _STREAM_OPTIONS
    if unknown:
        raise BadRequest(f"stream_options: unsupported field(s) {sorted(unknown)!r}")
    return {k: boolean(v, f"stream_options.{k}") for k, v in opts.items() if v is not None}


def _echo(req: pb.GenerateRequest, fields: dict[str, Any], decode: Callable[[list[int]], str] | None) -> str | None:
    """completions' echo: the prompt's text, to put before each choice's."""
    if "echo" not in fields or not boolean(fields["echo"], "echo"):
        return None
    if req.WhichOneof("prompt") == "text":
        return req.text
    return decode(list(req.token_ids.ids)) if decode is not None else ""


def from_openai(
    body: Any,
    chat: bool,
    vocab_size: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    tool_format: ToolCallFormat | None = None,
) -> OpenAIRequest:
    """An OpenAI JSON body -> the request to run; BadRequest names the field that is wrong.

    Every value is checked before it goes into the protobuf, so what comes out
    serialises; `null` counts as absent, as in OpenAI's API. `decode` gives a token-id
    prompt's text for echo; `tool_format`, the syntax the model's chat template teaches (None
    where it takes no tools).
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - _KNOWN[chat]
    if unknown:
        raise BadRequest(f"unsupported field(s): {sorted(unknown)!r}")  # repr: a surrogate in a key stays printable
    fields = {k: v for k, v in body.items() if v is not None}
    for name in ("model", "user"):  # not used, but a wrong type is still a wrong body
        if name in fields:
            string(fields[name], name)
    req = pb.GenerateRequest()
    req.request_id = string(fields["request_id"], "request_id") if "request_id" in fields else ""
    req.request_id = req.request_id or f"http-{uuid.uuid4().hex}"
    tools = parse_tool_choice(fields) if chat else None
    if tools is not None and tool_format is not None:
        tools = dataclasses.replace(tools, template_format=tool_format.name)
        req.chat.tools_json = unicode(json.dumps(template_tools(tools), ensure_ascii=False), "tools")
    if chat:
        for message in chat_messages(fields.get("messages"), tools):
            req.chat.messages.add(**message)
    else:
        _prompt(req, fields, vocab_size)
    _sampling(req.sampling, fields)
    _token_lists(req.sampling, fields, vocab_size)
    logprobs, top = _logprobs(req, fields, chat)
    _constraint(req.sampling, fields, tools)
    opts = _stream_options(fields)
    req.stream_options.continuous_usage = opts.get("continuous_usage_stats", False)
    stream = boolean(fields.get("stream", False), "stream")
    include_usage = stream and opts.get("include_usage", False)
    shape = Shape(chat, tools, logprobs, top, None if chat else _echo(req, fields, decode))
    return OpenAIRequest(req, stream, include_usage, shape, include_usage and req.stream_options.continuous_usage)


class OpenAIServer:
    def __init__(
        self,
        generation: Any,
        model_name: str,
        ready: Callable[[], Readiness],
        registry: CollectorRegistry,
        may_read_metrics: Callable[[str | None], bool],
    ) -> None:
        self.generation = generation  # router.server.GenerationService
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
    async def _require_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every route behind the key but /health (router/auth.py), an unknown path too: without
        the key, 401 is all a stranger learns. /metrics also answers --metrics-key
        (`may_read_metrics`)."""
        if request.path in OPEN_HTTP_PATHS or not self.generation.keys.required:
            return cast(web.StreamResponse, await handler(request))
        authorization = request.headers.get("Authorization")
        if request.path == "/metrics":
            allowed = self.may_read_metrics(authorization)
        else:
            allowed = self.generation.keys.tenant(authorization) is not None
        if not allowed:
            return _error(401, UNAUTHENTICATED, "authentication_error")
        return cast(web.StreamResponse, await handler(request))

    async def start(self, host: str, port: int, tls: ReloadingSSLContext | None = None) -> int:
        """Listen (HTTPS with `tls`, its certificate followed as it rotates); the bound port."""
        # handler_cancellation: a client that disconnects cancels its handler at once, wherever it
        # waits (for the next token, or for a whole answer), which cancels the worker calls
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls.context if tls is not None else None)
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
        body: dict[str, Any] = {"status": "ok"} if r.ready else {"status": r.code, "reason": r.reason}
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

    async def _read(self, request: web.Request) -> Any:
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

    def _translate(self, body: Any, chat: bool) -> OpenAIRequest:
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
            resp = _error(e.status, str(e))
            if e.close:
                resp.force_close()
            return resp
        except BadRequest as e:
            return _error(400, str(e))
        except RequestFailed as e:  # a grammar that does not compile too: "sampling.grammar: ...", 400
            return _failed(e)
        try:
            if oreq.stream:
                return await self._stream(request, admitted, oreq)
            return await self._whole(admitted, oreq)
        finally:  # (the stream gives it back itself; this is for an answer that never started one)
            self.generation.release(admitted)

    async def _whole(self, run: Any, oreq: OpenAIRequest) -> web.Response:
        created = int(time.time())
        rid, chat = oreq.generate.request_id, oreq.shape.chat
        answer = Answer(oreq.shape, self.token_text)
        pieces: list[Piece] = []
        try:
            async with contextlib.aclosing(self.generation.stream(run)) as responses:
                async for r in responses:
                    pieces.append(answer.update(r))
        except RequestFailed as e:
            return _failed(e, "server_error")
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
                "usage": _usage(answer.usage),
            }
        )

    async def _stream(self, request: web.Request, run: Any, oreq: OpenAIRequest) -> web.StreamResponse:
        rid = oreq.generate.request_id
        async with contextlib.aclosing(self.generation.stream(run)) as responses:
            # Nothing is sent before a decode worker has taken the request: one that fails before
            # (no decode worker came back, a worker refused it) is answered with its own status (503
            # with a Retry-After, 400 ...), not with a 200 whose stream holds nothing but an error.
            first = asyncio.ensure_future(anext(responses, None))
            try:
                await _first_of(first, run.run.admitted.wait())
            except BaseException:
                await _settle(first)
                raise
            if first.done() and isinstance(first.exception(), RequestFailed):
                return _failed(cast(RequestFailed, first.exception()), "server_error")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            kind = "chat.completion.chunk" if oreq.shape.chat else "text_completion"
            events = _EventStream(resp, rid, kind, int(time.time()), self.model_name)
            try:
                await resp.prepare(request)
                usage, failed = await self._send_chunks(events, responses, first, oreq)
                if not failed:  # a stream that failed ends after its error event: no [DONE] says it finished
                    if oreq.include_usage:  # after every choice's last chunk
                        await events.chunk([], usage=_usage(usage))
                    await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionResetError:
                # The client went away between two writes, before its disconnect cancelled this
                # handler: leaving the `async with` closes the stream (and so the worker calls).
                # An ordinary event, not a fault: one line, no traceback.
                log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
            except asyncio.CancelledError:  # the disconnect noticed while waiting (handler cancellation)
                log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
                raise
        return resp

    async def _send_chunks(
        self,
        events: _EventStream,
        responses: AsyncIterator[pb.GenerateResponse],
        first: asyncio.Future[pb.GenerateResponse | None],
        oreq: OpenAIRequest,
    ) -> tuple[pb.Usage | None, bool]:
        """A chunk per response that adds something to its choice (and each choice's first, which
        names the role); a failure as an error event with its code. Returns the last usage the
        stream reported, and whether it failed."""
        answer = Answer(oreq.shape, self.token_text)
        try:
            try:
                r = await first
            except BaseException:
                await _settle(first)
                raise
            while r is not None:
                choice = stream_choice(answer.update(r), oreq.shape.chat)
                if choice is not None:
                    extra = {"usage": _usage(r.usage)} if oreq.continuous_usage and r.HasField("usage") else {}
                    await events.chunk([choice], **extra)
                r = await anext(responses, None)
        except RequestFailed as e:
            error = {"message": status_details(str(e)), "type": "server_error", "code": _HTTP_STATUS.get(e.code, 500)}
            await events.send({"error": error})
            return answer.usage, True
        return answer.usage, False


async def _first_of(first: asyncio.Future[Any], admitted: Coroutine[Any, Any, Any]) -> None:
    """Until the stream's first response is in (or its failure), or the request is admitted."""
    waiting = asyncio.ensure_future(admitted)
    try:
        await asyncio.wait({first, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()


async def _settle(first: asyncio.Future[Any]) -> None:
    """Cancel a pending first response and wait for it to give the stream back (the stream can
    then be closed; closing it while its first step still runs raises)."""
    first.cancel()
    with contextlib.suppress(BaseException):
        await first


async def _follow_certificate(tls: ReloadingSSLContext) -> None:
    """Load a rotated certificate into the listening context: the next handshake serves it, and
    the connections already open (their streams) keep theirs."""
    while True:
        await asyncio.sleep(RELOAD_CHECK_S)
        if tls.maybe_reload():
            log.info("TLS certificate %s reloaded", tls.files.certfile)


class _EventStream(NamedTuple):
    """One streamed answer's server-sent events, each chunk stamped with the answer's id and model."""

    resp: web.StreamResponse
    rid: str
    obj: str  # "chat.completion.chunk" or "text_completion"
    created: int
    model: str

    async def send(self, payload: dict[str, Any]) -> None:
        await self.resp.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    async def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> None:
        body = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": choices}
        await self.send(body | extra)


def _usage(u: pb.Usage | None) -> dict[str, Any]:
    u = u or pb.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
