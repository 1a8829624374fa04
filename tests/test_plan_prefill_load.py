"""Prefill under load: a served prefill slows while other requests decode (the router and the
client share the workers' cores). Its measurement from a client's records, the fit per system,
the profile's JSON (versions 3 and 4 still read), the simulator's use of it, and the background streams
the measurement runs beside (against a real HTTP server streaming server-sent events)."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from splitserve.bench.decoding_streams import DecodingStreams
from splitserve.measure.results import RequestRecord
from splitserve.plan.calibrate import PREFILL_LOAD_STREAMS, prefill_load_flags, prefill_load_points
from splitserve.plan.costs import mixed_step_s
from splitserve.plan.profile import (
    PROFILE_VERSION,
    Profile,
    ProfileCosts,
    load_profile,
    prefill_slowdown,
    save_profile,
    with_prefill_load,
)
from splitserve.plan.sim.simulate import ClusterSpec, Request, simulate
from tests.http_helpers import http_server
from tests.test_plan_calibrate import synthetic

pytestmark = pytest.mark.timeout(60)


def _record(prompt: int, ttft: float, error: str | None = None) -> RequestRecord:
    return RequestRecord("plain", prompt, 2, 0.0, ttft, [0.02], ttft + 0.02, error)


def test_prefill_load_points_set_each_first_token_against_the_step_that_prefills_it():
    p = synthetic()  # prefill 5 ms + 1 ms/token; decode 10 ms + 0.5 ms/request + 1 us/context token
    costs = ProfileCosts(p)
    records = [_record(116, 0.150), _record(16, 0.5), _record(200, 0.0), _record(300, 1.0, "cut")]
    # beside 4 streams on a prefill worker: the prompt's prefill alone (16 tokens cached), nothing else
    got = prefill_load_points(records, 4, 0, 500, 16, p)
    assert got == [(4, pytest.approx(costs.prefill_s(100, 16)), 0.150)]  # no new token, no first token, an error
    # colocated, 2 decodes on the prompt's worker: the mixed step
    ((_, modelled, _),) = prefill_load_points(records[:1], 4, 2, 500, 16, p)
    assert modelled == pytest.approx(mixed_step_s(costs, 100, 16, 2, 1000))
    assert modelled > costs.prefill_s(100, 16)


def test_the_slowdown_is_fitted_per_system_and_replaces_that_systems_earlier_fit():
    p = synthetic()
    assert prefill_slowdown(p, "disaggregated") is None
    # measured / modelled = 1.05 + 0.05 per decoding request, exactly: a multiplier, no cost per request
    pts = [(n, e, e * (1.05 + 0.05 * n)) for n in PREFILL_LOAD_STREAMS for e in (0.1, 0.4)]
    p = with_prefill_load(p, "disaggregated", pts)
    p = with_prefill_load(p, "colocated", [(n, e, e * (1.2 + 0.01 * n)) for n in (0, 6) for e in (0.2, 0.5)])
    f = prefill_slowdown(p, "disaggregated")
    assert f is not None and f(0) == pytest.approx((1.05, 0.0), abs=1e-9)
    assert f(4) == pytest.approx((1.25, 0.0), abs=1e-9)
    assert f(50) == f(max(PREFILL_LOAD_STREAMS))  # not extrapolated past the most streams measured beside
    g = prefill_slowdown(p, "colocated")
    assert g is not None and g(6) == pytest.approx((1.26, 0.0), abs=1e-9) and g(10) == g(6)
    again = with_prefill_load(p, "disaggregated", [(0, 0.1, 0.2), (6, 0.1, 0.2), (0, 0.3, 0.6), (6, 0.3, 0.6)])
    h = prefill_slowdown(again, "disaggregated")  # 2x whatever the load
    assert h is not None and h(6) == pytest.approx((2.0, 0.0), abs=1e-9)
    assert len(again.prefill_load_points) == 4 + 4  # colocated's four, and only the new four of disaggregated
    with pytest.raises(ValueError, match="no prefill-under-load points"):
        with_prefill_load(p, "x", [])


def test_the_fit_recovers_a_multiplier_and_a_cost_per_request_from_seconds():
    """Points made from known terms give those terms back: measured = model x (0.98 + 0.03 N) +
    0.06 + 0.004 N, over short and long prompts beside each count of decoding streams measured."""
    a, b, c, d = 0.98, 0.03, 0.06, 0.004
    pts = [(n, e, e * (a + b * n) + c + d * n) for n in PREFILL_LOAD_STREAMS for e in (0.15, 0.3, 0.8, 1.2)]
    p = with_prefill_load(synthetic(), "disaggregated", pts)
    ((_, *fit),) = p.prefill_load_fits
    assert fit == pytest.approx([a, b, c, d], abs=1e-9)
    f = prefill_slowdown(p, "disaggregated")
    assert f is not None and f(2) == pytest.approx((a + 2 * b, c + 2 * d))
    most = max(PREFILL_LOAD_STREAMS)
    assert f(100) == pytest.approx((a + most * b, c + most * d))  # not extrapolated past the most measured beside


def test_no_fitted_term_is_negative():
    """Prefills that get cheaper per request with more decoding (a term that would come out negative)
    and a constant pull toward a negative cost: each such term is held at 0 and the rest refitted."""
    pts = [(n, e, e * (1.0 + 0.05 * n) + 0.08 - 0.01 * n) for n in (0, 2, 6) for e in (0.2, 0.6, 1.0)]
    ((_, a, b, c, d),) = with_prefill_load(synthetic(), "colocated", pts).prefill_load_fits
    assert min(a, b, c, d) >= 0.0 and d == 0.0
    # a machine faster than the model by a fixed amount: no negative cost per request, the multiplier takes it
    pts = [(n, e, e - 0.02) for n in (0, 6) for e in (0.2, 0.6, 1.0)]
    ((_, a, b, c, d),) = with_prefill_load(synthetic(), "colocated", pts).prefill_load_fits
    assert c == 0.0 and d == 0.0 and b == 0.0 and 0.9 < a < 1.0


def test_the_slowdown_survives_json_and_older_versions_read(tmp_path):
    p = with_prefill_load(synthetic(), "disaggregated", [(0, 0.1, 0.105), (6, 0.1, 0.135), (6, 0.3, 0.36)])
    path = str(tmp_path / "p.json")
    save_profile(p, path)
    back = load_profile(path)
    assert back == p and json.load(open(path))["version"] == PROFILE_VERSION == 8
    old = p.to_dict()
    old["version"] = 4  # a ratio fit: (system, base, per decoding request); no cost per request
    old["prefill_load_fits"] = [["disaggregated", 1.05, 0.05]]
    v4 = Profile.from_dict(json.loads(json.dumps(old)))
    assert v4.prefill_load_fits == (("disaggregated", 1.05, 0.05, 0.0, 0.0),)
    f = prefill_slowdown(v4, "disaggregated")
    assert f is not None and f(2) == pytest.approx((1.15, 0.0))
    old["version"] = 3
    del old["prefill_load_points"], old["prefill_load_fits"]
    v3 = Profile.from_dict(old)
    assert v3.prefill_load_fits == () and prefill_slowdown(v3, "disaggregated") is None
    old["version"] = 2
    with pytest.raises(ValueError, match="profile version 2"):
        Profile.from_dict(old)


def test_the_simulator_slows_prefill_steps_by_the_decoding_in_the_whole_cluster():
    costs = ProfileCosts(synthetic())
    cluster = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1)
    alone = [Request(0.0, 300, 4)]
    base = simulate(alone, cluster, costs, random.Random(0))
    # nothing decodes while the only request prefills: the factor at 0 decoding applies
    slowed = simulate(alone, cluster, costs, random.Random(0), prefill_slowdown=lambda n: (1.5 + n, 0.0))
    assert slowed.ttft.p50 == pytest.approx(1.5 * base.ttft.p50)
    # a second request prefills while the first decodes: its step takes the factor at 1 decoding
    two = [Request(0.0, 300, 400), Request(1.0, 300, 4)]
    plain = simulate(two, cluster, costs, random.Random(0))
    load = simulate(two, cluster, costs, random.Random(0), prefill_slowdown=lambda n: (1.0 + 0.25 * n, 0.0))
    first, second = sorted(load.outcomes, key=lambda o: o.arrival_s)
    assert first.ttft_s == pytest.approx(min(plain.outcomes, key=lambda o: o.arrival_s).ttft_s)
    assert second.ttft_s == pytest.approx(1.25 * costs.prefill_s(300))
    # decode-only steps keep their figure: the long request's inter-token gaps are unchanged
    assert load.itl.p50 == pytest.approx(plain.itl.p50)


def test_a_step_that_finishes_prompts_takes_the_cost_per_request_once():
    """The cost per request was measured on prompts one at a time; a step that finishes one or more
    prompts carries it once, a step that only continues a long prompt's chunks does not."""
    costs = ProfileCosts(synthetic())
    cluster = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1)  # chunk 512
    plain = simulate([Request(0.0, 1000, 2)], cluster, costs, random.Random(0))
    slowed = simulate([Request(0.0, 1000, 2)], cluster, costs, random.Random(0), prefill_slowdown=lambda n: (1.0, 0.05))
    assert slowed.ttft.p50 == pytest.approx(plain.ttft.p50 + 0.05)  # two chunks, the cost once
    # two prompts wait while a first prefills, then one step prefills both: 2x the model, the cost once each step
    three = [Request(0.0, 100, 2), Request(0.001, 200, 2), Request(0.001, 200, 2)]
    plain = simulate(three, cluster, costs, random.Random(0))
    slowed = simulate(three, cluster, costs, random.Random(0), prefill_slowdown=lambda n: (2.0, 0.05))
    first_token_s = [o.arrival_s + o.ttft_s for o in slowed.outcomes]
    assert first_token_s == pytest.approx(
        [2 * (o.arrival_s + o.ttft_s) + k * 0.05 for o, k in zip(plain.outcomes, (1, 2, 2), strict=True)]
    )


def test_a_replayed_request_keeps_what_the_server_said_it_found_cached():
    from splitserve.measure.results import RunResult, Stats
    from splitserve.plan.sim.sweep import requests_from_run

    st = Stats(0.0, 0.0, 0.0, 0.0)
    recs = [
        RequestRecord("steady", 62, 8, 0.0, 0.07, [0.02], 0.3, None, cached_len=48),
        RequestRecord("plain", 62, 8, 1.0, 0.13, [0.02], 0.3, None),  # no usage: the template's 16
        RequestRecord("plain", 62, 8, 2.0, 0.13, [0.02], 0.3, None, cached_len=0),
    ]
    run = RunResult(1.0, 1.0, None, 3, 3.0, 3, 0, 1.0, 8.0, 20.0, 186, 24, st, st, st, st, None, None, {}, None, recs)
    assert [r.cached_tokens for r in requests_from_run(run, 16)] == [48, 16, 16]
    assert RequestRecord.from_dict(recs[0].to_dict()) == recs[0]
    old = recs[1].to_dict()
    del old["cached_len"]  # a JSON written before the field
    assert RequestRecord.from_dict(old).cached_len == -1


def test_the_measurement_flags_send_prompts_one_at_a_time():
    flags = prefill_load_flags(7)
    assert flags[flags.index("--max-concurrency") + 1] == "1"
    assert flags[flags.index("--seed") + 1] == "7"


# ---- DecodingStreams against a real server ------------------------------------------------------


class _SSE(BaseHTTPRequestHandler):
    """Streams one chat-completion chunk per token until the client goes, as the router does;
    `fail` answers 500 instead; `short` ends after 3 tokens."""

    mode = "ok"
    closed = threading.Semaphore(0)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"]
        if self.mode == "fail":
            self.send_error(500)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for _ in range(3) if self.mode == "short" else itertools.count():
                self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            _SSE.closed.release()  # the client closed its stream

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    with http_server(_SSE) as url:
        yield url
    _SSE.mode = "ok"


def test_streams_decode_until_stopped_and_close_their_connections(server):
    with DecodingStreams(server, "m", 3, timeout_s=10) as streams:
        streams.wait_decoding()
        assert all(n >= 1 for n in streams.tokens)
    for _ in range(3):
        assert _SSE.closed.acquire(timeout=10)  # each stream's connection was closed by the client
    assert streams.errors == []


def test_a_stream_that_fails_or_ends_early_is_an_error_not_a_wait(server):
    _SSE.mode = "fail"
    with DecodingStreams(server, "m", 2, timeout_s=10) as streams, pytest.raises(RuntimeError, match="500"):
        streams.wait_decoding()
    _SSE.mode = "short"
    with DecodingStreams(server, "m", 1, timeout_s=10) as streams:
        deadline = time.monotonic() + 10
        while not streams.errors and time.monotonic() < deadline:  # until the reader sees the end
            time.sleep(0.01)
        assert streams.errors == ["stream 0 ended after 3 tokens, before it was stopped"]
        with pytest.raises(RuntimeError, match="ended after 3 tokens"):
            streams.wait_decoding()
