"""Prefix-aware routing in numbers: four decode workers behind the router, a
request sequence whose prompts share system prompts. The KV-aware router sends
each prompt where its prefix is cached; round-robin on the same sequence does
not. Real gRPC, real workers (in this process, tiny model)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import DecodePolicy, Listeners, RouterConfig, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.server import start_worker
from tests.router_helpers import until_indexed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CFG = tiny_model_config(vocab_size=512, num_layers=1)
WEIGHTS = random_weights(CFG, seed=2)
ENGINE = EngineConfig(num_blocks=512, max_num_batched_tokens=256)
SYSTEMS, PER_SYSTEM, DECODE_WORKERS = 12, 4, 4


def request_sequence(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(96)] for _ in range(SYSTEMS)]
    seq = [s + [rng.randrange(256) for _ in range(rng.randrange(4, 20))] for s in systems for _ in range(PER_SYSTEM)]
    rng.shuffle(seq)
    return seq


async def hit_rate(policy: DecodePolicy, prompts: list[list[int]]) -> float:
    workers = [
        start_worker(WorkerConfig(role="decode", engine=ENGINE), Engine(CFG, WEIGHTS, ENGINE))
        for _ in range(DECODE_WORKERS)
    ]
    routing = RoutingConfig(mode="colocated", decode_policy=policy, block_size=ENGINE.block_size)
    cfg = RouterConfig(listeners=Listeners(grpc_port=0), routing=routing)
    router = Router(cfg, ByteTokenizer(), decode=[w.grpc_address for w in workers], rng=random.Random(0))
    port = await router.start(0)
    try:
        await router.wait_for_workers(30)
        cached = total = 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.GenerationStub(ch)
            for ids in prompts:
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=2)
                )
                async for r in stub.Generate(req, timeout=60):
                    if r.HasField("usage"):
                        cached += r.usage.cached_tokens
                        total += r.usage.prompt_tokens
                # the next request must be routed knowing where this prompt's blocks are now
                await until_indexed(router, block_hashes(ids, ENGINE.block_size))
        return cached / total
    finally:
        await router.stop()
        for w in workers:
            w.stop()


def test_kv_aware_routing_hits_the_prefix_cache_far_more_than_round_robin() -> None:
    prompts = request_sequence()
    kv = asyncio.run(hit_rate("kv_aware", prompts))
    rr = asyncio.run(hit_rate("round_robin", prompts))
    print(f"prefix-cache hit rate: kv_aware {kv:.3f}, round_robin {rr:.3f}")
    # kv_aware: every request after the first of its system prompt hits (3 of 4)
    assert kv >= 0.6
    assert kv >= rr + 0.2
