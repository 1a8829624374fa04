"""`splitserve serve`: from nothing to a serving cluster on this machine (or on
a Ray cluster given with --ray-address): Ray, the prefill and decode pools as
actors, and the router's gRPC front door."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.cluster.scaling import ScalingConfig

log = logging.getLogger("splitserve.cluster.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from splitserve.router.flags import add_router_arguments
    from splitserve.workers.server import add_admission_arguments, add_engine_arguments

    add_engine_arguments(p)  # --block-size among them, which the router shares
    add_admission_arguments(p)
    add_router_arguments(p)
    p.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address workers listen on and advertise; 'auto': each worker's own Ray node IP (multi-node)",
    )
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument(
        "--prefill-workers-max",
        type=int,
        default=None,
        help="scale the prefill pool on its queue between --prefill-workers and this (default: no scaling)",
    )
    p.add_argument(
        "--decode-workers-max",
        type=int,
        default=None,
        help="scale the decode pool on its load between --decode-workers and this (default: no scaling)",
    )
    p.add_argument(
        "--prefill-target-tokens",
        type=int,
        default=4096,
        help="queued prompt tokens per prefill worker above which the prefill pool grows",
    )
    p.add_argument(
        "--decode-target-tokens",
        type=int,
        default=16384,
        help="queued and running context tokens per decode worker above which the decode pool grows",
    )
    p.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPUs each worker asks Ray for (default 1, or the share that fits every worker on a local "
        "cluster with fewer CPUs than workers, said at start)",
    )
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=None,
            help=f"tensor-parallel size of each {role} worker (default: --tensor-parallel-size); the KV "
            "transfer re-shards heads between pools of different sizes",
        )
    p.add_argument(
        "--prefill-resources",
        default="{}",
        help='custom Ray resources per prefill worker, JSON, e.g. {"prefill_node": 1}',
    )
    p.add_argument("--decode-resources", default="{}", help="custom Ray resources per decode worker, JSON")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "ucx", "cuda_ipc"])
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.add_argument(
        "--node-types",
        default=None,
        help="the Ray autoscaler's node types: a cluster launcher YAML (its available_node_types) or JSON "
        '{"name": {"CPU": 8, "GPU": 1, "decode_node": 1}}; a worker no node type can hold is refused at '
        "once, one that waits for a node is not a problem (default: none known, shortfalls only said)",
    )


def scaling_config(a: argparse.Namespace, role: str) -> ScalingConfig | None:
    """The pool between --{role}-workers (its start and its floor) and --{role}-workers-max; None: a fixed size."""
    from splitserve.cluster.scaling import ScalingConfig

    workers, workers_max = getattr(a, f"{role}_workers"), getattr(a, f"{role}_workers_max")
    if workers_max is None or workers_max == workers:
        return None
    if workers_max < workers:
        raise ValueError(f"--{role}-workers-max ({workers_max}) is below --{role}-workers ({workers})")
    target = getattr(a, f"{role}_target_tokens")
    decode = role == "decode"
    return ScalingConfig(
        min_replicas=workers,
        max_replicas=workers_max,
        metric="work_tokens" if decode else "queued_tokens",
        target_tokens_per_worker=target,
        low_water_tokens_per_worker=target // 4,
        # a decode pool short of KV blocks queues requests before its token load shows it
        min_free_block_fraction=0.1 if decode else 0.0,
    )


def pool_tp_size(a: argparse.Namespace, role: str) -> int:
    """A pool's tensor-parallel size: its own flag, else the shared --tensor-parallel-size."""
    own: int | None = getattr(a, f"{role}_tensor_parallel_size")
    return own if own is not None else int(a.tensor_parallel_size)


def check_pool_tp(role: str, tp: int, device: str, gpus_per_worker: float) -> None:
    """Refuse a pool whose workers' ranks would run on GPUs Ray did not give them: on CUDA a
    worker of tensor-parallel size N puts a rank on each of N GPUs."""
    if tp < 1:
        raise ValueError(f"--{role}-tensor-parallel-size must be at least 1, got {tp}")
    if device.startswith("cuda") and gpus_per_worker < tp:
        raise ValueError(
            f"{role} workers at tensor-parallel size {tp} need {tp} GPUs each: --gpus-per-worker is "
            f"{gpus_per_worker:g}; set --gpus-per-worker {tp}"
        )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # checked before Ray starts, so a bad flag costs nothing
        prefill, decode = scaling_config(args, "prefill"), scaling_config(args, "decode")
        node_types = parse_node_types(args.node_types)
        for role in ("prefill", "decode"):
            check_pool_tp(role, pool_tp_size(args, role), args.device, args.gpus_per_worker)
    except (ValueError, OSError) as e:
        print(f"splitserve serve: {e}", file=sys.stderr)
        return 2
    from splitserve.router.event_loop import run as run_loop

    try:
        return run_loop(_serve(args, prefill, decode, node_types))
    except KeyboardInterrupt:
        return 0


async def _serve(
    a: argparse.Namespace,
    prefill_scaling: ScalingConfig | None,
    decode_scaling: ScalingConfig | None,
    node_types: dict[str, dict[str, float]] | None = None,
) -> int:
    # Ray's own plane: token auth on, dashboard off. Ray reads these when it is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not a.ray_address and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # a local cluster gets a fresh token of its own, handed to Ray's processes by environment
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    import ray

    from splitserve.cluster.pool import PoolManager, PoolSpec
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.flags import router_config_from_args
    from splitserve.router.server import Router
    from splitserve.router.shutdown import drain
    from splitserve.runtime.tracing import setup_tracing
    from splitserve.workers.common.config import WorkerConfig
    from splitserve.workers.server import engine_config_from_args

    if a.ray_address:
        ray.init(address=a.ray_address, logging_level=logging.WARNING)
    else:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    cpus_per_worker = _place(a, ray, node_types)
    if cpus_per_worker is None:
        ray.shutdown()
        return 2
    # Ours from here on (ray.init installs its own, which dies loudly): a signal during the
    # start stops what has started, like one after it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster_token = secrets.token_urlsafe(24)  # the control plane's credential, new per cluster
    engine_cfg = engine_config_from_args(a)
    tokenizer = EngineTokenizer(load_tokenizer(a.model))
    setup_tracing(a.otlp_traces_endpoint, "router")  # the router's; each worker actor sets up its own

    def worker(role: str) -> WorkerConfig:
        return WorkerConfig(
            role=role,
            model=a.model,
            engine=replace(engine_cfg, tensor_parallel_size=pool_tp_size(a, role)),
            host=a.worker_host,
            kv_transport=a.kv_transport,
            cluster_token=cluster_token,
            threads=a.threads,
            max_waiting_requests=a.max_waiting_requests,
            otlp_traces_endpoint=a.otlp_traces_endpoint,
        )

    specs = [
        PoolSpec(
            "prefill",
            a.prefill_workers,
            worker("prefill"),
            cpus_per_worker,
            a.gpus_per_worker,
            json.loads(a.prefill_resources),
            prefill_scaling,
        ),
        PoolSpec(
            "decode",
            a.decode_workers,
            worker("decode"),
            cpus_per_worker,
            a.gpus_per_worker,
            json.loads(a.decode_resources),
            decode_scaling,
        ),
    ]
    router_cfg = router_config_from_args(a, cluster_token)
    # ready (health SERVING) once every pool that will serve requests has a worker up; a colocated
    # router never calls the prefill pool
    required = tuple(
        spec.role for spec in specs if spec.replicas and (spec.role == "decode" or router_cfg.mode != "colocated")
    )
    router = Router(replace(router_cfg, required_pools=required), tokenizer)
    pools = PoolManager(specs, router.workers, metrics=router.metrics, node_types=node_types)

    async def start() -> None:
        port = await router.start()
        prefill, decode = (
            f"{spec.replicas}{f' (up to {spec.scaling.max_replicas})' if spec.scaling else ''} {spec.role}"
            for spec in specs
        )
        print(
            f"splitserve: starting {prefill} and {decode} worker(s) "
            f"on Ray ({'cluster ' + a.ray_address if a.ray_address else 'local'})",
            flush=True,
        )
        await pools.start()
        await router.wait_for_workers(timeout_s=120)
        print(f"splitserve: listening on {a.host}:{port} (gRPC splitserve.v1.Generation, grpc.health.v1)", flush=True)
        if router.http is not None:
            print(
                f"splitserve: OpenAI-compatible HTTP on {a.host}:{router.http_port} (/v1/chat/completions, "
                "/v1/completions)",
                flush=True,
            )
        for role in ("prefill", "decode"):
            for g, kv in pools.addresses(role):
                print(f"  {role} worker  grpc {g}" + (f"  kv {kv}" if kv else ""), flush=True)

    starting = asyncio.ensure_future(start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start ends here, through the finally below
            await stopping
    finally:
        started = starting.done() and not starting.cancelled() and starting.exception() is None
        for t in (starting, stopping):
            t.cancel()
        await asyncio.gather(starting, stopping, return_exceptions=True)
        if started:
            await drain(router, a.shutdown_grace_s, loop, log_prefix="splitserve")
        print("splitserve: stopping", flush=True)
        # the router first: no request may be routed to a worker that is going away
        await router.stop()
        await pools.stop()
        ray.shutdown()
    return 0


def parse_node_types(flag: str | None) -> dict[str, dict[str, float]] | None:
    """--node-types: JSON, or the path of a Ray cluster launcher YAML (ValueError, OSError if bad)."""
    from splitserve.cluster.placement import node_types_of_cluster_config

    if flag is None:
        return None
    if flag.lstrip().startswith("{"):
        return node_types_of_cluster_config(
            {"available_node_types": {n: {"resources": r} for n, r in json.loads(flag).items()}}
        )
    import yaml  # Ray's own dependency

    with open(flag) as f:
        try:
            return node_types_of_cluster_config(yaml.safe_load(f))
        except yaml.YAMLError as e:
            raise ValueError(f"--node-types {flag}: {e}") from e


def _place(a: argparse.Namespace, ray: Any, node_types: dict[str, dict[str, float]] | None = None) -> float | None:
    """CPUs per worker, once the pools' initial workers are known to fit the Ray cluster (or, with
    the autoscaler's node types, a node type each); None (after saying why, with the numbers) when
    they cannot be placed."""
    from splitserve.cluster.placement import CPU, PoolAsk, alive_nodes, fractional_cpus, placement_problems

    nodes = alive_nodes(ray.nodes())

    def asks(cpus: float) -> list[PoolAsk]:
        return [
            PoolAsk.of(role, getattr(a, f"{role}_workers"), cpus, a.gpus_per_worker, custom)
            for role, custom in (
                ("prefill", json.loads(a.prefill_resources)),
                ("decode", json.loads(a.decode_resources)),
            )
        ]

    cpus = a.cpus_per_worker
    if cpus is None:
        cpus = 1.0
        if not a.ray_address:  # a machine of our own: share its cores rather than wait for more
            have = sum(n.get(CPU, 0.0) for n in nodes)
            cpus = fractional_cpus(asks(1.0), have)
            if cpus < 1.0:
                n = a.prefill_workers + a.decode_workers
                print(
                    f"splitserve: {n} workers on {have:g} CPUs: each asks Ray for {cpus:g} CPU "
                    "(--cpus-per-worker to change)",
                    flush=True,
                )
    problems = placement_problems(asks(cpus), nodes, node_types)
    for p in problems:
        print(f"splitserve serve: cannot place the workers: {p}", file=sys.stderr, flush=True)
    if problems and (not a.ray_address or node_types is not None):
        return None
    if problems:  # a joined cluster may have an autoscaler that adds the nodes
        print("splitserve serve: starting anyway: an autoscaler may add the nodes", file=sys.stderr, flush=True)
    return cpus
