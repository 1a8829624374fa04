"""Both front doors of a real Router (real sockets, fake workers over real gRPC)
against thousands of random and mutated requests: HTTP bodies (random bytes,
valid bodies with fields set to wrong types and extreme values, lone
surrogates, deep nesting, odd charsets and encodings, byte-level damage) and
raw Generate messages (random bytes, valid requests with bytes flipped,
inserted and deleted, invalid UTF-8 and wrong wire types in string fields).

Pinned: no HTTP 500, no gRPC INTERNAL or UNKNOWN, every answer in an allowed
set, no ERROR log, and afterwards the router is healthy, holds nothing in
flight, and answers a normal request with the same text as before.

Reproducible: case i of a door draws from random.Random(f"{seed}:{door}:{i}"),
so one failing case can be replayed alone (four run at a time, and now and then a
client goes away mid-request, so the interleaving is the one thing that varies). SPLITSERVE_FUZZ_SEED and
SPLITSERVE_FUZZ_CASES (per door) override the seed and the count; the counts
per status are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp.http import HttpProcessingError
from aiohttp.web import RequestPayloadError

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Deadlines, Limits, Listeners, RouterConfig
from splitserve.router.openai.door import log as door_log
from splitserve.router.openai.translate import CHAT_FIELDS, COMPLETION_FIELDS
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

SEED = int(os.environ.get("SPLITSERVE_FUZZ_SEED", "20260101"))
CASES = int(os.environ.get("SPLITSERVE_FUZZ_CASES", "2000"))  # per front door

ANSWER = "Hello, world! The end."
SCRIPT = list(ANSWER.encode())

HTTP_ALLOWED = {200, 400, 404, 405, 409, 413, 415}  # 409: two cases in flight at once with one request_id
GRPC_ALLOWED = {"OK", "INVALID_ARGUMENT", "ALREADY_EXISTS"}
CONCURRENCY = 4  # cases in flight at once
GONE_RATE = 0.03  # cases whose client goes away after a few milliseconds

pytestmark = pytest.mark.timeout(60 + CASES * 0.03)  # about 20 s for the default count here, on 2 cores


# ---- HTTP cases

# every field either endpoint accepts, read from the door's one list of them (sorted: a set's
# order changes from process to process, and case i must draw the same fields in every run)
KNOWN = sorted(CHAT_FIELDS | COMPLETION_FIELDS)
RAW = "\x00raw\x00"  # a placeholder replaced by a raw JSON token (or non-token) after json.dumps
RAW_TOKENS = [
    "1e400",
    "-1e400",
    "NaN",
    "-Infinity",
    "9" * 5000,
    "-0",
    "01",
    "1.",
    "tru",
    "nul",
    '"\\ud800"',
    '"\\udc00\\ud800"',
    '"\\u12"',
    '"\\x41"',
    '"a\\',
    "[" * 40 + "]" * 40,
    "{" * 33 + "}" * 33,
]
WEIRD: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    0.5,
    -0.0,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    1e308,
    -1e308,
    float("inf"),
    float("nan"),
    "",
    "x",
    "\ud800",
    "a\udfffb",
    "\ud83d",
    "é漢",
    "\x00",
    " " * 300,
    [],
    {},
    [1, 2],
    [[[]]],
    {"role": "user"},
    ["\ud800"],
    [2**31],
    [257, 0],
    "9" * 100,
    RAW,
    [RAW],
    {"a": RAW},
    [7] * 9000,
    "y" * 300_000,
    ["s"] * 20,
    ["z" * 100],
    [{"role": "user", "content": "q"}] * 300,  # past the limits
]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=UTF8",
    "application/json; charset=foo",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset",
    ";;;",
    'application/json; charset="utf-16"',
    "*/*",
    "application/json; charset=utf-8; charset=ascii",
]
INTERESTING_BYTES = [b"\xff", b"\xed\xa0\x80", b"\xc3", b'"', b"\\", b"[" * 40, b"\x00", b"\\ud800", b"{", b"}", b","]


@dataclass
class HttpCase:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]


def valid_body(rng: random.Random, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if chat:
        body["messages"] = [
            {"role": rng.choice(["system", "user", "assistant"]), "content": rng.choice(["hi", "é漢", "x" * 50])}
            for _ in range(rng.randint(1, 3))
        ]
    else:
        body["prompt"] = rng.choice(
            ["Say hello", "é", [1, 2, 3], [rng.randrange(258) for _ in range(rng.randint(1, 20))]]
        )
    for key, values in (
        ("max_tokens", [1, 4, 16]),
        ("temperature", [0.0, 0.7]),
        ("top_p", [0.9, 1]),
        ("top_k", [0, 5]),
        ("seed", [1, 2**40]),
        ("stop", ["world", ["!", "end"]]),
        ("stream", [True, False]),
        ("stream_options", [{"include_usage": True}]),
        ("logprobs", [True, False, 2]),
        ("request_id", ["fuzz-1", "a.b:c"]),
        ("model", ["m"]),
        ("ignore_eos", [False]),
        ("n", [1]),
        ("presence_penalty", [0.5]),
        ("min_p", [0.1]),
    ):
        if rng.random() < 0.3:
            body[key] = rng.choice(values)
    return body


def _slots(v: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a JSON value, the places a mutation can land."""
    out: list[tuple[Any, Any]] = []
    if isinstance(v, dict):
        for k, child in v.items():
            out.append((v, k))
            out.extend(_slots(child))
    elif isinstance(v, list):
        for i, child in enumerate(v):
            out.append((v, i))
            out.extend(_slots(child))
    return out


def mutate_json(rng: random.Random, body: dict[str, Any]) -> Any:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        slots = _slots(body)
        op = rng.random()
        if op < 0.05 or not slots:
            return copy.deepcopy(rng.choice(WEIRD))  # the body itself is not an object
        container, key = rng.choice(slots)
        if op < 0.55:
            container[key] = copy.deepcopy(rng.choice(WEIRD))
        elif op < 0.7 and isinstance(container, dict):
            del container[key]
        elif op < 0.85:
            body[rng.choice([*KNOWN, "unknown", "\ud800"])] = copy.deepcopy(rng.choice(WEIRD))
        else:
            container[key] = [container[key]] if rng.random() < 0.5 else {"x": container[key]}
    return body


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(b) + 1)
        op = rng.randrange(5)
        if op == 0 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos:pos] = rng.randbytes(rng.randint(1, 4))
        elif op == 2:
            del b[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            del b[pos:]
        else:
            b[pos:pos] = rng.choice(INTERESTING_BYTES)
    return bytes(b)


def dumps(rng: random.Random, value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=rng.random() < 0.8)
    while json.dumps(RAW) in text:
        text = text.replace(json.dumps(RAW), rng.choice(RAW_TOKENS), 1)
    return text.encode("utf-8", "surrogatepass")  # a raw lone surrogate becomes bytes that are not UTF-8


def http_case(rng: random.Random) -> HttpCase:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = rng.random()
    if kind < 0.1:
        body = rng.randbytes(rng.randint(0, 200))
    elif kind < 0.2:
        body = rng.choice(
            [
                b"",
                b"[" * rng.randint(30, 100_000),
                b"{" * 5000,
                b'{"prompt": ' * 2000,
                b"{}",
                b"[]",
                b"null",
                b'"x"',
                b"\xef\xbb\xbf{}",
                b" " * 1000,
                b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
            ]
        )  # past the 8 MiB limit
    elif kind < 0.35:
        body = dumps(rng, valid_body(rng, chat))
    elif kind < 0.8:
        body = dumps(rng, mutate_json(rng, valid_body(rng, chat)))
    else:
        body = mutate_bytes(rng, dumps(rng, valid_body(rng, chat)))
    headers = {}
    content_type = rng.choice(CONTENT_TYPES) if rng.random() < 0.3 else "application/json"
    if content_type is not None:
        headers["Content-Type"] = content_type
    if rng.random() < 0.05:
        headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "identity", "x-unknown"])
        if headers["Content-Encoding"] == "gzip" and rng.random() < 0.5:
            body = gzip.compress(body)
    method = "POST"
    if rng.random() < 0.02:
        method, path = rng.choice([("GET", path), ("PUT", path), ("POST", "/v1/nope"), ("POST", "/v1/models")])
    return HttpCase(method, path, body, headers)


async def send_http(s: aiohttp.ClientSession, case: HttpCase) -> str:
    """The answer's status; for a stream, 'stream-error-<code>' if an error event came instead of tokens."""
    async with s.request(
        case.method, case.path, data=case.body, headers=case.headers, skip_auto_headers=["Content-Type"]
    ) as r:
        raw = await r.read()
        if r.status != 200 or not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            if r.status == 200 and case.path.endswith("completions"):
                json.loads(raw)  # a whole answer is JSON
            return str(r.status)
    lines = [x[len(b"data: ") :] for x in raw.split(b"\n") if x.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", raw[-200:]
    for chunk in map(json.loads, lines[:-1]):
        if "error" in chunk:
            return f"stream-error-{chunk['error']['code']}"
    return "200"


# ---- gRPC cases


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negatives as protobuf sends them: ten bytes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message, packed) with any payload, valid or not."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"ok\xe2\x82"]


def valid_request(rng: random.Random) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=rng.choice(["", "", f"g{rng.randrange(10**6)}"]))
    kind = rng.randrange(3)
    if kind == 0:
        req.text = rng.choice(["hi", "Say hello", "é漢", "x" * 300])
    elif kind == 1:
        req.token_ids.ids.extend(rng.randrange(258) for _ in range(rng.randint(1, 20)))
    else:
        for _ in range(rng.randint(1, 3)):
            req.chat.messages.add(role=rng.choice(["system", "user", "assistant"]), content=rng.choice(["hi", "é"]))
    sp = req.sampling
    for name, values in (
        ("temperature", [0.0, 0.8]),
        ("top_p", [0.5, 1.0]),
        ("top_k", [0, 7]),
        ("seed", [3]),
        ("max_tokens", [1, 8, 32]),
        ("min_p", [0.0, 0.2]),
        ("ignore_eos", [True, False]),
        ("logprobs", [True]),
        ("repetition_penalty", [1.1]),
    ):
        if rng.random() < 0.3:
            setattr(sp, name, rng.choice(values))
    if rng.random() < 0.2:
        sp.stop.append(rng.choice(["world", "!"]))
    if rng.random() < 0.2:
        sp.stop_token_ids.append(rng.randrange(258))
    if rng.random() < 0.2:
        req.stream_options.continuous_usage = True
    if rng.random() < 0.2:
        extreme(rng, req)
    return req


def extreme(rng: random.Random, req: pb.GenerateRequest) -> None:
    """Values the wire format carries but the API refuses, each for validation to name."""
    sp = req.sampling

    def past_max_model_len() -> None:  # prompt + max_tokens
        sp.max_tokens = 64
        req.token_ids.ids.extend([7] * 7935)

    rng.choice(
        [
            lambda: setattr(
                sp,
                rng.choice(
                    ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
                ),
                rng.choice([float("nan"), float("inf"), -float("inf"), -1.0, 3.4e38, 1e-45]),
            ),
            lambda: setattr(sp, rng.choice(["top_k", "max_tokens"]), rng.choice([-(2**31), -1, 2**31 - 1, 259])),
            lambda: setattr(sp, "seed", rng.choice([-(2**63), -1, 2**63 - 1])),
            lambda: sp.stop.extend(rng.choice([[""], ["s"] * 20, ["z" * 100], ["\x00"]])),
            lambda: sp.stop_token_ids.extend(rng.choice([[-1], [2**31 - 1], [258], [1] * 100])),
            lambda: setattr(req, "request_id", rng.choice(["x" * 129, "bad id", "\x00", "é", "a/b", "-"])),
            lambda: setattr(req, "text", rng.choice(["", "y" * 262_145, "\x00" * 10])),
            lambda: req.token_ids.ids.extend(rng.choice([[], [7] * 8000, [-(2**31)], [2**31 - 1]])),
            lambda: req.chat.messages.extend(
                [pb.ChatMessage(role=rng.choice(["", "tool", "user"]), content="q")] * rng.choice([1, 300])
            ),
            lambda: req.chat.messages.add(role="r" * 100_000, content="q"),  # a long value quoted back in the status
            past_max_model_len,
        ]
    )()


def bad_field(rng: random.Random) -> bytes:
    """One field that a parser must refuse or a validator must name: invalid UTF-8, a wrong wire type,
    an out-of-range or unknown number."""
    bad = rng.choice(BAD_UTF8)
    return rng.choice(
        [
            field(1, bad),  # request_id
            field(2, bad),  # text
            field(4, field(1, field(1, bad) + field(2, b"hi"))),  # chat.messages[0].role
            field(4, field(1, field(1, b"user") + field(2, bad))),  # chat.messages[0].content
            field(5, field(11, bad)),  # sampling.stop[0]
            field(3, field(1, b"".join(varint(rng.choice([2**31, 2**40, -1, 2**64 - 1, 300])) for _ in range(3)))),
            varint(2 << 3 | 0) + varint(5),  # text as a varint
            varint(5 << 3 | 0) + varint(1),  # sampling as a varint
            varint(3 << 3 | 5) + b"\x00\x00\x00\x00",  # token_ids as fixed32
            varint(99 << 3 | 0) + varint(1),  # an unknown field
            b"".join(
                varint(n << 3 | 0) + varint(1) for n in range(100, 3000)
            ),  # thousands of unknown fields, each named
            field(5, varint(99 << 3 | 2) + varint(1) + b"x"),  # an unknown sampling field
            varint(1 << 3 | 3) + varint(1 << 3 | 4),  # a group (deprecated wire types)
            field(4, field(1, b"\x0a" * 200)),  # nested lengths that run past their end
        ]
    )


def grpc_case(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.1:
        return rng.randbytes(rng.randint(0, 100))
    raw = valid_request(rng).SerializeToString()
    if kind < 0.3:
        return raw
    if kind < 0.6:
        return mutate_bytes(rng, raw)
    if kind < 0.9:  # appended fields override or extend the valid ones (protobuf merges)
        return raw + b"".join(bad_field(rng) for _ in range(rng.randint(1, 2)))
    return raw + valid_request(rng).SerializeToString()  # two messages concatenated: one merged request


async def send_grpc(generate: Any, raw: bytes) -> str:
    try:
        async for _ in generate(raw, timeout=10):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


# ---- the run


@contextlib.asynccontextmanager
async def real_router() -> AsyncIterator[tuple[Router, FakeDecodeWorker]]:
    kv = FakeKVPlane()
    d = FakeDecodeWorker(kv, SCRIPT, worker_id="d0")
    p = FakePrefillWorker(kv, SCRIPT, worker_id="p0")
    await d.start()
    await p.start()
    # small generations: a valid case costs a few tokens, not the default 256
    cfg = RouterConfig(
        limits=Limits(max_tokens_cap=64, default_max_tokens=32),
        deadlines=Deadlines(stats_interval_s=0.05),
        listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0),
    )
    router = Router(cfg, ByteTokenizer(), decode=[d.address], prefill=[p.address], rng=random.Random(SEED))
    await router.start()
    await router.wait_for_workers()
    try:
        yield router, d
    finally:
        await router.stop(0)
        await d.stop()
        await p.stop()


async def normal_answers(s: aiohttp.ClientSession, channel: grpc.aio.Channel) -> tuple[str, str]:
    async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64}) as r:
        assert r.status == 200
        http_text = (await r.json())["choices"][0]["text"]
    stub = channel.unary_stream(
        "/splitserve.v1.Generation/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    grpc_text = "".join([r.text async for r in stub(pb.GenerateRequest(text="hi"))])
    return http_text, grpc_text


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def within(send: Any, rng: random.Random) -> str:
    """A case's status; now and then the client goes away after a few milliseconds instead."""
    limit = rng.uniform(0.001, 0.05) if rng.random() < GONE_RATE else 10.0
    try:
        return await asyncio.wait_for(send, limit)
    except TimeoutError:
        return "client-gone" if limit < 10 else "client-TimeoutError"
    except Exception as e:  # a dropped connection, a body that is not what its status says
        return f"client-{type(e).__name__}"


async def fuzz_http(s: aiohttp.ClientSession, i: int) -> tuple[str, str]:
    rng = random.Random(f"{SEED}:http:{i}")
    case = http_case(rng)
    status = await within(send_http(s, case), rng)
    return status, f"http case {i}: {status} for {case.method} {case.path} {case.headers} {case.body[:200]!r}"


async def fuzz_grpc(generate: Any, i: int) -> tuple[str, str]:
    rng = random.Random(f"{SEED}:grpc:{i}")
    raw = grpc_case(rng)
    status = await within(send_grpc(generate, raw), rng)
    return status, f"grpc case {i}: {status} for {raw[:200]!r}"


async def fuzz() -> tuple[Counter[str], Counter[str], list[str]]:
    http: Counter[str] = Counter()
    rpc: Counter[str] = Counter()
    bad: list[str] = []

    async def batches(one: Any, counts: Counter[str], allowed: set[str]) -> None:
        for start in range(0, CASES, CONCURRENCY):
            for status, what in await asyncio.gather(*(one(i) for i in range(start, min(start + CONCURRENCY, CASES)))):
                counts[status] += 1
                if status not in allowed:
                    bad.append(what)

    async with real_router() as (router, d):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        generate: grpc.aio.UnaryStreamMultiCallable[bytes, pb.GenerateResponse] = channel.unary_stream(
            "/splitserve.v1.Generation/Generate",
            request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            before = await normal_answers(s, channel)
            assert before == (ANSWER, ANSWER)
            await batches(lambda i: fuzz_http(s, i), http, {*map(str, HTTP_ALLOWED), "client-gone"})
            await batches(lambda i: fuzz_grpc(generate, i), rpc, {*GRPC_ALLOWED, "client-gone"})
            # still healthy, nothing left in flight (the abandoned ones included), and the same answers
            await until(lambda: router.generation.inflight == 0 and not d.active)
            async with s.get("/health") as r:
                assert r.status == 200
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert await normal_answers(s, channel) == before
        await channel.close()
    return http, rpc, bad


def client_garbage(r: logging.LogRecord) -> bool:
    """aiohttp's own report of broken HTTP it met outside any handler (it answers 400 itself)."""
    exc = r.exc_info[1] if r.exc_info else None
    return r.name == "aiohttp.server" and isinstance(exc, (HttpProcessingError, RequestPayloadError))


def foreign_loop(r: logging.LogRecord) -> bool:
    """Something an earlier test in this process left on its own loop, since closed, met that loop
    closed: gRPC's asyncio poller (one per process) handing a completion to the loop its call was made
    on (seen once in a full CI run), or an HTTP client left to the garbage collector closing itself
    (seen under `pytest -n 2`, which puts other files before this one). This test has one loop, running
    all along, so such a record was never one of its requests."""
    exc = r.exc_info[1] if r.exc_info else None
    return r.name == "asyncio" and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def test_no_client_input_gets_a_server_error(caplog: pytest.LogCaptureFixture) -> None:
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        http, rpc, bad = asyncio.run(fuzz())
    print(
        f"\nfuzz seed={SEED} cases={CASES} per door, {time.monotonic() - t0:.1f}s\n"
        f"  HTTP: {dict(sorted(http.items()))}\n  gRPC: {dict(sorted(rpc.items()))}"
    )
    assert sum(http.values()) == sum(rpc.values()) == CASES
    assert not bad, "\n".join(bad[:10])
    # aiohttp logs (at ERROR) the broken HTTP it meets outside any handler: an encoding its parser cannot
    # decode, or a body that fails to decompress as it drains it after a 404 or 405. The client's garbage,
    # met by aiohttp's code; not a fault of the router.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not client_garbage(r) and not foreign_loop(r)]
    assert not errors, [r.getMessage() for r in errors[:5]]
    warnings = [r for r in caplog.records if r.name == door_log.name]
    assert not warnings, [r.getMessage() for r in warnings[:5]]  # a body that slipped past the checks
