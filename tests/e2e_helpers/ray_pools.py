"""What the end-to-end tests on real Ray share (one local node in test_e2e_ray, several raylets
in test_e2e_ray_multinode): Ray's token auth turned on before Ray is imported, a router in this
process in front of a PoolManager's actors, greedy requests and streams through it, stats and
leak checks straight from the workers, and the single-process engine's answer to compare with.

Importing this module sets Ray's auth environment: import it before anything imports Ray.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc

from splitserve.cluster.pool import PoolManager, PoolSpec
from splitserve.cluster.scaling import ScalingConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.router.workers import Role
from splitserve.workers.common.config import WorkerConfig

# Ray reads its auth settings once, when it is first imported, and nothing imports it while
# tests are collected: set them here, before any test runs, as `splitserve serve` does before
# its own import. (They stay set for the session, since Ray's import does too.)
os.environ["RAY_AUTH_MODE"] = "token"
if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

T = TypeVar("T")

NEW_TOKENS = 8
NUM_BLOCKS = 384
ENGINE = EngineConfig(dtype="float32", num_blocks=NUM_BLOCKS, max_num_batched_tokens=128)
DEADLINE_S = 180.0  # an actor's start (model load on a busy core) and any one wait below

CHATS = [
    [
        ("system", "You are a meticulous assistant for a railway company. Answer precisely and never invent rules."),
        ("user", "Can I get a refund if my train is two hours late, and does it matter whether I booked online?"),
    ],
    [
        ("system", "You are a meticulous assistant for a railway company. Answer precisely and never invent rules."),
        ("user", "What is the difference between a day return and an open return when travelling off-peak?"),
    ],
    [
        ("system", "You are a friendly cooking tutor. Explain techniques step by step."),
        ("user", "How do I caramelise onions without burning them, and how long should it take on a gas hob?"),
    ],
    [("user", "Say yes.")],
]

PARAGRAPH = (
    "The committee reviewed the quarterly figures for every depot, the maintenance backlog, the staffing "
    "plan for the winter timetable, the signalling upgrade between the two junctions, the complaints about "
    "crowding on the early services, and the proposal to move the ticket office into the new concourse. "
)


def burst_chat(i: int) -> list[tuple[str, str]]:
    """A long prompt (over 240 tokens, a few prefill chunks), distinct from its first tokens on, so
    that no prefix cache shortens another's prefill."""
    return [("user", f"Report {i}: summarise the minutes below in one line. " + PARAGRAPH * 4)]


def encode(model: Any, chats: list[list[tuple[str, str]]]) -> list[list[int]]:
    enc = EngineTokenizer(model.tokenizer)
    return [enc.encode_chat(c) for c in chats]


def reference(model: Any, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    engine = Engine(model.config, model.weights, ENGINE)
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


async def until(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.05)


async def until_actor_dead(ray: Any, actor: Any, timeout_s: float = 30.0) -> None:
    """ray.kill returns before the actor is gone: ask it until Ray says it died."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            await asyncio.wait_for(actor.ping.remote(), timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < end, "the actor still answers"
        await asyncio.sleep(0.05)


def counted(metric: Any, **labels: str) -> float:
    """A Prometheus counter's or gauge's value for these labels (0 if never set)."""
    for m in metric.collect():
        for s in m.samples:
            if s.labels == labels and not s.name.endswith("_created"):
                return float(s.value)
    return 0.0


@dataclass
class Cluster:
    router: Router
    pools: PoolManager
    channel: grpc.aio.Channel
    stub: pbg.GenerationStub
    token: str  # the control plane's cluster token

    async def generate(self, ids: list[int]) -> tuple[list[int], pb.Usage]:
        toks: list[int] = []
        usage = pb.Usage()
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        async for r in self.stub.Generate(req, timeout=DEADLINE_S):
            toks += list(r.token_ids)
            if r.HasField("usage"):
                usage = r.usage
        return toks, usage

    async def stream(self, ids: list[int], n: int, got: list[int]) -> list[int]:
        """`n` greedy tokens, appended to `got` as they arrive (so a test can watch the progress)."""
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        async for r in self.stub.Generate(req, timeout=DEADLINE_S):
            got += list(r.token_ids)
        return got

    async def stats(self, address: str, role: str) -> wpb.WorkerStats:
        """Straight from the worker, with the cluster token it requires."""
        async with grpc.aio.insecure_channel(address) as ch:
            stub = wgrpc.DecodeWorkerStub(ch) if role == "decode" else wgrpc.PrefillWorkerStub(ch)
            return await stub.GetStats(wpb.StatsRequest(), timeout=10, metadata=(("x-splitserve-token", self.token),))

    async def no_blocks_held(self) -> None:
        """Every worker's free blocks back to its total. The prefill worker frees its blocks when the
        decode worker confirms the KV, which may come after the client has its answer: poll."""
        end = time.monotonic() + 30
        while True:
            stats = [
                (a, await self.stats(a, role)) for role in ("prefill", "decode") for a, _ in self.pools.addresses(role)
            ]
            held = {a: s.total_blocks - s.free_blocks for a, s in stats if s.free_blocks != s.total_blocks}
            if not held:
                assert all(s.total_blocks == NUM_BLOCKS for _, s in stats)
                return
            assert time.monotonic() < end, f"blocks still held: {held}"
            await asyncio.sleep(0.05)

    def healthy(self, role: Role) -> list[str]:
        return [w.address for w in self.router.workers.healthy(role)]

    async def close(self) -> None:
        await self.channel.close()
        await self.pools.stop()
        await self.router.stop(0)


async def start_cluster(
    model: Any,
    prefill_scaling: ScalingConfig | None = None,
    *,
    resources: Mapping[Role, dict[str, float]] | None = None,
    worker_host: str = "127.0.0.1",
    num_cpus: float = 1.0,
    decode_scaling: ScalingConfig | None = None,
    node_types: Mapping[str, Mapping[str, float]] | None = None,
    prefill_tp: int = 1,
    decode_standby: int = 0,
) -> Cluster:
    """One prefill and one decode actor to start with; a pool scales if given a config.
    `resources`: each pool's custom Ray resources (its node type); `worker_host` as `serve
    --worker-host` ("auto": each worker listens on and advertises its Ray node's IP); `node_types`
    the autoscaler's, as `serve --node-types`; `prefill_tp` the prefill workers' tensor-parallel size
    (the decode pool's is 1: the KV transfer re-shards between them); `decode_standby` the decode
    workers kept warm and not routed to."""
    token = secrets.token_urlsafe(16)
    resources = resources or {}

    def spec(role: Role, scaling: ScalingConfig | None = None) -> PoolSpec:
        engine = replace(ENGINE, tensor_parallel_size=prefill_tp if role == "prefill" else 1)
        worker = WorkerConfig(role=role, engine=engine, host=worker_host, cluster_token=token, threads=1)
        standby = decode_standby if role == "decode" else 0
        return PoolSpec(
            role, 1, worker, num_cpus, resources=dict(resources.get(role, {})), scaling=scaling, standby=standby
        )

    specs = [spec("prefill", prefill_scaling), spec("decode", decode_scaling)]
    # disaggregated: every request goes through the prefill pool and the KV transfer
    cfg = RouterConfig(
        routing=RoutingConfig(mode="disaggregated"),
        listeners=Listeners(host="127.0.0.1", grpc_port=0, cluster_token=token),
    )
    router = Router(cfg, EngineTokenizer(model.tokenizer))
    port = await router.start()
    pools = PoolManager(
        specs,
        router.workers,
        start_timeout_s=DEADLINE_S,
        watch_interval_s=0.5,
        metrics=router.metrics,
        node_types=node_types,
    )
    try:
        await pools.start()
        await router.wait_for_workers(DEADLINE_S)
    except BaseException:
        await pools.stop()
        await router.stop(0)
        raise
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Cluster(router, pools, channel, pbg.GenerationStub(channel), token)


@dataclass
class Running:
    """A cluster living on an event loop of its own, which runs while a test runs it (so that a
    class of tests can share one cluster)."""

    loop: asyncio.AbstractEventLoop
    cluster: Cluster

    def run(self, scenario: Callable[[Cluster], Coroutine[Any, Any, T]]) -> T:
        return self.loop.run_until_complete(scenario(self.cluster))
