"""The router's gRPC front door against fake workers over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest

from splitserve.bench.fake_workers import EOS, FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc
from splitserve.router.config import Deadlines, Limits, Listeners, RouterConfig, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)

ANSWER = "Hello, world! The end."
SCRIPT = list(ANSWER.encode())
LONG = "a long prompt, " * 30  # 450 tokens: remote prefill under the default threshold of 256


@dataclass
class Cluster:
    router: Router
    stub: generate_pb2_grpc.GenerationStub
    channel: grpc.aio.Channel
    decode: list[FakeDecodeWorker] = field(default_factory=list)
    prefill: list[FakePrefillWorker] = field(default_factory=list)

    async def generate(self, metadata: Any = None, **kw: Any) -> list[pb.GenerateResponse]:
        return [r async for r in self.stub.Generate(pb.GenerateRequest(**kw), metadata=metadata)]


# polls and reconnects fast, so a test waits little for the router to see a change
FAST = Deadlines(stats_interval_s=0.05, reconnect_backoff_s=0.05)
LOCAL = Listeners(host="127.0.0.1", grpc_port=0)


@contextlib.asynccontextmanager
async def cluster(
    decode: list[dict[str, Any]] | None = None,
    prefill: list[dict[str, Any]] | None = None,
    script: list[int] = SCRIPT,
    **sections: Any,
) -> AsyncIterator[Cluster]:
    """Fake workers and a router in front of them; `sections`: RouterConfig's, in place of the
    defaults (FAST polls, LOCAL listeners)."""
    kv = FakeKVPlane()
    decoders = [FakeDecodeWorker(kv, script, worker_id=f"d{i}", **kw) for i, kw in enumerate(decode or [{}])]
    prefillers = [FakePrefillWorker(kv, script, worker_id=f"p{i}", **kw) for i, kw in enumerate(prefill or [{}])]
    for f in [*decoders, *prefillers]:
        await f.start()
    cfg = RouterConfig(**{"deadlines": FAST, "listeners": LOCAL, **sections})
    router = Router(
        cfg,
        ByteTokenizer(),
        decode=[d.address for d in decoders],
        prefill=[p.address for p in prefillers],
        rng=random.Random(0),
    )
    port = await router.start()
    await router.wait_for_workers()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Cluster(router, generate_pb2_grpc.GenerationStub(channel), channel, decoders, prefillers)
    finally:
        await channel.close()
        await router.stop(0)
        for f in [*decoders, *prefillers]:
            await f.stop()


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def joined(responses: list[pb.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def status_of(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value


def details(e: grpc.aio.AioRpcError) -> str:
    """The status message ("" where there is none: gRPC's types leave it optional)."""
    return e.details() or ""


# ---- the happy paths


def test_local_prefill_streams_the_whole_answer_with_usage() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            rs = await c.generate(request_id="r1", text="hi there")
            text, ids = joined(rs)
            assert text == ANSWER
            assert ids == [*SCRIPT, EOS]
            assert all(r.request_id == "r1" for r in rs)
            assert rs[-1].finish_reason == pb.FINISH_REASON_STOP
            assert (rs[-1].usage.prompt_tokens, rs[-1].usage.completion_tokens) == (8, len(SCRIPT) + 1)
            assert not any(r.HasField("usage") for r in rs[:-1])
            (req,) = c.decode[0].requests
            assert req.prefill_mode == wpb.PREFILL_MODE_LOCAL
            assert not c.prefill[0].requests

    run(scenario)


def test_remote_prefill_sends_the_first_token_from_the_prefill_worker() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(temperature=0.0, logprobs=True))
            assert joined(rs) == (ANSWER, [*SCRIPT, EOS])
            (dreq,) = c.decode[0].requests
            (preq,) = c.prefill[0].requests
            assert dreq.prefill_mode == wpb.PREFILL_MODE_REMOTE
            assert list(preq.handoff.prompt_token_ids) == list(LONG.encode())
            assert not preq.handoff.samples  # fresh: every sample (here the one) starts at the prefill worker
            assert len(preq.reservation.ticket) == 16
            assert preq.handoff.sampling.temperature == 0.0 and preq.handoff.sampling.max_tokens == 256
            assert rs[0].token_ids == [SCRIPT[0]] and rs[0].logprobs == [-0.25]  # from Prefill
            assert rs[1].logprobs == [-0.5]  # from the decode worker

    run(scenario)


def test_stop_string_cuts_the_text_and_cancels_the_decode_stream() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.01}]) as c:
            rs = await c.generate(request_id="s1", text="hi", sampling=pb.SamplingParams(stop=["world"]))
            assert joined(rs)[0] == "Hello, "
            assert rs[-1].finish_reason == pb.FINISH_REASON_STOP
            assert rs[-1].usage.completion_tokens == len("Hello, world")
            await until(lambda: len(c.decode[0].cancelled) == 1 and not c.decode[0].active)

    run(scenario)


def test_max_tokens_ends_with_length() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            rs = await c.generate(
                text="hi",
                sampling=pb.SamplingParams(max_tokens=5),
                stream_options=pb.StreamOptions(continuous_usage=True),
            )
            assert joined(rs) == ("Hello", SCRIPT[:5])
            assert rs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert [r.usage.completion_tokens for r in rs if r.token_ids] == [1, 2, 3, 4, 5]

    run(scenario)


def test_stop_string_split_across_tokens_is_held_back() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            rs = await c.generate(text="hi", sampling=pb.SamplingParams(stop=["Hello!"]))
            # "Hello" was held back token by token, then released when "," broke the match
            assert [r.text for r in rs[:6]] == ["", "", "", "", "", "Hello,"]
            assert joined(rs)[0] == ANSWER

    run(scenario)


def test_prefix_aware_routing_follows_the_block_events() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{}, {}]) as c:
            shared = "system prompt " * 4  # 56 tokens: 3 full blocks
            await c.generate(text=shared + "one", sampling=pb.SamplingParams(max_tokens=1))
            first = next(d for d in c.decode if d.requests)
            await until(lambda: len(c.router.index) >= 3)
            for i in range(4):
                rs = await c.generate(text=shared + f"question {i}", sampling=pb.SamplingParams(max_tokens=1))
                assert rs[-1].usage.cached_tokens >= 48  # the shared blocks, and more from earlier questions
            assert len(first.requests) == 5
            assert c.router.metrics.prefix_hit_rate._value.get() > 0.5

    run(scenario)


def test_health_reports_serving_while_a_decode_worker_is_healthy() -> None:
    async def scenario() -> None:
        async with cluster(deadlines=replace(FAST, no_decode_wait_s=0.2)) as c:
            health = health_pb2_grpc.HealthStub(c.channel)
            ok = await health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"))
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
            e = await status_of(health.Check(health_pb2.HealthCheckRequest(service="nope")))
            assert e.code() == grpc.StatusCode.NOT_FOUND
            c.router.workers.remove(c.decode[0].address)
            down = await health.Check(health_pb2.HealthCheckRequest())
            assert down.status == health_pb2.HealthCheckResponse.NOT_SERVING
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.UNAVAILABLE

    run(scenario)


# ---- bad requests


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"text": ""}, "text"),
        ({"token_ids": pb.TokenIds(ids=[5, 300])}, "token_ids.ids[1]"),
        ({"text": "x", "sampling": pb.SamplingParams(top_p=0.0)}, "sampling.top_p"),
        ({"text": "x", "request_id": "bad id"}, "request_id"),
    ],
)
def test_invalid_argument_names_the_field(kw: dict[str, Any], field: str) -> None:
    async def scenario() -> None:
        async with cluster() as c:
            e = await status_of(c.generate(**kw))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert details(e).startswith(f"{field}:")
            assert not c.decode[0].requests

    run(scenario)


def test_api_key_is_required_when_configured() -> None:
    async def scenario() -> None:
        async with cluster(listeners=replace(LOCAL, api_key="sekrit")) as c:
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            for wrong in ("Bearer sekriT", "Bearer sekri", "Bearer sekrit2", "sekrit"):
                e = await status_of(c.generate(text="hi", metadata=(("authorization", wrong),)))
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, wrong
            rs = await c.generate(text="hi", metadata=(("authorization", "Bearer sekrit"),))
            assert joined(rs)[0] == ANSWER

    run(scenario)


def test_the_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """hmac.compare_digest, never ==: an early-exit comparison leaks the key through timing."""
    import splitserve.router.server as server

    compared: list[tuple[bytes, bytes]] = []
    real = server.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server.hmac, "compare_digest", spy)

    async def scenario() -> None:
        async with cluster(listeners=replace(LOCAL, api_key="sekrit")) as c:
            await status_of(c.generate(text="hi", metadata=(("authorization", "Bearer nope"),)))

    run(scenario)
    assert (b"Bearer nope", b"Bearer sekrit") in compared


def test_a_request_id_in_flight_cannot_be_reused() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.05}]) as c:
            first = c.stub.Generate(pb.GenerateRequest(request_id="dup", text="hi"))
            await first.read()
            e = await status_of(c.generate(request_id="dup", text="hi"))
            assert e.code() == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()

    run(scenario)


# ---- overload, cancel, failures


def test_overload_is_refused_at_once() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.05}], limits=Limits(max_inflight=1)) as c:
            slow = c.stub.Generate(pb.GenerateRequest(text="hi"))
            await slow.read()
            t0 = time.monotonic()
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t0 < 0.5
            slow.cancel()
            await until(lambda: c.router.generation.inflight == 0)
            assert joined(await c.generate(text="hi"))[0] == ANSWER

    run(scenario)


def test_client_cancel_reaches_the_decode_worker() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.05}]) as c:
            call = c.stub.Generate(pb.GenerateRequest(request_id="c1", text="hi"))
            await call.read()
            call.cancel()
            await until(lambda: len(c.decode[0].cancelled) == 1 and not c.decode[0].active)
            await until(lambda: c.router.generation.inflight == 0)

    run(scenario)


def test_client_cancel_during_prefill_reaches_both_workers() -> None:
    async def scenario() -> None:
        async with cluster(prefill=[{"delay_s": 5.0}]) as c:
            call = c.stub.Generate(pb.GenerateRequest(request_id="c2", text=LONG))
            await until(lambda: bool(c.prefill[0].requests))
            call.cancel()
            await until(lambda: len(c.prefill[0].cancelled) == 1)
            await until(
                lambda: c.decode[0].cancelled == c.prefill[0].cancelled and not c.decode[0].active
            )  # one attempt id, both workers

    run(scenario)


def test_decode_worker_dying_mid_stream_migrates_the_request() -> None:
    async def scenario() -> None:
        # d0 looks idle and dies after 4 tokens; d1 looks busy, so it is only the fallback
        async with cluster(
            decode=[{"die_after_tokens": 4}, {"extra_queued_tokens": 8000}],
            routing=RoutingConfig(local_prefill_max_tokens=10_000),
        ) as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(max_tokens=12))
            assert joined(rs) == (ANSWER[:12], SCRIPT[:12])
            assert rs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            (moved,) = c.decode[1].requests
            (sample,) = moved.handoff.samples
            assert (sample.index, list(sample.output_token_ids)) == (0, SCRIPT[:4])
            assert moved.handoff.sampling.max_tokens == 12  # the handed-over tokens count against it
            assert c.router.metrics.migrations._value.get() == 1

    run(scenario)


def test_a_decode_worker_that_refuses_is_skipped() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"refuse": True}, {"extra_queued_tokens": 8000}]) as c:
            assert joined(await c.generate(text="hi"))[0] == ANSWER
            assert len(c.decode[0].requests) == 1 and len(c.decode[1].requests) == 1

    run(scenario)


def test_a_decode_worker_that_never_admits_hits_the_admit_deadline() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"admit_delay_s": 30.0}], deadlines=replace(FAST, admit_timeout_s=0.2)) as c:
            t0 = time.monotonic()
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "no event within 0.2s" in details(e)
            assert time.monotonic() - t0 < 2.0

    run(scenario)


def test_a_stalled_prefill_falls_back_to_local_prefill() -> None:
    async def scenario() -> None:
        async with cluster(prefill=[{"delay_s": 30.0}], deadlines=replace(FAST, prefill_timeout_s=0.2)) as c:
            t0 = time.monotonic()
            assert joined(await c.generate(text=LONG))[0] == ANSWER
            assert time.monotonic() - t0 < 2.0
            modes = [r.prefill_mode for r in c.decode[0].requests]
            assert modes == [wpb.PREFILL_MODE_REMOTE, wpb.PREFILL_MODE_LOCAL]
            await until(lambda: not c.decode[0].active)

    run(scenario)


def test_a_failed_prefill_is_retried_on_another_prefill_worker() -> None:
    async def scenario() -> None:
        async with cluster(prefill=[{"fail": grpc.StatusCode.UNAVAILABLE}, {"queued_tokens": 100}]) as c:
            assert joined(await c.generate(text=LONG))[0] == ANSWER
            assert len(c.prefill[0].requests) == 1 and len(c.prefill[1].requests) == 1
            assert [r.prefill_mode for r in c.decode[0].requests] == [wpb.PREFILL_MODE_REMOTE]

    run(scenario)


def test_the_client_deadline_bounds_the_request() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"token_delay_s": 0.2}]) as c:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in c.stub.Generate(pb.GenerateRequest(text="hi"), timeout=0.5):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 1.5
            await until(lambda: not c.decode[0].active)

    run(scenario)


def test_a_character_split_across_tokens_is_sent_whole() -> None:
    async def scenario() -> None:
        async with cluster(script=list("café!".encode())) as c:  # "é" is two bytes: two tokens
            rs = await c.generate(text="hi")
            assert [r.text for r in rs if r.token_ids] == ["c", "a", "f", "", "é", "!", ""]
            # cut after the first byte of "é": the end of the stream flushes what is held
            rs = await c.generate(text="hi", sampling=pb.SamplingParams(max_tokens=4))
            assert joined(rs)[0] == "caf\ufffd"

    run(scenario)


# ---- whose fault: a request's failure is not a worker's


def test_a_request_a_worker_refuses_fails_alone_and_the_worker_stays_in_routing() -> None:
    async def scenario() -> None:
        async with cluster(decode=[{"fail": grpc.StatusCode.INVALID_ARGUMENT}, {"extra_queued_tokens": 8000}]) as c:
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "refused the request" in details(e)
            assert len(c.decode[0].requests) == 1 and not c.decode[1].requests  # not retried elsewhere
            w = c.router.workers.get(c.decode[0].address)
            assert w is not None and w.healthy

    run(scenario)


def test_a_request_that_fails_unclearly_on_two_workers_is_not_tried_on_a_third() -> None:
    async def scenario() -> None:
        bad = {"fail": grpc.StatusCode.INTERNAL}
        async with cluster(decode=[bad, {**bad, "extra_queued_tokens": 4000}, {"extra_queued_tokens": 8000}]) as c:
            e = await status_of(c.generate(text="hi"))
            assert e.code() == grpc.StatusCode.INTERNAL
            assert "query-of-death" in details(e)
            assert [len(d.requests) for d in c.decode] == [1, 1, 0]
            assert c.router.metrics.queries_of_death._value.get() == 1
            assert all(w is not None and w.healthy for w in (c.router.workers.get(d.address) for d in c.decode))

    run(scenario)


def test_workers_see_an_id_of_the_routers_own_never_the_clients() -> None:
    async def scenario() -> None:
        async with cluster(routing=RoutingConfig(mode="disaggregated")) as c:
            long_id = "x" * 128  # valid for clients, longer than a KV frame's 64 bytes
            for _ in range(2):  # the same client id twice: two different attempt ids
                assert joined(await c.generate(request_id=long_id, text=LONG))[0] == ANSWER
            ids = [r.request_id for r in c.decode[0].requests]
            assert len(set(ids)) == 2 and all(len(i.encode()) <= 64 and i != long_id for i in ids)
            assert [r.request_id for r in c.prefill[0].requests] == ids

    run(scenario)


# ---- bytes that are not a GenerateRequest


def raw_generate(channel: grpc.aio.Channel) -> Any:
    """Generate with the request as raw bytes, as a client with another (or a broken) encoder sends it."""
    return channel.unary_stream(
        "/splitserve.v1.Generation/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )


async def raw_call(c: Cluster, raw: bytes, metadata: Any = None) -> list[pb.GenerateResponse]:
    return [r async for r in raw_generate(c.channel)(raw, metadata=metadata)]


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff\xff",  # not the wire format
        b"\x12\x02\xff\xfe",  # text = two bytes that are not UTF-8
        b"\x0a\x03\xed\xa0\x80\x12\x01x",  # request_id = a surrogate encoded as UTF-8 bytes
        b"\x22\x04\x0a\x02\x0a\xc3",  # chat.messages[0].role cut inside a character
        b"\x12\x05hi",  # text longer than the message
    ],
)
def test_bytes_that_are_not_a_generate_request_are_invalid_argument(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with cluster() as c:
            e = await status_of(raw_call(c, raw))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert details(e).startswith("request: not a valid GenerateRequest")
            assert not c.decode[0].requests
            rs = await raw_call(c, pb.GenerateRequest(text="hi").SerializeToString())  # the raw path serves too
            assert joined(rs)[0] == ANSWER

    run(scenario)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_api_key_is_checked_before_the_bytes_are_parsed() -> None:
    async def scenario() -> None:
        async with cluster(listeners=replace(LOCAL, api_key="sekrit")) as c:
            e = await status_of(raw_call(c, b"\xff\xff"))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            e = await status_of(raw_call(c, b"\xff\xff", metadata=(("authorization", "Bearer sekrit"),)))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario)


def varint_field(number: int, value: int) -> bytes:
    """A varint field in wire format, for field numbers the proto does not define."""
    out, n = bytearray(), number << 3
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n, value])


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            pb.GenerateRequest(
                chat=pb.ChatMessages(messages=[pb.ChatMessage(role="x" * 100_000, content="hi")])
            ).SerializeToString(),
            "chat.messages[0].role",
        ),
        (
            pb.GenerateRequest(text="hi").SerializeToString() + b"".join(varint_field(n, 1) for n in range(100, 5000)),
            "request",
        ),  # 4900 unknown field numbers, each named
    ],
)
def test_a_status_quoting_a_huge_value_still_arrives(raw: bytes, field: str) -> None:
    # the details travel in a trailer; past 16 KiB a client drops it and sees RESOURCE_EXHAUSTED instead
    async def scenario() -> None:
        async with cluster() as c:
            e = await status_of(raw_call(c, raw))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert details(e).startswith(f"{field}:")
            assert len(details(e)) < 1000
            health = health_pb2_grpc.HealthStub(c.channel)
            e = await status_of(health.Check(health_pb2.HealthCheckRequest(service="s" * 100_000)))
            assert e.code() == grpc.StatusCode.NOT_FOUND

    run(scenario)
