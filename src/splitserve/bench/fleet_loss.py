"""`splitserve bench fleet-loss`: a share of the decode fleet killed under load, and what it cost.

The real Router (its own process, on its own core) in front of a fleet of mocker
workers (bench/mocker/: the real worker services, steps timed by the planner's
model; one process on the other core, with the client). The client keeps
`concurrency` closed-loop Generate streams of distinct prompts; halfway through the
measured window a `--kill` share of the decode mockers is stopped at once (their
servers gone, their calls failed: what the router sees of a dead process). The
router migrates each stream they held (prompt and the tokens already streamed) to
a live decode worker, which re-prefills it. Counted:

- lost: requests that ended in an error instead of their tokens (target 0);
- wrong: requests whose tokens differ from the mockers' checkable sequence
  (bench/mocker/tokens.py: a migration that repeated, skipped or garbled a token
  shows here; target 0);
- blocks back: after the load, the seconds until every surviving mocker's KV pool
  is whole again (cached blocks count as free; target under 1 s).

    splitserve bench fleet-loss [--decode-workers 40] [--prefill-workers 8] [--kill 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from splitserve.bench.mocker.cluster import serve_mockers, serve_router
from splitserve.bench.mocker.main import add_costs_arguments
from splitserve.bench.results_file import with_results
from splitserve.bench.router import pct, worker_and_router_processes
from splitserve.bench.router_load import load

BLOCKS_TIMEOUT_S = 10.0
TARGET_BLOCKS_BACK_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-workers", type=int, default=40, help="decode mockers")
    p.add_argument("--prefill-workers", type=int, default=8, help="prefill mockers")
    p.add_argument("--kill", type=float, default=0.1, help="share of the decode mockers killed mid-load")
    p.add_argument("--tokens", type=int, default=128, help="tokens out per request: long enough to die mid-stream")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop streams")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds; the kill comes halfway")
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "colocated"))
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    add_costs_arguments(p)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.kill < 1:
        print("splitserve bench fleet-loss: --kill must lie strictly between 0 and 1", flush=True)
        return 2
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    pin = len(os.sched_getaffinity(0)) >= 2
    with worker_and_router_processes((serve_mockers, args), (serve_router, args.mode, 1), pin) as c:
        conn = c.workers_conn

        async def kill_halfway() -> tuple[float, list[str]]:
            await asyncio.sleep(args.warmup_seconds + args.seconds / 2)
            t = time.monotonic()
            conn.send(("kill", args.kill))
            dead = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            return t, dead

        async def both() -> tuple:
            return await asyncio.gather(
                load(c.routers["router"], c.routers["pids"], args.tokens, args.concurrency, args, True), kill_halfway()
            )

        result, (_, dead) = asyncio.run(both())
        conn.send(("blocks", BLOCKS_TIMEOUT_S))
        blocks_back = conn.recv()
        c.routers_conn.send("counts")
        counts = c.routers_conn.recv()

    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        f"fleet loss ({args.mode}): {args.concurrency} closed-loop gRPC Generate streams of {args.tokens} tokens "
        f"through the real Router {c.workers['line']}; {args.seconds:g} s measured after {args.warmup_seconds:g} s; "
        f"{len(dead)} of {args.decode_workers} decode mockers ({args.kill:.0%}) stopped at once halfway; "
        f"router process pinned to one core, mockers and client to the other"
    )
    print()
    back = f"{blocks_back:.2f} s" if blocks_back is not None else f"not within {BLOCKS_TIMEOUT_S:g} s"
    print(
        f"the router moved {counts['migrations']} streams to another decode worker mid-stream and retried "
        f"{counts['prefill_retries']} prefills on another prefill worker"
    )
    print(
        f"requests finished {result.requests} ({result.rate:.1f}/s), lost {result.lost} (target 0), wrong tokens "
        f"{result.wrong} (target 0); latency p50 {pct(result.latencies_s, 50) * 1e3:.0f} ms, p99 "
        f"{pct(result.latencies_s, 99) * 1e3:.0f} ms; every surviving mocker's blocks back {back} after the load "
        f"(target {TARGET_BLOCKS_BACK_S:g} s)"
    )
    ok = result.lost == 0 and result.wrong == 0 and blocks_back is not None
    return 0 if ok else 1
