"""The router's Prometheus metrics, on a registry of its own (so tests and
several routers in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.router.config import RouterConfig
from splitserve.runtime.tracing import PHASE_BUCKETS, PHASE_METRIC

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    def __init__(self, cfg: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._add_request_metrics(self.registry)
        self._add_routing_metrics(self.registry, cfg)
        self._add_pool_metrics(self.registry)
        self._blocks = 0
        self._hits = 0

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "splitserve_router_requests", "Generate calls by final gRPC status code", ["code"], registry=r
        )
        self.inflight = Gauge("splitserve_router_inflight_requests", "Generate calls in flight", registry=r)
        self.ttft = Histogram(
            "splitserve_router_ttft_seconds",
            "Request arrival to first token sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_router_itl_seconds", "Time between tokens sent to the client", buckets=_ITL_BUCKETS, registry=r
        )
        self.migrations = Counter(
            "splitserve_router_migrations", "Requests moved to another decode worker mid-stream", registry=r
        )
        self.queries_of_death = Counter(
            "splitserve_router_queries_of_death",
            "Requests failed without another try after failing on max_request_faults workers",
            registry=r,
        )
        self.prefill_retries = Counter(
            "splitserve_router_prefill_retries", "Prefill calls retried on another prefill worker", registry=r
        )

    def _add_routing_metrics(self, r: CollectorRegistry, cfg: RouterConfig) -> None:
        self.decisions = Counter(
            "splitserve_router_routing_decisions", "Routing decisions by prefill mode", ["mode"], registry=r
        )
        self.local_threshold = Gauge(
            "splitserve_router_local_prefill_threshold_tokens",
            "Uncached prompt tokens at or below which prefill is local",
            registry=r,
        )
        self.local_threshold.set(cfg.routing.local_prefill_max_tokens)
        self.prompt_blocks = Counter("splitserve_router_prompt_blocks", "Full prompt blocks routed", registry=r)
        self.prefix_hit_blocks = Counter(
            "splitserve_router_prefix_hit_blocks", "Prompt blocks cached on the chosen decode worker", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "splitserve_router_prefix_hit_rate", "prefix_hit_blocks / prompt_blocks since start", registry=r
        )
        # the router's phases of a request (tracing.py), under the name the workers give theirs
        self.phase = Histogram(
            PHASE_METRIC,
            "Time in each phase of a request, the same as its trace span (router: routing)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.routing_time = self.phase.labels("routing")

    def _add_pool_metrics(self, r: CollectorRegistry) -> None:
        # the pool controller's (cluster/pool.py): state is serving, starting or draining
        self.pool_workers = Gauge(
            "splitserve_router_pool_workers", "Workers of each pool by state", ["role", "state"], registry=r
        )
        self.scaling_decisions = Counter(
            "splitserve_router_scaling_decisions",
            "Pool changes by action: grow, shrink, replace (a dead worker)",
            ["role", "action"],
            registry=r,
        )

    def routed(self, mode: str, prompt_blocks: int, hit_blocks: int) -> None:
        self.decisions.labels(mode).inc()
        self.prompt_blocks.inc(prompt_blocks)
        self.prefix_hit_blocks.inc(hit_blocks)
        self._blocks += prompt_blocks
        self._hits += hit_blocks
        if self._blocks:
            self.prefix_hit_rate.set(self._hits / self._blocks)
