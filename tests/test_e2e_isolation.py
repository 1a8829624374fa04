"""One request must never hurt another, on real processes: one prefill and two
decode workers, the router's gRPC front door in front of them.

- Requests that pass validation but used to poison a worker (a request id
  longer than a KV frame holds, a temperature or repetition penalty of 1e-45)
  run while eight greedy streams run: the eight give the undisturbed text, the
  poisons complete, and health never leaves SERVING.
- Cancels inside the reservation window, hundreds of them, straight at a decode
  worker: afterwards greedy output is unchanged (a reservation that outlived
  its request used to reset blocks that belonged to the prefix cache by then),
  no block was freed while a live reservation could still write it, none leaked.
- A request id reused right after a cancel gets its answer, never a hang.
- A cancel storm at random stages through the router: every worker's blocks
  come back within seconds, the prefill queue empties, nothing stays in flight.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Protocol

import grpc
import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import (
    FLAGS,
    expected,
    free_port,
    scrape,
    stats,
    wait_all_blocks_free,
    with_router,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


class DecodeCall(Protocol):
    """A blocking Decode call: its events, as they come, and a way to cancel it."""

    def __iter__(self) -> Iterator[wpb.DecodeEvent]: ...
    def __next__(self) -> wpb.DecodeEvent: ...
    def cancel(self) -> bool: ...


TOPICS = ["printing press", "steam engine", "telegraph", "compass", "windmill", "telescope", "bicycle", "camera"]
LONG_PROMPT = "Tell me everything you know about the history of the printing press, in detail. " * 12
FREED_WHILE_RESERVED = "splitserve_decode_blocks_freed_while_reserved_total"


class Cluster:
    def __init__(self) -> None:
        self.metrics_ports = [free_port(), free_port()]
        self.decode = [spawn_worker("decode", *FLAGS, "--metrics-port", str(p)) for p in self.metrics_ports]
        self.prefill = [spawn_worker("prefill", *FLAGS)]

    @property
    def all(self) -> list[WorkerProcess]:
        return [*self.decode, *self.prefill]

    def freed_while_reserved(self) -> float:
        return sum(scrape(p, FREED_WHILE_RESERVED) for p in self.metrics_ports)

    def stop(self) -> None:
        for w in self.all:
            w.stop()


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


def chat(model, text: str) -> list[int]:
    return EngineTokenizer(model.tokenizer).encode_chat([("user", text)])


def greedy(ids: list[int], n: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), **kw
    )


async def tokens_of(call) -> list[int]:
    return [t async for r in call for t in r.token_ids]


async def status_of(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_poison_requests_leave_eight_greedy_streams_and_health_untouched(model, cluster):
    prompts = [chat(model, f"Write a short paragraph about the {t}.") for t in TOPICS]
    n = 24
    want = expected(model, prompts, n)
    base = chat(model, "Say something nice.")
    poisons = [
        pb.GenerateRequest(
            request_id="p" * 100, token_ids=pb.TokenIds(ids=base), sampling=pb.SamplingParams(max_tokens=4)
        ),  # a KV frame holds 64 bytes of id
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=base), sampling=pb.SamplingParams(temperature=1e-45, max_tokens=4)
        ),
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=base), sampling=pb.SamplingParams(temperature=1e-38, max_tokens=4)
        ),
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=base),
            sampling=pb.SamplingParams(temperature=1.0, repetition_penalty=1e-45, max_tokens=4),
        ),
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=base),
            sampling=pb.SamplingParams(
                temperature=1e-38,
                repetition_penalty=1e-45,
                top_p=1e-45,
                min_p=1.0,
                presence_penalty=2,
                frequency_penalty=-2,
                max_tokens=4,
            ),
        ),
    ]

    async def body(stub, router):
        health: list[int] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            hstub = health_pb2_grpc.HealthStub(ch)
            streams = asyncio.gather(*(tokens_of(stub.Generate(greedy(p, n), timeout=300)) for p in prompts))
            poison_codes: list[grpc.StatusCode] = []
            while not streams.done():
                health.append((await hstub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status)
                for p in poisons:
                    poison_codes.append(await status_of(stub.Generate(p, timeout=120)))
            got = await streams
            health.append((await hstub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status)
        return got, poison_codes, health

    got, codes, health = asyncio.run(
        with_router(cluster.decode, cluster.prefill, model.tokenizer, body, routing=RoutingConfig(mode="disaggregated"))
    )
    assert got == want
    assert codes and set(codes) == {grpc.StatusCode.OK}, codes
    assert set(health) == {health_pb2.HealthCheckResponse.SERVING}
    wait_all_blocks_free(cluster.all)


LEASE_MS = 400


def test_cancels_inside_the_reservation_window_never_corrupt_the_cache(model, cluster):
    d = cluster.decode[0]
    n = 12
    # Storm prompts share nothing cacheable with the check prompts: each reservation takes fresh
    # blocks, and each check prompt's KV lands in blocks a stale reservation may have held.
    storm = [chat(model, f"{i}: " + LONG_PROMPT) for i in range(10)]
    checks = [chat(model, f"Write a short paragraph about the {t}.") for t in TOPICS[:6]]
    want = expected(model, checks, n)
    rng = random.Random(8)
    codes: dict[str, int] = {}

    def decode(rid: str, prompt: list[int], mode: wpb.PrefillMode) -> DecodeCall:
        sampling = wpb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, top_p=1.0, repetition_penalty=1.0)
        return stub.Decode(
            wpb.DecodeRequest(
                request_id=rid,
                handoff=wpb.Handoff(prompt_token_ids=prompt, sampling=sampling),
                prefill_mode=mode,
                lease_ms=LEASE_MS,
            ),
            timeout=60,
        )

    def local_greedy(prompt: list[int]) -> list[int]:
        return [
            t
            for ev in decode(f"check-{rng.random()}", prompt, wpb.PREFILL_MODE_LOCAL)
            if ev.WhichOneof("event") == "tokens"
            for t in ev.tokens.token_ids
        ]

    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = wgrpc.DecodeWorkerStub(ch)
        for i in range(300):
            if i % 50 == 0:  # while the storm's leases still run, a check prompt's KV enters the prefix cache
                k = i // 50
                assert local_greedy(checks[k]) == want[k]
            call = decode(f"w{i % 7}", storm[i % len(storm)], wpb.PREFILL_MODE_REMOTE)  # ids reused at once
            if i % 3 == 0:
                try:
                    next(call)  # the reservation arrived: cancel right after it
                except grpc.RpcError:
                    pass
            else:
                time.sleep(rng.uniform(0, 0.004))  # a random point before, during or after reserving
            call.cancel()
            try:
                for _ in call:
                    pass
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            codes[code.name] = codes.get(code.name, 0) + 1
        # Let every lease the storm handed out run out: a reservation that outlived its request
        # would reset its blocks now, blocks the prefix cache holds for the check prompts by then.
        time.sleep(3 * LEASE_MS / 1000)
        got = [local_greedy(c) for c in checks]  # from the prefix cache
    print("reservation-window cancels:", codes)
    assert got == want
    assert set(codes) <= {"CANCELLED", "ALREADY_EXISTS", "OK"}, codes
    assert cluster.freed_while_reserved() == 0
    wait_all_blocks_free(cluster.all)


def test_a_request_id_reused_right_after_a_cancel_gets_its_answer(model, cluster):
    ids = chat(model, "Name three colours.")
    (want,) = expected(model, [ids], 6)

    async def body(stub, router):
        outcomes: dict[str, int] = {}
        for _ in range(40):
            # The previous round's cancel may not have reached the router yet (a refused second
            # request comes back at once): the id is in flight until it does, so retry, in time.
            t0 = time.monotonic()
            while True:
                first = stub.Generate(greedy(ids, 64, request_id="same"), timeout=60)
                try:
                    async for _ in first:
                        break
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() - t0 < 20, e
            first.cancel()
            t0 = time.monotonic()
            try:
                got = await tokens_of(stub.Generate(greedy(ids, 6, request_id="same"), timeout=30))
                assert got == want
                key = "OK"
            except grpc.aio.AioRpcError as e:
                key = e.code().name
            assert time.monotonic() - t0 < 20
            outcomes[key] = outcomes.get(key, 0) + 1
        return outcomes

    outcomes = asyncio.run(with_router(cluster.decode, cluster.prefill, model.tokenizer, body))
    print("reused ids:", outcomes)
    assert set(outcomes) <= {"OK", "ALREADY_EXISTS"} and outcomes.get("OK", 0) >= 20, outcomes
    wait_all_blocks_free(cluster.all)


def test_a_cancel_storm_gives_every_block_back_within_seconds(model, cluster):
    """600 cancels at random points of a request's life: queued at the router, prefilling, right
    after the first token (the prefill worker's, before decode has started), decoding."""
    prompts = [chat(model, LONG_PROMPT + t) for t in TOPICS] + [chat(model, f"Hi, {t}!") for t in TOPICS]
    rng = random.Random(11)
    stages: dict[str, int] = {}
    n = 600

    async def one(stub, i: int) -> None:
        call = stub.Generate(greedy(rng.choice(prompts), 48), timeout=120)
        stage = rng.choice(["queued", "prefill", "handover", "tokens"])
        stages[stage] = stages.get(stage, 0) + 1
        if stage in ("handover", "tokens"):
            k = 1 if stage == "handover" else rng.randint(2, 6)
            async for _ in call:
                k -= 1
                if k == 0:
                    break
        else:
            await asyncio.sleep(rng.uniform(0, 0.05 if stage == "queued" else 1.5))  # a random point to cancel at
        call.cancel()

    async def body(stub, router):
        sem = asyncio.Semaphore(24)

        async def bounded(i: int) -> None:
            async with sem:
                await one(stub, i)

        await asyncio.gather(*(bounded(i) for i in range(n)))
        t0 = time.monotonic()
        while router.generation.inflight:
            assert time.monotonic() - t0 < 10, f"{router.generation.inflight} requests still in flight"
            await asyncio.sleep(0.05)
        settled = time.monotonic() - t0
        reg = router.metrics.registry
        codes = {
            c: reg.get_sample_value("splitserve_router_requests_total", {"code": c}) or 0.0
            for c in ("OK", "CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL")
        }
        assert reg.get_sample_value("splitserve_router_inflight_requests") == 0
        return settled, settled + await asyncio.to_thread(wait_all_blocks_free, cluster.all, 15.0), codes

    settled, freed, codes = asyncio.run(
        with_router(
            cluster.decode, cluster.prefill, model.tokenizer, body, routing=RoutingConfig(local_prefill_max_tokens=32)
        )
    )
    print(
        f"cancel storm: {n} requests, stages {stages}; nothing in flight {settled:.2f} s and every block back "
        f"{freed:.2f} s after the last cancel; router codes {codes}"
    )
    # every request the router saw counted once, as cancelled (or finished just before its cancel),
    # and none failed; a cancel while queued may come before the call reached the router at all
    counted = codes["CANCELLED"] + codes["OK"]
    assert n - stages["queued"] <= counted <= n and codes["CANCELLED"] >= 0.9 * n, codes
    assert codes["UNAVAILABLE"] == codes["RESOURCE_EXHAUSTED"] == codes["INTERNAL"] == 0, codes
    for w in cluster.all:
        st = stats(w)
        assert (st.running_requests, st.queued_tokens) == (0, 0), st
    assert cluster.freed_while_reserved() == 0
