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
from splitserve.router.config import RoutingConfig
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
    from splitserve.router.flags import tls_from_args
    from splitserve.runtime.tls import load_cluster_tls

    try:
        tls_from_args(a)
        if a.internal_tls_dir:
            load_cluster_tls(a.internal_tls_dir)
    except ValueError as e:
        print(f"splitserve router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from splitserve.router.event_loop import run as run_loop

    return run_loop(_run(a, decode, prefill))


async def _run(a: argparse.Namespace, decode: list[str], prefill: list[str]) -> int:
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.flags import router_config_from_args
    from splitserve.router.server import Router
    from splitserve.router.shutdown import drain
    from splitserve.runtime.tracing import setup_tracing

    setup_tracing(a.otlp_traces_endpoint, "router")
    cfg = router_config_from_args(a, a.cluster_token)
    # ready once every pool it was given has a worker up (a colocated router never calls the prefill pool)
    required = ("decode", "prefill") if prefill and cfg.routing.mode != "colocated" else ("decode",)
    cfg = replace(cfg, required_pools=required)
    router = Router(cfg, EngineTokenizer(load_tokenizer(a.model)), decode=decode, prefill=prefill)
    port = await router.start()
    print(
        f"splitserve router: listening on {cfg.listeners.host}:{port}"
        + (f", OpenAI-compatible HTTP on {router.http_port}" if router.http is not None else ""),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(router, a.shutdown_grace_s, loop, log_prefix="splitserve router")
    await router.stop()
    return 0
