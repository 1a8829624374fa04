"""`splitserve bench router`: the router's own cost, against mock workers.

1. Added latency: one process hosts fake decode and prefill workers, another
   the router in front of them (gRPC on loopback). The client sends the same
   request straight to the fake decode worker (the direct path: Decode, plus
   Prefill in remote mode) and through the router (Generate), interleaved one
   by one, and reports the router path minus the direct path: for the whole
   request, for the first token, and per further token. The router runs in a
   process of its own on a core of its own, as deployed; the mock workers and
   the client share the other core.
2. Routing decisions per second of the pure policy on one core: prefix-index
   overlap, decode-worker cost over every worker, local/remote choice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, NamedTuple

from splitserve.router.event_loop import loop_name

TARGET_ADDED_P50_MS = 1.0
TARGET_DECISIONS_PER_S = 2000.0
STARTUP_TIMEOUT_S = 120.0  # a fleet of hundreds of mockers takes tens of seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=500, help="measured requests per path and mode")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--decode-workers", type=int, default=8, help="decode workers in the decisions benchmark")
    p.add_argument("--no-pin", action="store_true", help="do not pin the server and the client to separate cores")


def pct(xs: Sequence[float], q: float) -> float:
    """The nearest-rank percentile `q` of `xs` (nan for none)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


# ---------------------------------------------------------------- server side


def serve_workers(conn: mp.connection.Connection, tokens: int, cpu: int | None) -> None:
    """The mock workers' process: a fake decode and a fake prefill worker."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker

    async def main() -> None:
        kv = FakeKVPlane()
        script = [ord("a") + i % 26 for i in range(tokens)]
        d = FakeDecodeWorker(kv, script, total_blocks=1 << 20)
        p = FakePrefillWorker(kv, script)
        conn.send({"decode": await d.start(), "prefill": await p.start()})
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the client is done
        await d.stop()
        await p.stop()

    asyncio.run(main())


def serve_routers(conn: mp.connection.Connection, workers: dict[str, str], cpu: int | None) -> None:
    """The router's process: one router per mode, in front of the same mock workers."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import logging

    logging.disable(logging.WARNING)
    import grpc

    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.event_loop import run as run_loop
    from splitserve.router.server import Router
    from splitserve.router.tokenizer import ByteTokenizer

    class BareProxy(generate_pb2_grpc.GenerationServicer):
        """The floor for any gRPC-to-gRPC router in Python: forward, relay, nothing else."""

        def __init__(self, channel: grpc.aio.Channel) -> None:
            self.stub = wgrpc.DecodeWorkerStub(channel)

        async def Generate(  # noqa: N802 (the gRPC method name)
            self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[pb.GenerateResponse]:
            call = self.stub.Decode(
                wpb.DecodeRequest(
                    request_id=request.request_id,
                    handoff=wpb.Handoff(
                        prompt_token_ids=request.token_ids.ids,
                        sampling=wpb.SamplingParams(
                            max_tokens=request.sampling.max_tokens, ignore_eos=True, top_p=1.0, repetition_penalty=1.0
                        ),
                    ),
                    prefill_mode=wpb.PREFILL_MODE_LOCAL,
                ),
                timeout=30,
            )
            async for ev in call:
                if ev.WhichOneof("event") == "tokens":
                    yield pb.GenerateResponse(request_id=request.request_id, token_ids=ev.tokens.token_ids)

    async def main() -> None:
        bare_channel = grpc.aio.insecure_channel(workers["decode"])
        bare = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(BareProxy(bare_channel), bare)
        bare_port = bare.add_insecure_port("127.0.0.1:0")
        await bare.start()
        routers = {}
        for mode in ("colocated", "disaggregated"):
            cfg = RouterConfig(routing=RoutingConfig(mode=mode), listeners=Listeners(host="127.0.0.1", grpc_port=0))
            routers[mode] = Router(
                cfg, ByteTokenizer(), decode=[workers["decode"]], prefill=[workers["prefill"]], rng=random.Random(0)
            )
        ports = {m: await r.start() for m, r in routers.items()}
        for r in routers.values():
            await r.wait_for_workers()
        conn.send({"bare": f"127.0.0.1:{bare_port}", **{m: f"127.0.0.1:{port}" for m, port in ports.items()}})
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for r in routers.values():
            await r.stop(0)
        await bare.stop(0)
        await bare_channel.close()

    run_loop(main())  # the loop `splitserve router` and `splitserve serve` run on


# ---------------------------------------------------------------- client side


async def _latencies(addr: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    import grpc

    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc

    prompt = [random.Random(i).randrange(256) for i in range(args.prompt_tokens)]
    n = args.tokens
    channels = [grpc.aio.insecure_channel(a) for a in addr.values()]
    ch = dict(zip(addr, channels, strict=True))
    decode = wgrpc.DecodeWorkerStub(ch["decode"])
    prefill = wgrpc.PrefillWorkerStub(ch["prefill"])
    front = {m: generate_pb2_grpc.GenerationStub(ch[m]) for m in ("colocated", "disaggregated", "bare")}
    sampling = wpb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=n)

    async def direct(remote: bool, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = 0.0
        call = decode.Decode(
            wpb.DecodeRequest(
                request_id=f"d{i}",
                handoff=wpb.Handoff(prompt_token_ids=prompt, sampling=sampling),
                lease_ms=30000,
                prefill_mode=wpb.PREFILL_MODE_REMOTE if remote else wpb.PREFILL_MODE_LOCAL,
            ),
            timeout=30,
        )
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "reservation":
                await prefill.Prefill(
                    wpb.PrefillRequest(
                        request_id=f"d{i}",
                        handoff=wpb.Handoff(prompt_token_ids=prompt, sampling=sampling),
                        reservation=ev.reservation,
                    ),
                    timeout=30,
                )
                first = time.perf_counter()
            elif kind == "tokens" and not first:
                first = time.perf_counter()
        return time.perf_counter() - t0, first - t0

    async def routed(mode: str, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = 0.0
        req = pb.GenerateRequest(
            request_id=f"r{i}",
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        async for r in front[mode].Generate(req, timeout=30):
            if r.token_ids and not first:
                first = time.perf_counter()
        return time.perf_counter() - t0, first - t0

    out: dict[str, dict[str, list[float]]] = {}
    for mode, remote in (("colocated", False), ("disaggregated", True), ("bare", False)):
        res: dict[str, list[float]] = {k: [] for k in ("direct", "router", "direct_first", "router_first")}
        for i in range(args.warmup + args.requests):
            # alternate which path goes first, so drift hits both alike
            pair = [("direct", functools.partial(direct, remote, i)), ("router", functools.partial(routed, mode, i))]
            for name, fn in pair if i % 2 else pair[::-1]:
                total, first = await fn()
                if i >= args.warmup:
                    res[name].append(total)
                    res[name + "_first"].append(first)
        out[mode] = res
    for c in channels:
        await c.close()
    return out


# ---------------------------------------------------------------- decisions


def _decisions(args: argparse.Namespace) -> tuple[float, float]:
    from splitserve.engine.block_hash import block_hashes
    from splitserve.router.config import RoutingConfig
    from splitserve.router.policy import WorkerLoad, route
    from splitserve.router.prefix_index import PrefixIndex

    routing = RoutingConfig()
    rng = random.Random(0)
    workers = [f"10.0.0.{i}:7001" for i in range(args.decode_workers)]
    systems = [[rng.randrange(32000) for _ in range(args.prompt_tokens // 2)] for _ in range(16)]
    prompts = [systems[i % 16] + [rng.randrange(32000) for _ in range(args.prompt_tokens // 2)] for i in range(256)]
    hashes = [block_hashes(p, routing.block_size) for p in prompts]
    index = PrefixIndex()
    for i, h in enumerate(hashes):  # every worker holds some system prompts and some whole prompts
        index.stored(workers[i % len(workers)], h[: len(h) // 2 + i % 3])
    loads = {w: WorkerLoad(rng.randrange(4096), rng.randrange(65536), rng.randrange(4096), 4096) for w in workers}
    prefill = {f"10.0.1.{i}:7101": rng.randrange(10000) for i in range(4)}
    n = args.decisions
    t0 = time.perf_counter()
    for i in range(n):
        route(hashes[i % 256], args.prompt_tokens, index, loads, prefill, routing, rng)
    policy_rate = n / (time.perf_counter() - t0)
    m = max(1, n // 10)
    t0 = time.perf_counter()
    for i in range(m):
        route(
            block_hashes(prompts[i % 256], routing.block_size), args.prompt_tokens, index, loads, prefill, routing, rng
        )
    hashed_rate = m / (time.perf_counter() - t0)
    return policy_rate, hashed_rate


def start_process(
    target: Callable[..., object], *args: object, daemon: bool = True
) -> tuple[mp.process.BaseProcess, mp.connection.Connection]:
    """`target(pipe, *args)` in a fresh interpreter; the process and this end of the pipe. A daemon
    dies with this process but may not start processes of its own (router replicas)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=daemon)
    proc.start()
    return proc, parent


@contextlib.contextmanager
def mock_cluster(tokens: int, pin: bool) -> Iterator[tuple[dict[str, str], dict[str, str], int]]:
    """The mock workers' process and the routers' process: (the workers' addresses, each router's
    by mode and the bare proxy's, the routers' pid)."""
    with worker_and_router_processes((serve_workers, tokens), (serve_routers,), pin) as c:
        yield c.workers, c.routers, c.router_pid


class Processes(NamedTuple):
    workers: Any  # what the workers' process sent once listening
    routers: Any  # what the routers' process sent once ready
    router_pid: int
    workers_conn: mp.connection.Connection  # to send the workers' process more (it ends at "done")
    routers_conn: mp.connection.Connection  # the same, to the routers' process
    workers_pid: int = 0


@contextlib.contextmanager
def worker_and_router_processes(workers: tuple[Any, ...], routers: tuple[Any, ...], pin: bool) -> Iterator[Processes]:
    """Two processes: `workers` (a target and its arguments, called with a pipe first and the core
    to pin to last), which sends what its routers need, then `routers` (called with the pipe, what
    the workers sent, its arguments and its core), which sends what the client needs. Pinned: the
    routers on a core of their own (as deployed), the workers and this process (the client) on the
    other."""
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, other_cpu = (cpus[0], cpus[1]) if pin else (None, None)
    procs = []
    try:
        if pin:
            os.sched_setaffinity(0, {cpus[1]})
        wproc, wconn = start_process(workers[0], *workers[1:], other_cpu)
        procs.append((wproc, wconn))
        if not wconn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the mock workers did not start")
        sent = wconn.recv()
        # not a daemon: it may start router replicas; the `finally` below ends it
        rproc, rconn = start_process(routers[0], sent, *routers[1:], router_cpu, daemon=False)
        procs.append((rproc, rconn))
        if not rconn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the routers did not start")
        assert rproc.pid is not None
        assert wproc.pid is not None
        yield Processes(sent, rconn.recv(), rproc.pid, wconn, rconn, wproc.pid)
    finally:
        for proc, conn in reversed(procs):
            with contextlib.suppress(OSError):
                conn.send("done")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if pin:
            os.sched_setaffinity(0, set(cpus))


def run(args: argparse.Namespace) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    with mock_cluster(args.tokens, pin) as (workers, routers, _):
        lat = asyncio.run(_latencies({**workers, **routers}, args))
    if pin:
        os.sched_setaffinity(0, {cpus[0]})  # decisions: one core, alone
    policy_rate, hashed_rate = _decisions(args)
    if pin:
        os.sched_setaffinity(0, set(cpus))

    from splitserve.measure.hw import machine_line  # torch, which it imports, only once the figures are in

    print(machine_line())
    print(
        f"router overhead against mock workers: {args.requests} requests per path and mode after {args.warmup} warm-up,"
    )
    print(
        f"interleaved; {args.prompt_tokens}-token prompts, {args.tokens} tokens each; gRPC on loopback;"
        f" {'router process pinned to one core, mock workers and client to the other' if pin else 'unpinned'};"
        f" router event loop {loop_name()}"
    )
    print()
    print(f"{'mode':<14} {'path':<8} {'total p50':>10} {'total p99':>10} {'first p50':>10} {'first p99':>10}   (ms)")
    added: dict[str, tuple[float, float, float, float]] = {}
    for mode, r in lat.items():
        for path in ("direct", "router"):
            t, f = r[path], r[path + "_first"]
            print(
                f"{mode:<14} {path:<8} {pct(t, 50) * 1e3:10.3f} {pct(t, 99) * 1e3:10.3f} "
                f"{pct(f, 50) * 1e3:10.3f} {pct(f, 99) * 1e3:10.3f}"
            )
        paired = [a - b for a, b in zip(r["router"], r["direct"], strict=True)]
        paired_first = [a - b for a, b in zip(r["router_first"], r["direct_first"], strict=True)]
        per_token = (statistics.median(paired) - statistics.median(paired_first)) / max(1, args.tokens - 1)
        added[mode] = (pct(paired, 50), pct(paired, 99), pct(paired_first, 50), per_token)
    print()
    print(
        f"{'mode':<14} {'added p50':>10} {'added p99':>10} {'first-token p50':>16} {'per further token':>18}   "
        f"(ms, router minus direct, paired)"
    )
    for mode, (p50, p99, f50, tok) in added.items():
        print(f"{mode:<14} {p50 * 1e3:10.3f} {p99 * 1e3:10.3f} {f50 * 1e3:16.3f} {tok * 1e3:18.4f}")
    print("(bare: a gRPC pass-through proxy with no validation, routing or detokenization; the floor of the extra hop)")
    print()
    print(
        f"routing decisions per second, one core, {args.decode_workers} decode workers, "
        f"{args.prompt_tokens}-token prompts:"
    )
    print(f"  policy (prefix overlap + cost + mode):     {policy_rate:12,.0f} /s")
    print(f"  with the prompt's block hashing included:  {hashed_rate:12,.0f} /s")
    print()
    worst = max(a[0] for m, a in added.items() if m != "bare") * 1e3
    ok = worst <= TARGET_ADDED_P50_MS
    print(
        f"target added p50 <= {TARGET_ADDED_P50_MS:g} ms: {'PASS' if worst <= TARGET_ADDED_P50_MS else 'FAIL'} "
        f"(worst mode {worst:.3f} ms)"
    )
    dec_ok = policy_rate >= TARGET_DECISIONS_PER_S
    print(f"target >= {TARGET_DECISIONS_PER_S:,.0f} decisions/s: {'PASS' if dec_ok else 'FAIL'} ({policy_rate:,.0f}/s)")
    return 0 if ok and dec_ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
