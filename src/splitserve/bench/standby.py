"""`splitserve bench standby`: a pool grown from a standby worker against one grown by a cold
start, on real workers running the real model (the embedded SmolLM2) in a local Ray cluster.

Two clusters in turn, each the real Router and PoolManager in this process over one prefill and
one decode actor (disaggregated: every prompt's KV crosses the KV plane):
- cold: the decode pool grows by a new worker (a Ray actor started, the model loaded, warmed up);
- standby: the same pool with a standby decode worker (`--decode-standby`), which the grow hands
  to the router; another standby worker is started in its place, and the next grow waits for it.
At each grow the pool's serving decode worker is drained, so the request sent at that instant can
run only on the new one: its time to first token, from the grow, is the time from the scaling
decision to the first token a client sees on the new worker. Target from standby: under 1 s.

And a third cluster, of switchable workers (`serve --switch-roles`): one prefill and two decode
workers. The prefill pool grows by moving an idle decode worker (`PoolManager.switch`, in its own
process: no start, no model load) while its serving prefill worker is drained. With no prefill
worker the router prefills locally, so the request goes out the moment the router lists the moved
worker as a prefill worker; the figure is the time from the switch to that request's first token.
The moved worker goes back before the next repeat.

    splitserve bench standby [--repeats 3] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import statistics
import time
from typing import Any

from splitserve.bench.results_file import with_results

TARGET_S = 1.0  # issue 44: standby activation to first token
PROMPT = "Name three rivers in Europe and the seas they flow into."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, help="grows from standby (each waits for the standby refill)")
    p.add_argument("--cold-repeats", type=int, default=1, help="grows by a cold start")
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    # Ray's own plane under token auth, as `splitserve serve` starts it; read when Ray is imported
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING)
    try:
        cold = asyncio.run(_grows(0, args.cold_repeats))
        warm = asyncio.run(_grows(1, args.repeats))
        moved = asyncio.run(_switches(args.repeats))
    finally:
        ray.shutdown()
    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        "standby: the decode pool of a local Ray cluster (1 prefill + 1 decode actor, the embedded SmolLM2, one "
        "torch thread each, disaggregated) grown by one worker while its serving decode worker is drained; "
        "time from the grow to the first token of a request sent at that instant"
    )
    print()
    for name, times in (("cold start", cold), ("from standby", warm), ("role switch", moved)):
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name:>13}: median {statistics.median(times):.2f} s ({each} s)")
    ratio = statistics.median(cold) / statistics.median(warm)
    print()
    print(
        f"from standby {statistics.median(warm):.2f} s to the first token (target under {TARGET_S:g} s), "
        f"{ratio:.0f}x sooner than a cold start's {statistics.median(cold):.1f} s"
    )
    print(
        f"role switch {statistics.median(moved):.2f} s to the first token on the moved worker (an idle decode "
        f"worker drained, then routed as a prefill worker; no process started)"
    )
    return 0 if statistics.median(warm) < TARGET_S else 1


async def _grows(standby: int, repeats: int) -> list[float]:
    """A cluster with `standby` decode workers on standby, grown `repeats` times; each grow's time to
    the first token on the new worker."""
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg

    router, port, pools = await _cluster({"prefill": 1, "decode": 1}, decode_standby=standby)
    times = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbg.GenerationStub(channel)
            await _first_token(stub, "warm")  # the prefill worker and the router warmed up
            for i in range(repeats):
                while standby and not pools.standby["decode"]:  # the refill of the last grow
                    await asyncio.sleep(0.1)
                (old,) = [m for m in pools.members["decode"] if not m.draining]
                start = time.monotonic()
                router.workers.drain(old.grpc_address)  # routing sees no decode worker but the new one
                pools.grow("decode")
                await _first_token(stub, f"grow-{i}")
                times.append(time.monotonic() - start)
                await pools.retire("decode", old.grpc_address)
    finally:
        await pools.stop()
        await router.stop(0)
    return times


async def _cluster(workers: dict[str, int], decode_standby: int = 0, switchable: bool = False) -> tuple[Any, int, Any]:
    """The real Router (disaggregated) and PoolManager over `workers` Ray actors a pool, started and
    routable: (router, its port, the pool manager)."""
    from splitserve.cluster.pool import PoolManager, PoolSpec
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router
    from splitserve.workers.common.config import WorkerConfig

    token = secrets.token_urlsafe(16)
    engine = EngineConfig(num_blocks=512)

    def spec(role: Any) -> PoolSpec:
        worker = WorkerConfig(role=role, engine=engine, cluster_token=token, threads=1, switchable=switchable)
        return PoolSpec(role, workers[role], worker, 1.0, standby=decode_standby if role == "decode" else 0)

    cfg = RouterConfig(
        routing=RoutingConfig(mode="disaggregated"),
        listeners=Listeners(host="127.0.0.1", grpc_port=0, cluster_token=token),
    )
    router = Router(cfg, EngineTokenizer(load_tokenizer(None)))
    port = await router.start()
    pools = PoolManager([spec("prefill"), spec("decode")], router.workers, metrics=router.metrics)
    try:
        await pools.start()
        await router.wait_for_workers(180)
    except BaseException:
        await pools.stop()
        await router.stop(0)
        raise
    return router, port, pools


async def _switches(repeats: int) -> list[float]:
    """A cluster of one prefill and two decode switchable workers; `repeats` times, the prefill pool
    grown by a decode worker's switch while its prefill worker is drained: each switch's time to the
    first token of a request the moved worker prefills."""
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg

    router, port, pools = await _cluster({"prefill": 1, "decode": 2}, switchable=True)
    times = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbg.GenerationStub(channel)
            await _first_token(stub, "warm")
            (prefill,) = [m.grpc_address for m in pools.members["prefill"]]
            for i in range(repeats):
                moved = pools.members["decode"][0].grpc_address
                start = time.monotonic()
                router.workers.drain(prefill)  # only the moved worker may prefill the next request
                pools.switch("decode", moved)
                while not router.workers.healthy("prefill"):
                    await asyncio.sleep(0.005)
                await _first_token(stub, f"switch-{i}")
                times.append(time.monotonic() - start)
                # back as it was: the moved worker to the decode pool, the prefill worker routable again
                pools.switch("prefill", moved)
                while len(pools.members["decode"]) < 2 or pools.pending["decode"]:
                    await asyncio.sleep(0.05)
                router.workers.remove(prefill)
                router.workers.add(prefill, "prefill")
                await router.wait_for_workers(60)
    finally:
        await pools.stop()
        await router.stop(0)
    return times


async def _first_token(stub: Any, rid: str) -> None:
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(
        request_id=rid, text=PROMPT, sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    async for r in stub.Generate(req, timeout=300):
        if r.token_ids:
            return
    raise RuntimeError(f"request {rid} ended with no token")
