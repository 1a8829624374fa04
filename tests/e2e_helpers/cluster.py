"""What the end-to-end tests on real worker processes share: worker flags, stats
and leak checks over gRPC, a router in this process in front of the workers,
the single-process engine's greedy answer to compare with, and a scrape of a
worker's Prometheus endpoint."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import grpc

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.workers.launch import WorkerProcess

T = TypeVar("T")

ENGINE_FLAGS = ("--dtype", "float32", "--num-blocks", "512", "--max-num-batched-tokens", "64", "--threads", "1")
# loopback workers without a cluster token (test_e2e_hostile checks the token on workers that have one)
FLAGS = (*ENGINE_FLAGS, "--insecure-no-cluster-token")


def stats(w: WorkerProcess, token: str | None = None) -> wpb.WorkerStats:
    """GetStats, with the cluster token when the worker has one."""
    with grpc.insecure_channel(w.grpc_address) as ch:
        stub = wgrpc.DecodeWorkerStub(ch) if w.role == "decode" else wgrpc.PrefillWorkerStub(ch)
        return stub.GetStats(wpb.StatsRequest(), timeout=10, metadata=(("x-splitserve-token", token),) if token else ())


def wait_all_blocks_free(workers: list[WorkerProcess], timeout_s: float = 30.0, token: str | None = None) -> float:
    """Until every worker has all its blocks free and nothing queued or running; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        s = [stats(w, token) for w in workers]
        if all(x.free_blocks == x.total_blocks and x.running_requests == 0 and x.queue_length == 0 for x in s):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(
                "blocks not returned: "
                + ", ".join(
                    f"{x.worker_id}: {x.free_blocks}/{x.total_blocks} free, {x.queue_length} queued, "
                    f"{x.running_requests} running"
                    for x in s
                )
            )
        time.sleep(0.05)


def expected(model: Any, prompts: list[list[int]], n: int, sampling: SamplingParams | None = None) -> list[list[int]]:
    """The single-process engine's output, `n` tokens each, EOS ignored: greedy, or as `sampling` says."""
    engine = Engine(model.config, model.weights, EngineConfig(num_blocks=512))
    params = replace(sampling or SamplingParams(temperature=0), max_tokens=n, ignore_eos=True)
    return engine.generate(prompts, params)


async def with_router(
    decode: list[WorkerProcess],
    prefill: list[WorkerProcess],
    tokenizer: Any,
    body: Callable[[pbg.GenerationStub, Router], Awaitable[T]],
    **sections: Any,
) -> T:
    """Run `body(stub, router)` against a router (in this process) in front of the workers;
    `sections`: RouterConfig's (routing=RoutingConfig(mode="colocated"), ...)."""
    router = Router(
        RouterConfig(**{"listeners": Listeners(grpc_port=0), **sections}),
        EngineTokenizer(tokenizer),
        decode=[w.grpc_address for w in decode],
        prefill=[w.grpc_address for w in prefill],
    )
    port = await router.start(0)
    await router.wait_for_workers(30)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await body(pbg.GenerationStub(ch), router)
    finally:
        await router.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, name: str) -> float:
    """The sum of a metric's samples (all label sets) on a Prometheus endpoint; 0 if absent."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
