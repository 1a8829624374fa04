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
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from splitserve.cluster.placement import CPU
from splitserve.engine.kernels.prebuild import preflight as kernels_preflight
from splitserve.engine.memory import RUNTIME_BYTES, Pool, available_memory, fit_problems
from splitserve.engine.preflight import engine_problems, tier_problems
from splitserve.engine.problems import Check, Problem

if TYPE_CHECKING:
    from splitserve.cluster.joint import JointConfig
    from splitserve.cluster.pool import PoolManager, PoolSpec
    from splitserve.cluster.scaling import ScalingConfig
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.tuned import Tuned
    from splitserve.router.config import RouterConfig
    from splitserve.router.replicas import Replicas
    from splitserve.router.server import Router
    from splitserve.router.workers import Role
    from splitserve.runtime.tls import ClusterTLS

log = logging.getLogger("splitserve.cluster.serve")

ROLES: tuple[Role, ...] = ("prefill", "decode")
# What a local cluster runs beside its workers: this process (the router and the pools' manager)
# and Ray's own (GCS, raylet, its agents, log monitor and autoscaler). Measured with `serve` on
# SmolLM2 once listening: 0.64 GB of PSS beside the workers' 1.41 GB each (engine/memory.py counts
# 1.59 GB for each); rounded up.
SERVE_BYTES = 2 * RUNTIME_BYTES
FEWER_WORKERS = "--prefill-workers, --decode-workers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from splitserve.engine.flags import add_engine_arguments
    from splitserve.engine.kernels.prebuild import add_argument as add_kernels_argument
    from splitserve.router.flags import add_router_arguments
    from splitserve.workers.server import add_admission_arguments, add_stream_argument

    engine = p.add_argument_group("model and engine")
    add_engine_arguments(engine)  # --block-size among them, shared by the router
    add_kernels_argument(engine)
    add_admission_arguments(p.add_argument_group("admission"))
    add_stream_argument(p.add_argument_group("streaming"))
    add_router_arguments(p.add_argument_group("router"))
    _add_pool_arguments(p.add_argument_group("pools"))
    _add_placement_arguments(p.add_argument_group("placement on Ray"))


def _add_pool_arguments(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--insecure-internal",
        action="store_true",
        help="the cluster's own planes (router to workers, the KV plane) in plaintext: by default serve makes a "
        "certificate authority at start and every internal connection is mutual TLS",
    )
    p.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address workers listen on and advertise; 'auto': each worker's own Ray node IP (multi-node)",
    )
    # the tuned pair (engine/tuned.py): one of each, whose prefill borrows the decode worker's idle cores
    p.add_argument("--prefill-workers", type=int, default=None, help="prefill workers at start (default: tuned)")
    p.add_argument("--decode-workers", type=int, default=None, help="decode workers at start (default: tuned)")
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
    _add_scaling_arguments(p)
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
    for role in ROLES:
        p.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=None,
            help=f"tensor-parallel size of each {role} worker (default: --tensor-parallel-size); the KV "
            "transfer re-shards heads between pools of different sizes",
        )
    from splitserve.workers.common.config import add_kv_transport_argument, add_wire_codec_arguments

    add_kv_transport_argument(p)
    add_wire_codec_arguments(p)


def _add_scaling_arguments(p: argparse._ActionsContainer) -> None:
    """How the pools grow and shrink between their sizes: standby workers, the policy, its SLOs."""
    for role in ROLES:
        p.add_argument(
            f"--{role}-standby",
            type=int,
            default=None,
            help=f"{role} workers kept started and warm (model loaded, warmed up, listening) but not routed to, "
            f"taken first by a grow or a replacement: the pool grows in one stats poll instead of a process start "
            f"and a model load; each holds its weights and its KV pool (on a CPU, only the blocks its warm-up "
            f"wrote) (default: 1 when the {role} pool scales, "
            f"within its --{role}-workers-max, else 0)",
        )
    p.add_argument(
        "--scaling",
        default="queue",
        choices=("queue", "joint"),
        help="how the pools scale between --*-workers and --*-workers-max: queue, each on its own queue "
        "(--*-target-tokens, after 5 s over); joint, both together for --slo-ttft-ms and --slo-itl-ms from the "
        "token rates, predicted ahead (cluster/joint.py)",
    )
    p.add_argument(
        "--switch-roles",
        action="store_true",
        help="--scaling joint: when one pool grows while the other shrinks, the shrinking pool's least-loaded "
        "worker moves to the growing pool in its own process (once idle) instead of one process stopping while "
        "another starts; every worker then serves both roles (the pools' --*-tensor-parallel-size and "
        "--*-resources must match)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="--scaling joint: the time-to-first-token SLO")
    p.add_argument("--slo-itl-ms", type=float, default=100.0, help="--scaling joint: the inter-token latency SLO")


def _add_placement_arguments(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPUs each worker asks Ray for (default 1, or the share that fits every worker on a local "
        "cluster with fewer CPUs than workers, said at start)",
    )
    p.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each worker asks Ray for")
    p.add_argument(
        "--prefill-resources",
        default="{}",
        help='custom Ray resources per prefill worker, JSON, e.g. {"prefill_node": 1}',
    )
    p.add_argument("--decode-resources", default="{}", help="custom Ray resources per decode worker, JSON")
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


def standby_count(a: argparse.Namespace, role: str, scaling: ScalingConfig | None) -> int:
    """A pool's standby workers: --{role}-standby, else one for a pool that scales (its grows are
    what a standby worker speeds up; a fixed pool's replacements wait for a start, as before). A
    scaling pool's standby workers count within its maximum (--{role}-workers-max): they are
    workers it may run."""
    asked: int | None = getattr(a, f"{role}_standby")
    if asked is not None and asked < 0:
        raise ValueError(f"--{role}-standby must be 0 or more, got {asked}")
    if scaling is None:
        return asked or 0
    room = scaling.max_replicas - scaling.min_replicas
    return min(1 if asked is None else asked, room)


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


# ---- the steps, in order: configure, preflight, start Ray and place, build, start, wait, drain ----


@dataclass(frozen=True)
class ServeConfig:
    """What `serve` starts, read from its flags once (ValueError if they disagree) and never changed."""

    engine: EngineConfig  # the pools' engine; each pool's tensor-parallel size replaces the shared one
    workers: Mapping[Role, int]  # role -> initial workers (the scaling floor)
    standby: Mapping[Role, int]  # role -> workers kept warm and not routed to (PoolSpec.standby)
    tp: Mapping[Role, int]  # role -> tensor-parallel size of each worker
    tp_flags: Mapping[str, int]  # the flag that set each size -> the size, to name in a problem
    scaling: Mapping[Role, ScalingConfig | None]  # role -> its scaling, None: a fixed size
    resources: Mapping[Role, Mapping[str, float]]  # role -> custom Ray resources per worker
    node_types: Mapping[str, Mapping[str, float]] | None  # the autoscaler's, when --node-types gives them
    controller: JointConfig | None  # --scaling joint: both pools sized together for the SLOs
    switch_roles: bool  # --switch-roles: every worker serves both roles, and moves between the pools


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, tuned = with_tuned(args)
    print(f"splitserve: tuned for this machine: {tuned.line()} (a flag overrides each)", flush=True)
    try:  # checked before Ray starts or a port is bound, so a bad flag costs seconds
        cfg = configure(args)
    except (ValueError, OSError) as e:
        return _refuse(str(e))
    cpus_per_worker, problems = preflight(args, cfg)
    if not problems:  # the cheap checks first: a build takes seconds
        problems = kernels_preflight(cfg.engine.device, args.allow_torch_fallback, _say)
    if problems:
        return _refuse(*(_said(p) for p in problems))
    from splitserve.router.event_loop import run as run_loop

    try:
        return run_loop(_serve(args, cfg, cpus_per_worker))
    except KeyboardInterrupt:
        return 0


def with_tuned(a: argparse.Namespace) -> tuple[argparse.Namespace, Tuned]:
    """The flags with every tuned one not given set to the machine's tuned choice (engine/tuned.py),
    every choice the start line prints among them, and what the choices are (each flag given still
    wins, so the line printed is the machine's). Where the choice is to lend cores, the workers of
    this machine share a core lease: a fresh file in /dev/shm per cluster (each node has its own
    /dev/shm, so a multi-node cluster lends within each machine)."""
    from splitserve.engine.tuned import fill_tuned, tuned_for

    tuned = tuned_for(a.device)
    filled = fill_tuned(a, tuned, whole_cluster=True)
    if a.core_lease is None:
        filled.core_lease = f"/dev/shm/splitserve-cores-{secrets.token_hex(6)}" if tuned.core_lease else ""
    elif a.core_lease == "off":
        filled.core_lease = ""
    return filled, tuned


def _say(line: str) -> None:
    print(f"splitserve: {line}", flush=True)


def _refuse(*lines: str) -> int:
    for line in lines:
        print(f"splitserve serve: {line}", file=sys.stderr, flush=True)
    return 2


def _said(problem: Problem) -> str:
    # said as the check against Ray's own nodes says it (_place), before Ray or after
    return f"cannot place the workers: {problem.line()}" if problem.check == Check.PLACEMENT else problem.line()


def configure(a: argparse.Namespace) -> ServeConfig:
    """The flags read into one config; ValueError (OSError for an unreadable --node-types) if they
    cannot be: what needs no model and no machine to know."""
    from splitserve.engine.flags import engine_config_from_args

    scaling = {role: scaling_config(a, role) for role in ROLES}
    node_types = parse_node_types(a.node_types)
    tp = {role: pool_tp_size(a, role) for role in ROLES}
    for role in ROLES:
        check_pool_tp(role, tp[role], a.device, a.gpus_per_worker)
    from splitserve.router.flags import router_config_from_args

    # the router's flags (its ports, TLS files, limits, deadlines) read as the router will read them,
    # with the cluster token it gets later: `--metrics-port -1` ended in a traceback after Ray started
    router_config_from_args(a, "")
    if a.kv_transport != "tcp" and not a.insecure_internal:
        raise ValueError(
            f"--kv-transport {a.kv_transport} carries KV outside the cluster's TLS: use tcp or --insecure-internal"
        )
    if a.internal_tls_dir and a.insecure_internal:
        raise ValueError("--internal-tls-dir and --insecure-internal: one or the other")
    return ServeConfig(
        engine=engine_config_from_args(a),
        workers={role: getattr(a, f"{role}_workers") for role in ROLES},
        standby={role: standby_count(a, role, scaling[role]) for role in ROLES},
        tp=tp,
        tp_flags={_tp_flag(a, role): tp[role] for role in ROLES},
        scaling=scaling,
        resources={role: _resources(getattr(a, f"{role}_resources"), f"--{role}-resources") for role in ROLES},
        node_types=node_types,
        controller=joint_config(a) if a.scaling == "joint" else None,
        switch_roles=switch_roles(a, tp),
    )


def switch_roles(a: argparse.Namespace, tp: Mapping[Role, int]) -> bool:
    """--switch-roles, if the pools' workers could be one another's (ValueError if not)."""
    if not a.switch_roles:
        return False
    if a.scaling != "joint":
        raise ValueError("--switch-roles moves workers for the joint controller: give --scaling joint")
    if tp["prefill"] != tp["decode"] or a.prefill_resources != a.decode_resources:
        raise ValueError(
            "--switch-roles: a worker keeps its Ray resources and tensor-parallel size when it moves, so the pools' "
            "must match (--prefill-resources/--decode-resources, --*-tensor-parallel-size)"
        )
    return True


def joint_config(a: argparse.Namespace) -> JointConfig:
    """--scaling joint's controller, each pool between --{role}-workers and --{role}-workers-max."""
    from splitserve.cluster.joint import JointConfig

    def bounds(role: str) -> tuple[int, int]:
        least = getattr(a, f"{role}_workers")
        return least, max(least, getattr(a, f"{role}_workers_max") or least)

    (pmin, pmax), (dmin, dmax) = bounds("prefill"), bounds("decode")
    for flag, value in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-itl-ms", a.slo_itl_ms)):
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"{flag} must be a positive number of milliseconds, got {value:g}")
    if pmin == pmax and dmin == dmax:
        raise ValueError(
            "--scaling joint sizes pools that may grow: give --prefill-workers-max or --decode-workers-max above "
            "its pool's --*-workers"
        )
    return JointConfig(
        slo_ttft_s=a.slo_ttft_ms / 1e3,
        slo_itl_s=a.slo_itl_ms / 1e3,
        prefill_min=pmin,
        prefill_max=pmax,
        decode_min=dmin,
        decode_max=dmax,
        decode_tokens_per_worker=a.decode_target_tokens,
    )


def started_workers(cfg: ServeConfig) -> dict[Role, int]:
    """The workers serve starts at once, per pool: the routed ones and the standby ones."""
    return {role: cfg.workers[role] + cfg.standby[role] for role in ROLES}


def preflight(a: argparse.Namespace, cfg: ServeConfig) -> tuple[float, list[Problem]]:
    """The CPUs each worker will ask Ray for, and what keeps the cluster from starting: the engine
    against the model's header, and (a local cluster) the pools against this machine, which it
    warns about when they oversubscribe its cores. A joined cluster's nodes are checked in _place."""
    from splitserve.cluster.preflight import (
        machine_problems,
        machine_resources,
        oversubscription,
        pool_asks,
        threads_per_rank,
        worker_cpus,
    )

    problems = engine_problems(a.model, cfg.tp_flags)
    problems += tier_problems(cfg.engine.kv_disk_tier_bytes, cfg.engine.kv_disk_tier_dir)
    if a.ray_address:
        return worker_cpus(a.cpus_per_worker, started_workers(cfg), None), problems
    machine = machine_resources()
    started = started_workers(cfg)
    cpus = worker_cpus(a.cpus_per_worker, started, machine[CPU])
    problems += machine_problems(pool_asks(started, cpus, a.gpus_per_worker, cfg.resources), machine, cfg.node_types)
    if problems:
        return cpus, problems
    # every worker of a local cluster runs on this machine (standby ones too): its memory, counted before any starts
    pools = [Pool(role, started[role], role_engine(a, cfg, role)) for role in ROLES]
    problems = fit_problems(a.model, pools, available_memory(), SERVE_BYTES, FEWER_WORKERS)
    if problems:
        return cpus, problems
    if a.cpus_per_worker is None and cpus < 1.0:
        print(
            f"splitserve: {sum(started.values())} workers on {machine[CPU]:g} CPUs: each asks Ray for "
            f"{cpus:g} CPU (--cpus-per-worker to change)",
            flush=True,
        )
    on_cpu = not cfg.engine.device.startswith("cuda")  # a CPU's tensor-parallel ranks share its cores
    ranks = {role: cfg.tp[role] if on_cpu else 1 for role in ROLES}
    threads = threads_per_rank(a.threads, cpus, os.environ)
    # standby workers idle: only the routed ones contend for the cores
    if warning := oversubscription(cfg.workers, ranks, threads, machine[CPU]):
        log.warning("%s", warning)
    return cpus, problems


async def _serve(a: argparse.Namespace, cfg: ServeConfig, cpus_per_worker: float) -> int:
    ray = _start_ray(a)
    if not _place(a, ray, cfg, cpus_per_worker):
        ray.shutdown()
        return 2
    # Ours from here on (ray.init installs its own, which dies loudly): a signal during the
    # start stops what has started, like one after it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster_token = secrets.token_urlsafe(24)  # the control plane's credential, new per cluster
    internal = _internal_tls(a)
    specs = pool_specs(a, cfg, cpus_per_worker, cluster_token, internal)
    router = _router(a, specs, cluster_token, internal)
    from splitserve.cluster.pool import PoolManager

    pools = PoolManager(
        specs, router.workers, metrics=router.metrics, node_types=cfg.node_types, controller=cfg.controller
    )
    replicas: list[Replicas] = []  # the router's replicas (--routers), once _start has them listening
    try:
        await _run_until_stopped(a, _start(a, router, pools, specs, replicas), router, stop, replicas)
    finally:
        print("splitserve: stopping", flush=True)
        # the routers first: no request may be routed to a worker that is going away
        for r in replicas:
            r.terminate()
            await r.join()
        await router.stop()
        await pools.stop()
        ray.shutdown()
    return 0


def _start_ray(a: argparse.Namespace) -> Any:
    """Ray, started here or joined (--ray-address), with its own plane's token auth on and no dashboard."""
    # Ray reads these when it is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not a.ray_address and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # a local cluster gets a fresh token of its own, handed to Ray's processes by environment
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    if not a.ray_address:
        # Ray's single-machine mode (its default on macOS and Windows): the node's address is
        # 127.0.0.1, and then the GCS, the raylet and every core worker listen on loopback only.
        # Otherwise each of them listens on all interfaces, the token their only guard.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if a.ray_address:
        ray.init(address=a.ray_address, logging_level=logging.WARNING)
    else:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    return ray


def _internal_tls(a: argparse.Namespace) -> ClusterTLS | None:
    """The cluster's mutual TLS: the operator's (--internal-tls-dir), a CA made now, or none."""
    from splitserve.runtime.tls import load_cluster_tls, make_cluster_tls

    if a.insecure_internal:
        return None
    return load_cluster_tls(a.internal_tls_dir) if a.internal_tls_dir else make_cluster_tls()


def role_engine(a: argparse.Namespace, cfg: ServeConfig, role: Role) -> EngineConfig:
    """The engine a pool's workers run: the shared one at the pool's tensor-parallel size and chunk."""
    from splitserve.engine.tuned import chunk_tokens

    return replace(
        cfg.engine,
        tensor_parallel_size=cfg.tp[role],
        max_num_batched_tokens=a.max_num_batched_tokens or chunk_tokens(role),
    )


def pool_specs(
    a: argparse.Namespace, cfg: ServeConfig, cpus_per_worker: float, cluster_token: str, internal: ClusterTLS | None
) -> list[PoolSpec]:
    """Each pool: its workers' config (the shared engine at the pool's tensor-parallel size), its
    size and scaling, and what each worker asks Ray for; `a` as `with_tuned` filled it."""
    from splitserve.cluster.pool import PoolSpec
    from splitserve.workers.common.config import WorkerConfig

    def worker(role: Role) -> WorkerConfig:
        return WorkerConfig(
            role=role,
            model=a.model,
            engine=role_engine(a, cfg, role),
            host=a.worker_host,
            kv_transport=a.kv_transport,
            kv_wire_codec=a.kv_wire_codec,
            kv_link_gbps=a.kv_link_gbps,
            cluster_token=cluster_token,
            internal_tls=internal,
            threads=a.threads,
            core_lease=a.core_lease,
            lease_cores=a.lease_cores,
            decode_borrows=a.decode_borrows == "on",
            max_waiting_requests=a.max_waiting_requests,
            otlp_traces_endpoint=a.otlp_traces_endpoint,
            switchable=cfg.switch_roles,
            stream_interval=a.stream_interval,
        )

    return [
        PoolSpec(
            role,
            cfg.workers[role],
            worker(role),
            cpus_per_worker,
            a.gpus_per_worker,
            dict(cfg.resources[role]),
            cfg.scaling[role],
            cfg.standby[role],
        )
        for role in ROLES
    ]


def _router(a: argparse.Namespace, specs: list[PoolSpec], cluster_token: str, internal: ClusterTLS | None) -> Router:
    """The router, with the model's tokenizer and tracing."""
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.replicas import per_replica
    from splitserve.router.server import Router
    from splitserve.runtime.tracing import setup_tracing

    tokenizer = EngineTokenizer(load_tokenizer(a.model))
    setup_tracing(a.otlp_traces_endpoint, "router")  # the router's; each worker actor sets up its own
    cfg, notes = per_replica(router_config(a, specs, cluster_token, internal))
    for note in notes:
        log.warning("%s", note)
    return Router(cfg, tokenizer)


def router_config(
    a: argparse.Namespace, specs: list[PoolSpec], cluster_token: str, internal: ClusterTLS | None
) -> RouterConfig:
    """The router's config, ready (health SERVING) once every pool that will serve requests has a
    worker up; `a` as `with_tuned` filled it."""
    from splitserve.router.flags import router_config_from_args

    router_cfg = router_config_from_args(a, cluster_token)
    # a colocated router never calls the prefill pool
    required = tuple(
        spec.role
        for spec in specs
        if spec.replicas and (spec.role == "decode" or router_cfg.routing.mode != "colocated")
    )
    listeners = replace(router_cfg.listeners, internal_tls=internal)
    return replace(router_cfg, required_pools=required, listeners=listeners)


async def _start(
    a: argparse.Namespace, router: Router, pools: PoolManager, specs: list[PoolSpec], replicas: list[Replicas]
) -> None:
    """The router's ports and its replicas (put in `replicas`), then the pools, then the wait for
    their workers; each address said."""
    from splitserve.router.replicas import start_replicas

    port = await router.start()
    if (started := await start_replicas(router, a.model, a.shutdown_grace_s, a.otlp_traces_endpoint)) is not None:
        replicas.append(started)
    prefill, decode = (
        f"{spec.replicas}{f' (up to {spec.scaling.max_replicas})' if spec.scaling else ''} {spec.role}"
        + (f" + {spec.standby} on standby" if spec.standby else "")
        for spec in specs
    )
    print(
        f"splitserve: starting {prefill} and {decode} worker(s) "
        f"on Ray ({'cluster ' + a.ray_address if a.ray_address else 'local'})",
        flush=True,
    )
    await pools.start()
    await router.wait_for_workers(timeout_s=120)
    processes = f", {a.routers} router processes" if a.routers > 1 else ""
    print(
        f"splitserve: listening on {a.host}:{port} (gRPC splitserve.v1.Generation, grpc.health.v1{processes})",
        flush=True,
    )
    if router.http is not None:
        print(
            f"splitserve: OpenAI-compatible {'HTTPS' if a.ssl_certfile else 'HTTP'} on {a.host}:{router.http_port} "
            "(/v1/chat/completions, "
            "/v1/completions)",
            flush=True,
        )
    for line in exposure_lines(a, router.generation.keys.required):
        print(f"splitserve: {line}", flush=True)
    for role in ROLES:
        for g, kv in pools.addresses(role):
            print(f"  {role} worker  grpc {g}" + (f"  kv {kv}" if kv else ""), flush=True)


def exposure_lines(a: argparse.Namespace, keyed: bool) -> list[str]:
    """What of this cluster another machine can reach, said at start."""
    from splitserve.workers.common.auth import is_loopback

    if is_loopback(a.host):
        front = f"the router's ports are on loopback ({a.host}): reachable from this machine only"
    elif keyed:
        front = f"the router's ports are open to the network on {a.host}: every route but /health needs an API key"
    else:
        front = (
            f"the router's ports are open to the network on {a.host} WITHOUT an API key: anyone who reaches them may"
        )
    if a.ssl_certfile:
        front += "; over TLS" + (", clients need a certificate of --ssl-ca-certs" if a.ssl_ca_certs else "")
    workers = "on loopback" if is_loopback(a.worker_host) else f"on {a.worker_host}, open to the network"
    if a.ray_address:
        auth = os.environ.get("RAY_AUTH_MODE", "off")
        ray = f"Ray cluster {a.ray_address}: its ports on its nodes' addresses, token authentication {auth}"
    else:
        ray = "Ray (local): its ports on loopback, token authentication on"
    inside = "in plaintext (--insecure-internal)" if a.insecure_internal else "under mutual TLS of the cluster's CA"
    return [front, f"workers' control and KV ports {workers}, behind the cluster token and {inside}", ray]


async def _run_until_stopped(
    a: argparse.Namespace,
    start: Coroutine[Any, Any, None],
    router: Router,
    stop: asyncio.Event,
    replicas: list[Replicas],
) -> None:
    """The start, then serving until a signal; a signal during the start cancels it. A cluster
    that started drains its requests (its router's replicas theirs, at the same time) before the
    caller stops it; a failed start raises."""
    from splitserve.router.shutdown import drain

    starting = asyncio.ensure_future(start)
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
            for r in replicas:
                r.terminate()
            if not await drain(router, a.shutdown_grace_s, asyncio.get_running_loop(), log_prefix="splitserve"):
                for r in replicas:  # cut short by a second signal, or out of time: the replicas too
                    r.cut()


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


def _place(a: argparse.Namespace, ray: Any, cfg: ServeConfig, cpus_per_worker: float) -> bool:
    """Whether the pools' initial workers fit the Ray cluster's nodes (or, with the autoscaler's node
    types, a node type each), said with the numbers when they do not. A local cluster was checked
    against this machine before Ray started; this is the check for a joined one, and for what
    Ray counts differently."""
    from splitserve.cluster.placement import alive_nodes, placement_problems
    from splitserve.cluster.preflight import pool_asks

    asks = pool_asks(started_workers(cfg), cpus_per_worker, a.gpus_per_worker, cfg.resources)
    problems = placement_problems(asks, alive_nodes(ray.nodes()), cfg.node_types)
    for p in problems:
        print(f"splitserve serve: cannot place the workers: {p}", file=sys.stderr, flush=True)
    if problems and (not a.ray_address or cfg.node_types is not None):
        return False
    if problems:  # a joined cluster may have an autoscaler that adds the nodes
        print("splitserve serve: starting anyway: an autoscaler may add the nodes", file=sys.stderr, flush=True)
    return True


def _tp_flag(a: argparse.Namespace, role: str) -> str:
    """The flag that set a pool's tensor-parallel size: its own, or the shared one."""
    own = f"{role}_tensor_parallel_size"
    return f"--{own.replace('_', '-')}" if getattr(a, own) is not None else "--tensor-parallel-size"


def _resources(flag_value: str, flag: str) -> dict[str, float]:
    """--{role}-resources: a JSON object of resource name -> amount (ValueError if not)."""
    try:
        resources = json.loads(flag_value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON ({e}): give an object, e.g. '{{\"decode_node\": 1}}'") from None
    if not isinstance(resources, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in resources.values()
    ):
        raise ValueError(
            f"{flag}: {flag_value!r} is not a JSON object of resource amounts, e.g. '{{\"decode_node\": 1}}'"
        )
    return {str(k): float(v) for k, v in resources.items()}
