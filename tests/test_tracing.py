"""One OpenTelemetry trace per request: a router and real workers (in this
process, tiny model, real gRPC and KV sockets) serve one disaggregated request
that carries a client's traceparent. Every span of the router, the decode worker
and the prefill worker (and the per-layer KV events) is in the client's trace,
the spans form one tree under the client's span, and each phase histogram holds
exactly what its span lasted. With tracing off, nothing is recorded and requests
work the same."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import aiohttp
import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from prometheus_client import CollectorRegistry

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Deadlines, Listeners, RouterConfig, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.runtime import tracing
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.server import RunningWorker, start_worker

pytestmark = [pytest.mark.e2e]

T = TypeVar("T")

CFG = tiny_model_config(vocab_size=512, num_layers=2)
WEIGHTS = random_weights(CFG, seed=3)
# a 32-token chunk: the 80-token prompt below is prefilled (and its KV sent) in three chunks
ENGINE = EngineConfig(num_blocks=256, max_num_batched_tokens=32)
TOKEN = "tracing-test-token"
PROMPT = [(7 * i) % 256 for i in range(80)]
MAX_TOKENS = 4
TRACE_ID = 0x5B8EFFF798038103D269B633813FC60C
CLIENT_SPAN_ID = 0xEEE19B7EC3C1B174
TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"

ROUTER_SPANS = {"router.generate", "router.route", "router.decode_attempt", "router.prefill"}
DECODE_SPANS = {"decode.admission", "decode.stream", "decode.handover"}
PREFILL_SPANS = {"prefill.queue", "prefill.compute", "prefill.kv_send", "prefill.kv_transfer_tail"}
PARENT = {  # span -> its parent's name (router.generate's parent is the client's span)
    "router.route": "router.generate",
    "router.decode_attempt": "router.generate",
    "router.prefill": "router.decode_attempt",
    "decode.admission": "router.decode_attempt",
    "decode.stream": "router.decode_attempt",
    "decode.handover": "decode.stream",
    "prefill.queue": "router.prefill",
    "prefill.compute": "router.prefill",
    "prefill.kv_send": "router.prefill",
    "prefill.kv_transfer_tail": "prefill.kv_send",
}
# span -> (whose registry, phase label)
PHASE_OF = {
    "router.route": ("router", "routing"),
    "decode.admission": ("decode", "admission"),
    "decode.handover": ("decode", "handover"),
    "prefill.queue": ("prefill", "prefill_queue"),
    "prefill.compute": ("prefill", "prefill_compute"),
    "prefill.kv_transfer_tail": ("prefill", "kv_transfer_tail"),
}


def _reset_global_tracer_provider() -> None:
    # OpenTelemetry lets a process set its provider once; the tests set it and take it back
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """An SDK provider for this process whose spans land in memory (what setup_tracing installs,
    with an in-memory exporter in place of OTLP)."""
    _reset_global_tracer_provider()
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    trace.set_tracer_provider(provider)
    yield exp
    provider.shutdown()
    _reset_global_tracer_provider()


@pytest.fixture
def no_tracing() -> Iterator[None]:
    _reset_global_tracer_provider()
    yield
    _reset_global_tracer_provider()


class Cluster:
    def __init__(self, router: Router, decode: RunningWorker, prefill: RunningWorker) -> None:
        self.router, self.decode, self.prefill = router, decode, prefill

    def registry(self, who: str) -> CollectorRegistry:
        return {
            "router": self.router.metrics.registry,
            "decode": self.decode.metrics.registry,
            "prefill": self.prefill.metrics.registry,
        }[who]

    def phase(self, who: str, phase: str) -> tuple[float, float]:
        """(count, sum) of one phase's histogram."""
        labels = {"phase": phase}
        if who != "router":
            worker = self.decode if who == "decode" else self.prefill
            labels.update(zip(("model_name", "role", "worker_id"), worker.metrics.label_values, strict=True))
        r = self.registry(who)
        count = r.get_sample_value(f"{tracing.PHASE_METRIC}_count", labels)
        total = r.get_sample_value(f"{tracing.PHASE_METRIC}_sum", labels)
        return count or 0.0, total or 0.0


async def with_cluster(body: Callable[[Cluster], Awaitable[T]]) -> T:
    def worker(role: str) -> RunningWorker:
        cfg = WorkerConfig(role=role, worker_id=f"{role}-0", engine=ENGINE, cluster_token=TOKEN, warm_up=False)
        return start_worker(cfg, Engine(CFG, WEIGHTS, ENGINE))

    decode, prefill = worker("decode"), worker("prefill")
    routing = RoutingConfig(mode="disaggregated", block_size=ENGINE.block_size)
    cfg = RouterConfig(
        deadlines=Deadlines(stats_interval_s=0.05),
        listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0, cluster_token=TOKEN),
        routing=routing,
    )
    router = Router(cfg, ByteTokenizer(), [decode.grpc_address], [prefill.grpc_address], rng=random.Random(0))
    await router.start(0)
    try:
        await router.wait_for_workers(30)
        return await body(Cluster(router, decode, prefill))
    finally:
        await router.stop()
        decode.stop()
        prefill.stop()


async def generate(router: Router, metadata: tuple[tuple[str, str], ...] = ()) -> list[int]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        async for r in pbg.GenerationStub(ch).Generate(req, timeout=60, metadata=metadata):
            tokens.extend(r.token_ids)
    return tokens


async def until_spans(exporter: InMemorySpanExporter, names: set[str], timeout_s: float = 15.0) -> list[ReadableSpan]:
    """The finished spans, once every one of `names` is among them (the KV confirmation and the
    decode worker's stream end after the client has its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = list(exporter.get_finished_spans())
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        await asyncio.sleep(0.02)


def duration_s(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    out: dict[str, ReadableSpan] = {}
    for s in spans:
        assert s.name not in out, f"two {s.name} spans for one request: {[x.name for x in spans]}"
        out[s.name] = s
    return out


@pytest.mark.timeout(180)
def test_one_trace_across_router_and_workers_and_phases_agree_with_spans(exporter: InMemorySpanExporter) -> None:
    async def body(c: Cluster) -> tuple[list[int], list[ReadableSpan], dict[str, tuple[float, float]]]:
        tokens = await generate(c.router, (("traceparent", TRACEPARENT),))
        spans = await until_spans(exporter, ROUTER_SPANS | DECODE_SPANS | PREFILL_SPANS)
        return tokens, spans, {name: c.phase(*PHASE_OF[name]) for name in PHASE_OF}

    tokens, spans, phases = asyncio.run(with_cluster(body))
    assert len(tokens) == MAX_TOKENS

    # every span is the client's trace, and each expected span exactly once
    assert {s.context.trace_id for s in spans} == {TRACE_ID}
    named = by_name(spans)
    assert set(named) == ROUTER_SPANS | DECODE_SPANS | PREFILL_SPANS

    # one tree: the router's span hangs under the client's, every other under the one named in PARENT
    root = named["router.generate"]
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN_ID and root.parent.is_remote
    for name, parent in PARENT.items():
        span = named[name]
        assert span.parent is not None, name
        assert span.parent.span_id == named[parent].context.span_id, f"{name} is not under {parent}"
    # the workers' spans are children of a context that came over the wire
    assert named["decode.admission"].parent is not None and named["decode.admission"].parent.is_remote
    assert named["prefill.kv_send"].parent is not None and named["prefill.kv_send"].parent.is_remote

    # the KV went layer by layer: an event per layer of each of the three chunks, every layer present
    layers = [e.attributes["layer"] for e in named["prefill.kv_send"].events if e.name == "kv.layer" and e.attributes]
    assert set(layers) == set(range(CFG.num_layers))
    assert len(layers) == 3 * CFG.num_layers

    # each phase histogram observed once, exactly what its span lasted
    for name, (count, total) in phases.items():
        assert count == 1, f"{name}: {count} observations"
        assert total == pytest.approx(duration_s(named[name]), abs=1e-6), name
        assert total > 0, name

    # the phases sit in order on one timeline: queue, then compute, then the decode handover
    q, comp, ho = named["prefill.queue"], named["prefill.compute"], named["decode.handover"]
    assert q.end_time is not None and comp.start_time is not None and comp.end_time is not None
    assert abs(comp.start_time - q.end_time) < 1_000_000  # the same engine timestamp, within 1 ms
    assert ho.start_time is not None and ho.start_time >= comp.end_time - 1_000_000
    assert root.attributes is not None and root.attributes["splitserve.completion_tokens"] == MAX_TOKENS


@pytest.mark.timeout(180)
def test_http_front_door_takes_the_traceparent_header(exporter: InMemorySpanExporter) -> None:
    async def body(c: Cluster) -> list[ReadableSpan]:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{c.router.http_port}") as s:
            payload = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
            async with s.post("/v1/completions", json=payload, headers={"traceparent": TRACEPARENT}) as r:
                assert r.status == 200, await r.text()
        return await until_spans(exporter, {"router.generate", "prefill.kv_transfer_tail", "decode.stream"})

    spans = asyncio.run(with_cluster(body))
    named = by_name(spans)
    assert {s.context.trace_id for s in spans} == {TRACE_ID}
    root = named["router.generate"]
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN_ID
    assert root.attributes is not None and root.attributes["splitserve.front_door"] == "http"


@pytest.mark.timeout(180)
def test_without_a_client_traceparent_the_router_starts_the_trace(exporter: InMemorySpanExporter) -> None:
    async def body(c: Cluster) -> list[ReadableSpan]:
        await generate(c.router)
        return await until_spans(exporter, ROUTER_SPANS | DECODE_SPANS | PREFILL_SPANS)

    spans = asyncio.run(with_cluster(body))
    named = by_name(spans)
    root = named["router.generate"]
    assert root.parent is None
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}


@pytest.mark.timeout(180)
def test_tracing_off_records_nothing_and_requests_work(no_tracing: None) -> None:
    assert tracing.setup_tracing(None, "router") is None
    assert tracing.setup_tracing("", "decode-worker") is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # nothing installed

    async def body(c: Cluster) -> tuple[list[int], dict[str, tuple[float, float]]]:
        tokens = await generate(c.router, (("traceparent", TRACEPARENT),))
        await asyncio.sleep(0.3)  # the KV confirmation ends after the answer
        return tokens, {name: c.phase(*PHASE_OF[name]) for name in PHASE_OF}

    tokens, phases = asyncio.run(with_cluster(body))
    assert len(tokens) == MAX_TOKENS
    assert not tracing.tracer().start_span("probe").is_recording()
    # a provider installed now sees nothing of the request that ran before it
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    trace.set_tracer_provider(provider)
    assert exp.get_finished_spans() == ()
    provider.shutdown()
    # the phase histograms do not depend on tracing
    assert {name: count for name, (count, _) in phases.items()} == dict.fromkeys(PHASE_OF, 1.0)


@pytest.mark.timeout(30)
def test_setup_tracing_installs_an_otlp_provider_named_for_the_service(no_tracing: None) -> None:
    provider = tracing.setup_tracing("http://127.0.0.1:1/v1/traces", "prefill-worker")
    try:
        assert isinstance(provider, TracerProvider)
        assert trace.get_tracer_provider() is provider
        assert provider.resource.attributes["service.name"] == "prefill-worker"
        assert tracing.tracer().start_span("probe").is_recording()
    finally:
        assert provider is not None
        provider.shutdown()
    with pytest.raises(ValueError, match="service_name"):
        tracing.setup_tracing("http://127.0.0.1:1", "worker")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://jaeger:4318", "http://jaeger:4318/v1/traces"),
        ("http://jaeger:4318/", "http://jaeger:4318/v1/traces"),
        ("jaeger:4318", "http://jaeger:4318/v1/traces"),
        ("https://collector.example/otlp/v1/traces", "https://collector.example/otlp/v1/traces"),
    ],
)
def test_traces_url(endpoint: str, url: str) -> None:
    assert tracing.traces_url(endpoint) == url


@pytest.mark.timeout(10)
def test_flag_defaults_to_the_otel_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://collector:4318")
    p = argparse.ArgumentParser()
    tracing.add_tracing_argument(p)
    assert p.parse_args([]).otlp_traces_endpoint == "http://collector:4318"
    assert p.parse_args(["--otlp-traces-endpoint", "http://x:1"]).otlp_traces_endpoint == "http://x:1"
    monkeypatch.delenv(tracing.ENDPOINT_ENV)
    p = argparse.ArgumentParser()
    tracing.add_tracing_argument(p)
    assert p.parse_args([]).otlp_traces_endpoint is None
