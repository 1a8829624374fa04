"""`splitserve bench router-replicas`: router replicas (`--routers N`, router/replicas.py) against
one router, on one load: their CPU per request (what N cores would carry) and the prefix-cache
hit rate they keep.

For each replica count, a fresh mocker fleet (bench/mocker/: the real worker services, a real
block pool and prefix cache per worker, steps timed by the planner's costs) and the real Router
with its replicas in front of it: the routers pinned to one core, the fleet and the client to
the other. The client keeps `concurrency` closed-loop `Generate` streams over as many
connections (each its own, so the kernel spreads them over the replicas), every prompt one of
`groups` shared prefixes (a system prompt, a document, a conversation's history) followed by a
suffix of its own, every token checked against the mockers' sequence.

- Hit rate: the decode mockers' prompt tokens found in their prefix caches over those looked up,
  over the whole run. Each replica builds its prefix index from the workers' own KV events, but
  routes on its own view of their load, so N replicas may send one prefix's requests apart where
  one router keeps them together: the target is within 2 points of one router's.
- CPU: the router processes' CPU over the measured window (every replica's, summed) per
  request. This machine has two cores, so the replicas share one: the rate N cores would carry is
  N times one router's, times one router's CPU per request over the replicas' (linear when equal),
  times the mean replica's CPU over the busiest's (the kernel's spread of connections). Said as
  a projection from CPU measured here; target at least 0.8 of linear.

    splitserve bench router-replicas [--routers 1,2,4] [--seconds 8] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
from dataclasses import dataclass

from splitserve.bench.mocker.cluster import serve_mockers, serve_router
from splitserve.bench.mocker.main import add_costs_arguments
from splitserve.bench.results_file import with_results
from splitserve.bench.router import pct, worker_and_router_processes
from splitserve.bench.router_load import Load, idle_cpu, load
from splitserve.router.event_loop import loop_name

TARGET_HIT_POINTS = 2.0  # issue 44: the hit rate with replicas within 2 points of one router's
TARGET_SCALING = 0.8  # of linear, per added core
IDLE_SECONDS = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routers", type=_counts, default=(1, 2, 4), help="replica counts to run, 1 first (default 1,2,4)")
    p.add_argument("--decode-workers", type=int, default=16, help="decode mockers")
    p.add_argument("--prefill-workers", type=int, default=4, help="prefill mockers")
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "colocated"))
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop streams, each on its own connection")
    p.add_argument("--tokens", type=int, default=16, help="tokens out per request")
    p.add_argument("--groups", type=int, default=64, help="shared prompt prefixes the requests draw from")
    p.add_argument("--prefix-tokens", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--suffix-tokens", type=int, default=64, help="tokens of each request's own suffix")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds")
    p.add_argument(
        "--warmup-seconds", type=float, default=2.0, help="unmeasured seconds first (the prefixes' first use)"
    )
    p.add_argument(
        "--idle-seconds", type=float, default=IDLE_SECONDS, help="the routers' CPU with no request in flight, over"
    )
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    add_costs_arguments(p)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected replica counts, e.g. 1,2,4") from None
    if not counts or counts[0] != 1 or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: positive counts, 1 first (the baseline)")
    return counts


@dataclass(frozen=True)
class Run:
    routers: int
    load: Load
    idle_cores: float  # every router process's CPU with no request in flight, summed
    hits: int  # decode mockers' prompt tokens found in their prefix caches
    queries: int  # looked up there

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.queries)

    @property
    def spread(self) -> float:
        """The mean replica's CPU over the busiest's: 1 when the connections spread evenly."""
        each = self.load.router_cpu_each_s
        return statistics.fmean(each) / max(each) if each and max(each) > 0 else 1.0


def grouped_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The shared prefixes, the same for every replica count."""
    rng = random.Random(44)
    return [[rng.randrange(256) for _ in range(args.prefix_tokens)] for _ in range(args.groups)]


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    pin = len(os.sched_getaffinity(0)) >= 2
    prefixes = grouped_prompts(args)

    def prompt(rng: random.Random) -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(256) for _ in range(args.suffix_tokens)]

    runs: list[Run] = []
    line = ""
    for n in args.routers:
        # a fresh fleet each time: every count starts from cold prefix caches
        with worker_and_router_processes((serve_mockers, args), (serve_router, args.mode, n), pin) as c:
            line = c.workers["line"]
            pids = c.routers["pids"]
            idle = idle_cpu(pids, args.idle_seconds)
            got = asyncio.run(
                load(c.routers["router"], pids, args.tokens, args.concurrency, args, True, prompt, args.concurrency)
            )
            c.workers_conn.send("prefix")
            hits, queries = c.workers_conn.recv()
        runs.append(Run(n, got, idle, hits, queries))
    print_report(runs, args, pin, line)
    return 0 if all(r.load.lost == 0 and r.load.wrong == 0 for r in runs) else 1


def print_report(runs: list[Run], args: argparse.Namespace, pin: bool, fleet_line: str) -> None:
    from splitserve.measure.hw import machine_line  # torch, which it imports, only once the figures are in

    print(machine_line())
    print(
        f"router replicas ({args.mode}): {args.concurrency} closed-loop gRPC Generate streams, each on its own "
        f"connection, of {args.tokens} tokens out; prompts of one of {args.groups} shared {args.prefix_tokens}-token "
        f"prefixes and {args.suffix_tokens} tokens of their own; through the real Router and its replicas "
        f"(--routers N, SO_REUSEPORT) {fleet_line}; a fresh fleet for each N; {args.seconds:g} s measured after "
        f"{args.warmup_seconds:g} s; "
        f"{'every router process pinned to one core, mockers and client to the other' if pin else 'unpinned'}; "
        f"router event loop {loop_name()}"
    )
    print()
    print(
        f"{'routers':>7} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'router CPU':>10} {'CPU/request':>12} "
        f"{'spread':>6} {'idle CPU':>9} {'hit rate':>8} {'lost':>5} {'wrong':>6}"
    )
    for r in runs:
        x = r.load
        print(
            f"{r.routers:>7} {x.rate:>7.1f} {pct(x.latencies_s, 50) * 1e3:>7.1f} {pct(x.latencies_s, 99) * 1e3:>7.1f} "
            f"{x.router_cpu_s / x.seconds:>5.2f} core {x.cpu_per_request_s * 1e3:>9.2f} ms {r.spread:>6.2f} "
            f"{r.idle_cores:>4.3f} core {r.hit_rate:>8.1%} {x.lost:>5} {x.wrong:>6}"
        )
    one = runs[0]
    print()
    print(
        "spread: the mean router process's CPU over the busiest's (how evenly the kernel spread the connections); "
        "idle CPU: every router process's, with no request in flight (each replica polls every worker)"
    )
    for r in runs[1:]:
        points = (r.hit_rate - one.hit_rate) * 100
        efficiency = one.load.cpu_per_request_s / r.load.cpu_per_request_s if r.load.cpu_per_request_s else 0.0
        projected = r.routers * efficiency * r.spread
        print(
            f"{r.routers} replicas: hit rate {r.hit_rate:.1%} against one router's {one.hit_rate:.1%} "
            f"({points:+.1f} points, target within {TARGET_HIT_POINTS:g}); CPU per request {efficiency:.2f}x one "
            f"router's efficiency, spread {r.spread:.2f}: on {r.routers} cores {projected:.2f}x one router's rate, "
            f"{projected / r.routers:.2f} of linear (target {TARGET_SCALING:g}; projected from CPU measured here, "
            f"the replicas sharing one core)"
        )
