"""The OpenAI-compatible HTTP front door: `POST /v1/chat/completions`,
`POST /v1/completions` (streaming as server-sent events or whole), `GET
/v1/models`, `GET /health` (200 once ready, router/readiness.py; 503 naming
what it waits for; either naming the workers that do not answer), `GET
/metrics` (the router's Prometheus metrics).

Each request is translated into the public `GenerateRequest` and goes through
exactly the gRPC path: the same admission, validation, routing and streaming.
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
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.json_body import BodyError, parse_json_body
from splitserve.router.readiness import Readiness
from splitserve.router.request import RequestFailed
from splitserve.router.status import status_details
from splitserve.runtime import tracing

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
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}

# OpenAI field -> GenerateRequest sampling field. Extensions beyond OpenAI's API
# (top_k, min_p, repetition_penalty, ignore_eos) are the ones vLLM accepts too.
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
    *_FLOATS,
    *_INTS,
}
_KNOWN = {True: _COMMON | {"messages"}, False: _COMMON | {"prompt"}}  # by chat or not
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


class BadRequest(Exception):
    pass


class OpenAIRequest(NamedTuple):
    """A checked OpenAI body: the request to run, and how to answer it."""

    generate: pb.GenerateRequest
    stream: bool
    include_usage: bool  # a last chunk with usage (streaming only)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    # json.dumps escapes non-ASCII, so a client's lone surrogate quoted back cannot break the encoding;
    # the length is bounded as gRPC's is, the same message either way
    body = {"error": {"message": status_details(message), "type": kind, "code": status}}
    return web.json_response(body, status=status)


# ---- one field each: type, then what protobuf can hold


def _string(v: Any, field: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{field}: must be a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate from a JSON "\ud800": protobuf cannot encode it
        raise BadRequest(f"{field}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return v


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{field}: must be a boolean")
    return v


def _number(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{field}: must be a number")
    try:
        f = float(v)
    except OverflowError:
        raise BadRequest(f"{field}: out of range") from None
    if not math.isfinite(f):  # a JSON number too large for a float parses as infinity
        raise BadRequest(f"{field}: must be finite")
    return f


def _integer(v: Any, field: str, integral_floats: bool = False) -> int:
    if integral_floats and isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{field}: must be an integer")
    return v


def _set(msg: Any, name: str, value: Any, field: str) -> None:
    """Set a protobuf scalar; one out of the field's range (int32, int64) is the client's error."""
    try:
        setattr(msg, name, value)
    except (ValueError, OverflowError, TypeError):
        raise BadRequest(f"{field}: out of range") from None


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


def _prompt(req: pb.GenerateRequest, fields: dict[str, Any], chat: bool, vocab_size: int | None) -> None:
    if chat:
        messages = fields.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]: must be an object with string role and content")
            req.chat.messages.add(
                role=_string(m["role"], f"messages[{i}].role"), content=_string(m["content"], f"messages[{i}].content")
            )
        return
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        req.text = _string(prompt, "prompt")
    elif isinstance(prompt, list) and prompt:
        req.token_ids.ids.extend(_token_ids(prompt, vocab_size))
    else:
        raise BadRequest("prompt: must be a string or a non-empty list of token ids")


def _sampling(sp: pb.SamplingParams, fields: dict[str, Any]) -> None:
    for name in _FLOATS:
        if name in fields:
            _set(sp, name, _number(fields[name], name), name)
    for name in _INTS:
        if name in fields:
            _set(sp, name, _integer(fields[name], name, integral_floats=True), name)
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if name in fields:
            _set(sp, "max_tokens", _integer(fields[name], name), name)
            break
    if "ignore_eos" in fields:
        sp.ignore_eos = _bool(fields["ignore_eos"], "ignore_eos")
    if "stop" in fields:
        stop = fields["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("stop: must be a string or a list of strings")
        sp.stop.extend(_string(s, "stop" if isinstance(stop, str) else f"stop[{i}]") for i, s in enumerate(stops))
    if "logprobs" in fields:
        # chat sends a boolean; the legacy completions API a count of top log-probabilities
        # (the chosen token's is all this server returns)
        v = fields["logprobs"]
        if not isinstance(v, bool) and _integer(v, "logprobs") < 0:
            raise BadRequest("logprobs: must be a boolean or a non-negative integer")
        if v:
            sp.logprobs = True


def _stream_options(fields: dict[str, Any]) -> dict[str, bool]:
    opts = fields.get("stream_options", {})
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: must be an object")
    unknown = set(opts) - _STREAM_OPTIONS
    if unknown:
        raise BadRequest(f"stream_options: unsupported field(s) {sorted(unknown)!r}")
    return {k: _bool(v, f"stream_options.{k}") for k, v in opts.items() if v is not None}


def from_openai(body: Any, chat: bool, vocab_size: int | None = None) -> OpenAIRequest:
    """An OpenAI JSON body -> the request to run; BadRequest names the field that is wrong.

    Every value is checked before it goes into the protobuf, so what comes out
    serialises; `null` counts as absent, as in OpenAI's API.
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - _KNOWN[chat]
    if unknown:
        raise BadRequest(f"unsupported field(s): {sorted(unknown)!r}")  # repr: a surrogate in a key stays printable
    fields = {k: v for k, v in body.items() if v is not None}
    for name in ("model", "user"):  # not used, but a wrong type is still a wrong body
        if name in fields:
            _string(fields[name], name)
    if "n" in fields and _integer(fields["n"], "n") != 1:
        raise BadRequest("n: only n=1 is supported")
    req = pb.GenerateRequest()
    req.request_id = _string(fields["request_id"], "request_id") if "request_id" in fields else ""
    req.request_id = req.request_id or f"http-{uuid.uuid4().hex}"
    _prompt(req, fields, chat, vocab_size)
    _sampling(req.sampling, fields)
    opts = _stream_options(fields)
    req.stream_options.continuous_usage = opts.get("continuous_usage_stats", False)
    stream = _bool(fields.get("stream", False), "stream")
    return OpenAIRequest(req, stream, stream and opts.get("include_usage", False))


class OpenAIServer:
    def __init__(
        self, generation: Any, model_name: str, ready: Callable[[], Readiness], registry: CollectorRegistry
    ) -> None:
        self.generation = generation  # router.server.GenerationService
        self.model_name = model_name
        self.ready = ready  # Router.readiness
        self.registry = registry  # the router's metrics
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
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

    async def start(self, host: str, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler at once, wherever it
        # waits (for the next token, or for a whole answer), which cancels the worker calls
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return int(self._runner.addresses[0][1])  # the bound port (port 0 picks one)

    async def stop(self) -> None:
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

    def _translate(self, body: Any, chat: bool) -> OpenAIRequest:
        try:
            return from_openai(body, chat, self.generation.tokenizer.vocab_size)
        except BadRequest:
            raise
        except Exception as e:  # a check from_openai lacks; still the client's body, but worth a look
            log.warning("an HTTP body failed translation outside the checks", exc_info=True)
            raise BadRequest(f"request: not a valid request ({type(e).__name__})") from None

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        try:
            self.generation.check_key(authorization)  # before reading: a stranger's body is not parsed
            oreq = self._translate(await self._read(request), chat)
            trace_parent = tracing.extract(request.headers)  # the client's traceparent, if it sent one
            run = self.generation.admit(oreq.generate, authorization, None, trace_parent, front_door="http")
        except BodyError as e:
            resp = _error(e.status, str(e))
            if e.close:
                resp.force_close()
            return resp
        except BadRequest as e:
            return _error(400, str(e))
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 500), str(e))
        rid = oreq.generate.request_id
        kind = "chat.completion" if chat else "text_completion"
        if oreq.stream:
            return await self._stream(request, run, rid, kind, chat, oreq.include_usage)
        return await self._whole(run, rid, kind, chat)

    async def _whole(self, run: Any, rid: str, kind: str, chat: bool) -> web.Response:
        created = int(time.time())
        text, logprobs, finish, usage = [], [], None, None
        try:
            async with contextlib.aclosing(self.generation.stream(run)) as responses:
                async for r in responses:
                    text.append(r.text)
                    logprobs.extend(r.logprobs)
                    finish = _FINISH.get(r.finish_reason, finish)
                    if r.HasField("usage"):
                        usage = r.usage
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 500), str(e), "server_error")
        except asyncio.CancelledError:  # the client went away while the answer was being made
            log.info("request %s: the client disconnected before its answer; request cancelled", rid)
            raise
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        if logprobs:
            choice["logprobs"] = {"token_logprobs": logprobs}
        return web.json_response(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage(usage),
            }
        )

    async def _stream(
        self, request: web.Request, run: Any, rid: str, kind: str, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        events = _EventStream(resp, rid, kind + (".chunk" if chat else ""), int(time.time()), self.model_name)
        try:
            await resp.prepare(request)
            usage = await self._send_chunks(events, run, chat)
            if include_usage:
                await events.chunk([], usage=_usage(usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away between two writes, before its disconnect cancelled this
            # handler: leaving the `async with` closed the stream (and so the worker calls).
            # An ordinary event, not a fault: one line, no traceback.
            log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
        except asyncio.CancelledError:  # the disconnect noticed while waiting (handler cancellation)
            log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
            raise
        return resp

    async def _send_chunks(self, events: _EventStream, run: Any, chat: bool) -> pb.Usage | None:
        """A chunk per response with text or a finish (and the first, which names the role); a
        failure as an error event. Returns the last usage the stream reported."""
        usage = None
        first = True
        try:
            async with contextlib.aclosing(self.generation.stream(run)) as responses:
                async for r in responses:
                    if r.HasField("usage"):
                        usage = r.usage
                    finish = _FINISH.get(r.finish_reason)
                    if not r.text and finish is None and not first:
                        continue
                    await events.chunk([_stream_choice(r.text, finish, chat, first)])
                    first = False
        except RequestFailed as e:
            error = {"message": status_details(str(e)), "type": "server_error", "code": _HTTP_STATUS.get(e.code, 500)}
            await events.send({"error": error})
        return usage


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


def _stream_choice(text: str, finish: str | None, chat: bool, first: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish}
    delta: dict[str, Any] = {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "finish_reason": finish}


def _usage(u: pb.Usage | None) -> dict[str, Any]:
    u = u or pb.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
