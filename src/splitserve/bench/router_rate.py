"""`splitserve bench router-rate`: the highest request rate one router sustains while adding at
most 5 ms at p99 (issue 44), in front of a mocker fleet of a given size.

The real Router (its own process, pinned to one core, on `splitserve router`'s event loop)
stands in front of mocker workers (bench/mocker/: the real worker services, steps timed by the
planner's model), which share the other core with the client. The client sends open-loop Poisson
arrivals at each rate of a ladder, each request a distinct prompt (no prefix hit helps it),
`--tokens` out. At each rate R the router gets Poisson arrivals at R, and between them, in the
same window, as many requests go straight to the workers (the client does what the router does:
Decode on the decode worker with the fewest of its requests, Prefill with its reservation on a
prefill worker): arrivals at 2R, alternately routed and direct. The router's added latency at R is
the p99 request latency through it less the direct requests' p99, so the fleet's own queueing and
the machine's drift, which both meet at once, are not counted as the router's (the fleet carries
2R). The process CPU of both sides is
printed beside it: where the fleet's core saturates before the router's, the figure is the
fleet's limit, a lower bound on the router's.

    splitserve bench router-rate --decode-workers 64 --prefill-workers 16 [--rates 10,50,100,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.bench.mocker.cluster import serve_mockers, serve_router
from splitserve.bench.mocker.main import add_costs_arguments
from splitserve.bench.mocker.tokens import expected_tokens
from splitserve.bench.results_file import with_results
from splitserve.bench.router import pct, worker_and_router_processes
from splitserve.bench.router_load import distinct_prompt, generated, own_channels, window_cpu
from splitserve.router.event_loop import loop_name

ADDED_P99_S = 0.005  # issue 44: the router adds at most 5 ms at p99
SATURATED = 2.0  # the direct path's p99 over this many times the first rate's: the fleet's queue


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-workers", type=int, default=16)
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="tokens out per request")
    p.add_argument("--rates", default="10,40,80,120,160,200,240,280", help="req/s, ascending; the first is the base")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds of each rate")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    add_costs_arguments(p)


@dataclass(frozen=True)
class Step:
    rate: float
    latencies_s: tuple[float, ...]  # through the router: requests that arrived in the measured window
    direct_s: tuple[float, ...]  # those straight to the workers, between them
    lost: int
    wrong: int
    router_cores: float
    fleet_cores: float  # the fleet's process, carrying both paths (the client's is not counted)

    @property
    def p99(self) -> float:
        return pct(self.latencies_s, 99)

    @property
    def added_p99(self) -> float:
        return self.p99 - pct(self.direct_s, 99)


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.rates.split(",")]
    if len(rates) < 2 or rates != sorted(rates) or rates[0] <= 0:
        print("splitserve bench router-rate: --rates needs two or more ascending positive rates", flush=True)
        return 2
    pin = len(os.sched_getaffinity(0)) >= 2
    with worker_and_router_processes((serve_mockers, args), (serve_router, "disaggregated", 1), pin) as c:
        steps = asyncio.run(_ladder(c.workers, c.routers["router"], (c.router_pid, c.workers_pid), rates, args))
        fleet_line = c.workers["line"]
    print_report(args, steps, fleet_line, pin)
    return 0


async def _ladder(
    fleet: dict, address: str, pids: tuple[int, int], rates: Sequence[float], args: argparse.Namespace
) -> list[Step]:
    """Each rate on both paths, their connections made once for the whole ladder (a connection made
    inside a measured window would cost that request its setup)."""
    direct, routed = Direct(fleet), Routed(address)
    await direct.open()
    await routed.open()
    try:
        await direct.connect_every_pair()
        steps: list[Step] = []
        for rate in rates:
            steps.append(await _one_rate((routed, direct), pids, rate, args))
            if steps[-1].lost or steps[-1].added_p99 > 20 * ADDED_P99_S:
                break  # far past the knee: the higher rates only queue
        return steps
    finally:
        await direct.close()
        await routed.close()


class Routed:
    """Generate through the router; the tokens are checked against the mockers' sequence."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def open(self) -> None:
        from splitserve.proto.splitserve.v1 import generate_pb2_grpc

        self.channels = own_channels(self.address, 4)
        self.stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in self.channels]

    async def send(self, i: int, rid: str, ids: list[int], tokens: int) -> bool:
        got = await generated(self.stubs[i % len(self.stubs)], rid, ids, tokens)
        return got == expected_tokens(ids, tokens)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


class Direct:
    """What the router does, done by the client: Decode on the decode worker with the fewest of its
    requests in flight, then Prefill with its reservation on the prefill worker with the fewest (the
    router's choice without prefix hits, by its own count, so that both paths load the fleet alike)."""

    def __init__(self, fleet: dict) -> None:
        self.decode_addresses, self.prefill_addresses = fleet["decode"], fleet["prefill"]

    async def open(self) -> None:
        import grpc

        from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc

        self.channels = [grpc.aio.insecure_channel(a) for a in self.decode_addresses + self.prefill_addresses]
        n = len(self.decode_addresses)
        self.decode = [wgrpc.DecodeWorkerStub(ch) for ch in self.channels[:n]]
        self.prefill = [wgrpc.PrefillWorkerStub(ch) for ch in self.channels[n:]]
        self.decoding = [0] * len(self.decode)
        self.prefilling = [0] * len(self.prefill)

    async def send(self, i: int, rid: str, ids: list[int], tokens: int, pair: tuple[int, int] | None = None) -> bool:
        """`pair`: this decode and prefill worker (by index) rather than the least busy."""
        from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb

        sampling = wpb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=tokens)
        sampling.ignore_eos = True
        handoff = wpb.Handoff(prompt_token_ids=ids, sampling=sampling)
        d = _fewest(self.decoding, i) if pair is None else pair[0]
        self.decoding[d] += 1
        try:
            call = self.decode[d].Decode(
                wpb.DecodeRequest(
                    request_id=rid, handoff=handoff, lease_ms=30000, prefill_mode=wpb.PREFILL_MODE_REMOTE
                ),
                timeout=60,
            )
            async for ev in call:
                if ev.WhichOneof("event") == "reservation":
                    p = _fewest(self.prefilling, i) if pair is None else pair[1]
                    self.prefilling[p] += 1
                    try:
                        request = wpb.PrefillRequest(request_id=rid, handoff=handoff, reservation=ev.reservation)
                        await self.prefill[p].Prefill(request, timeout=60)
                    finally:
                        self.prefilling[p] -= 1
        finally:
            self.decoding[d] -= 1
        return True  # the first token comes with the prefill's handoff: not checked here

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()

    async def connect_every_pair(self, concurrency: int = 32) -> None:
        """One short request over every (decode, prefill) pair: each prefill worker's KV connection
        to each decode worker is made once, before anything is measured (a deployment's are warm;
        a cold one costs its first request a connection setup, which neither path should pay)."""
        import grpc

        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(0)

        async def one(d: int, p: int) -> bool:
            async with gate:
                try:
                    return await self.send(0, f"warm-{d}-{p}", distinct_prompt(rng), 1, (d, p))
                except grpc.aio.AioRpcError:
                    return False  # its connection is made all the same, or the measured requests say why

        t0 = time.monotonic()
        pairs = [(d, p) for d in range(len(self.decode)) for p in range(len(self.prefill))]
        done = await asyncio.gather(*(one(d, p) for d, p in pairs))
        print(
            f"every prefill-decode pair connected first: {len(pairs)} pairs in {time.monotonic() - t0:.1f} s, "
            f"{len(pairs) - sum(done)} of their requests failed"
        )


def _fewest(inflight: list[int], i: int) -> int:
    """The index with the fewest in flight, ties broken in turn from `i`."""
    n = len(inflight)
    return min(range(n), key=lambda k: (inflight[k], (k - i) % n))


async def _one_rate(paths: tuple[Routed, Direct], pids: tuple[int, int], rate: float, args: argparse.Namespace) -> Step:
    """Poisson arrivals at 2 x `rate`, alternately sent along each of `paths`."""
    import grpc

    rng = random.Random(args.seed + int(rate))
    start = time.monotonic()
    t_measured, t_end = start + args.warmup_seconds, start + args.warmup_seconds + args.seconds
    latencies: tuple[list[float], list[float]] = ([], [])
    lost = wrong = 0

    async def one(i: int, at: float, ids: list[int]) -> None:
        nonlocal lost, wrong
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        t0 = time.monotonic()
        try:
            wrong += not await paths[i % 2].send(i // 2, f"r{rate:g}-{i}", ids, args.tokens)
        except grpc.aio.AioRpcError as e:
            lost += 1
            print(f"request {i} at {rate:g} req/s lost: {e.code().name} {e.details()}", flush=True)
            return
        if t_measured <= at < t_end:
            latencies[i % 2].append(time.monotonic() - t0)

    arrivals, t = [], start
    while t < t_end:
        t += rng.expovariate(2 * rate)
        arrivals.append((t, distinct_prompt(rng)))
    cpu = asyncio.ensure_future(window_cpu(pids, t_measured, t_end))
    await asyncio.gather(*(one(i, at, ids) for i, (at, ids) in enumerate(arrivals)))
    (r0, f0), (r1, f1) = await cpu
    routed, direct = latencies
    return Step(rate, tuple(routed), tuple(direct), lost, wrong, (r1 - r0) / args.seconds, (f1 - f0) / args.seconds)


def sustained(steps: Sequence[Step]) -> tuple[Step | None, str]:
    """The highest rate of the ladder, up to the first that breaks it, at which the router adds at
    most ADDED_P99_S at p99 and loses nothing, and why the ladder stopped there: the router's
    added latency, or the fleet's (its direct p99 over SATURATED times the first rate's: past that
    both paths only queue in the fleet, and the difference says nothing of the router)."""
    best = None
    for s in steps:
        if pct(s.direct_s, 99) > SATURATED * pct(steps[0].direct_s, 99):
            return best, f"the fleet saturating at {s.rate:g} req/s (direct p99 over {SATURATED:g}x the first rate's)"
        if s.lost or s.added_p99 > ADDED_P99_S:
            return best, f"the router adding {s.added_p99 * 1e3:+.1f} ms at {s.rate:g} req/s"
        best = s
    return best, "the ladder's last rate"


def print_report(args: argparse.Namespace, steps: list[Step], fleet_line: str, pin: bool) -> None:
    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        f"router rate: open-loop Poisson gRPC Generate requests of distinct 256-token prompts, {args.tokens} tokens "
        f"out, through the real Router (disaggregated) {fleet_line}; {args.seconds:g} s measured at each rate "
        f"after {args.warmup_seconds:g} s; "
        f"{'router process pinned to one core, the fleet and the client to the other' if pin else 'unpinned'}; "
        f"router event loop {loop_name()}"
    )
    print()
    print(
        f"{'req/s':>7} {'done':>6} {'direct p99':>11} {'routed p50':>11} {'routed p99':>11} {'added p99':>10} "
        f"{'router':>7} {'fleet':>7} lost wrong"
    )
    for s in steps:
        print(
            f"{s.rate:>7g} {len(s.latencies_s):>6} {pct(s.direct_s, 99) * 1e3:>9.1f}ms "
            f"{pct(s.latencies_s, 50) * 1e3:>9.1f}ms {s.p99 * 1e3:>9.1f}ms {s.added_p99 * 1e3:>+8.1f}ms "
            f"{s.router_cores:>5.2f}c {s.fleet_cores:>5.2f}c {s.lost:>4} {s.wrong:>5}"
        )
    best, why = sustained(steps)
    print()
    at = best or steps[0]  # the cores used at the rate sustained, or at the first one, which was not
    what = f"{best.rate:g} req/s" if best is not None else f"below {steps[0].rate:g} req/s"
    print(
        f"sustained within +{ADDED_P99_S * 1e3:g} ms p99: {what} with {args.decode_workers} decode + "
        f"{args.prefill_workers} prefill workers, router {at.router_cores:.2f} core, fleet {at.fleet_cores:.2f} "
        f"core; stopped by {why}"
    )
