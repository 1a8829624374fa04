"""One OpenTelemetry trace per request, across the router, the decode worker and
the prefill worker, and the timer that keeps the traces and the phase
histograms in agreement.

Tracing is off unless a process is given an OTLP endpoint (`--otlp-traces-endpoint`,
default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): `setup_tracing` then installs an SDK
tracer provider that batches spans to that collector over OTLP/HTTP. Off, every
span below comes from the API's no-op tracer, so the instrumented code costs a few
attribute lookups per phase. Nothing happens at import.

The context travels explicitly: each front door extracts the client's W3C
`traceparent` (`extract`), every span names its parent `Context`, and every
internal gRPC call carries the caller's span in its metadata (`inject`). No span
is made current (attached): the router's requests are async generators and the
workers hand a request between threads, where an ambient context would leak.

A phase (routing, admission, prefill queue and compute, the KV transfer's tail,
the decode handover) is timed once, from two readings of `time.monotonic` (the
engine's clock in a worker), and that one duration both ends its span and is
observed by `splitserve:request_phase_seconds{phase=...}`: `phase` for what is
timed live, `record_phase` for what the engine already timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    import argparse

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.util.types import AttributeValue
    from prometheus_client import Histogram

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACER_NAME = "splitserve"
SERVICE_NAMES = ("router", "prefill-worker", "decode-worker")
PHASE_METRIC = "splitserve:request_phase_seconds"
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate, whatever the global one is

Attributes = Mapping[str, "AttributeValue"]
Metadata = Mapping[str, str] | Iterable[tuple[str, str | bytes]]  # gRPC metadata or HTTP headers


def add_tracing_argument(p: argparse._ActionsContainer) -> None:
    """--otlp-traces-endpoint, for every command that starts a router or a worker (vLLM's flag name)."""
    import os

    p.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get(ENDPOINT_ENV) or None,
        help="send one OpenTelemetry trace per request to this OTLP/HTTP collector, e.g. "
        f"http://localhost:4318/v1/traces (default: ${ENDPOINT_ENV}; unset: tracing off)",
    )


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: an endpoint given without a path gets OTLP/HTTP's /v1/traces."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.path in ("", "/"):
        return parts._replace(path="/v1/traces").geturl()
    return parts.geturl()


def setup_tracing(endpoint: str | None, service_name: str) -> TracerProvider | None:
    """Install a tracer provider exporting to `endpoint` for this process, named `service_name`
    (router, prefill-worker, decode-worker); None and nothing installed when `endpoint` is empty.
    Once per process (OpenTelemetry refuses a second provider)."""
    if not endpoint:
        return None
    if service_name not in SERVICE_NAMES:
        raise ValueError(f"service_name must be one of {SERVICE_NAMES}, got {service_name!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    trace.set_tracer_provider(provider)
    return provider


def tracer() -> Tracer:
    """The process's tracer, looked up at each use (so a provider installed later is the one used)."""
    return trace.get_tracer(TRACER_NAME)


# ---- propagation


def extract(metadata: Metadata | None) -> Context:
    """The caller's context from gRPC metadata or HTTP headers (`traceparent`); empty if none."""
    if not metadata:
        return Context()
    carrier = metadata if isinstance(metadata, Mapping) else {k: v for k, v in metadata if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier, context=Context())


def inject(metadata: Sequence[tuple[str, str]] | None, parent: Context) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the `traceparent` (and `tracestate`) of `parent`'s span, for an outgoing call."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=parent)
    return (*(metadata or ()), *carrier.items())


def child(span: Span) -> Context:
    """A context whose parent is `span` (for the spans and calls under it)."""
    return trace.set_span_in_context(span, Context())


# ---- spans and phases


def start_span(
    name: str, parent: Context, attributes: Attributes | None = None, kind: SpanKind = SpanKind.INTERNAL
) -> Span:
    """A span under `parent`, ended by the caller (`end_span`)."""
    return tracer().start_span(name, context=parent, kind=kind, attributes=attributes)


def end_span(span: Span, error: str | None = None) -> None:
    """End `span`, with an error status when `error` says what went wrong."""
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def _epoch_ns(mono: float, now_mono: float, now_ns: int) -> int:
    return now_ns - round((now_mono - mono) * 1e9)


@contextmanager
def phase(
    name: str, parent: Context, histogram: Histogram | None, attributes: Attributes | None = None
) -> Iterator[Span]:
    """Time a phase live: its span (under `parent`) and its histogram get the same duration. An
    exception marks the span failed and goes on; the phase is observed either way."""
    start_ns, start = time.time_ns(), time.monotonic()
    span = tracer().start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    try:
        yield span
    except BaseException as e:
        span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        elapsed = time.monotonic() - start
        span.end(end_time=start_ns + round(elapsed * 1e9))
        if histogram is not None:
            histogram.observe(elapsed)


def record_phase(
    name: str,
    parent: Context,
    histogram: Histogram | None,
    start: float,
    end: float,
    attributes: Attributes | None = None,
) -> Span:
    """A phase that is over, timed on `time.monotonic` (`start`, `end`: an engine's RequestTimes):
    its span, placed on the wall clock, lasts exactly what the histogram observes."""
    now_ns, now = time.time_ns(), time.monotonic()
    start_ns = _epoch_ns(start, now, now_ns)
    span = tracer().start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    span.end(end_time=start_ns + round((end - start) * 1e9))
    if histogram is not None:
        histogram.observe(end - start)
    return span
