"""The KV tiers end to end over real gRPC (workers in this process, tiny model): a decode worker with a
host tier evicts a context from its pool; its block events tell the router the context is in its host
tier, its stats carry its measured speeds, and the second turn goes to it (an empty worker beside it
costs a whole recompute) and loads the context instead of prefilling it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

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
from splitserve.workers.server import start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CFG = tiny_model_config(vocab_size=512, num_layers=1)
WEIGHTS = random_weights(CFG, seed=2)
PLAIN = EngineConfig(num_blocks=16, max_num_batched_tokens=256)
TIERED = EngineConfig(num_blocks=16, max_num_batched_tokens=256, kv_host_tier_bytes=1 << 20)
rng = random.Random(5)
CONTEXT = [rng.randrange(256) for _ in range(128)]  # 8 blocks of 16
FILLER = [rng.randrange(256) for _ in range(250)]  # takes every block of the 16-block pool


async def generate(stub: pbg.GenerationStub, ids: list[int]) -> int:
    """The request's cached prompt tokens."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=2))
    cached = -1
    async for r in stub.Generate(req, timeout=60):
        if r.HasField("usage"):
            cached = r.usage.cached_tokens
    return cached


async def until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


def test_a_host_tier_hit_is_routed_to_and_loaded() -> None:
    asyncio.run(host_tier_hit())


async def host_tier_hit() -> None:
    tiered = start_worker(WorkerConfig(role="decode", engine=TIERED, worker_id="tiered"), Engine(CFG, WEIGHTS, TIERED))
    plain = start_worker(WorkerConfig(role="decode", engine=PLAIN, worker_id="plain"), Engine(CFG, WEIGHTS, PLAIN))
    routing = RoutingConfig(mode="colocated", block_size=PLAIN.block_size)
    router = Router(
        RouterConfig(listeners=Listeners(grpc_port=0), routing=routing),
        ByteTokenizer(),
        decode=[tiered.grpc_address],  # the first turns go to the tiered worker alone
        rng=random.Random(0),
    )
    port = await router.start(0)
    try:
        await router.wait_for_workers(30)
        hashes = block_hashes(CONTEXT, PLAIN.block_size)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.GenerationStub(ch)
            await generate(stub, CONTEXT)
            await generate(stub, FILLER)  # evicts the context into the host tier
            a = tiered.grpc_address
            await until(
                lambda: router.index.overlap_tiers(hashes).get(a) == ["host"] * len(hashes),
                "the tier's block events did not reach the router",
            )
            worker = router.workers.get(a)
            assert worker is not None
            await until(lambda: worker.load().speeds.prefill_tokens_per_s > 0, "no measured speeds in the stats")
            router.workers.add(plain.grpc_address, "decode")
            await until(lambda: len(router.workers.healthy("decode")) == 2, "the second worker did not join")
            cached = await generate(stub, CONTEXT + [7, 8, 9])
        assert cached == len(CONTEXT)  # routed to the tiered worker, its context loaded from the host tier
        assert tiered.loop.engine.tiers is not None and tiered.loop.engine.tiers.stats["host"].hits == len(hashes)
    finally:
        await router.stop()
        tiered.stop()
        plain.stop()
