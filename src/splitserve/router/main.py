"""`splitserve router`: the front door alone, in front of workers started
elsewhere (docker compose, systemd, another scheduler) and given by address.

The addresses are checked before anything starts (router/addresses.py): a bad
one ends the command at once with exit code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace

from splitserve.router.addresses import BadAddress, parse_worker_addresses
from splitserve.router.config import RouterConfig, RoutingConfig
from splitserve.router.flags import add_router_arguments
from splitserve.runtime.credentials import add_secret_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        required=True,
        help="decode worker host:port; one address per flag, repeat the flag for more workers",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        help="prefill worker host:port; one address per flag, repeat the flag for more workers",
    )
    p.add_argument("--model", default=None, help="the workers' model, for its tokenizer (default: embedded SmolLM2)")
    add_router_arguments(p)
    p.add_argument(
        "--block-size", type=int, default=RoutingConfig().block_size, help="tokens per KV block: the workers'"
    )
    add_secret_argument(
        p, "--cluster-token", "SPLITSERVE_CLUSTER_TOKEN", "the cluster token, sent to the workers on every call"
    )


def run(a: argparse.Namespace) -> int:
    try:
        decode = parse_worker_addresses(a.decode, "--decode")
        prefill = parse_worker_addresses(a.prefill, "--prefill")
    except BadAddress as e:  # a usage error: one line, no traceback, before anything starts
        print(f"splitserve router: {e}", file=sys.stderr)
        return 2
    from splitserve.router.flags import router_config_from_args
    from splitserve.router.replicas import per_replica

    try:  # every flag read before a port is bound
        cfg, notes = per_replica(router_config_from_args(a, a.cluster_token))
    except ValueError as e:
        print(f"splitserve router: {e}", file=sys.stderr)
        return 2
    # ready once every pool it was given has a worker up (a colocated router never calls the prefill pool)
    required = ("decode", "prefill") if prefill and cfg.routing.mode != "colocated" else ("decode",)
    cfg = replace(cfg, required_pools=required)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:
        print(f"splitserve router: {note}", file=sys.stderr, flush=True)
    from splitserve.router.event_loop import run as run_loop

    return run_loop(_run(a, cfg, decode, prefill))


async def _run(a: argparse.Namespace, cfg: RouterConfig, decode: list[str], prefill: list[str]) -> int:
    from splitserve.router.engine_tokenizer import model_tokenizer
    from splitserve.router.replicas import start_replicas
    from splitserve.router.server import Router
    from splitserve.router.shutdown import drain
    from splitserve.runtime.tracing import setup_tracing

    setup_tracing(a.otlp_traces_endpoint, "router")
    router = Router(cfg, model_tokenizer(a.model), decode=decode, prefill=prefill)
    port = await router.start()
    replicas = await start_replicas(router, a.model, a.shutdown_grace_s, a.otlp_traces_endpoint)
    print(
        f"splitserve router: listening on {cfg.listeners.host}:{port}"
        + (f", OpenAI-compatible HTTP on {router.http_port}" if router.http is not None else "")
        + (f" ({cfg.listeners.replicas} router processes)" if replicas is not None else ""),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if replicas is not None:
        replicas.terminate()
    drained = await drain(router, a.shutdown_grace_s, loop, log_prefix="splitserve router")
    if replicas is not None:
        if not drained:  # cut short by a second signal, or out of time: the replicas too
            replicas.cut()
        await replicas.join()
    await router.stop()
    return 0
