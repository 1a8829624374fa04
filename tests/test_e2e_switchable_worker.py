"""A switchable worker serves either pool from one process: two of them behind the real router
(disaggregated: every prompt's KV crosses the KV plane), first A prefilling for B, then, with the
roles swapped at the router and no process restarted, B prefilling for A. The same greedy
requests give the same tokens both ways, the new decode worker holds the prompts' blocks
(the KV arrived there), and each engine ends with every block free. Real gRPC and TCP KV
transfer; the workers run in this process on a tiny model."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.common.either_role import EitherRoleConnector
from splitserve.workers.server import RunningWorker, start_worker
from tests.router_helpers import until_indexed
from tests.worker_helpers import assert_engine_empty

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CFG = tiny_model_config(vocab_size=512, num_layers=2)
WEIGHTS = random_weights(CFG, seed=3)
ENGINE = EngineConfig(num_blocks=256, max_num_batched_tokens=256)


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(40, 90))] for _ in range(n)]


async def generate(stub: Any, ids: list[int]) -> list[int]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    out: list[int] = []
    async for r in stub.Generate(req, timeout=60):
        out.extend(r.token_ids)
    return out


async def serve_both_ways(a: RunningWorker, b: RunningWorker) -> tuple[list[list[int]], list[list[int]]]:
    routing = RoutingConfig(mode="disaggregated", block_size=ENGINE.block_size)
    cfg = RouterConfig(listeners=Listeners(grpc_port=0), routing=routing)
    router = Router(cfg, ByteTokenizer(), decode=[b.grpc_address], prefill=[a.grpc_address])
    port = await router.start(0)
    try:
        await router.wait_for_workers(30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.GenerationStub(ch)
            before = [await generate(stub, ids) for ids in prompts(0)]
            # the pool manager's switch, at the router: out of one pool, into the other
            for w in (a, b):
                router.workers.remove(w.grpc_address)
            router.workers.add(b.grpc_address, "prefill")
            router.workers.add(a.grpc_address, "decode")
            await router.wait_for_workers(30)
            after = [await generate(stub, ids) for ids in prompts(0)]
            fresh = prompts(1, 1)[0]
            await generate(stub, fresh)
            # A decoded it: the prompt's KV, sent by B, is in A's prefix cache
            await until_indexed(router, block_hashes(fresh, ENGINE.block_size), on={a.grpc_address})
        return before, after
    finally:
        await router.stop()


def until_idle(w: RunningWorker, timeout_s: float = 10.0) -> None:
    """Until the worker reports nothing queued, running or held (a prefill's blocks are held until
    the decode worker confirms its KV, which may come after the client's last token)."""
    deadline = time.monotonic() + timeout_s
    while (s := w.loop.stats).running_requests or s.queue_length or w.loop.engine.scheduler.held:
        assert time.monotonic() < deadline, f"worker {w.cfg.role} still busy: {s}"
        time.sleep(0.01)


def switchable_worker(role: str) -> RunningWorker:
    return start_worker(WorkerConfig(role=role, engine=ENGINE, switchable=True), Engine(CFG, WEIGHTS, ENGINE))


def test_a_switchable_worker_serves_either_role_and_the_tokens_are_the_same_both_ways() -> None:
    a, b = switchable_worker("prefill"), switchable_worker("decode")
    try:
        assert a.kv_endpoint is not None and b.kv_endpoint is not None  # each can receive KV
        assert all(isinstance(w.loop.engine.connector, EitherRoleConnector) for w in (a, b))
        before, after = asyncio.run(serve_both_ways(a, b))
        assert after == before
        assert all(len(t) == 6 for t in before)
        for w in (a, b):
            until_idle(w)
            w.loop.stop()  # nothing touches the engine from here on
            assert_engine_empty(w.loop.engine)
    finally:
        for w in (a, b):
            w.stop()
