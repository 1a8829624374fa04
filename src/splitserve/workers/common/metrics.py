"""A worker's engine metrics in Prometheus, under the names vLLM gives its own
(`splitserve:` where vLLM has `vllm:`), and the worker's HTTP endpoint.

Every series carries `model_name` (as vLLM's do), `role` (prefill or decode)
and `worker_id`. Gauges are read at scrape time from the engine loop's latest
`SchedulerStats`; counters and histograms are fed with each step's
`IterationStats` (engine/stats.py) on the engine thread. Times are the
engine's own view of a request: on a decode worker that receives the prompt's
KV from a prefill worker, the queue runs from the reservation to the KV's
arrival, the first token is the prefill worker's (TTFT is reservation to KV
arrival) and the prefill time is 0. Token counters count what this engine
computed, so a sum over all workers counts each token once: a remote prompt
counts on its prefill worker, whose one generation token is the first token.

The endpoint also serves the process's default registry: the KV plane's
`splitserve_kv_*` counters, `splitserve_decode_*`, and the process and GC metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.engine.kv_tier import TierStats
from splitserve.engine.scheduler import SchedulerStats
from splitserve.engine.stats import IterationStats
from splitserve.runtime.metrics_http import serve_metrics_http
from splitserve.runtime.request_metrics import ITL_BUCKETS, LABELS, REQUEST_BUCKETS, TTFT_BUCKETS
from splitserve.runtime.tracing import PHASE_BUCKETS, PHASE_METRIC

Snapshot = Callable[[], SchedulerStats]

# a worker's phases of one request (tracing.py times each as a span and an observation):
# admission: Decode call to reservation (or local admission);
# handover: the engine takes the arrived KV to the first token it samples;
# prefill_queue, prefill_compute: admitted to first scheduled, to the first token;
# kv_transfer_tail: the last layer computed to the decode worker's confirmation of every byte
PHASES = ("admission", "handover", "prefill_queue", "prefill_compute", "kv_transfer_tail")


class WorkerMetrics:
    """One worker's engine series, on a registry of its own (several workers may share a process in tests)."""

    def __init__(self, model_name: str, role: str, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.label_values = (model_name, role, worker_id)
        self._snapshot: Snapshot | None = None
        self._add_token_counters()
        self._add_latency_histograms()
        self._phase = Histogram(
            PHASE_METRIC,
            "Time in each phase of a request, the same as its trace span: decode worker admission, handover; "
            "prefill worker prefill_queue, prefill_compute, kv_transfer_tail (tracing.py)",
            (*LABELS, "phase"),
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineGauges(self))

    def _counter(self, name: str, doc: str) -> Counter:  # prometheus_client adds `_total` to the name
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self.label_values)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.label_values)

    def _add_token_counters(self) -> None:
        self.prompt_tokens = self._counter(
            "splitserve:prompt_tokens",
            "Prompt tokens prefilled by this engine, cached prefix included (a remote prefill's count on its prefill "
            "worker)",
        )
        self.generation_tokens = self._counter(
            "splitserve:generation_tokens",
            "Tokens sampled by this engine (a remote prefill's first token counts on its prefill worker)",
        )
        self.prefix_cache_queries = self._counter(
            "splitserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (tokens, as vLLM counts)"
        )
        self.prefix_cache_hits = self._counter(
            "splitserve:prefix_cache_hits", "Prompt tokens found in the prefix cache (tokens, whole blocks)"
        )
        # the acceptance rate is accepted / draft tokens over any window (rate() of each, as vLLM's)
        self.spec_draft_tokens = self._counter(
            "splitserve:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens the target verified"
        )
        self.spec_accepted_tokens = self._counter(
            "splitserve:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (each a decode step saved)",
        )

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram(
            "splitserve:time_to_first_token_seconds",
            "Admission to first token in this engine (decode worker with remote KV: reservation to KV arrival)",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "splitserve:inter_token_latency_seconds", "Time between two tokens of one request", ITL_BUCKETS
        )
        self.tpot = self._histogram(
            "splitserve:request_time_per_output_token_seconds",
            "Per finished request: decode time per token after the first",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "splitserve:e2e_request_latency_seconds",
            "Admission to finish in this engine (prefill worker: to the first token)",
            REQUEST_BUCKETS,
        )
        self.queue = self._histogram(
            "splitserve:request_queue_time_seconds",
            "Admission to first scheduled (decode worker with remote KV: reservation to KV arrival, when it joins "
            "the running batch)",
            REQUEST_BUCKETS,
        )
        self.prefill = self._histogram(
            "splitserve:request_prefill_time_seconds",
            "First scheduled to first token (0 on a decode worker with remote KV)",
            REQUEST_BUCKETS,
        )
        self.decode = self._histogram(
            "splitserve:request_decode_time_seconds", "First token to last token", REQUEST_BUCKETS
        )

    def phase(self, name: str) -> Histogram:
        """The histogram of one phase of a request on this worker (see PHASES)."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        return self._phase.labels(*self.label_values, name)

    def watch(self, snapshot: Snapshot) -> None:
        """Read the gauges from `snapshot()` at each scrape (the engine loop's `stats`); absent until then."""
        self._snapshot = snapshot

    def watch_tiers(self, tiers: dict[str, TierStats]) -> None:
        """Export the KV tiers' counts (engine/kv_tiers.py, by tier name), read at each scrape."""
        self.registry.register(_TierMetrics(self, tiers))

    def record(self, it: IterationStats) -> None:
        """One step's counts and times (the engine loop's `on_iteration`)."""
        self.prompt_tokens.inc(it.prompt_tokens)
        self.generation_tokens.inc(it.generation_tokens)
        self.prefix_cache_queries.inc(it.prefix_cache_queries)
        self.prefix_cache_hits.inc(it.prefix_cache_hits)
        self.spec_draft_tokens.inc(it.draft_tokens)
        self.spec_accepted_tokens.inc(it.accepted_draft_tokens)
        for t in it.ttfts:
            self.ttft.observe(t)
        for t in it.itls:
            self.itl.observe(t)
        for f in it.finished:
            self.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue.observe(f.queue_time)
            if f.prefill_time is not None:
                self.prefill.observe(f.prefill_time)
            if f.decode_time is not None:
                self.decode.observe(f.decode_time)
            if f.time_per_output_token is not None:
                self.tpot.observe(f.time_per_output_token)


class _EngineGauges(Collector):
    """Running, waiting and KV usage, read when scraped."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("splitserve:num_requests_running", "Requests in the running batch", labels=LABELS),
            GaugeMetricFamily(
                "splitserve:num_requests_waiting",
                "Requests waiting to run: queued, or reserved and waiting for their KV (decode worker)",
                labels=LABELS,
            ),
            GaugeMetricFamily(
                "splitserve:kv_cache_usage_perc",
                "Share of KV blocks in use, 0 to 1 (cached blocks no request holds count as free)",
                labels=LABELS,
            ),
        ]

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        snapshot = self.metrics._snapshot
        if snapshot is None:
            return []
        s = snapshot()
        running, waiting, usage = self._families()
        values = list(self.metrics.label_values)
        running.add_metric(values, s.running_requests)
        waiting.add_metric(values, s.queue_length + s.reserved_requests)
        usage.add_metric(values, 1.0 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0)
        return [running, waiting, usage]


# name (without `_total`), kind, TierStats field, help
_TIER_SERIES = (
    ("splitserve:kv_tier_blocks", "gauge", "blocks", "KV blocks a tier behind the prefix cache holds now"),
    ("splitserve:kv_tier_bytes", "gauge", "bytes", "Bytes a tier holds now (the disk tier's file headers included)"),
    ("splitserve:kv_tier_stored_blocks", "counter", "stored", "Blocks written into a tier"),
    ("splitserve:kv_tier_hits", "counter", "hits", "Blocks loaded from a tier into the pool instead of recomputed"),
    ("splitserve:kv_tier_loaded_bytes", "counter", "bytes_loaded", "Bytes loaded from a tier into the pool"),
    ("splitserve:kv_tier_load_seconds", "counter", "load_seconds", "Seconds spent loading blocks from a tier"),
    (
        "splitserve:kv_tier_recomputed_instead",
        "counter",
        "recomputed_instead",
        "Blocks found in a tier but recomputed, loading them being slower than the measured prefill",
    ),
    (
        "splitserve:kv_tier_checksum_failures",
        "counter",
        "checksum_failures",
        "Blocks refused at load (bad checksum, short, missing or foreign file): recomputed",
    ),
    ("splitserve:kv_tier_write_failures", "counter", "write_failures", "Blocks a tier failed to write (a full disk)"),
    (
        "splitserve:kv_tier_write_dropped",
        "counter",
        "write_dropped",
        "Blocks not written to the disk tier because its writer's queue was full (the disk slower than the evictions)",
    ),
)


class _TierMetrics(Collector):
    """Per tier (label `tier`): what engine/kv_tiers.py counts, read when scraped."""

    def __init__(self, metrics: WorkerMetrics, tiers: dict[str, TierStats]) -> None:
        self.metrics = metrics
        self.tiers = tiers

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        labels = [*LABELS, "tier"]
        return [
            GaugeMetricFamily(name, doc, labels=labels)
            if kind == "gauge"
            else CounterMetricFamily(name, doc, labels=labels)
            for name, kind, _, doc in _TIER_SERIES
        ]

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        for tier, stats in self.tiers.items():
            values = [*self.metrics.label_values, tier]
            for family, (_, _, field, _) in zip(families, _TIER_SERIES, strict=True):
                family.add_metric(values, getattr(stats, field))
        return families


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[str, Callable[[], None]]:
    """Serve `registry` and the process's default registry at http://host:port/metrics (port 0: a free
    one). Returns the bound "host:port" and a function that stops the server."""
    return serve_metrics_http(host, port, registry, REGISTRY)
