"""End to end over a real throttled link: prefill workers inside a network namespace whose veth
link `tc` shapes to 1 Gb/s (bench/transfer_link.py), the decode worker and the router outside it,
the KV crossing the link over kv_transfer TCP. Needs CAP_NET_ADMIN (root); skipped without it.

- `--kv-wire-codec raw` across the link: greedy tokens identical to the single-process engine
  (the codec that keeps the KV exact).
- `--kv-wire-codec int8` across the link: greedy tokens identical to the same codec over loopback
  (the link neither drops nor alters a byte, and the codec is deterministic), its frames counted
  as int8 at about half the bytes; int8 is lossy, so these are not compared with the engine's.
- `--kv-wire-codec auto` with `--kv-link-gbps 1` (the link stated, not measured): int8 across the
  link from the first stream.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from splitserve.bench.transfer_link import ThrottledLink, net_admin_refusal
from splitserve.bench.transfer_netns import metrics_address, spawn, stop_all, wait_ready, wire_bytes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.workers.launch import WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(net_admin_refusal() is not None, reason=f"a throttled link: {net_admin_refusal()}"),
]

NEW_TOKENS = 8
CHUNK = 64  # the workers' prefill chunk, and the reference engine's (the same sums in the same order)
FLAGS = ["--dtype", "float32", "--num-blocks", "256", "--max-num-batched-tokens", str(CHUNK), "--threads", "1"]
PROMPTS = [
    "The railway timetable changes in May. Which trains still stop at the small stations on the coast line, "
    "and how do I get a refund for a season ticket that I can no longer use because of the new timetable?",
    "Explain, step by step and with one example each, why a mutable default argument in a Python function "
    "surprises people, and what to write instead when the function must start from an empty list each time.",
]


@dataclass
class Cluster:
    link: ThrottledLink
    token: str
    workers: dict[str, WorkerProcess]  # by name: decode-link, decode-lo, ns-raw, ns-int8, ns-auto, lo-int8


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    token = secrets.token_hex(16)
    with ThrottledLink(1.0) as link, tempfile.TemporaryDirectory(prefix="splitserve-e2e-netns-") as tmp:
        inside = link.exec_prefix
        plan = {
            "decode-link": ("decode", [*FLAGS, "--host", link.outer_host], []),
            "decode-lo": ("decode", [*FLAGS, "--host", "127.0.0.1"], []),
            "ns-raw": ("prefill", [*FLAGS, "--host", link.inner_host, "--kv-wire-codec", "raw"], inside),
            "ns-int8": ("prefill", [*FLAGS, "--host", link.inner_host, "--kv-wire-codec", "int8"], inside),
            "ns-auto": ("prefill", [*FLAGS, "--host", link.inner_host, "--kv-link-gbps", "1"], inside),
            "lo-int8": ("prefill", [*FLAGS, "--host", "127.0.0.1", "--kv-wire-codec", "int8"], []),
        }
        starting = [spawn(role, flags, tmp, name, prefix, None, token) for name, (role, flags, prefix) in plan.items()]
        try:
            workers = wait_ready(starting, 300)
            yield Cluster(link, token, dict(zip(plan, workers, strict=True)))
        finally:
            stop_all([s.proc for s in starting])


def generate(c: Cluster, tokenizer, decode: str, prefill: str, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens through a router forcing remote prefill on `prefill` for `decode`."""

    async def run() -> list[list[int]]:
        cfg = RouterConfig(
            routing=RoutingConfig(mode="disaggregated"),
            listeners=Listeners(host="127.0.0.1", grpc_port=0, cluster_token=c.token),
        )
        router = Router(
            cfg, tokenizer, decode=[c.workers[decode].grpc_address], prefill=[c.workers[prefill].grpc_address]
        )
        port = await router.start(0)
        await router.wait_for_workers(60)
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pbg.GenerationStub(ch)
                for ids in prompts:  # one at a time: each stream alone on the link
                    req = pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=ids),
                        sampling=pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                    )
                    toks: list[int] = []
                    async for r in stub.Generate(req, timeout=300):
                        toks += list(r.token_ids)
                    out.append(toks)
        finally:
            await router.stop()
        return out

    return asyncio.run(run())


def expected(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The single-process engine's greedy tokens, prefilled in the workers' chunks."""
    engine = Engine(model.config, model.weights, EngineConfig(num_blocks=256, max_num_batched_tokens=CHUNK))
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def encode(model, texts: list[str]) -> list[list[int]]:
    return [model.tokenizer.encode(t) for t in texts]


def sent(c: Cluster, name: str) -> dict[str, float]:
    return wire_bytes(metrics_address(c.workers[name]))


def test_raw_across_the_link_gives_the_engines_greedy_tokens(model, cluster):
    ids = encode(model, PROMPTS)
    got = generate(cluster, EngineTokenizer(model.tokenizer), "decode-link", "ns-raw", ids)
    assert got == expected(model, ids, NEW_TOKENS)
    bytes_by_codec = sent(cluster, "ns-raw")
    assert bytes_by_codec.get("raw", 0) > 0 and bytes_by_codec.get("int8", 0) == 0, bytes_by_codec


def test_int8_across_the_link_gives_the_same_tokens_as_over_loopback(model, cluster):
    ids = encode(model, [p + " Answer briefly." for p in PROMPTS])  # not cached on either decode worker
    tok = EngineTokenizer(model.tokenizer)
    across = generate(cluster, tok, "decode-link", "ns-int8", ids)
    local = generate(cluster, tok, "decode-lo", "lo-int8", ids)
    assert across == local
    assert all(len(t) == NEW_TOKENS for t in across)
    for name in ("ns-int8", "lo-int8"):
        bytes_by_codec = sent(cluster, name)
        assert bytes_by_codec.get("int8", 0) > 0 and bytes_by_codec.get("raw", 0) == 0, (name, bytes_by_codec)


def test_auto_with_the_link_stated_sends_int8_across_it(model, cluster):
    ids = encode(model, [PROMPTS[0] + " Say it in one line."])
    got = generate(cluster, EngineTokenizer(model.tokenizer), "decode-link", "ns-auto", ids)
    assert len(got[0]) == NEW_TOKENS
    assert got[0][0] == expected(model, ids, 1)[0][0]  # the first token is the prefill worker's, from exact KV
    bytes_by_codec = sent(cluster, "ns-auto")
    assert bytes_by_codec.get("int8", 0) > 0 and bytes_by_codec.get("raw", 0) == 0, bytes_by_codec
