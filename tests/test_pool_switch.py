"""The pool manager moves a worker between the pools in its own process (`PoolManager.switch`),
and the joint controller does so when one pool grows while the other shrinks. Real router,
real switchable workers (tiny model, in this process) handed out by a launcher that starts
nothing: the test counts every start the pool manager asks for."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest

from splitserve.cluster import joint
from splitserve.cluster.pool import PoolManager, PoolSpec
from splitserve.engine.block_hash import block_hashes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.policy import WorkerLoad
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.server import RunningWorker, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CFG = tiny_model_config(vocab_size=512, num_layers=2)
WEIGHTS = random_weights(CFG, seed=5)
ENGINE = EngineConfig(num_blocks=256, max_num_batched_tokens=256)
FRESH = list(range(100, 164))  # a prompt first seen after the move


def test_a_pool_that_grows_while_the_other_drains_takes_the_drained_worker() -> None:
    def load(tokens: int) -> WorkerLoad:
        return WorkerLoad(queued_tokens=0, running_tokens=tokens, free_blocks=10, total_blocks=10)

    loads = {"d1": load(50), "d2": load(5)}
    assert joint.switch({"prefill": (2, None), "decode": joint.resize(1, 2, loads)}) == ("decode", "d2")
    assert joint.switch({"prefill": (0, "p1"), "decode": (1, None)}) == ("prefill", "p1")
    assert joint.switch({"prefill": (2, None), "decode": (1, None)}) is None  # both grow
    assert joint.switch({"prefill": (0, "p1"), "decode": (0, "d1")}) is None  # both shrink


class Handout:
    """A launcher over workers started already: each start takes the next of its role."""

    def __init__(self, workers: dict[str, list[RunningWorker]]) -> None:
        self.idle = {role: list(ws) for role, ws in workers.items()}
        self.starts: list[str] = []
        self.stops: list[str] = []

    async def start(self, spec: Any, cfg: Any, timeout_s: float) -> tuple[Any, str, str | None]:
        self.starts.append(spec.role)
        w = self.idle[spec.role].pop(0)
        return w, w.grpc_address, w.kv_endpoint

    async def ping(self, handle: Any) -> None:
        return None

    async def stop(self, handle: Any) -> None:
        self.stops.append(handle.grpc_address)

    def kill(self, handle: Any) -> None:
        pass

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        pass


async def generate(stub: Any, ids: list[int]) -> list[int]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    return [t async for r in stub.Generate(req, timeout=60) for t in r.token_ids]


async def until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def switch_under_joint_control(workers: dict[str, list[RunningWorker]], monkeypatch: Any) -> dict[str, Any]:
    def spec(role: Any, n: int) -> PoolSpec:
        return PoolSpec(role, n, WorkerConfig(role=role, engine=ENGINE, switchable=True))

    routing = RoutingConfig(mode="disaggregated", block_size=ENGINE.block_size)
    router = Router(RouterConfig(listeners=Listeners(grpc_port=0), routing=routing), ByteTokenizer())
    port = await router.start(0)
    launcher = Handout(workers)
    pools = PoolManager([spec("prefill", 1), spec("decode", 2)], router.workers, launcher=launcher)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(60)] for _ in range(4)]
    try:
        await pools.start()
        await router.wait_for_workers(30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.GenerationStub(ch)
            before = [await generate(stub, ids) for ids in prompts]
            # the controller wants a second prefill worker and one decode worker fewer
            decision = joint.JointDecision(prefill=2, decode=1, reason="test")
            monkeypatch.setattr(joint, "decide", lambda cfg, obs, state: (decision, state))
            cfg = joint.JointConfig(0.5, 0.05, prefill_max=2, decode_max=2, drain_timeout_s=30)
            pools.joint_once(cfg, joint.JointState())
            counted = (pools.pending["prefill"], pools._routed_or_starting("decode"))
            await until(lambda: pools.switches["prefill"])
            (moved,) = [m.grpc_address for m in pools.members["prefill"] if m.worker_id.startswith("decode")]
            roles = {w.address: w.role for w in router.workers.all()}
            after = [await generate(stub, ids) for ids in prompts]
            router.workers.drain(workers["prefill"][0].grpc_address)  # the moved worker prefills alone
            await generate(stub, FRESH)
            pools.joint_once(cfg, joint.JointState())  # at its targets now: nothing starts, nothing moves
        return {
            "before": before,
            "after": after,
            "counted": counted,
            "roles": roles,
            "moved": moved,
            "starts": list(launcher.starts),
            "stops": list(launcher.stops),
            "pending": dict(pools.pending),
        }
    finally:
        await pools.stop()
        await router.stop()


def test_the_joint_controller_moves_a_decode_worker_to_the_prefill_pool_in_its_own_process(monkeypatch: Any) -> None:
    def worker(role: str) -> RunningWorker:
        return start_worker(WorkerConfig(role=role, engine=ENGINE, switchable=True), Engine(CFG, WEIGHTS, ENGINE))

    workers = {"prefill": [worker("prefill")], "decode": [worker("decode"), worker("decode")]}
    try:
        out = asyncio.run(switch_under_joint_control(workers, monkeypatch))
        hashes = block_hashes(FRESH, ENGINE.block_size)
        cached = {}
        for w in (*workers["prefill"], *workers["decode"]):
            w.loop.stop()  # nothing touches the engine from here on
            cached[w.grpc_address] = len(w.loop.engine.blocks.cached_prefix(hashes, len(FRESH) + 1))  # every full block
    finally:
        for ws in workers.values():
            for w in ws:
                w.stop()
    (stayed,) = {w.grpc_address for w in workers["decode"]} - {out["moved"]}
    # a decode worker moved: counted as starting in the prefill pool while it drained, and in the
    # decode pool no longer; then routed as a prefill worker
    assert out["counted"] == (1, 1)
    assert out["roles"][out["moved"]] == "prefill" and out["roles"][stayed] == "decode"
    assert sorted(out["starts"]) == ["decode", "decode", "prefill"]  # the three at start: none for the move
    assert out["stops"] == []  # nor stopped one
    assert out["pending"] == {"prefill": 0, "decode": 0}
    assert out["after"] == out["before"]  # the same greedy tokens with two prefill workers
    # the prompt sent once the first prefill worker drained was prefilled by the moved worker
    # (its blocks in its cache) and decoded by the other (the KV arrived there)
    full = len(FRESH) // ENGINE.block_size
    assert cached[out["moved"]] == cached[stayed] == full
    assert cached[workers["prefill"][0].grpc_address] == 0
