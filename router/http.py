"""The OpenAI-compatible HTTP front door: `POST /v1/chat/completions`,
`POST /v1/completions` (streaming as server-sent events or whole), `GET
/v1/models`, `GET /health`.

Each request is translated into the public `GenerateRequest` and goes through
exactly the gRPC path: the same admission, validation, routing and streaming.
gRPC statuses map to HTTP ones (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED
504), with an OpenAI-style error body that names what is wrong.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.request import RequestFailed

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}

# OpenAI field -> GenerateRequest sampling field. Extensions beyond OpenAI's API
# (top_k, min_p, repetition_penalty, ignore_eos) are the ones vLLM accepts too.
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
}
_IGNORED = {"model", "user", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "stop",
            "logprobs", "messages", "prompt", "request_id"}


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def to_generate_request(body: Any, chat: bool) -> pb.GenerateRequest:
    """OpenAI JSON -> GenerateRequest; BadRequest names the field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - set(_SAMPLING) - _IGNORED
    if unknown:
        raise BadRequest(f"unsupported field(s): {sorted(unknown)}")
    if body.get("n", 1) != 1:
        raise BadRequest("n: only n=1 is supported")
    req = pb.GenerateRequest(request_id=str(body.get("request_id") or f"http-{uuid.uuid4().hex}"))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]: must be an object with string role and content")
            req.chat.messages.add(role=m["role"], content=m["content"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            req.token_ids.ids.extend(prompt)
        else:
            raise BadRequest("prompt: must be a string or a non-empty list of token ids")
    sp = req.sampling
    for src, dst in _SAMPLING.items():
        if src in body and body[src] is not None:
            v = body[src]
            want = bool if dst == "ignore_eos" else (int if dst in ("top_k", "seed") else float)
            if want is bool and not isinstance(v, bool) or want is not bool and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise BadRequest(f"{src}: must be a {want.__name__}")
            if want is int and not float(v).is_integer():
                raise BadRequest(f"{src}: must be an integer")
            try:
                setattr(sp, dst, want(v))
            except (ValueError, OverflowError):
                raise BadRequest(f"{src}: out of range") from None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise BadRequest("max_tokens: must be an integer")
        try:
            sp.max_tokens = max_tokens
        except ValueError:
            raise BadRequest("max_tokens: out of range") from None
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("stop: must be a string or a list of strings")
        sp.stop.extend(stops)
    if body.get("logprobs"):
        sp.logprobs = True
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: must be an object")
    req.stream_options.continuous_usage = bool(opts.get("continuous_usage_stats", False))
    return req


class OpenAIServer:
    def __init__(self, generation: Any, model_name: str) -> None:
        self.generation = generation  # router.server.GenerationService
        self.model_name = model_name
        self.app = web.Application(client_max_size=8 * 1024 * 1024)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "splitserve"}]})

    async def health(self, request: web.Request) -> web.Response:
        healthy = bool(self.generation.workers.decode_loads())
        return web.json_response({"status": "ok" if healthy else "no healthy decode worker"}, status=200 if healthy else 503)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON")
        try:
            greq = to_generate_request(body, chat)
            run = self.generation.admit(greq, request.headers.get("Authorization"), None)
        except BadRequest as e:
            return _error(400, str(e))
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 500), str(e))
        rid = greq.request_id
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            return await self._stream(request, run, rid, created, kind, chat,
                                      bool((body.get("stream_options") or {}).get("include_usage")))
        text, tokens, logprobs, finish, usage = [], 0, [], None, None
        try:
            async for r in self.generation.stream(run):
                text.append(r.text)
                tokens += len(r.token_ids)
                logprobs.extend(r.logprobs)
                finish = _FINISH.get(r.finish_reason, finish)
                if r.HasField("usage"):
                    usage = r.usage
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 500), str(e), "server_error")
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        if logprobs:
            choice["logprobs"] = {"token_logprobs": logprobs}
        return web.json_response({
            "id": rid, "object": kind, "created": created, "model": self.model_name,
            "choices": [choice], "usage": _usage(usage),
        })

    async def _stream(self, request: web.Request, run: Any, rid: str, created: int, kind: str, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = kind + (".chunk" if chat else "")
        usage = None

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

        first = True
        try:
            async for r in self.generation.stream(run):
                if r.HasField("usage"):
                    usage = r.usage
                finish = _FINISH.get(r.finish_reason)
                if not r.text and finish is None and not first:
                    continue
                if chat:
                    delta: dict[str, Any] = {"content": r.text}
                    if first:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": r.text, "finish_reason": finish}
                first = False
                await send({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]})
        except RequestFailed as e:
            await send({"error": {"message": str(e), "type": "server_error", "code": _HTTP_STATUS.get(e.code, 500)}})
        if include_usage:
            await send({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                        "usage": _usage(usage)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(u: pb.Usage | None) -> dict[str, Any]:
    u = u or pb.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
