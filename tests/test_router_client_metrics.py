"""The router's request series under the workers' (vLLM's) names, as the client sees them:
the ResponseShaper observes each once per request (per token for ITL and the token counters),
on a fake clock, with the router's labels."""

from __future__ import annotations

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RouterConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.response import ResponseShaper
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.router.validation import ValidRequest
from splitserve.runtime.request_metrics import ITL_BUCKETS, LABELS, REQUEST_BUCKETS, TTFT_BUCKETS

LABEL_VALUES = {"model_name": "splitserve", "role": "router", "worker_id": "router-50051"}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def shaper(max_tokens: int, stop: tuple[str, ...] = ()) -> tuple[ResponseShaper, RouterMetrics, Clock]:
    metrics = RouterMetrics(RouterConfig())
    clock = Clock(10.0)
    req = ValidRequest("r", (1, 2, 3), SamplingParams(max_tokens=max_tokens, stop=stop), continuous_usage=False)
    return ResponseShaper(req, ByteTokenizer(), metrics, start=10.0, clock=clock), metrics, clock


def value(metrics: RouterMetrics, name: str, **extra: str) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABEL_VALUES, **extra})


def test_each_series_observed_once_per_request_with_the_clients_times() -> None:
    s, m, clock = shaper(max_tokens=4)
    clock.t = 10.5
    s.on_admitted()
    clock.t = 10.9
    s.on_admitted()  # a second attempt's first event (after a migration): not queued again
    clock.t = 11.0
    assert s.emit(0, [72], []) is not None
    clock.t = 11.4
    s.emit(0, [101, 108], [])  # a batch of two: each counts half the gap
    clock.t = 12.0
    last = s.emit(0, [108, 111], [])  # one token left in the budget: the stream ends (length)
    assert last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert s.emit(0, [1], []) is None and s.final(0, pb.FINISH_REASON_STOP) is None  # past the end: not counted

    assert value(m, "splitserve:request_queue_time_seconds_count") == 1
    assert value(m, "splitserve:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(m, "splitserve:time_to_first_token_seconds_count") == 1
    assert value(m, "splitserve:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(m, "splitserve:inter_token_latency_seconds_count") == 3
    assert value(m, "splitserve:inter_token_latency_seconds_sum") == pytest.approx(0.2 + 0.2 + 0.6)
    assert value(m, "splitserve:e2e_request_latency_seconds_count") == 1
    assert value(m, "splitserve:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value(m, "splitserve:prompt_tokens_total") == 3
    assert value(m, "splitserve:generation_tokens_total") == 4
    assert value(m, "splitserve:request_success_total", finished_reason="length") == 1
    assert value(m, "splitserve:request_success_total", finished_reason="stop") is None
    # the router's own series go on as before
    assert m.registry.get_sample_value("splitserve_router_ttft_seconds_count") == 1
    assert m.registry.get_sample_value("splitserve_router_itl_seconds_count") == 3


def test_a_worker_finish_and_a_stop_string_count_as_stop() -> None:
    s, m, clock = shaper(max_tokens=16, stop=("lo",))
    clock.t = 10.25
    s.emit(0, list(b"hel"), [])
    clock.t = 10.75
    resp = s.emit(0, list(b"lo"), [])
    assert resp is not None and resp.finish_reason == pb.FINISH_REASON_STOP
    assert value(m, "splitserve:request_success_total", finished_reason="stop") == 1
    assert value(m, "splitserve:e2e_request_latency_seconds_sum") == pytest.approx(0.75)
    assert value(m, "splitserve:request_queue_time_seconds_count") == 0  # no worker event was reported

    s, m, clock = shaper(max_tokens=16)
    s.emit(0, list(b"hi"), [])
    clock.t = 13.0
    last = s.final(0, pb.FINISH_REASON_LENGTH)
    assert last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert value(m, "splitserve:request_success_total", finished_reason="length") == 1
    assert value(m, "splitserve:e2e_request_latency_seconds_sum") == pytest.approx(3.0)


def test_the_workers_names_labels_and_buckets() -> None:
    m = RouterMetrics(RouterConfig())
    families = {f.name: f for f in m.registry.collect()}
    for name, buckets in (
        ("splitserve:time_to_first_token_seconds", TTFT_BUCKETS),
        ("splitserve:inter_token_latency_seconds", ITL_BUCKETS),
        ("splitserve:e2e_request_latency_seconds", REQUEST_BUCKETS),
        ("splitserve:request_queue_time_seconds", REQUEST_BUCKETS),
    ):
        samples = [s for s in families[name].samples if s.name.endswith("_bucket")]
        assert [float(s.labels["le"]) for s in samples] == [*buckets, float("inf")]
        assert all({k: s.labels[k] for k in LABELS} == LABEL_VALUES for s in samples)


def test_a_request_of_two_samples_is_observed_once_and_each_sample_keeps_its_own_gaps() -> None:
    metrics = RouterMetrics(RouterConfig())
    clock = Clock(10.0)
    req = ValidRequest("r", (1, 2, 3), SamplingParams(max_tokens=3, n=2), continuous_usage=False)
    s = ResponseShaper(req, ByteTokenizer(), metrics, start=10.0, clock=clock)
    clock.t = 11.0
    s.emit(0, [72], [])  # the request's first token: its TTFT
    clock.t = 11.1
    s.emit(1, [73], [])  # the other sample's first: no gap of its own
    clock.t = 11.5
    s.emit(0, [74], [])  # 0.5 after sample 0's first
    clock.t = 11.6
    s.emit(1, [75], [])  # 0.5 after sample 1's first
    done = s.final(1, pb.FINISH_REASON_STOP)
    assert done is not None and done.finish_reason == pb.FINISH_REASON_STOP and not done.HasField("usage")
    clock.t = 12.0
    last = s.emit(0, [76], [])  # sample 0's budget: the request ends
    assert last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 5
    assert s.finished and s.final(0, pb.FINISH_REASON_STOP) is None

    assert value(metrics, "splitserve:time_to_first_token_seconds_count") == 1
    assert value(metrics, "splitserve:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "splitserve:inter_token_latency_seconds_count") == 3
    assert value(metrics, "splitserve:inter_token_latency_seconds_sum") == pytest.approx(0.5 + 0.5 + 0.5)
    assert value(metrics, "splitserve:generation_tokens_total") == 5
    assert value(metrics, "splitserve:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "splitserve:request_success_total", finished_reason="length") == 1  # a sample was cut
