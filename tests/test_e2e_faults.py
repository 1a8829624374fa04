"""Failures on real processes (DESIGN.md, "When things fail"): a decode worker
killed mid-stream (the request migrates and the client's stream goes on,
token-identical, greedy or seeded), a prefill worker killed mid-prefill (the router re-prefills
elsewhere), and a client that cancels (no block leaks anywhere)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS, expected, stats, wait_all_blocks_free, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LONG_PROMPT = "Tell me everything you know about the history of the printing press, in detail. " * 12


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


# greedy, and seeded sampling: the replacement draws token i from (seed, sample, i) as the first worker would have
MIGRATED = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95, seed=7)]


@pytest.mark.parametrize("sampling", MIGRATED, ids=["greedy", "seeded"])
def test_decode_worker_killed_mid_stream_the_request_migrates(model, sampling):
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", "Count from one to one hundred in words.")])
    n = 48
    want = expected(model, [ids], n, sampling)[0]
    wire = pb.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, max_tokens=n, ignore_eos=True
    )
    d1, d2 = spawn_worker("decode", *FLAGS), spawn_worker("decode", *FLAGS)
    p = spawn_worker("prefill", *FLAGS)
    try:

        async def body(stub, router):
            got: list[int] = []
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=wire)
            killed = None
            async for r in stub.Generate(req, timeout=300):
                got += list(r.token_ids)
                if killed is None and len(got) >= 8:
                    killed = next(w for w in (d1, d2) if stats(w).running_requests > 0)
                    killed.kill()  # SIGKILL: no goodbye
            return got, killed, router.metrics.migrations._value.get()

        got, killed, migrations = asyncio.run(
            with_router([d1, d2], [p], model.tokenizer, body, routing=RoutingConfig(mode="disaggregated"))
        )
        assert got == want
        assert migrations >= 1
        survivors = [w for w in (d1, d2) if w is not killed] + [p]
        wait_all_blocks_free(survivors)
    finally:
        for w in (d1, d2, p):
            w.stop()


def test_prefill_worker_killed_mid_prefill_the_request_still_completes(model):
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", LONG_PROMPT)])
    want = expected(model, [ids], 8)[0]
    d = spawn_worker("decode", *FLAGS)
    # the first prefill worker is slowed to a crawl (one small chunk per step) so it can be killed mid-prefill
    p1 = spawn_worker(
        "prefill",
        "--dtype",
        "float32",
        "--num-blocks",
        "512",
        "--max-num-batched-tokens",
        "16",
        "--threads",
        "1",
        "--insecure-no-cluster-token",
    )
    p2 = spawn_worker("prefill", *FLAGS)
    try:

        async def body(stub, router):
            router.workers.remove(p2.grpc_address)  # the request must start on p1
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            )
            call = stub.Generate(req, timeout=300)
            deadline = time.monotonic() + 60
            while stats(p1).queued_tokens == 0:  # p1 has started on it
                assert time.monotonic() < deadline, "prefill never started"
                await asyncio.sleep(0.01)
            p1.kill()
            router.workers.add(p2.grpc_address, "prefill")
            got: list[int] = []
            async for r in call:
                got += list(r.token_ids)
            return got

        got = asyncio.run(
            with_router([d], [p1, p2], model.tokenizer, body, routing=RoutingConfig(mode="disaggregated"))
        )
        assert got == want
        wait_all_blocks_free([d, p2])
    finally:
        for w in (d, p1, p2):
            w.stop()


def test_client_cancel_frees_every_block(model):
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", LONG_PROMPT)])
    d, p = spawn_worker("decode", *FLAGS), spawn_worker("prefill", *FLAGS)
    try:

        async def body(stub, router):
            calls = []
            for i in range(4):
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids + [i]),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                )
                calls.append(stub.Generate(req, timeout=300))
            # two cancelled after their first token, two while still prefilling
            for c in calls[:2]:
                async for _ in c:
                    break
            for c in calls:
                c.cancel()

        asyncio.run(with_router([d], [p], model.tokenizer, body, routing=RoutingConfig(mode="disaggregated")))
        wait_all_blocks_free([d, p])
    finally:
        d.stop()
        p.stop()
