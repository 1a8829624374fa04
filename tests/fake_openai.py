"""A fake OpenAI-compatible server (not splitserve) for testing `bench serve`
against known timings: an aiohttp app that streams server-sent events on a
fixed script.

Every streamed answer: the first chunk after `ttft_s`, then one chunk every
`gap_s`; the chunks carry `chunk_tokens` tokens each (one carrying several, as
a server that batches does) until `max_tokens` is reached, and a last chunk
has the usage when asked. The request that arrives `fail_index`-th (from 0) is
answered with HTTP 500, so failures are counted too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

MODEL = "fake-model"


@dataclass(frozen=True)
class FakeScript:
    ttft_s: float = 0.05
    gap_s: float = 0.02
    chunk_tokens: tuple[int, ...] = (1, 3)  # tokens per chunk, the last entry repeated: 1, 3, 3, ...
    prompt_tokens: int = 7  # the usage every answer reports
    cached_tokens: int = 4  # ... and of them, found in the prefix cache
    fail_index: int | None = 2

    def chunks(self, max_tokens: int) -> list[int]:
        """Tokens per chunk for an answer of `max_tokens` tokens."""
        out: list[int] = []
        while sum(out) < max_tokens:
            want = self.chunk_tokens[min(len(out), len(self.chunk_tokens) - 1)]
            out.append(min(want, max_tokens - sum(out)))
        return out


class FakeOpenAI:
    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []  # every request body received, in order
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
            ]
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        if index == self.script.fail_index:
            return web.json_response({"error": {"message": "scripted failure", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        chunks = self.script.chunks(int(body["max_tokens"]))
        if chat:  # OpenAI's first chat chunk: the role, no content (not output: TTFT does not end here)
            await send({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i, n in enumerate(chunks):
            await asyncio.sleep(self.script.ttft_s if i == 0 else self.script.gap_s)
            piece = " tok" * n
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            await send({"object": "chunk", "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": self.script.prompt_tokens,
                "completion_tokens": sum(chunks),
                "prompt_tokens_details": {"cached_tokens": self.script.cached_tokens},
            }
            await send({"object": "chunk", "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextmanager
def running_fake(script: FakeScript) -> Iterator[tuple[str, FakeOpenAI]]:
    """The fake serving on a free local port in a thread of its own; yields (base URL, the fake)."""
    fake = FakeOpenAI(script)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    runner = web.AppRunner(fake.app)

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(int(runner.addresses[0][1]))
        ready.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the fake OpenAI server did not start")
    try:
        yield f"http://127.0.0.1:{port[0]}", fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
