"""The OpenAI-compatible HTTP front door over the router's own path, against
fake workers on real gRPC: whole and streamed answers, usage, and each bad
input answered 400 with the field named (and 401/429 where they apply)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from splitserve.router.config import RouterConfig
from splitserve.router.fakes import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)

ANSWER = "Hello, world! The end."
SCRIPT = list(ANSWER.encode())


async def with_http(body, token_delay_s: float = 0.0, **cfg_kw):
    kv = FakeKVPlane()
    d = FakeDecodeWorker(kv, SCRIPT, worker_id="d0", token_delay_s=token_delay_s)
    p = FakePrefillWorker(kv, SCRIPT, worker_id="p0")
    await d.start()
    await p.start()
    cfg = RouterConfig(host="127.0.0.1", grpc_port=0, http_port=0, stats_interval_s=0.05, **cfg_kw)
    router = Router(cfg, ByteTokenizer(), decode=[d.address], prefill=[p.address], rng=random.Random(0))
    await router.start()
    await router.wait_for_workers()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as session:
            return await body(session)
    finally:
        await router.stop(0)
        await d.stop()
        await p.stop()


def run(body, **kw):
    return asyncio.run(with_http(body, **kw))


def test_chat_completion_whole_answer_with_usage():
    async def body(s):
        async with s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}) as r:
            return r.status, await r.json()

    status, out = run(body)
    assert status == 200
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] >= len(SCRIPT)  # the script, and the fake's EOS


def test_completion_streamed_as_server_sent_events():
    async def body(s):
        payload = {"prompt": "Say hello", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post("/v1/completions", json=payload) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return [line for line in (await r.text()).split("\n") if line.startswith("data: ")]

    lines = run(body)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: "):]) for x in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == ANSWER
    assert chunks[-1]["usage"]["completion_tokens"] >= len(SCRIPT)


def test_stop_string_over_http():
    async def body(s):
        async with s.post("/v1/completions", json={"prompt": "x", "stop": [", world"], "max_tokens": 64}) as r:
            return await r.json()

    out = run(body)
    assert out["choices"][0]["text"] == "Hello"
    assert out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "secret_internal": 1}, "secret_internal"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ],
)
def test_bad_input_is_400_naming_the_field(payload, field):
    async def body(s):
        async with s.post("/v1/chat/completions", json=payload) as r:
            return r.status, await r.json()

    status, out = run(body)
    assert status == 400
    assert field in out["error"]["message"]


def test_malformed_json_is_400():
    async def body(s):
        async with s.post("/v1/chat/completions", data=b"{not json") as r:
            return r.status

    assert run(body) == 400


def test_api_key_required_when_configured():
    async def body(s):
        msg = {"messages": [{"role": "user", "content": "hi"}]}
        async with s.post("/v1/chat/completions", json=msg) as r1:
            async with s.post("/v1/chat/completions", json=msg, headers={"Authorization": "Bearer k"}) as r2:
                return r1.status, r2.status

    assert run(body, api_key="k") == (401, 200)


def test_overload_is_429():
    msg = {"messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def body(s):
        async with s.post("/v1/chat/completions", json=msg) as first:
            await first.content.readline()  # the first request is in flight and streaming
            async with s.post("/v1/chat/completions", json=msg) as second:
                return first.status, second.status, (await second.json())["error"]["message"]

    first, second, why = run(body, max_inflight=1, token_delay_s=0.05)
    assert (first, second) == (200, 429)
    assert "in flight" in why


def test_models_and_health():
    async def body(s):
        async with s.get("/v1/models") as m, s.get("/health") as h:
            return (await m.json())["data"][0]["id"], h.status

    assert run(body, model_name="smollm2") == ("smollm2", 200)
