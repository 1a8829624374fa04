"""A streamed answer: OpenAI's server-sent events, a chunk per response that adds something to
its choice (router/openai/choices.py), then a usage chunk where asked and `data: [DONE]`; a
failure mid-stream ends it with an error event (router/openai/errors.py) and no [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from aiohttp import web

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.choices import Answer, stream_choice, usage_json
from splitserve.router.openai.errors import error_body, failed_response, status_of
from splitserve.router.openai.json_value import JsonObject, JsonValue
from splitserve.router.openai.translate import OpenAIRequest
from splitserve.router.request import RequestFailed

log = logging.getLogger(__name__)


async def stream_answer(
    request: web.Request,
    responses: AsyncIterator[pb.GenerateResponse],
    admitted: asyncio.Event,
    oreq: OpenAIRequest,
    answer: Answer,
    model: str,
) -> web.StreamResponse:
    """The answer to `request` as server-sent events, from the admitted request's `responses`;
    `admitted` is set once a decode worker has taken the request."""
    rid = oreq.generate.request_id
    # Nothing is sent before a decode worker has taken the request: one that fails before
    # (no decode worker came back, a worker refused it) is answered with its own status (503
    # with a Retry-After, 400 ...), not with a 200 whose stream holds nothing but an error.
    first = asyncio.ensure_future(anext(responses, None))
    try:
        await _first_of(first, admitted)
    except BaseException:
        await _settle(first)
        raise
    failure = first.exception() if first.done() else None
    if isinstance(failure, RequestFailed):
        return failed_response(failure, "server_error")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    kind = "chat.completion.chunk" if oreq.shape.chat else "text_completion"
    events = _EventStream(resp, rid, kind, int(time.time()), model)
    try:
        await resp.prepare(request)
        usage, failed = await _send_chunks(events, responses, first, oreq, answer)
        if not failed:  # a stream that failed ends after its error event: no [DONE] says it finished
            if oreq.include_usage:  # after every choice's last chunk
                await events.chunk([], usage=usage_json(usage))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away between two writes, before its disconnect cancelled this
        # handler: the door's `async with` closes the stream (and so the worker calls).
        # An ordinary event, not a fault: one line, no traceback.
        log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
    except asyncio.CancelledError:  # the disconnect noticed while waiting (handler cancellation)
        log.info("request %s: the client disconnected mid-stream; request cancelled", rid)
        raise
    return resp


async def _send_chunks(
    events: _EventStream,
    responses: AsyncIterator[pb.GenerateResponse],
    first: asyncio.Future[pb.GenerateResponse | None],
    oreq: OpenAIRequest,
    answer: Answer,
) -> tuple[pb.Usage | None, bool]:
    """A chunk per response that adds something to its choice (and each choice's first, which
    names the role); a failure as an error event with its code. Returns the last usage the
    stream reported, and whether it failed."""
    try:
        try:
            r = await first
        except BaseException:
            await _settle(first)
            raise
        while r is not None:
            choice = stream_choice(answer.update(r), oreq.shape.chat)
            if choice is not None:
                extra: JsonObject = (
                    {"usage": usage_json(r.usage)} if oreq.continuous_usage and r.HasField("usage") else {}
                )
                await events.chunk([choice], **extra)
            r = await anext(responses, None)
    except RequestFailed as e:
        await events.send(error_body(status_of(e), str(e), "server_error"))
        return answer.usage, True
    return answer.usage, False


async def _first_of(first: asyncio.Future[pb.GenerateResponse | None], admitted: asyncio.Event) -> None:
    """Until the stream's first response is in (or its failure), or the request is admitted."""
    waiting = asyncio.ensure_future(admitted.wait())
    # asyncio.wait takes one kind of future: the union names both
    either: set[asyncio.Future[pb.GenerateResponse | None] | asyncio.Task[bool]] = {first, waiting}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()


async def _settle(first: asyncio.Future[pb.GenerateResponse | None]) -> None:
    """Cancel a pending first response and wait for it to give the stream back (the stream can
    then be closed; closing it while its first step still runs raises)."""
    first.cancel()
    with contextlib.suppress(BaseException):
        await first


class _EventStream(NamedTuple):
    """One streamed answer's server-sent events, each chunk stamped with the answer's id and model."""

    resp: web.StreamResponse
    rid: str
    obj: str  # "chat.completion.chunk" or "text_completion"
    created: int
    model: str

    async def send(self, payload: JsonObject) -> None:
        await self.resp.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    async def chunk(self, choices: list[JsonObject], **extra: JsonValue) -> None:
        body: JsonObject = {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        await self.send(body | extra)
