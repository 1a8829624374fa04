"""A mocker fleet's process and a router's process, for the benchmarks that load them.

bench/router.py's `worker_and_router_processes` starts the two: `serve_mockers`
(the fleet, on the workers' core) and `serve_router` (the real `Router`, and its
replicas when asked, in front of it, on a core of their own). The fleet's process then takes commands on its pipe:

    ("kill", fraction)   stop that share of the decode mockers at once, the ones
                         holding the most requests first, as a dead process looks
                         to the router (its calls fail, its port refuses); answers
                         their addresses
    ("blocks", timeout)  wait until every surviving mocker's KV blocks are free;
                         answers the seconds it took, or None past the timeout
    "prefix"             the decode mockers' prompt tokens found in their prefix
                         caches and looked up there, so far: (hits, queries)
    "done"               stop the fleet and end

and the router's takes "counts" (answers its migrations and prefill retries so far)
and "done".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import time
from typing import Any

from splitserve.bench.mocker.fleet import Fleet
from splitserve.router.config import Mode


def serve_mockers(conn: mp.connection.Connection, args: argparse.Namespace, cpu: int | None) -> None:
    """The mockers' process: the fleet (`args.prefill_workers`, `args.decode_workers` and the costs
    of bench/mocker/main.py's flags); sends its addresses and a line saying what it is."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import logging

    logging.disable(logging.WARNING)
    from splitserve.bench.mocker.fleet import start_fleet
    from splitserve.bench.mocker.main import mocker_spec

    spec = mocker_spec(args)
    fleet = start_fleet(spec, args.prefill_workers, args.decode_workers)
    line = (
        f"over {args.prefill_workers} prefill + {args.decode_workers} decode mocker workers (bench/mocker/: the "
        f"real worker services, steps timed by {spec.costs_what}; KV at 1/{fleet.kv_scale:.0f} of its bytes"
        + (f"; tokens sent in groups of at least {spec.stream_interval}" if spec.stream_interval > 1 else "")
        + ")"
    )
    conn.send(
        {
            "decode": [w.grpc_address for w in fleet.decode],
            "prefill": [w.grpc_address for w in fleet.prefill],
            "line": line,
        }
    )
    while True:
        cmd: Any = conn.recv()
        if cmd == "done":
            break
        if cmd[0] == "kill":
            busiest = sorted(fleet.decode, key=_held, reverse=True)
            dead = busiest[: max(1, round(cmd[1] * len(fleet.decode)))]
            fleet.decode = [w for w in fleet.decode if w not in dead]
            for w in dead:
                w.stop(0)
            conn.send([w.grpc_address for w in dead])
        elif cmd[0] == "blocks":
            conn.send(_until_blocks_free(fleet, cmd[1]))
        elif cmd == "prefix":
            m = [w.metrics for w in fleet.decode]
            conn.send(
                (
                    sum(counter_total(x.prefix_cache_hits) for x in m),
                    sum(counter_total(x.prefix_cache_queries) for x in m),
                )
            )
    fleet.stop(0)


def _held(w: Any) -> int:
    """The requests a decode mocker holds: running, and reserved for KV on its way."""
    stats = w.loop.stats
    return int(stats.running_requests + stats.reserved_requests)


def _until_blocks_free(fleet: Fleet, timeout_s: float) -> float | None:
    """Seconds until every mocker's block pool is whole again; None if it is not within `timeout_s`."""
    start = time.monotonic()
    while True:
        if fleet.all_blocks_free():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.01)


def counter_total(counter: Any) -> int:
    """A Prometheus counter's total, over its labels."""
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))


def serve_router(conn: mp.connection.Connection, fleet: dict, mode: Mode, routers: int, cpu: int | None) -> None:
    """The router's process: a Router of `mode` in front of the fleet, on the loop `splitserve
    router` runs, with `routers` - 1 replicas beside it on its port and core (router/replicas.py);
    sends its address and every router process's pid once every worker is ready."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import logging

    logging.disable(logging.WARNING)
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.event_loop import run as run_loop
    from splitserve.router.replicas import Replicas
    from splitserve.router.server import Router
    from splitserve.router.tokenizer import ByteTokenizer

    async def main() -> None:
        listeners = Listeners(host="127.0.0.1", grpc_port=0, replicas=routers)
        cfg = RouterConfig(routing=RoutingConfig(mode=mode), listeners=listeners)
        router = Router(cfg, ByteTokenizer(), decode=fleet["decode"], prefill=fleet["prefill"], rng=random.Random(0))
        port = await router.start()
        replicas = Replicas(router, ByteTokenizer, shutdown_grace_s=0.0, log_level=logging.WARNING)
        await replicas.start()
        await router.wait_for_workers(60)
        conn.send({"router": f"127.0.0.1:{port}", "pids": [os.getpid(), *replicas.pids()]})
        while await asyncio.get_running_loop().run_in_executor(None, conn.recv) == "counts":
            m = router.metrics
            conn.send({"migrations": counter_total(m.migrations), "prefill_retries": counter_total(m.prefill_retries)})
        replicas.terminate()
        await replicas.join()
        await router.stop(0)

    run_loop(main())
