"""`splitserve bench router-load`: the rate one router carries, and its CPU per request and per
streamed token.

`bench router` times one request at a time; this one loads the router. The real `Router` (in its
own process, pinned to one core, on the event loop `splitserve router` runs) stands in front of
the mock workers of bench/fake_workers.py (their real gRPC services: handshake, stats, block
events; tokens at once, no model), which share the other core with the client. The client keeps
`concurrency` `Generate` streams open, closed loop: a stream's next request goes out as its last
one ends; every prompt is distinct (256 random tokens), so there are no prefix hits to help.

For each load the router process's CPU time (utime + stime, /proc) over the measured window is
divided by the requests that finished in it. Per streamed token is the slope between two loads
that differ only in tokens out (1 and 64 at the same concurrency), and per request the
intercept, so the two costs are told apart rather than assumed.

    splitserve bench router-load [--mode disaggregated] [--seconds 8] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.bench.mocker.cluster import serve_mockers, serve_router
from splitserve.bench.mocker.main import add_costs_arguments
from splitserve.bench.mocker.tokens import expected_tokens
from splitserve.bench.results_file import with_results
from splitserve.bench.router import pct, serve_routers, serve_workers, worker_and_router_processes
from splitserve.measure.hw import process_cpu_seconds
from splitserve.router.event_loop import loop_name

# (tokens out, concurrency): the table of issue 44, measured the same way
LOADS = ((1, 16), (16, 4), (16, 16), (16, 128), (64, 16))
SCRIPT_TOKENS = 64  # the mock decode worker's script; each request asks for its first `tokens`
PROMPT_TOKENS = 256
TARGET_US_PER_TOKEN = 15.0  # issue 44's targets for router CPU
TARGET_US_PER_REQUEST = 300.0
IDLE_SECONDS = 3.0  # the router's CPU with no request in flight, measured before the loads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "colocated"))
    p.add_argument(
        "--fleet",
        default="fakes",
        choices=("fakes", "mockers"),
        help="fakes: one fake worker per role, tokens at once; mockers: bench/mocker/'s workers, steps timed",
    )
    p.add_argument("--decode-workers", type=int, default=16, help="with --fleet mockers: decode mockers")
    p.add_argument("--prefill-workers", type=int, default=4, help="with --fleet mockers: prefill mockers")
    add_costs_arguments(p)
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds of each load")
    p.add_argument("--warmup-seconds", type=float, default=2.0, help="unmeasured seconds before each load")
    p.add_argument("--no-pin", action="store_true", help="do not pin the router and the client to separate cores")
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    p.add_argument(
        "--loads",
        type=parse_loads,
        default=LOADS,
        help="TOKENSxCONCURRENCY,... (default: " + ",".join(f"{t}x{c}" for t, c in LOADS) + ")",
    )


def parse_loads(text: str) -> tuple[tuple[int, int], ...]:
    """'1x16,64x16' -> ((1, 16), (64, 16))."""
    try:
        loads = tuple((int(t), int(c)) for t, c in (item.split("x") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKENSxCONCURRENCY,...") from None
    if not loads or any(t < 1 or t > SCRIPT_TOKENS or c < 1 for t, c in loads):
        raise argparse.ArgumentTypeError(f"{text!r}: tokens 1..{SCRIPT_TOKENS}, concurrency at least 1")
    return loads


@dataclass(frozen=True)
class Load:
    tokens: int
    concurrency: int
    requests: int  # finished within the measured window
    seconds: float
    latencies_s: tuple[float, ...]
    router_cpu_s: float
    wrong: int = 0  # requests whose tokens were not the mockers' sequence (0 unchecked)
    lost: int = 0  # requests that ended in an error, not their tokens
    router_cpu_each_s: tuple[float, ...] = ()  # each router process's share of router_cpu_s (replicas)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_per_request_s(self) -> float:
        return self.router_cpu_s / max(1, self.requests)


def distinct_prompt(rng: random.Random) -> list[int]:
    """A prompt no other request shares: no prefix hit helps it."""
    return [rng.randrange(256) for _ in range(PROMPT_TOKENS)]


async def load(
    address: str,
    router_pids: Sequence[int],
    tokens: int,
    concurrency: int,
    args: argparse.Namespace,
    check: bool,
    prompt: Callable[[random.Random], list[int]] = distinct_prompt,
    connections: int = 1,
) -> Load:
    """`concurrency` closed-loop streams for the warm-up and the measured window; what finished in it,
    and the CPU the router processes (`router_pids`: every replica) used in it. `check`: every
    request's tokens against the mockers' sequence (tokens.py), a mismatch counted. `connections`:
    the streams spread over that many client connections (router replicas share them out by
    connection)."""
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc

    rng = random.Random(tokens * 1000 + concurrency)
    channels = own_channels(address, connections)
    stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
    t_start = time.monotonic() + args.warmup_seconds
    t_end = t_start + args.seconds
    latencies: list[float] = []
    count = 0
    wrong = 0
    lost = 0

    async def stream(k: int) -> None:
        nonlocal count, wrong, lost
        stub = stubs[k % connections]
        i = 0
        while time.monotonic() < t_end:
            i += 1
            ids = prompt(rng)
            rid = f"c{k}-{i}"
            t0 = time.monotonic()
            try:
                got = await generated(stub, rid, ids, tokens)
            except grpc.aio.AioRpcError as e:
                lost += 1
                print(f"request {rid} lost: {e.code().name} {e.details()}", flush=True)
                continue
            t1 = time.monotonic()
            if check and got != expected_tokens(ids, tokens):
                wrong += 1
            if t_start <= t1 <= t_end:
                latencies.append(t1 - t0)
                count += 1

    cpu = asyncio.ensure_future(window_cpu(router_pids, t_start, t_end))
    await asyncio.gather(*(stream(k) for k in range(concurrency)))
    c0, c1 = await cpu
    for c in channels:
        await c.close()
    each = tuple(b - a for a, b in zip(c0, c1, strict=True))
    return Load(tokens, concurrency, count, args.seconds, tuple(latencies), sum(each), wrong, lost, each)


def own_channels(address: str, n: int) -> list[Any]:
    """`n` gRPC channels to `address`, each a connection of its own (a channel of its own subchannel
    pool; gRPC shares one connection otherwise)."""
    import grpc

    own = (("grpc.use_local_subchannel_pool", 1),)
    return [grpc.aio.insecure_channel(address, options=own) for _ in range(n)]


async def generated(stub: Any, rid: str, ids: list[int], tokens: int, timeout_s: float = 60.0) -> list[int]:
    """The tokens of one greedy Generate of `tokens` (EOS ignored) through `stub`."""
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
    )
    return [t async for r in stub.Generate(req, timeout=timeout_s) for t in r.token_ids]


async def window_cpu(pids: Sequence[int], t0: float, t1: float) -> tuple[list[float], list[float]]:
    """Processes `pids`' CPU seconds at `t0` and at `t1` (monotonic clock), waiting for each."""
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    before = [router_cpu_seconds(pid) for pid in pids]
    await asyncio.sleep(max(0.0, t1 - time.monotonic()))
    return before, [router_cpu_seconds(pid) for pid in pids]


def per_token_and_request(loads: list[Load]) -> tuple[float, float] | None:
    """(CPU s per streamed token, per request): the slope and intercept between the fewest and the
    most tokens out at the concurrency both were measured at."""
    by = {(x.tokens, x.concurrency): x for x in loads}
    few, many = min(t for t, _ in by), max(t for t, _ in by)
    shared = sorted({c for t, c in by if t == few} & {c for t, c in by if t == many})
    if few == many or not shared:
        return None
    a, b = by[(few, shared[0])], by[(many, shared[0])]
    if not (a.requests and b.requests) or a.lost or b.lost:
        return None  # a load that finished nothing, or lost requests, did not measure the router's cost
    per_token = (b.cpu_per_request_s - a.cpu_per_request_s) / (many - few)
    return per_token, a.cpu_per_request_s - few * per_token


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    mockers = args.fleet == "mockers"
    workers = (serve_mockers, args) if mockers else (serve_workers, SCRIPT_TOKENS)
    routers = (serve_router, args.mode, 1) if mockers else (serve_routers,)
    with worker_and_router_processes(workers, routers, pin) as c:
        address = c.routers["router"] if mockers else c.routers[args.mode]
        idle = idle_cpu([c.router_pid], IDLE_SECONDS)
        loads = [
            asyncio.run(load(address, [c.router_pid], tokens, concurrency, args, mockers))
            for tokens, concurrency in args.loads
        ]
    print_report(loads, args, pin, c.workers["line"] if mockers else FAKES_LINE, idle)
    return 0


def idle_cpu(pids: Sequence[int], seconds: float) -> float:
    """The cores processes `pids` use over `seconds` of this process's sleep: a router's with no request
    in flight is its health polls and KV event streams, which grow with the workers it watches."""
    c0 = sum(router_cpu_seconds(pid) for pid in pids)
    time.sleep(seconds)
    return (sum(router_cpu_seconds(pid) for pid in pids) - c0) / seconds


def router_cpu_seconds(pid: int) -> float:
    """The router process's CPU seconds so far; RuntimeError where they cannot be read."""
    cpu = process_cpu_seconds(pid)
    if cpu is None:
        raise RuntimeError(f"the router process's CPU time cannot be read (/proc/{pid}/stat)")
    return cpu


FAKES_LINE = "over mock workers (tokens at once, no model)"


def print_report(loads: list[Load], args: argparse.Namespace, pin: bool, fleet_line: str, idle: float) -> None:
    from splitserve.measure.hw import machine_line  # torch, which it imports, only once the figures are in

    print(machine_line())
    print(
        f"router load ({args.mode}): closed-loop gRPC Generate streams of distinct {PROMPT_TOKENS}-token prompts "
        f"through the real Router {fleet_line}; {args.seconds:g} s measured after "
        f"{args.warmup_seconds:g} s of each load; "
        f"{'router process pinned to one core, mock workers and client to the other' if pin else 'unpinned'}; "
        f"router event loop {loop_name()}"
    )
    print()
    print(f"router CPU with no request in flight (its stats polls and KV event streams): {idle:.3f} core")
    print(
        f"{'tokens out':>10} {'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'router CPU':>10} {'CPU/request':>12} {'lost':>5} {'wrong':>6}"
    )
    for x in loads:
        print(
            f"{x.tokens:>10} {x.concurrency:>11} {x.rate:>8.1f} {pct(x.latencies_s, 50) * 1e3:>8.1f} "
            f"{pct(x.latencies_s, 99) * 1e3:>8.1f} {x.router_cpu_s / x.seconds:>5.2f} core "
            f"{x.cpu_per_request_s * 1e3:>9.2f} ms {x.lost:>5} {x.wrong if args.fleet == 'mockers' else '-':>6}"
        )
    fit = per_token_and_request(loads)
    if fit is None and any(x.lost or not x.requests for x in loads):
        print()
        print("no CPU per token and per request: a load finished no request or lost some (above)")
    if fit is not None:
        per_token, per_request = fit
        print()
        print(
            f"router CPU per streamed token {per_token * 1e6:.1f} us (target {TARGET_US_PER_TOKEN:g}), "
            f"per request {per_request * 1e6:.0f} us (target {TARGET_US_PER_REQUEST:g}): the slope and intercept "
            f"of CPU per request between {min(x.tokens for x in loads)} and {max(x.tokens for x in loads)} tokens out"
        )
