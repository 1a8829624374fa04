"""`splitserve router`: the front door alone, in front of workers started
elsewhere (docker compose, systemd, another scheduler) and given by address."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode", action="append", default=[], required=True, help="decode worker host:port (repeatable)")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker host:port (repeatable)")
    p.add_argument("--model", default=None, help="the workers' model, for its tokenizer (default: embedded SmolLM2)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API (-1: off)")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--mode", default="auto", choices=["auto", "disaggregated", "colocated"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--local-prefill-max-tokens", type=int, default=256)
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"))
    p.add_argument("--cluster-token", default=os.environ.get("SPLITSERVE_CLUSTER_TOKEN"))


def run(a: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from splitserve.router.event_loop import run as run_loop

    return run_loop(_run(a))


async def _run(a: argparse.Namespace) -> int:
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.config import RouterConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router

    cfg = RouterConfig(host=a.host, grpc_port=a.grpc_port, metrics_port=a.metrics_port, mode=a.mode,
                       http_port=None if a.http_port < 0 else a.http_port,
                       block_size=a.block_size, local_prefill_max_tokens=a.local_prefill_max_tokens,
                       api_key=a.api_key, cluster_token=a.cluster_token)
    router = Router(cfg, EngineTokenizer(load_tokenizer(a.model)), decode=a.decode, prefill=a.prefill)
    port = await router.start()
    print(f"splitserve router: listening on {a.host}:{port}"
          + (f", OpenAI-compatible HTTP on {router.http_port}" if router.http is not None else ""), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await router.stop()
    return 0
