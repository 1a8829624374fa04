"""The process that hosts one worker, in either role: load the model, start the
engine thread, the KV endpoint and the gRPC server, and report the addresses.

    python -m splitserve.workers.common --role decode --grpc-port 7001

Ray actors (cluster/actor.py) call `start_worker` in the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc
import torch

from splitserve.engine.core_lease import CoreLease
from splitserve.engine.engine import Engine
from splitserve.engine.flags import add_engine_arguments, engine_config_from_args
from splitserve.engine.kernels.prebuild import add_argument as add_kernels_argument
from splitserve.engine.loop import EngineLoop
from splitserve.engine.tuned import fill_tuned, tuned_for
from splitserve.runtime.credentials import add_secret_argument
from splitserve.runtime.tls import add_internal_tls_argument, load_cluster_tls
from splitserve.runtime.tracing import add_tracing_argument, setup_tracing
from splitserve.workers.common.auth import ClusterTokenInterceptor, cluster_token_refusal
from splitserve.workers.common.config import WorkerConfig, add_kv_transport_argument, add_wire_codec_arguments
from splitserve.workers.common.metrics import WorkerMetrics, start_metrics_server
from splitserve.workers.common.warm_up import warm_up

if TYPE_CHECKING:  # each role's pieces are imported when a worker of that role starts
    from splitserve.engine.connector import KVConnector
    from splitserve.workers.decode.connector import ReceiverConnector
    from splitserve.workers.prefill.connector import SenderConnector

log = logging.getLogger(__name__)


@dataclass
class RunningWorker:
    cfg: WorkerConfig
    grpc_address: str
    kv_endpoint: str | None  # decode role (and a switchable worker)
    loop: EngineLoop
    server: grpc.Server
    closers: list
    metrics: WorkerMetrics  # the engine's series; `serve_metrics` puts them on HTTP

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait(grace_s + 1)
        self.loop.stop()
        for close in self.closers:
            close()
        self.loop.engine.close()  # its tensor-parallel ranks, once nothing can step it


def start_worker(cfg: WorkerConfig, engine: Engine | None = None) -> RunningWorker:
    """Start a worker; `engine` may be given (tests), else the model is loaded from cfg."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if engine is None:
        engine, _ = Engine.from_path(cfg.model, cfg.engine, progress=False)
    if cfg.warm_up:  # before listening: a client's first token must not pay for lazy builds
        warm_up(engine)
    interceptors: list[grpc.ServerInterceptor] = (
        [ClusterTokenInterceptor(cfg.cluster_token)] if cfg.cluster_token else []
    )
    if not cfg.cluster_token:  # the command refuses this off loopback; a library caller chose it
        log.warning("%s worker %s: no cluster token, every control call is accepted", cfg.role, cfg.worker_id)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=cfg.max_concurrent_rpcs + 8, thread_name_prefix=f"{cfg.role}-rpc"),
        interceptors=interceptors,
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0)],
    )
    closers: list = []
    metrics = WorkerMetrics(engine.model_cfg.name, cfg.role, cfg.worker_id)
    engine.drain_iteration_stats()  # counted from here on: a warm-up request is not traffic
    lease = core_lease(cfg)
    if lease is not None:
        log.info(
            "%s worker %s: lends and borrows cores through %s (%d shared, %d its own)",
            cfg.role,
            cfg.worker_id,
            lease.path,
            lease.total_cores,
            lease.own_cores,
        )
    loop, kv_endpoint = _serve_roles(cfg, engine, metrics, server, closers, lease)
    metrics.watch(lambda: loop.stats)
    if engine.tiers is not None:
        metrics.watch_tiers(engine.tiers.stats)
    address = f"{cfg.host}:{cfg.grpc_port}"
    if cfg.internal_tls is not None:
        port = server.add_secure_port(address, cfg.internal_tls.grpc_server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        loop.stop()
        raise OSError(f"cannot listen on {cfg.host}:{cfg.grpc_port}")
    server.start()
    address = f"{cfg.host}:{port}"
    log.info(
        "%s worker %s listening on %s (kv %s); weights %s",
        cfg.role,
        cfg.worker_id,
        address,
        kv_endpoint,
        engine.weights_line(),
    )
    return RunningWorker(cfg, address, kv_endpoint, loop, server, closers, metrics)


# A worker is built bottom up: its KV connector (which the engine calls), the engine loop, then
# the services, given everything they use. A switchable worker has both roles' of each.


def _serve_roles(
    cfg: WorkerConfig,
    engine: Engine,
    metrics: WorkerMetrics,
    server: grpc.Server,
    closers: list,
    lease: CoreLease | None = None,
) -> tuple[EngineLoop, str | None]:
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
    from splitserve.workers.common.either_role import EitherRoleConnector
    from splitserve.workers.decode.service import DecodeService
    from splitserve.workers.prefill.service import PrefillService

    decodes, prefills = cfg.role == "decode" or cfg.switchable, cfg.role == "prefill" or cfg.switchable
    receiver, kv_endpoint = _receiver_connector(cfg, engine, closers) if decodes else (None, None)
    sender = _sender_connector(cfg, engine, metrics, closers) if prefills else None
    connector: KVConnector
    if sender is not None and receiver is not None:
        connector = EitherRoleConnector(sender, receiver)
    else:
        connector = sender if sender is not None else cast("ReceiverConnector", receiver)
    engine.connect(connector)
    loop = _engine_loop(cfg, engine, metrics, lease)
    # the loop is built on the engine, which calls the connectors: their wake-ups are set now
    if receiver is not None:
        receiver.wake = loop.wake
        wgrpc.add_DecodeWorkerServicer_to_server(DecodeService(cfg, loop, metrics), server)
    if sender is not None:
        sender.wake = loop.wake
        wgrpc.add_PrefillWorkerServicer_to_server(PrefillService(cfg, loop, sender, metrics), server)
    return loop, kv_endpoint


def _receiver_connector(cfg: WorkerConfig, engine: Engine, closers: list) -> tuple[ReceiverConnector, str]:
    """The decode role's: the KV receiver that prefill workers write into its reserved blocks."""
    from splitserve.kv_transfer import KVReceiver
    from splitserve.kv_transfer.links import TransportName
    from splitserve.kv_transfer.tcp import TCPTransport
    from splitserve.workers.decode.connector import CANCEL_WAIT_S, ReceiverConnector

    transport: TransportName | TCPTransport = cfg.kv_transport
    if cfg.internal_tls is not None:  # TCP under mutual TLS, offered to senders as "tcp"
        transport = TCPTransport(server_tls=cfg.internal_tls.ssl_context(server_side=True))
    receiver = KVReceiver(engine.kv_cache, host=cfg.host, port=cfg.kv_port, transport=transport)
    closers.append(receiver.close)
    return ReceiverConnector(receiver, cancel_timeout_s=CANCEL_WAIT_S), receiver.endpoint


def _sender_connector(cfg: WorkerConfig, engine: Engine, metrics: WorkerMetrics, closers: list) -> SenderConnector:
    """The prefill role's: the KV sender that streams each layer into a decode worker's blocks."""
    from splitserve.kv_transfer import KVSender
    from splitserve.kv_transfer.tcp import TCPTransport
    from splitserve.workers.prefill.connector import SenderConnector

    tls = cfg.internal_tls
    sender = KVSender(
        engine.kv_cache,
        wire_codec=cfg.kv_wire_codec,
        link_gbps=cfg.kv_link_gbps or None,
        transport=TCPTransport(client_tls=tls.ssl_context(server_side=False)) if tls is not None else None,
        # under TLS every byte is authenticated already (AES-GCM's tag): a frame checksum on top
        # would only cost both sides a pass over the KV (it halved the plane's throughput)
        checksum="none" if tls is not None else "lanesum",
    )
    closers.append(sender.close)
    tail_time = metrics.phase("kv_transfer_tail")
    return SenderConnector(sender, confirm_timeout_s=cfg.prefill_timeout_s, tail_time=tail_time)


def _engine_loop(cfg: WorkerConfig, engine: Engine, metrics: WorkerMetrics, lease: CoreLease | None) -> EngineLoop:
    """The role's engine loop (the prefill order is its scheduler's, from the engine's config)."""
    return EngineLoop(
        engine,
        waiting_limit=cfg.waiting_limit,
        on_iteration=metrics.record,
        core_lease=lease,
        decode_borrows=cfg.decode_borrows,
    )


def core_lease(cfg: WorkerConfig) -> CoreLease | None:
    """The worker's slot in its machine's core lease (None: off; on a GPU, whose cores are not lent;
    or for a tensor-parallel worker, whose ranks divide its threads between them once, at start)."""
    if cfg.core_lease in ("", "off") or cfg.engine.device != "cpu" or cfg.engine.tensor_parallel_size > 1:
        return None
    total = cfg.lease_cores or len(os.sched_getaffinity(0))
    return CoreLease(cfg.core_lease, total, min(total, cfg.threads or 1))


def serve_metrics(worker: RunningWorker, port: int) -> str:
    """The worker's Prometheus endpoint on its host (port 0: a free one); its "host:port"."""
    address, close = start_metrics_server(worker.metrics.registry, worker.cfg.host, port)
    worker.closers.append(close)
    return address


def add_admission_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """A worker's admission limit, for every command that starts workers."""
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=0,
        help="requests a worker lets wait for a seat; beyond, new ones are refused at once "
        "(RESOURCE_EXHAUSTED, HTTP 429 at the router) (0: twice --max-num-seqs)",
    )


def add_stream_argument(p: argparse._ActionsContainer) -> None:
    """How a decode worker groups a stream's tokens, for every command that starts workers."""
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="decode workers send a stream's tokens in groups of at least this many (the first and the last at once): "
        "fewer, larger messages through the router, tokens arriving in groups (1: each step's at once)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", required=True, choices=["prefill", "decode"], help="the worker's role (required)")
    p.add_argument(
        "--switchable",
        action="store_true",
        help="serve both roles (their services, the KV receiver and sender), so that a pool manager "
        "may move the worker between the pools; --role is the one it starts in",
    )
    p.add_argument("--worker-id", default=None, help="its name in logs and metrics (default: ROLE-GRPC_PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on and others reach it at")
    p.add_argument("--grpc-port", type=int, default=0, help="the control port, the router's calls (0: a free one)")
    p.add_argument("--kv-port", type=int, default=0, help="decode role: the KV receiver's port (0: a free one)")
    add_kv_transport_argument(p)
    add_wire_codec_arguments(p)
    add_secret_argument(
        p, "--cluster-token", "SPLITSERVE_CLUSTER_TOKEN", "the cluster token, required from every caller"
    )
    p.add_argument(
        "--insecure-no-cluster-token",
        action="store_true",
        help="start without a cluster token, every control call accepted; only with a loopback --host",
    )
    add_internal_tls_argument(p)
    p.add_argument("--ready-file", default=None, help="write 'grpc_address kv_endpoint' here once listening")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus endpoint on --host (0: a free port, named in the ready line; -1: off)",
    )
    add_engine_arguments(p)
    add_kernels_argument(p)
    add_admission_arguments(p)
    add_stream_argument(p)
    add_tracing_argument(p)


def worker_config_from_args(a: argparse.Namespace) -> WorkerConfig:
    """The worker the flags of `add_arguments` describe (ValueError if they cannot be). A tuned flag
    not given takes the machine's tuned choice for one process started alone: no share of the
    machine (engine/tuned.py MACHINE_SHARES), so torch's own threads and no core lease unless given."""
    a = fill_tuned(a, tuned_for(a.device))
    return WorkerConfig(
        role=a.role,
        worker_id=a.worker_id or f"{a.role}-{a.grpc_port}",
        model=a.model,
        engine=engine_config_from_args(a, a.role),
        host=a.host,
        grpc_port=a.grpc_port,
        kv_port=a.kv_port,
        kv_transport=a.kv_transport,
        kv_wire_codec=a.kv_wire_codec,
        kv_link_gbps=a.kv_link_gbps,
        cluster_token=a.cluster_token,
        internal_tls=load_cluster_tls(a.internal_tls_dir) if a.internal_tls_dir else None,
        threads=a.threads or 0,
        core_lease=a.core_lease or "",
        lease_cores=a.lease_cores,
        decode_borrows=a.decode_borrows == "on",
        max_waiting_requests=a.max_waiting_requests,
        switchable=a.switchable,
        stream_interval=a.stream_interval,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.workers", description="Run one prefill or decode worker.")
    add_arguments(p)
    return run(p.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    refusal = cluster_token_refusal(a.cluster_token, a.insecure_no_cluster_token, a.host)
    if refusal is not None:
        print(f"splitserve worker: {refusal}", file=sys.stderr)
        return 2
    from splitserve.engine.kernels.prebuild import preflight as kernels_preflight
    from splitserve.engine.memory import Pool, available_memory, fit_problems
    from splitserve.engine.preflight import engine_problems, tier_problems

    try:  # the flags, then the model's header against them: before any port or model load
        cfg = worker_config_from_args(a)
    except ValueError as e:
        print(f"splitserve worker: {e}", file=sys.stderr)
        return 2
    problems = engine_problems(a.model, {"--tensor-parallel-size": cfg.engine.tensor_parallel_size})
    problems += tier_problems(cfg.engine.kv_disk_tier_bytes, cfg.engine.kv_disk_tier_dir)
    if not problems:  # the model read: its weights, KV pool and runtime against this machine's memory
        problems = fit_problems(a.model, [Pool(a.role, 1, cfg.engine)], available_memory(), 0, "")
    if not problems:  # the cheap checks first: a build takes seconds
        problems = kernels_preflight(cfg.engine.device, a.allow_torch_fallback, lambda line: print(line, flush=True))
    for problem in problems:
        print(f"splitserve worker: {problem.line()}", file=sys.stderr)
    if problems:
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing(a.otlp_traces_endpoint, f"{a.role}-worker")
    worker = start_worker(cfg)
    metrics = serve_metrics(worker, a.metrics_port) if a.metrics_port >= 0 else "-"
    print(
        f"{cfg.role} worker ready: grpc {worker.grpc_address} kv {worker.kv_endpoint or '-'} metrics {metrics}",
        flush=True,
    )
    if a.ready_file:
        write_ready_file(a.ready_file, [f"{worker.grpc_address} {worker.kv_endpoint or '-'}"])
    wait_for_stop_signal()
    worker.stop()
    return 0


def write_ready_file(path: str, lines: list[str]) -> None:
    """`lines` into `path` at once (a reader polling for it never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(path + ".tmp", path)


def wait_for_stop_signal() -> None:
    """Until SIGINT or SIGTERM: a worker process's life, from ready to its orderly stop."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
