"""Overload on real processes: twice a decode worker's capacity in concurrent streams. What the
worker can hold (its seats plus its bounded waiting queue) is admitted and answered exactly as the
single-process engine answers; the rest is refused at once with RESOURCE_EXHAUSTED (HTTP 429),
in milliseconds, not queued until a deadline."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS, expected, wait_all_blocks_free, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SEATS, WAITING = 3, 3
CAPACITY = SEATS + WAITING


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


def test_twice_the_capacity_admits_what_fits_and_refuses_the_rest_at_once(model):
    tok = EngineTokenizer(model.tokenizer)
    prompts = [tok.encode_chat([("user", f"Name a colour, number {i}.")]) for i in range(2 * CAPACITY)]
    n = 24
    want = expected(model, prompts, n)
    d = spawn_worker("decode", *FLAGS, "--max-num-seqs", str(SEATS), "--max-waiting-requests", str(WAITING))
    try:

        async def one(stub, ids: list[int]) -> tuple[str, float, list[int]]:
            t = time.monotonic()
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
            try:
                out = [t for r in [r async for r in stub.Generate(req, timeout=240)] for t in r.token_ids]
            except grpc.aio.AioRpcError as e:
                return e.code().name, time.monotonic() - t, []
            return "OK", time.monotonic() - t, out

        async def body(stub, router):
            return await asyncio.gather(*(one(stub, ids) for ids in prompts))

        results = asyncio.run(with_router([d], [], model.tokenizer, body, routing=RoutingConfig(mode="colocated")))
        codes = [c for c, _, _ in results]
        print(
            "overload:",
            {c: codes.count(c) for c in set(codes)},
            "refusals took",
            sorted(round(s, 3) for c, s, _ in results if c != "OK"),
        )
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes.count("OK") >= CAPACITY and codes.count("RESOURCE_EXHAUSTED") >= CAPACITY // 2, codes
        for (code, _, out), w in zip(results, want, strict=True):
            if code == "OK":
                assert out == w  # admitted requests answered exactly, overload or not
        refusals = [s for c, s, _ in results if c == "RESOURCE_EXHAUSTED"]
        served = sorted(s for c, s, _ in results if c == "OK")
        assert max(refusals) < min(served)  # every refusal came before the first answer finished
        assert max(refusals) < 2.0  # at once: no queueing, no retry loop
        wait_all_blocks_free([d])
    finally:
        d.stop()
