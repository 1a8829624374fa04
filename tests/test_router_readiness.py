"""Readiness, draining and overload at the router: health says NOT_SERVING (gRPC) and 503 (HTTP,
naming what it waits for) until every required pool has a ready worker; a drain refuses new
requests at once while those in flight finish; a full pool is 429 / RESOURCE_EXHAUSTED, not an
outage; a worker at its own call limit is busy, not dead; /metrics is on the HTTP port."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc
from splitserve.router.config import Deadlines, Listeners, Retries, RouterConfig
from splitserve.router.readiness import DRAINING, NO_WORKER, READY, readiness
from splitserve.router.server import HEALTH_DETAILS_KEY, Router
from splitserve.router.tokenizer import ByteTokenizer
from tests.test_router_server import FAST, cluster, joined, run, status_of, until

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---- the pure function


def test_ready_needs_a_ready_worker_in_every_required_pool() -> None:
    assert readiness({"decode": 1}, {"decode": 1}, ("decode",), False).code == READY
    r = readiness({"decode": 1}, {"decode": 1, "prefill": 2}, ("decode", "prefill"), False)
    assert (r.code, r.reason) == (NO_WORKER, "no ready prefill worker (2 starting)")
    r = readiness({}, {}, ("decode",), False)
    assert (r.code, r.reason, r.ready) == (NO_WORKER, "no decode worker yet", False)
    # a pool that is not required does not hold readiness back
    assert readiness({"decode": 1}, {"decode": 1, "prefill": 1}, ("decode",), False).ready


def test_draining_is_never_ready() -> None:
    r = readiness({"decode": 3, "prefill": 3}, {"decode": 3, "prefill": 3}, ("decode",), True)
    assert r.code == DRAINING and not r.ready and "shutting down" in r.reason


def test_required_pools_are_checked() -> None:
    with pytest.raises(ValueError, match="required_pools"):
        RouterConfig(required_pools=("decode", "encode"))


# ---- the router


async def _health(port: int) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status


def test_health_waits_for_every_required_pool_on_both_front_doors() -> None:
    async def scenario() -> None:
        kv = FakeKVPlane()
        d, p = FakeDecodeWorker(kv, [1, 2], worker_id="d0"), FakePrefillWorker(kv, [1, 2], worker_id="p0")
        await d.start()
        cfg = RouterConfig(
            deadlines=Deadlines(stats_interval_s=0.05),
            listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0),
            required_pools=("decode", "prefill"),
        )
        router = Router(cfg, ByteTokenizer(), decode=[d.address], rng=random.Random(0))
        port = await router.start()
        try:
            await router.wait_for_workers()
            # the decode pool is up, the prefill pool is not: not ready on either front door
            assert await _health(port) == NOT_SERVING
            url = f"http://127.0.0.1:{router.http_port}"
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/health") as h:
                    assert h.status == 503
                    assert await h.json() == {"status": NO_WORKER, "reason": "no prefill worker yet"}
                await p.start()
                router.workers.add(p.address, "prefill")
                await router.wait_for_workers()
                assert await _health(port) == SERVING
                async with s.get(f"{url}/health") as h:
                    assert (h.status, await h.json()) == (200, {"status": "ok"})
        finally:
            await router.stop(0)
            await d.stop()
            await p.stop()

    run(scenario)


def test_a_drain_refuses_new_requests_at_once_and_lets_those_in_flight_finish() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.02}]) as c:
            watch = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            running = asyncio.ensure_future(c.generate(text="hi", request_id="in-flight"))
            await until(lambda: c.router.generation.inflight == 1)
            c.router.drain()
            assert (await watch.read()).status == NOT_SERVING  # pushed to watchers at once
            watch.cancel()
            e = await status_of(c.generate(text="late"))
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (e.details() or "")
            assert c.router.generation.inflight == 1  # the refusal did not wait for anything
            assert await c.router.drained(timeout_s=10)
            text, _ = joined(await running)
            assert text == "Hello, world! The end."

    run(scenario)


def test_drained_says_when_the_grace_period_runs_out() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 5.0}]) as c:
            running = asyncio.ensure_future(c.generate(text="hi"))
            await until(lambda: c.router.generation.inflight == 1)
            c.router.drain()
            assert not await c.router.drained(timeout_s=0.2)
            running.cancel()

    run(scenario)


def test_every_decode_worker_full_is_resource_exhausted_not_unavailable() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"refuse": True}, {"refuse": True}]) as c:
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "full" in (e.details() or "")
            # and neither worker was taken for dead
            assert all(w.healthy for w in c.router.workers.all())

    run(scenario)


def test_a_worker_at_its_call_limit_is_busy_not_dead() -> None:
    async def scenario() -> None:
        async with cluster(retries=Retries(unhealthy_after_failures=1)) as c:
            d = c.decode[0]
            w = c.router.workers.all()[0]
            d.stats_busy = True
            await until(lambda: d.stats_refused >= 4)  # past unhealthy_after_failures, several times over
            assert w.healthy and w.failures == 0
            joined(await c.generate(text="hi"))

    run(scenario)


def test_metrics_are_on_the_http_port() -> None:
    async def scenario() -> None:
        kv = FakeKVPlane()
        d = FakeDecodeWorker(kv, list(b"ok"), worker_id="d0")
        await d.start()
        cfg = RouterConfig(
            deadlines=Deadlines(stats_interval_s=0.05), listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0)
        )
        router = Router(cfg, ByteTokenizer(), decode=[d.address], rng=random.Random(0))
        port = await router.start()
        try:
            await router.wait_for_workers()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = generate_pb2_grpc.GenerationStub(ch)
                [r async for r in stub.Generate(pb.GenerateRequest(text="hi"))]
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{router.http_port}/metrics") as m:
                assert m.status == 200 and m.headers["Content-Type"].startswith("text/plain")
                text = await m.text()
            assert 'splitserve_router_requests_total{code="OK"} 1.0' in text
            assert "splitserve_router_ttft_seconds_bucket" in text
        finally:
            await router.stop(0)
            await d.stop()

    run(scenario)


# ---- the decode pool's last worker dies


def test_stats_from_before_a_failed_call_do_not_make_the_worker_routable_again() -> None:
    """A dying worker can answer a stats poll that went out before a request's call to it failed;
    that answer put the worker back in routing, and every retry on it again (a flake of the test
    below under load). Only a poll that went out after the failure may restore it."""

    async def scenario() -> None:
        async with cluster(decode=[{}]) as c:
            d = c.decode[0]
            w = c.router.workers.get(d.address)
            assert w is not None and w.healthy
            d.stats_delay_s = 1.0
            started = d.stats_started
            await until(lambda: d.stats_started > started)  # a poll is in flight, held by the worker
            c.router.workers.mark_failed(d.address)  # meanwhile a request's call to it fails
            assert not w.healthy
            held = d.stats_started
            await until(lambda: d.stats_started > held)  # the held poll answered; the next one is held
            assert not w.healthy, "an answer from before the failure made the worker routable"
            d.stats_delay_s = 0.0
            await until(lambda: w.healthy)  # the poll that went out after the failure answers

    run(scenario)


def test_streams_wait_for_a_replacement_when_the_last_decode_worker_dies() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"die_after_tokens": 6, "token_delay_s": 0.01}]) as c:
            want = "Hello, world! The end."
            streams = [asyncio.ensure_future(c.generate(text="hi", request_id=f"s{i}")) for i in range(3)]
            await until(lambda: not c.router.workers.healthy("decode"))  # the only worker is gone
            assert not any(s.done() for s in streams)  # and no stream failed for it
            replacement = FakeDecodeWorker(FakeKVPlane(), list(want.encode()), worker_id="d-new")
            await replacement.start()
            c.decode.append(replacement)  # stopped by the cluster's exit
            c.router.workers.add(replacement.address, "decode")  # what the pool manager does
            for s in streams:
                assert joined(await s)[0] == want
            assert replacement.requests  # the streams went on there

    run(scenario)


def test_without_a_replacement_the_wait_ends_unavailable() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"die_after_tokens": 3}], deadlines=replace(FAST, no_decode_wait_s=0.3)) as c:
            t = asyncio.get_running_loop().time()
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert 0.25 <= asyncio.get_running_loop().time() - t < 5.0

    run(scenario)


def test_the_metrics_port_keeps_vllm_style_names_for_an_openmetrics_scraper() -> None:
    """Prometheus asks for OpenMetrics; prometheus_client's own server then renamed splitserve:* to
    splitserve_* (metrics_http.py answers in the text format whatever is asked)."""
    from tests.e2e_helpers.cluster import free_port

    async def scenario() -> None:
        port = free_port()
        cfg = RouterConfig(
            deadlines=Deadlines(stats_interval_s=0.05),
            listeners=Listeners(host="127.0.0.1", grpc_port=0, metrics_port=port),
        )
        router = Router(cfg, ByteTokenizer(), rng=random.Random(0))
        await router.start()
        try:
            accept = {"Accept": "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"}
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics", headers=accept) as m:
                assert m.status == 200 and m.headers["Content-Type"].startswith("text/plain")
                text = await m.text()
            assert "splitserve:request_phase_seconds_bucket" in text
            assert "splitserve_request_phase_seconds" not in text
        finally:
            await router.stop(0)

    run(scenario)


def test_an_unreachable_worker_is_logged_once_at_warning_and_named_by_health(caplog: pytest.LogCaptureFixture) -> None:
    from tests.e2e_helpers.cluster import free_port

    caplog.set_level(logging.INFO, logger="splitserve.router.workers")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: a mistyped address, say

    async def scenario() -> None:
        d = FakeDecodeWorker(FakeKVPlane(), [1, 2], worker_id="d0")
        await d.start()
        cfg = RouterConfig(deadlines=FAST, listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0))
        router = Router(cfg, ByteTokenizer(), decode=[d.address, dead], rng=random.Random(0))
        port = await router.start()
        try:
            w = router.workers.get(dead)
            assert w is not None
            await until(lambda: w.failures >= 8)  # many polls past the 2 that make it unreachable
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING and dead in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not at every poll
            assert "unreachable" in warnings[0].getMessage() and "UNAVAILABLE" in warnings[0].getMessage()
            # ready (d0 answers), and still naming the worker that does not, on both front doors
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{router.http_port}/health") as h:
                body = await h.json()
                assert h.status == 200 and body["status"] == "ok"
                assert list(body["unreachable"]) == [dead] and body["unreachable"][dead].startswith("UNAVAILABLE")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert (await call).status == SERVING
                details = dict(await call.trailing_metadata())[HEALTH_DETAILS_KEY]
                assert f"unreachable: {dead} (UNAVAILABLE" in details
        finally:
            await router.stop(0)
            await d.stop()

    run(scenario)


def test_readiness_names_the_unreachable_workers_ready_or_not() -> None:
    r = readiness({}, {"decode": 1}, ("decode",), False, {"a:1": "UNAVAILABLE: connection refused"})
    assert (r.code, r.unreachable) == (NO_WORKER, (("a:1", "UNAVAILABLE: connection refused"),))
    assert r.details == "no ready decode worker (1 starting); unreachable: a:1 (UNAVAILABLE: connection refused)"
    ok = readiness({"decode": 1}, {"decode": 2}, ("decode",), False, {"b:1": "DEADLINE_EXCEEDED: x"})
    assert ok.ready and ok.details == "unreachable: b:1 (DEADLINE_EXCEEDED: x)"
    assert readiness({"decode": 1}, {"decode": 1}, ("decode",), False).details == ""
