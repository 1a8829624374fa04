"""The router's Prometheus metrics, on a registry of its own (so tests and
several routers in one process do not collide).

Besides its own `splitserve_router_*` series, the router serves the request
series under the names the workers' engines use (vLLM's, `splitserve:` for
`vllm:`; workers/common/metrics.py), measured as the client sees them: from the
request's arrival at the router to what the router sends. They carry the
workers' labels, with role="router", model_name the name clients ask for
(`--model-name`) and worker_id "router-<grpc port>", so a dashboard built for
vLLM's names works when pointed at the router, and a Prometheus that scrapes
the router and the workers keeps the two apart (filter on role).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.router.config import RouterConfig
from splitserve.runtime.request_metrics import ITL_BUCKETS, LABELS, REQUEST_BUCKETS, TTFT_BUCKETS
from splitserve.runtime.tracing import PHASE_BUCKETS, PHASE_METRIC

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    def __init__(self, cfg: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._add_request_metrics(self.registry)
        self.client = ClientMetrics(self.registry, cfg.listeners.model_name, f"router-{cfg.listeners.grpc_port}")
        self._add_routing_metrics(self.registry, cfg)
        self._add_pool_metrics(self.registry)
        self._add_tenant_metrics(self.registry)
        self._blocks = 0
        self._hits = 0
        self._routed = 0

    def _add_tenant_metrics(self, r: CollectorRegistry) -> None:
        """Per tenant (router/tenants.py; "anonymous" without keys): one series each, as many as the
        tenants file names, never a value a client chooses."""
        self.tenant_requests = Counter(
            "splitserve_router_tenant_requests",
            "Requests run, by tenant and final status",
            ["tenant", "code"],
            registry=r,
        )
        self.tenant_refusals = Counter(
            "splitserve_router_tenant_refusals",
            "Requests refused for the tenant's own limits (in flight, tokens per minute)",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "splitserve_router_tenant_tokens", "Tokens served, by tenant and kind", ["tenant", "kind"], registry=r
        )
        self.tenant_waiting = Gauge(
            "splitserve_router_tenant_waiting_requests",
            "Requests waiting in the router for a seat (--max-running-requests), by tenant",
            ["tenant"],
            registry=r,
        )

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
        # the pool controller's (cluster/pool.py): state is serving, starting, draining or standby
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
        self._routed += 1
        self._hits += hit_blocks
        if self._blocks:
            self.prefix_hit_rate.set(self._hits / self._blocks)

    def routed_totals(self) -> tuple[int, int, int]:
        """(requests, full prompt blocks, of those cached on the chosen decode worker) routed since
        start: the load arriving at the pools, for the joint controller (cluster/joint.py)."""
        return self._routed, self._blocks, self._hits

    def itl_totals(self) -> tuple[float, int]:
        """(seconds, gaps) of every inter-token gap sent to clients since start."""
        total, count = 0.0, 0
        for metric in self.itl.collect():
            for s in metric.samples:
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = int(s.value)
        return total, count


class ClientMetrics:
    """The request series under the workers' (vLLM's) names, measured at the router: what the
    client sees. Children already labelled with the router's (model_name, role, worker_id)."""

    def __init__(self, r: CollectorRegistry, model_name: str, worker_id: str) -> None:
        self.label_values = (model_name, "router", worker_id)
        self.ttft = self._histogram(
            r, "splitserve:time_to_first_token_seconds", "Arrival at the router to the first token sent", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            r,
            "splitserve:inter_token_latency_seconds",
            "Time between two tokens sent to the client (a batch of tokens shares its gap equally)",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            r,
            "splitserve:e2e_request_latency_seconds",
            "Arrival at the router to the last response sent, for requests that finished (stop or length)",
            REQUEST_BUCKETS,
        )
        self.queue = self._histogram(
            r,
            "splitserve:request_queue_time_seconds",
            "Arrival at the router to the first event of a decode worker that admitted the request (its "
            "reservation for a remote prefill, or the start of its local prefill): routing, retries and the "
            "worker's admission queue",
            REQUEST_BUCKETS,
        )
        self.prompt_tokens = self._counter(
            r, "splitserve:prompt_tokens", "Prompt tokens of the requests whose first token was sent (cached included)"
        )
        self.generation_tokens = self._counter(r, "splitserve:generation_tokens", "Tokens sent to clients")
        self.success = Counter(
            "splitserve:request_success",
            "Requests that finished, by finish reason (stop or length; a failed request is counted by "
            "splitserve_router_requests)",
            (*LABELS, "finished_reason"),
            registry=r,
        )

    def _histogram(self, r: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.label_values)

    def _counter(self, r: CollectorRegistry, name: str, doc: str) -> Counter:  # `_total` added by prometheus_client
        return Counter(name, doc, LABELS, registry=r).labels(*self.label_values)

    def finished(self, reason: str) -> None:
        self.success.labels(*self.label_values, reason).inc()
