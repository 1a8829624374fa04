"""The shared door, against fake workers on real sockets: every route of both doors but health
behind the key (an unknown one too), /metrics opened to a scraper's own key, tenants found from
their keys alone, each held to its own limits with an honest Retry-After, and priorities a
request may only lower."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest

from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as gpb_grpc
from splitserve.router.config import Deadlines, Limits, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tenants import PRIORITY_KEY, Tenant
from tests.router_helpers import LOCAL, with_fake_cluster

pytestmark = pytest.mark.timeout(60)

SCRIPT = list(b"Hello, world!")
ALICE = Tenant("alice", ("sk-alice",))
BOB = Tenant("bob", ("sk-bob-1", "sk-bob-2"), max_concurrent=1, tokens_per_minute=600)


def run(body: Any, **kw: Any) -> Any:
    return asyncio.run(with_fake_cluster(body, SCRIPT, **kw))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- every route behind the key


def test_every_http_route_but_health_refuses_without_the_key() -> None:
    async def body(router: Router) -> dict[str, tuple[int, int]]:
        assert router.http is not None
        routes = {(r.method, r.resource.canonical) for r in router.http.app.router.routes() if r.resource is not None}
        routes.add(("GET", "/no/such/route"))  # a stranger learns nothing of which exist
        out = {}
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            for method, path in sorted(routes):
                if method == "HEAD":
                    continue
                async with s.request(method, path, json={}) as r:
                    without = r.status
                async with s.request(method, path, json={}, headers=bearer("sk-alice")) as r:
                    out[f"{method} {path}"] = (without, r.status)
        return out

    statuses = run(body, tenants=(ALICE,))
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /metrics"} <= set(statuses)
    for route, (without, with_key) in statuses.items():
        if route == "GET /health":
            assert without == with_key == 200
        else:
            assert without == 401, route
            assert with_key != 401, route
    assert statuses["GET /no/such/route"][1] == 404


def test_every_grpc_method_but_health_refuses_without_the_key() -> None:
    async def body(router: Router) -> dict[str, grpc.StatusCode]:
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            reply = await health.Check(health_pb2.HealthCheckRequest())
            out["Health/Check"] = grpc.StatusCode.OK if reply.status else grpc.StatusCode.UNKNOWN
            for key in (None, "sk-wrong", "sk-alice"):
                md = (("authorization", f"Bearer {key}"),) if key else ()
                stub = gpb_grpc.GenerationStub(ch)
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(text="hi"), metadata=md):
                        pass
                    out[f"Generate {key}"] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    out[f"Generate {key}"] = e.code()
                unknown: Any = ch.unary_unary("/splitserve.v1.Generation/NoSuchMethod")
                try:
                    await unknown(b"", metadata=md)
                except grpc.aio.AioRpcError as e:
                    out[f"NoSuchMethod {key}"] = e.code()
        return out

    codes = run(body, tenants=(ALICE,))
    assert codes["Health/Check"] == grpc.StatusCode.OK
    for key in (None, "sk-wrong"):
        assert codes[f"Generate {key}"] == grpc.StatusCode.UNAUTHENTICATED
        assert codes[f"NoSuchMethod {key}"] == grpc.StatusCode.UNAUTHENTICATED
    assert codes["Generate sk-alice"] == grpc.StatusCode.OK
    assert codes["NoSuchMethod sk-alice"] == grpc.StatusCode.UNIMPLEMENTED


def _scrape(port: int, key: str | None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=bearer(key) if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.parametrize(
    ("metrics_key", "expected"),
    [
        (None, {None: 401, "sk-scrape": 401, "sk-alice": 200}),
        ("sk-scrape", {None: 401, "sk-scrape": 200}),
        ("", {None: 200}),
    ],
)
def test_metrics_answer_a_key_a_scraper_key_or_anyone_as_configured(
    metrics_key: str | None, expected: dict[str | None, int]
) -> None:
    async def body(router: Router) -> dict[str, dict[str | None, int]]:
        assert router.http is not None
        ports = {"http": router.http_port, "metrics-port": _metrics_port(router)}
        return {
            door: {key: await asyncio.to_thread(_scrape, port, key) for key in expected} for door, port in ports.items()
        }

    listeners = replace(LOCAL, metrics_key=metrics_key, metrics_port=_free_port())
    seen = run(body, tenants=(ALICE,), listeners=listeners)
    assert seen == {"http": expected, "metrics-port": expected}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics_port(router: Router) -> int:
    return router.cfg.listeners.metrics_port


# ---- tenants


async def _complete(s: aiohttp.ClientSession, key: str, **extra: Any) -> tuple[int, dict[str, str], Any]:
    headers = bearer(key) | extra.pop("headers", {})
    payload = {"prompt": "hi", "max_tokens": 8, **extra}
    async with s.post("/v1/completions", json=payload, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


def test_a_tenant_over_its_tokens_per_minute_gets_429_with_an_honest_retry_after() -> None:
    """bob: 600 tokens a minute (10 a second). A request takes its prompt and max_tokens (2 + 203)
    while it runs. Two running leave 190 in the bucket: the third is refused with the seconds
    until 205 are there, and a retry after exactly that long is admitted while the first two still
    run (so nothing was given back meanwhile: the refill alone made room). alice is not touched."""

    async def body(router: Router) -> list[Any]:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            running = [asyncio.create_task(_complete(s, "sk-bob-1", max_tokens=203)) for _ in range(2)]
            while router.generation.tenant_limits.inflight(BOB) < 2:
                await asyncio.sleep(0.005)
            refused = await _complete(s, "sk-bob-2", max_tokens=203)
            other = asyncio.create_task(_complete(s, "sk-alice", max_tokens=203))
            await asyncio.sleep(float(refused[1].get("Retry-After", 0)))
            assert router.generation.tenant_limits.inflight(BOB) == 2  # none has given tokens back
            retried = await _complete(s, "sk-bob-2", max_tokens=203)
            return [refused, await other, retried, *[await t for t in running]]

    refused, other, retried, *first = run(body, tenants=(ALICE, replace(BOB, max_concurrent=None)), token_delay_s=0.25)
    status, headers, error = refused
    assert status == 429 and headers["Retry-After"] == "2", refused  # (205 - 190) / 10 per s = 1.5 s
    assert "tenant 'bob' is over its 600 tokens per minute" in error["error"]["message"]
    assert [r[0] for r in (other, retried, *first)] == [200, 200, 200, 200]


def test_a_request_larger_than_a_tenants_whole_minute_is_400_not_a_retry() -> None:
    async def body(router: Router) -> Any:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            return await _complete(s, "sk-bob-1", max_tokens=1000)

    status, headers, error = run(body, tenants=(BOB,))
    assert status == 400 and "Retry-After" not in headers
    assert "exceed tenant 'bob''s tokens_per_minute of 600" in error["error"]["message"]


def test_a_tenant_at_its_concurrency_is_refused_and_the_others_are_not() -> None:
    async def body(router: Router) -> list[int]:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            first = asyncio.create_task(_complete(s, "sk-bob-1", max_tokens=20))
            while router.generation.tenant_limits.inflight(BOB) == 0:
                await asyncio.sleep(0.005)
            second = await _complete(s, "sk-bob-2")
            other = await _complete(s, "sk-alice")
            return [(await first)[0], second[0], other[0]]

    assert run(body, tenants=(ALICE, replace(BOB, tokens_per_minute=None)), token_delay_s=0.02) == [200, 429, 200]


def test_the_tenant_is_the_keys_and_its_series_count_its_requests_and_tokens() -> None:
    async def body(router: Router) -> str:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            # the body's `user` names nobody: the key decides
            assert (await _complete(s, "sk-alice", user="bob"))[0] == 200
            assert (await _complete(s, "sk-bob-2"))[0] == 200
            async with s.get("/metrics", headers=bearer("sk-alice")) as r:
                return await r.text()

    text = run(body, tenants=(ALICE, replace(BOB, tokens_per_minute=None)))
    assert 'splitserve_router_tenant_requests_total{code="OK",tenant="alice"} 1.0' in text
    assert 'splitserve_router_tenant_requests_total{code="OK",tenant="bob"} 1.0' in text
    assert 'splitserve_router_tenant_tokens_total{kind="prompt",tenant="alice"} 2.0' in text


def test_a_request_may_lower_its_priority_but_not_raise_it() -> None:
    async def body(router: Router) -> list[Any]:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            return [
                await _complete(s, "sk-alice", headers={"x-splitserve-priority": p}) for p in ("low", "high", "urgent")
            ]

    low, high, bad = run(body, tenants=(ALICE,))
    assert low[0] == 200 and high[0] == 200  # "high" from a normal key runs, at normal
    assert bad[0] == 400 and "x-splitserve-priority" in bad[2]["error"]["message"]


def test_waiting_requests_take_the_seats_in_fair_order_and_a_cancelled_one_frees_its_place() -> None:
    """One seat. alice fills a queue of five while her first runs; bob's one request, sent after
    them, runs second, not sixth; a waiting request whose client goes away leaves no seat held."""

    async def body(router: Router) -> list[str]:
        order: list[str] = []
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:

            async def one(key: str, name: str) -> None:
                status, _, _ = await _complete(s, key, max_tokens=300)  # 302 tokens: one a round
                assert status == 200
                order.append(name)

            tasks = [asyncio.create_task(one("sk-alice", "a0"))]
            while router.generation.seats.taken == 0:
                await asyncio.sleep(0.005)
            for i in range(1, 5):
                tasks.append(asyncio.create_task(one("sk-alice", f"a{i}")))
            gone = asyncio.create_task(one("sk-alice", "gone"))
            while sum(router.generation.seats.waiting().values()) < 5:
                await asyncio.sleep(0.005)
            gone.cancel()
            tasks.append(asyncio.create_task(one("sk-bob-1", "b0")))
            await asyncio.gather(*tasks)
        assert router.generation.seats.taken == 0 and not router.generation.seats.waiting()
        return order

    order = run(
        body,
        tenants=(ALICE, replace(BOB, max_concurrent=None, tokens_per_minute=None)),
        limits=Limits(max_running=1),
        token_delay_s=0.02,
    )
    assert order[0] == "a0" and order.index("b0") <= 2, order
    assert "gone" not in order


def test_the_workers_are_told_whose_request_it_is_from_the_key_not_the_request() -> None:
    """The decode worker's handoff carries the tenant of the key, its weight and the band the
    request asked (lower than its key's): what the workers share their prefill tokens by. A
    request's own `user` field names no tenant."""

    async def body(router: Router) -> None:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            headers = bearer("sk-bob-2") | {PRIORITY_KEY: "low"}
            payload = {"prompt": "hi", "max_tokens": 4, "user": "alice"}
            async with s.post("/v1/completions", json=payload, headers=headers) as r:
                assert r.status == 200, await r.text()

    fakes: list[Any] = []
    run(body, tenants=(ALICE, replace(BOB, weight=3.0, tokens_per_minute=None)), workers=fakes)
    decode = fakes[0]
    (request,) = decode.requests
    share = request.handoff.share
    assert (share.tenant, share.weight, share.band) == ("bob", 3.0, 2)


# ---- a request the router gives up on is told so


def test_a_request_the_router_gives_up_on_before_its_first_token_gets_its_status() -> None:
    """The only decode worker dies before it has taken either request (it takes 5 s to admit one)
    and no replacement comes: streamed or whole, the answer is a 503 with a Retry-After, never a
    200 with empty content."""

    async def body(router: Router) -> list[Any]:
        (worker,) = [w for w in router.workers.all() if w.role == "decode"]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            payload = {"prompt": "hi", "max_tokens": 8}
            calls = [
                asyncio.create_task(s.post("/v1/completions", json=payload | {"stream": st})) for st in (True, False)
            ]
            while router.generation.inflight < 2:
                await asyncio.sleep(0.005)
            router.workers.mark_failed(worker.address)
            kill[0]()  # the decode worker goes away mid-call
            return [(r.status, dict(r.headers), await r.json()) for r in [await c for c in calls]]

    kill: list[Any] = []
    answers = run(
        body,
        deadlines=Deadlines(stats_interval_s=0.05, no_decode_wait_s=1.0),
        decode_kw={"admit_delay_s": 5.0},
        on_decode=kill.append,
    )
    for status, headers, error in answers:
        assert status == 503 and headers["Retry-After"] == "5", (status, headers, error)
        assert "no healthy decode worker" in error["error"]["message"]


def test_a_worker_removed_with_a_call_in_flight_lets_the_call_finish() -> None:
    """The pool manager removes the prefill worker (scale-down) while it computes a request's
    prefill: the request still gets its whole answer. Closing the worker's channel at once had
    cancelled the call from under the request, which took it for its client's cancel and dropped
    the connection."""

    async def body(router: Router) -> tuple[int, Any]:
        (prefill,) = [w for w in router.workers.all() if w.role == "prefill"]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            call = asyncio.create_task(s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}))
            while not fakes[1].requests:  # the prefill call is in flight (the fake takes 1 s)
                await asyncio.sleep(0.005)
            router.workers.remove(prefill.address)
            r = await call
            return r.status, await r.json()

    fakes: list[Any] = []
    status, answer = run(body, routing=RoutingConfig(mode="disaggregated"), workers=fakes, prefill_kw={"delay_s": 1.0})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


def test_a_stream_the_router_gives_up_on_midway_ends_with_an_error_event_and_no_done() -> None:
    async def body(router: Router) -> tuple[int, str]:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s:
            async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True}) as r:
                return r.status, await r.text()

    status, events = run(
        body, deadlines=Deadlines(stats_interval_s=0.05, no_decode_wait_s=1.0), decode_kw={"die_after_tokens": 3}
    )
    assert status == 200 and events.count('"text"') >= 3, events  # the tokens it had
    assert '"error"' in events and '"code": 503' in events, events
    assert "[DONE]" not in events  # a client that waits for [DONE] sees a stream that did not finish


def test_a_grpc_refusal_for_the_tenants_tokens_carries_retry_after_in_its_trailers() -> None:
    async def body(router: Router) -> tuple[grpc.StatusCode, str, str | None]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = gpb_grpc.GenerationStub(ch)
            md = (("authorization", "Bearer sk-bob-1"),)
            req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=400))
            held = stub.Generate(req, metadata=md)  # holds 402 of bob's 600 tokens while it runs
            await held.read()
            call = stub.Generate(req, metadata=md)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                trailers = dict(e.trailing_metadata() or ())
                held.cancel()
                return e.code(), e.details() or "", trailers.get("retry-after")
        raise AssertionError("not refused")

    code, details, retry_after = run(body, tenants=(replace(BOB, max_concurrent=None),), token_delay_s=0.2)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "600 tokens per minute" in details
    assert retry_after is not None and int(retry_after) >= 1
