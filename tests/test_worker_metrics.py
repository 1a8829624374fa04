"""The workers' engine metrics (workers/common/metrics.py, fed by engine/stats.py).

Unit tests run a real tiny engine on a fake clock and check exact counter
values, histogram counts and sums and gauges: a local prefill chunked over two
steps, a repeated prompt served from the prefix cache, a remote prefill seen
from both its prefill and its decode engine, an abort in the queue. The
exposition test pins the names as exposed (counters end in `_total` once),
and the end-to-end test scrapes a real worker process, whose endpoint is on by
default.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from prometheus_client import generate_latest

import splitserve.kv_transfer.metrics  # noqa: F401  # the default registry's KV counters, served beside ours
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.workers.common.metrics import WorkerMetrics, start_metrics_server
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS
from tests.worker_helpers import EnginePair, assert_engine_empty, tiny_engine

NAMES = [
    "splitserve:num_requests_running",
    "splitserve:num_requests_waiting",
    "splitserve:kv_cache_usage_perc",
    "splitserve:prefix_cache_queries_total",
    "splitserve:prefix_cache_hits_total",
    "splitserve:prompt_tokens_total",
    "splitserve:generation_tokens_total",
    "splitserve:time_to_first_token_seconds",
    "splitserve:inter_token_latency_seconds",
    "splitserve:request_time_per_output_token_seconds",
    "splitserve:e2e_request_latency_seconds",
    "splitserve:request_queue_time_seconds",
    "splitserve:request_prefill_time_seconds",
    "splitserve:request_decode_time_seconds",
]
HISTOGRAMS = [n for n in NAMES if n.endswith("_seconds")]
PROMPT = list(range(10, 20))  # 10 tokens: two full blocks of 4 and two tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Reader:
    """One worker's series, by short name."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        model_name, role, worker_id = metrics.label_values
        self.labels = {"model_name": model_name, "role": role, "worker_id": worker_id}

    def __call__(self, name: str, **extra: str) -> float | None:
        return self.metrics.registry.get_sample_value(f"splitserve:{name}", {**self.labels, **extra})

    def hist(self, name: str) -> tuple[float | None, float | None]:
        """(count, sum) of a histogram."""
        return self(f"{name}_seconds_count"), self(f"{name}_seconds_sum")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def watched(engine: Engine, role: str, worker_id: str) -> tuple[WorkerMetrics, Reader]:
    m = WorkerMetrics(engine.model_cfg.name, role, worker_id)
    m.watch(engine.stats)
    return m, Reader(m)


def step_at(clock: FakeClock, t: float, engine: Engine, metrics: WorkerMetrics) -> None:
    clock.now = t
    engine.step()
    metrics.record(engine.drain_iteration_stats())


@pytest.mark.timeout(60)
def test_local_requests_counted_and_timed_exactly_with_a_prefix_hit_on_the_repeat():
    clock = FakeClock()
    # one seat, so the second request waits; 8 tokens a step, so the first prompt takes two steps
    engine = tiny_engine(num_blocks=64, max_num_seqs=1, block_size=4, max_num_batched_tokens=8, clock=clock)
    m, r = watched(engine, "decode", "d0")
    engine.add_request("r1", PROMPT, greedy(3))
    engine.add_request("r2", PROMPT, greedy(3))  # the same prompt: its two full blocks come from r1's cache

    step_at(clock, 1.0, engine, m)  # r1 scheduled: the first 8 prompt tokens
    assert (r("num_requests_running"), r("num_requests_waiting")) == (1.0, 1.0)
    assert r("kv_cache_usage_perc") == 3 / 64  # 10 tokens in blocks of 4
    assert r("prompt_tokens_total") == 0.0 and r("time_to_first_token_seconds_count") == 0.0
    step_at(clock, 2.0, engine, m)  # r1: the last 2 prompt tokens and its first token
    assert r("prompt_tokens_total") == 10.0 and r("generation_tokens_total") == 1.0
    step_at(clock, 3.0, engine, m)
    step_at(clock, 4.0, engine, m)  # r1's third token: finished (length)
    assert r("e2e_request_latency_seconds_count") == 1.0
    step_at(clock, 5.0, engine, m)  # r2: 8 cached tokens, 2 computed, first token
    step_at(clock, 6.0, engine, m)
    step_at(clock, 7.0, engine, m)
    assert not engine.has_work

    assert r("prompt_tokens_total") == 20.0  # cached prefix included, as vLLM counts
    assert r("generation_tokens_total") == 6.0
    assert r("prefix_cache_queries_total") == 20.0  # tokens
    assert r("prefix_cache_hits_total") == 8.0  # r2's two full blocks
    assert r.hist("time_to_first_token") == (2.0, 2.0 + 5.0)
    assert r("time_to_first_token_seconds_bucket", le="2.5") == 1.0
    assert r("time_to_first_token_seconds_bucket", le="5.0") == 2.0
    assert r.hist("inter_token_latency") == (4.0, 4.0)
    assert r.hist("e2e_request_latency") == (2.0, 4.0 + 7.0)
    assert r.hist("request_queue_time") == (2.0, 1.0 + 5.0)
    assert r.hist("request_prefill_time") == (2.0, 1.0 + 0.0)  # r1 over two steps, r2 in one
    assert r.hist("request_decode_time") == (2.0, 2.0 + 2.0)
    assert r.hist("request_time_per_output_token") == (2.0, 1.0 + 1.0)
    assert (r("num_requests_running"), r("num_requests_waiting"), r("kv_cache_usage_perc")) == (0.0, 0.0, 0.0)
    assert_engine_empty(engine)


@pytest.mark.timeout(60)
def test_remote_prefill_counts_its_prompt_on_the_prefill_worker_and_its_queue_to_kv_arrival_on_the_decode_worker():
    clock = FakeClock()
    pair = EnginePair.tiny(clock=clock)
    try:
        pm, p = watched(pair.prefill, "prefill", "p0")
        dm, d = watched(pair.decode, "decode", "d0")
        remote = pair.reserve("r", PROMPT, greedy(3))  # decode arrival: 0
        assert (d("num_requests_running"), d("num_requests_waiting")) == (0.0, 1.0)  # reserved: waits for its KV
        assert d("kv_cache_usage_perc") == 3 / 64
        clock.now = 1.0
        pair.start_prefill("r", PROMPT, greedy(3), remote)  # prefill arrival: 1
        clock.now = 2.0
        assert pair.step_prefill() == []  # the first 8 tokens
        clock.now = 3.0
        pair.prefill_until_done("r")
        pair.poll_prefill()  # the confirmed send frees the held blocks
        pm.record(pair.prefill.drain_iteration_stats())
        clock.now = 4.0
        (commit,) = pair.poll_decode()  # the KV is in: r runs, with the prefill worker's first token
        assert commit.token_id == -1 and not commit.finished
        step_at(clock, 5.0, pair.decode, dm)
        step_at(clock, 6.0, pair.decode, dm)
        assert not pair.decode.has_work

        assert (p("prompt_tokens_total"), p("generation_tokens_total")) == (10.0, 1.0)
        assert p.hist("time_to_first_token") == (1.0, 2.0)
        assert p.hist("request_queue_time") == (1.0, 1.0)
        assert p.hist("request_prefill_time") == (1.0, 1.0)
        assert p.hist("e2e_request_latency") == (1.0, 2.0)  # once: at its first token, not again at release
        assert p.hist("request_time_per_output_token") == (0.0, 0.0)  # one token: no time per output token
        assert p("kv_cache_usage_perc") == 0.0

        assert (d("prompt_tokens_total"), d("generation_tokens_total")) == (0.0, 2.0)  # the first was remote
        assert (d("prefix_cache_queries_total"), d("prefix_cache_hits_total")) == (10.0, 0.0)
        assert d.hist("time_to_first_token") == (1.0, 4.0)  # reservation to KV arrival
        assert d.hist("request_queue_time") == (1.0, 4.0)
        assert d.hist("request_prefill_time") == (1.0, 0.0)
        assert d.hist("inter_token_latency") == (2.0, 2.0)
        assert d.hist("request_decode_time") == (1.0, 2.0)
        assert d.hist("e2e_request_latency") == (1.0, 6.0)
        assert (d("num_requests_running"), d("num_requests_waiting"), d("kv_cache_usage_perc")) == (0.0, 0.0, 0.0)
        assert_engine_empty(pair.prefill)
        assert_engine_empty(pair.decode)
    finally:
        pair.close()


@pytest.mark.timeout(60)
def test_a_request_aborted_in_the_queue_has_an_end_to_end_time_but_no_queue_time_or_first_token():
    clock = FakeClock()
    engine = tiny_engine(clock=clock)
    m, r = watched(engine, "decode", "d0")
    engine.add_request("r", PROMPT, greedy(3))
    clock.now = 2.5
    assert engine.abort("r")
    m.record(engine.drain_iteration_stats())
    assert r.hist("e2e_request_latency") == (1.0, 2.5)
    assert r.hist("request_queue_time") == (0.0, 0.0)
    assert r.hist("time_to_first_token") == (0.0, 0.0)
    assert r.hist("request_decode_time") == (0.0, 0.0)
    assert_engine_empty(engine)


def exposed_names(text: str) -> set[str]:
    return {line.split(" ", 2)[2] for line in text.splitlines() if line.startswith("# TYPE ")} | {
        re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")
    }


@pytest.mark.timeout(60)
def test_names_as_exposed_and_the_endpoint_serves_the_default_registry_too():
    engine = tiny_engine()
    m, _ = watched(engine, "prefill", "p7")
    text = generate_latest(m.registry).decode()
    samples = exposed_names(text)
    for name in NAMES:
        kind = "histogram" if name in HISTOGRAMS else "counter" if name.endswith("_total") else "gauge"
        assert f"{name} {kind}" in samples, f"# TYPE {name} {kind} missing from:\n{text}"
        assert (name + "_count" if kind == "histogram" else name) in samples
    assert not any("_total_total" in s for s in samples)
    assert 'splitserve:num_requests_running{model_name="tiny",role="prefill",worker_id="p7"} 0.0' in text

    address, close = start_metrics_server(m.registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            served = exposed_names(resp.read().decode())
    finally:
        close()
    assert "splitserve:generation_tokens_total" in served
    assert "splitserve_kv_reservations_completed_total" in served  # the KV plane's, from the default registry


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_worker_process_serves_its_metrics_by_default():
    w = spawn_worker("decode", *FLAGS, "--worker-id", "d-metrics")  # no --metrics-port: on, on a free port
    sampling = wpb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, top_p=1.0, repetition_penalty=1.0)
    try:
        ready = [line for line in w.log().splitlines() if "worker ready" in line]
        assert ready, w.log()
        found = re.search(r" metrics (127\.0\.0\.1:\d+)$", ready[0])
        assert found, ready[0]
        request = wpb.DecodeRequest(
            request_id="m1",
            handoff=wpb.Handoff(prompt_token_ids=PROMPT, sampling=sampling),
            prefill_mode=wpb.PREFILL_MODE_LOCAL,
        )
        with grpc.insecure_channel(w.grpc_address) as ch:
            events = list(wgrpc.DecodeWorkerStub(ch).Decode(request, timeout=120))
        assert events[-1].WhichOneof("event") == "finish", events
        assert sum(len(e.tokens.token_ids) for e in events if e.WhichOneof("event") == "tokens") == 4
        with urllib.request.urlopen(f"http://{found.group(1)}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        w.stop()
    samples = exposed_names(text)
    for name in NAMES:
        assert (name + "_count" if name in HISTOGRAMS else name) in samples, f"{name} not served:\n{text}"

    def value(name: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(name + "{") and 'worker_id="d-metrics"' in x]
        assert 'role="decode"' in line, line
        return float(line.rsplit(" ", 1)[1])

    assert value("splitserve:prompt_tokens_total") == len(PROMPT)
    assert value("splitserve:generation_tokens_total") == 4
    assert value("splitserve:e2e_request_latency_seconds_count") == 1
    assert value("splitserve:inter_token_latency_seconds_count") == 3
    assert value("splitserve:num_requests_running") == 0
    assert "splitserve_decode_blocks_freed_while_reserved_total" in samples  # the default registry too
