"""End to end on real processes: a prefill worker and a decode worker as
separate processes running SmolLM2, the router's gRPC front door, the KV cache
streamed over kv_transfer (TCP, and UCX where ucxx is installed). Greedy
outputs must be token-identical to the single-process engine, for concurrent
requests of mixed lengths, shared prefixes hitting the prefix cache on both
sides, and short requests the router sends to local prefill. A seeded sampled
request gives the same text colocated and disaggregated."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import replace

import grpc
import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NEW_TOKENS = 12
NUM_BLOCKS = 1024
ENGINE_FLAGS = (
    "--dtype",
    "float32",
    "--num-blocks",
    str(NUM_BLOCKS),
    "--max-num-batched-tokens",
    "128",
    "--threads",
    "1",
    "--insecure-no-cluster-token",  # loopback only
)
TRANSPORTS = ["tcp"] + (["ucx"] if importlib.util.find_spec("ucxx") else [])

SYSTEMS = [
    "You are a meticulous assistant for a railway company. Answer questions about timetables, tickets, "
    "delays and refunds precisely, citing the relevant rule number when you can, and never invent rules.",
    "You are a friendly cooking tutor. Explain techniques step by step, suggest substitutions for missing "
    "ingredients, and always mention food safety where it matters, such as cooking temperatures.",
    "You are a senior Python reviewer. Point out bugs first, then style issues, and keep every comment "
    "short and actionable, with a corrected snippet when a fix is not obvious from the text alone.",
]
# long enough that, even with the system prompt cached, the uncached suffix goes to the prefill pool
DETAIL = " Please be thorough: give the reasoning, the caveats, and one concrete example of each case you mention."
QUESTIONS = [
    "Can I get a refund if my train is two hours late, and does it matter whether I booked online?" + DETAIL,
    "How do I caramelise onions without burning them, and how long should it take on a gas hob?" + DETAIL,
    "Is it fine to use a mutable default argument in a function signature, for example a list?" + DETAIL,
    "What is the difference between a day return and an open return when travelling off-peak?" + DETAIL,
    "My bread is dense and does not rise much, even though I follow the recipe. What went wrong?" + DETAIL,
    "Review this function and its test: def add(a, b): return a - b; assert add(2, 2) == 4" + DETAIL,
]
SHORT = ["Hi", "2+2?", "Name a colour.", "Say yes."]  # they share the template's default system prompt


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


def prompts(tokenizer) -> list[list[int]]:
    chats = [[("system", s), ("user", q)] for s in SYSTEMS for q in QUESTIONS]  # 18 sharing 3 prefixes
    chats += [[("user", q)] for q in SHORT]  # short: the router prefills these locally
    enc = EngineTokenizer(tokenizer)
    return [enc.encode_chat(c) for c in chats]


def reference(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    engine = Engine(model.config, model.weights, EngineConfig(num_blocks=NUM_BLOCKS, max_num_batched_tokens=128))
    return engine.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))


async def generate(stub, ids: list[int]) -> tuple[list[int], pb.Usage]:
    toks: list[int] = []
    usage = pb.Usage()
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    async for r in stub.Generate(req, timeout=300):
        toks += list(r.token_ids)
        if r.HasField("usage"):
            usage = r.usage
    return toks, usage


def worker_stats(address: str, role: str) -> wpb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        stub = wgrpc.DecodeWorkerStub(ch) if role == "decode" else wgrpc.PrefillWorkerStub(ch)
        return stub.GetStats(wpb.StatsRequest(), timeout=10)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disaggregated_greedy_matches_single_process_engine(model, transport):
    ids = prompts(model.tokenizer)
    expected = reference(model, ids)
    decode = spawn_worker("decode", *ENGINE_FLAGS, "--kv-transport", transport)
    prefill = spawn_worker("prefill", *ENGINE_FLAGS)
    try:

        async def run() -> tuple[list[tuple[list[int], pb.Usage]], Router]:
            # a backlog far above the wave's: every prompt with a question goes remote (at the default
            # 700 the wave's own queue, charged when routed, sends some to the idle decode worker)
            routing = RoutingConfig(mode="auto", local_prefill_max_tokens=24, prefill_backlog_tokens=1 << 20)
            cfg = RouterConfig(routing=routing, listeners=Listeners(grpc_port=0))
            router = Router(
                cfg, EngineTokenizer(model.tokenizer), decode=[decode.grpc_address], prefill=[prefill.grpc_address]
            )
            port = await router.start(0)
            await router.wait_for_workers(30)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    stub = pbg.GenerationStub(ch)
                    # first one request per system prompt, so that the rest find its prefix cached
                    first = [k * len(QUESTIONS) for k in range(len(SYSTEMS) + 1)]
                    wave1 = await asyncio.gather(*[generate(stub, ids[i]) for i in first])
                    rest = [i for i in range(len(ids)) if i not in first]
                    wave2 = await asyncio.gather(*[generate(stub, ids[i]) for i in rest])
            finally:
                await router.stop()
            out: list = [None] * len(ids)
            for i, r in zip(first + rest, wave1 + wave2, strict=True):
                out[i] = r
            return out, router

        results, router = asyncio.run(run())
        assert len(results) >= 20
        for i, ((got, usage), want) in enumerate(zip(results, expected, strict=True)):
            assert got == want, f"request {i} ({len(ids[i])} prompt tokens) differs"
            assert usage.prompt_tokens == len(ids[i]) and usage.completion_tokens == NEW_TOKENS

        decisions = {
            s.labels["mode"]: s.value
            for m in router.metrics.decisions.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        # every request with a question goes remote; short ones after the first find the default system
        # prompt cached on the decode worker and prefill locally
        assert decisions.get("remote", 0) >= len(SYSTEMS) * len(QUESTIONS), decisions
        assert decisions.get("local", 0) >= len(SHORT) - 1, decisions
        assert sum(u.cached_tokens for _, u in results) > 0  # the decode worker's prefix cache hit

        # every block comes back: nothing leaked on either side. The prefill worker returns the first
        # token before the decode worker confirms the last KV byte, and frees its blocks on that
        # confirmation, so its count may still be settling when the client has its answer.
        deadline = time.monotonic() + 30
        while True:
            d, p = worker_stats(decode.grpc_address, "decode"), worker_stats(prefill.grpc_address, "prefill")
            if d.free_blocks == p.free_blocks == NUM_BLOCKS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert d.free_blocks == d.total_blocks == NUM_BLOCKS
        assert p.free_blocks == p.total_blocks == NUM_BLOCKS
        assert d.prefix_cache_hits > 0 and p.prefix_cache_hits > 0
        if transport == "ucx":
            assert "(ucx)" in decode.log()
    finally:
        decode.stop()
        prefill.stop()


SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)


async def generate_text(stub, ids: list[int], p: SamplingParams) -> tuple[list[int], str]:
    sampling = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos
    )
    toks: list[int] = []
    text = ""
    async for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling), timeout=300):
        toks += list(r.token_ids)
        text += r.text
    return toks, text


def test_a_seed_gives_the_same_text_colocated_and_disaggregated(model):
    """Disaggregated, the prefill worker draws token 0 and the decode worker the rest; colocated (run
    second, on a decode worker that has the prompts cached now) one worker draws them all."""
    ids = [prompts(model.tokenizer)[i] for i in (0, 7, 14)]
    engine = Engine(model.config, model.weights, EngineConfig(num_blocks=NUM_BLOCKS, max_num_batched_tokens=128))
    want = engine.generate(ids, SEEDED)
    assert want != engine.generate(ids, replace(SEEDED, temperature=0))  # it samples: the test can tell draws apart
    decode = spawn_worker("decode", *ENGINE_FLAGS)
    prefill = spawn_worker("prefill", *ENGINE_FLAGS)
    try:

        async def body(stub, router):
            return await asyncio.gather(*[generate_text(stub, x, SEEDED) for x in ids])

        got = {
            mode: asyncio.run(with_router([decode], [prefill], model.tokenizer, body, routing=RoutingConfig(mode=mode)))
            for mode in ("disaggregated", "colocated")
        }
        assert [t for t, _ in got["disaggregated"]] == want
        assert got["colocated"] == got["disaggregated"]  # the same tokens and the same text
        assert all(text for _, text in got["colocated"])
    finally:
        decode.stop()
        prefill.stop()
