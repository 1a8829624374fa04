"""A worker as a Ray actor. The actor hosts the same process as
`python -m splitserve.workers` and tells its owner where it listens; the router
then talks to it over gRPC and kv_transfer, never through Ray. Like the
process, the actor serves its Prometheus metrics on a free port of its host
(`metrics_address`), logged at start."""

from __future__ import annotations

import logging

import ray

from splitserve.workers.common.config import WorkerConfig


class WorkerActor:
    """Wrapped with `ray.remote` by the pool manager, with the pool's resources. Its methods
    are `ray.method`s so that, in Ray's types, a handle's methods have `.remote`."""

    def __init__(self, cfg: WorkerConfig) -> None:
        import dataclasses

        from splitserve.runtime.tracing import setup_tracing
        from splitserve.workers.server import serve_metrics, start_worker

        if cfg.host == "auto":  # multi-node: listen on and advertise this node's address
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.cfg = cfg
        setup_tracing(cfg.otlp_traces_endpoint, f"{cfg.role}-worker")  # an actor is a process of its own
        self.worker = start_worker(cfg)
        self.metrics_address = serve_metrics(self.worker, 0)
        logging.getLogger(__name__).info("%s worker %s metrics on %s", cfg.role, cfg.worker_id, self.metrics_address)

    @ray.method
    def addresses(self) -> tuple[str, str | None]:
        """(gRPC address, KV endpoint or None) as other nodes reach them."""
        return self.worker.grpc_address, self.worker.kv_endpoint

    @ray.method
    def metrics(self) -> str:
        """The "host:port" of this worker's Prometheus endpoint."""
        return self.metrics_address

    @ray.method
    def ping(self) -> int:
        return self.worker.loop.steps

    @ray.method
    def stop(self) -> None:
        self.worker.stop()
