"""The OpenAI-compatible HTTP front door over the router's own path, against
fake workers on real gRPC: whole and streamed answers, usage, and each bad
input answered 400 with the field named (and 401/429 where they apply)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import replace

import aiohttp
import pytest

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Deadlines, Limits, Listeners, RouterConfig
from splitserve.router.openai.json_body import nesting_depth
from splitserve.router.openai.translate import from_openai
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)

ANSWER = "Hello, world! The end."
SCRIPT = list(ANSWER.encode())
FAST = Deadlines(stats_interval_s=0.05)
LOCAL = Listeners(host="127.0.0.1", grpc_port=0, http_port=0)


async def with_http(body, token_delay_s: float = 0.0, **sections):
    kv = FakeKVPlane()
    d = FakeDecodeWorker(kv, SCRIPT, worker_id="d0", token_delay_s=token_delay_s)
    p = FakePrefillWorker(kv, SCRIPT, worker_id="p0")
    await d.start()
    await p.start()
    cfg = RouterConfig(**{"deadlines": FAST, "listeners": LOCAL, **sections})
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
        async with s.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
        ) as r:
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
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
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
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
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

    assert run(body, listeners=replace(LOCAL, api_key="k")) == (401, 200)


def test_overload_is_429():
    msg = {"messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def body(s):
        async with s.post("/v1/chat/completions", json=msg) as first:
            await first.content.readline()  # the first request is in flight and streaming
            async with s.post("/v1/chat/completions", json=msg) as second:
                return first.status, second.status, (await second.json())["error"]["message"]

    first, second, why = run(body, limits=Limits(max_inflight=1), token_delay_s=0.05)
    assert (first, second) == (200, 429)
    assert "in flight" in why


def test_models_and_health():
    async def body(s):
        async with s.get("/v1/models") as m, s.get("/health") as h:
            return (await m.json())["data"][0]["id"], h.status

    assert run(body, listeners=replace(LOCAL, model_name="smollm2")) == ("smollm2", 200)


def test_metrics_serve_the_workers_request_series_as_the_client_saw_them():
    """After one request, the router's /metrics has the workers' (vLLM's) names, labelled role=router."""
    from prometheus_client.parser import text_string_to_metric_families

    async def body(s):
        async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}) as r:
            assert r.status == 200, await r.text()
        async with s.get("/metrics") as r:
            return await r.text()

    samples = {
        (x.name, x.labels.get("finished_reason")): (x.labels, x.value)
        for family in text_string_to_metric_families(run(body))
        for x in family.samples
    }
    labels, ttft_count = samples[("splitserve:time_to_first_token_seconds_count", None)]
    assert ttft_count >= 1
    assert labels == {"model_name": "splitserve", "role": "router", "worker_id": "router-0"}
    for name in ("request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert samples[(f"splitserve:{name}_count", None)][1] == 1
    assert samples[("splitserve:inter_token_latency_seconds_count", None)][1] == 4
    assert samples[("splitserve:generation_tokens_total", None)][1] == 5
    assert samples[("splitserve:prompt_tokens_total", None)][1] == 2
    assert samples[("splitserve:request_success_total", "length")][1] == 1
    assert samples[("splitserve_router_ttft_seconds_count", None)][1] == 1  # the router's own, as before


# ---- no client body gets a 500: each case below was one before (a traceback, not an answer)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def post_raw(s, path: str, data: bytes, content_type: str | None = "application/json"):
    headers = {"Content-Type": content_type} if content_type is not None else {"Content-Type": ""}
    async with s.post(path, data=data, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/v1/completions", b'{"prompt": [1, 2, 2147483648]}', "prompt[2]"),  # int32 overflow in TokenIds
        ("/v1/completions", b'{"prompt": [9223372036854775808]}', "prompt[0]"),
        ("/v1/completions", b'{"prompt": [5, 258]}', "prompt[1]"),  # in int32, outside ByteTokenizer's vocabulary
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate protobuf cannot encode
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages[0].role"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["ok", "\\ud800"]}', "stop[1]"),
        ("/v1/completions", b'{"prompt": "x", "stop": "\\ud800"}', "stop"),
        ("/v1/completions", b'{"prompt": "x", "request_id": "\\ud800"}', "request_id"),
        ("/v1/completions", b'{"prompt": "x", "request_id": 7}', "request_id"),  # was str()-ed into an id
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),  # was truthy: streamed
        ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": 1}}', "include_usage"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "NaN"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "seed": 1e300}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 99999999999}', "max_tokens"),
    ],
)
def test_a_body_protobuf_cannot_hold_is_400_naming_the_field(path, raw, field):
    status, out = run(lambda s: post_raw(s, path, raw))
    assert status == 400
    assert field in out["error"]["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=foo", "application/json; charset=latin-1", "text/plain; charset="]
)
def test_a_charset_other_than_utf8_is_refused_naming_it(content_type):
    status, out = run(lambda s: post_raw(s, "/v1/chat/completions", json.dumps(CHAT).encode(), content_type))
    assert status == 415
    assert "charset" in out["error"]["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=UTF-8", 'application/json; charset="utf8"', "text/plain", None]
)
def test_utf8_or_no_charset_is_read(content_type):
    status, out = run(lambda s: post_raw(s, "/v1/chat/completions", json.dumps(CHAT).encode(), content_type))
    assert status == 200
    assert out["choices"][0]["message"]["content"] == ANSWER


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[" * 100_000, "deep"),  # was a RecursionError inside json.loads
        (b'{"prompt": "x", "user": ' + b"[" * 33 + b"]" * 33 + b"}", "deep"),  # valid JSON, just too deep
        (b'{"prompt": "\xff\xfe"}', "UTF-8"),
        (b'{"prompt": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate encoded as UTF-8 bytes (CESU-8)
        (b"", "not valid JSON"),
        (b'{"prompt": "x"', "not valid JSON"),
        (b'{"prompt": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past Python's int digit limit: ValueError
    ],
)
def test_bytes_that_are_not_utf8_json_of_bounded_depth_are_400(raw, words):
    status, out = run(lambda s: post_raw(s, "/v1/completions", raw))
    assert status == 400
    assert words in out["error"]["message"]


def test_depth_is_counted_outside_strings_only():
    brackets = "[{" * 40  # inside a string: no depth at all
    payload = {"prompt": brackets + '\\"' + brackets, "stop": ['"\\', "]]"]}
    status, out = run(lambda s: post_raw(s, "/v1/completions", json.dumps(payload).encode()))
    assert status == 200, out


def test_nesting_depth_is_exact_on_valid_json():
    rng = random.Random(7)
    pieces = ["[", "{", "\\", '"', "]", "}", "a", "\\\\", '\\"']

    def value(depth: int):
        r = rng.random()
        if depth > 8 or r < 0.3:
            return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {"".join(rng.choice(pieces) for _ in range(3)): value(depth + 1) for _ in range(rng.randint(0, 3))}

    def depth_of(v) -> int:
        if isinstance(v, list):
            return 1 + max(map(depth_of, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth_of, v.values()), default=0)
        return 0

    for _ in range(2000):
        v = value(0)
        assert nesting_depth(json.dumps(v).encode()) == depth_of(v)


def test_too_large_a_body_is_413():
    status, out = run(lambda s: post_raw(s, "/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}'))
    assert status == 413
    assert "larger than" in out["error"]["message"]


def test_the_api_key_is_checked_before_the_body_is_read():
    async def body(s):
        no_key = await post_raw(s, "/v1/completions", b"[" * 100_000)
        async with s.post("/v1/completions", data=b"[" * 100_000, headers={"Authorization": "Bearer k"}) as r:
            return no_key[0], r.status

    assert run(body, listeners=replace(LOCAL, api_key="k")) == (401, 400)


def test_a_field_of_the_other_endpoint_is_refused():
    status, out = run(lambda s: post_raw(s, "/v1/chat/completions", json.dumps({**CHAT, "prompt": "x"}).encode()))
    assert status == 400
    assert "prompt" in out["error"]["message"]


def test_from_openai_output_always_serialises():
    # the translation's contract: whatever it returns, protobuf can encode
    req = from_openai(
        {"prompt": [0, 2**31 - 1], "stop": ["é"], "seed": 2**63 - 1, "request_id": "r"}, chat=False
    ).generate
    assert pb.GenerateRequest.FromString(req.SerializeToString()) == req


# ---- a client that goes away cancels its request at once


@contextlib.asynccontextmanager
async def http_cluster(token_delay_s: float):
    kv = FakeKVPlane()
    d = FakeDecodeWorker(kv, SCRIPT, worker_id="d0", token_delay_s=token_delay_s)
    await d.start()
    cfg = RouterConfig(deadlines=FAST, listeners=LOCAL)
    router = Router(cfg, ByteTokenizer(), decode=[d.address], rng=random.Random(0))
    await router.start()
    await router.wait_for_workers()
    try:
        yield router, d
    finally:
        await router.stop(0)
        await d.stop()


async def until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def open_request(port: int, payload: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request on a raw socket, so the test decides when the connection goes away."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(payload).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize(
    "stream, token_delay_s",
    [
        (True, 30.0),  # waiting for the next token: only handler cancellation notices the disconnect
        (True, 0.005),  # tokens flowing: writes race the disconnect
        (False, 30.0),  # waiting for the whole answer
    ],
)
def test_a_client_disconnect_cancels_the_request_at_once(stream, token_delay_s, caplog):
    payload = {"prompt": "hi", "stream": stream, "ignore_eos": True, "max_tokens": 4096}

    async def scenario():
        async with http_cluster(token_delay_s) as (router, d):
            reader, writer = await open_request(router.http_port, payload)
            if stream:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200")
            await until(lambda: bool(d.active))  # (the worker may know the request by an id of the router's)
            if token_delay_s < 1:
                await until(lambda: d.tokens_sent >= 5)
            writer.close()
            t0 = time.monotonic()
            await until(lambda: router.generation.inflight == 0 and bool(d.cancelled) and not d.active, timeout_s=15.0)
            return time.monotonic() - t0

    with caplog.at_level(logging.DEBUG):
        elapsed = asyncio.run(scenario())
    # The next token is 30 s away (or the answer never ends): well under that, the disconnect itself
    # ended the request, not a write that failed. A tighter bound would time the machine (a 2 s one
    # failed once on a loaded CI machine).
    assert elapsed < 15.0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    # the disconnect is an ordinary event: said once, in one line, with no traceback
    said = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and said[0].exc_info is None, said


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decompress_is_400_and_the_server_goes_on(encoding, caplog):
    async def body(s):
        headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
        async with s.post("/v1/completions", data=b"not compressed", headers=headers) as r:
            bad = r.status, await r.json()
        async with s.post("/v1/completions", json={"prompt": "x"}) as r:
            return bad, r.status

    with caplog.at_level(logging.WARNING):
        (status, out), after = run(body)
    assert (status, after) == (400, 200)
    assert encoding in out["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_continuous_usage_stats_puts_usage_on_every_chunk():
    async def body(s):
        opts = {"include_usage": True, "continuous_usage_stats": True}
        payload = {"prompt": "Say hello", "max_tokens": 5, "stream": True, "stream_options": opts}
        async with s.post("/v1/completions", json=payload) as r:
            return [json.loads(x[6:]) for x in (await r.text()).split("\n") if x.startswith("data: {")]

    chunks = run(body)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 5]  # the last: include_usage's
    assert chunks[-1]["choices"] == []
