"""The measured profile: fitting on synthetic points with known coefficients, the JSON
round trip, the cost model it makes, the serving overhead (its measurement from a client's
records and its place in every step), and plan-check's speed probe."""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitserve.bench.plan_check import Speed
from splitserve.measure.results import RequestRecord
from splitserve.plan.calibrate import at_calibration_speed, serving_load_flags, serving_point
from splitserve.plan.costs import mixed_step_s
from splitserve.plan.profile import (
    Profile,
    ProfileCosts,
    engine_decode_step_s,
    fit_profile,
    interpolate,
    least_squares,
    load_profile,
    save_profile,
    serving_beside_prefill,
    serving_by_busy,
    with_serving,
    with_serving_alone,
    with_serving_beside_prefill,
)

pytestmark = pytest.mark.timeout(60)

KV = 46080  # SmolLM2-135M in float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes


def synthetic() -> Profile:
    """Points from known models: prefill 5 ms + 1 ms/token, attention 2 ns per token x cached token;
    a decode step 10 ms + 0.5 ms/request + 1 us/context token; transfer 1 ms + 1 ns/byte."""
    prefill = [(n, 0.005 + 0.001 * n) for n in (16, 256, 512)] + [(64, 0.068), (64, 0.070)]  # a repeat, averaged
    cached = [(n, c, 0.005 + 0.001 * n + 2e-9 * n * c) for n, c in ((128, 512), (512, 512), (512, 1024))]
    decode = [(b, c, 0.010 + 0.0005 * b + 1e-6 * c) for b in (1, 2, 4, 8, 16) for c in (64 * b, 512 * b)]
    transfer = [(n * KV, 0.001 + 1e-9 * n * KV) for n in (64, 256, 1024)]
    return fit_profile("synthetic", 512, 30, KV, prefill, cached, decode, transfer)


def test_fitting_recovers_the_coefficients_of_synthetic_points():
    p = synthetic()
    assert p.prefill_points[1] == (64, pytest.approx(0.069))  # the two 64-token points averaged
    assert p.prefill_s_per_token_ctx == pytest.approx(2e-9)
    assert (p.decode_base_s, p.decode_s_per_seq, p.decode_s_per_ctx_token) == pytest.approx((0.010, 0.0005, 1e-6))
    assert (p.transfer_base_s, p.transfer_s_per_byte) == pytest.approx((0.001, 1e-9))


def test_the_profile_cost_model():
    c = ProfileCosts(synthetic())
    assert c.prefill_s(256) == pytest.approx(0.261)
    assert c.prefill_s(160) == pytest.approx(0.165)  # between measured lengths: the straight line
    assert c.prefill_s(256, cached_tokens=1000) == pytest.approx(0.261 + 2e-9 * 256 * 1000)
    assert c.decode_step_s(4, 2000) == pytest.approx(0.010 + 0.002 + 0.002)
    assert c.decode_step_s(0, 0) == pytest.approx(0.010)  # the step's fixed part
    wire = 1e-9 * 512 * KV  # 23.6 ms; the prefill (517 ms) hides all but the last of 30 layers
    assert c.whole_transfer_s(512) == pytest.approx(0.001 + wire)
    assert c.transfer_s(512) == pytest.approx(0.001 + wire / 30)
    assert c.prefill_s(0) == c.transfer_s(0) == 0.0


def test_least_squares_keeps_no_negative_term():
    rows = [[1.0, x] for x in (1, 2, 3, 4)]
    assert least_squares(rows, [3.0, 5.0, 7.0, 9.0]) == pytest.approx([1.0, 2.0])
    # falling values: a slope below zero is dropped, the mean is what is left
    assert least_squares(rows, [4.0, 3.0, 2.0, 1.0]) == pytest.approx([2.5, 0.0])
    assert least_squares(rows, [4.0, 3.0, 2.0, 1.0], nonnegative=False) == pytest.approx([5.0, -1.0])


def test_interpolate_extends_the_end_segments_and_never_goes_below_zero():
    pts = [(10, 1.0), (20, 2.0), (40, 3.0)]
    assert interpolate(pts, 15) == pytest.approx(1.5)
    assert interpolate(pts, 80) == pytest.approx(5.0)
    assert interpolate(pts, 0) == 0.0
    assert interpolate([(100, 0.5)], 50) == pytest.approx(0.25)


def test_profile_json_round_trip(tmp_path):
    p = with_serving(synthetic(), [(1, 100, 0.011, 0.013), (4, 400, 0.013, 0.019)], "colocated, 2 worker(s)")
    path = tmp_path / "sub" / "profile.json"
    save_profile(p, str(path))
    assert load_profile(str(path)) == p
    data = json.loads(path.read_text())
    data["version"] = 2  # before the spread of steps: refused, not read as no spread
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        load_profile(str(path))
    data["version"] = 3
    del data["serve_spread"]
    path.write_text(json.dumps(data))
    with pytest.raises(KeyError):
        load_profile(str(path))


def test_with_serving_fits_a_per_step_and_a_per_token_overhead():
    p = synthetic()
    # served gaps 1.5 ms + 0.8 ms per request above the engine's step
    pts = [
        (b, 100 * b, engine_decode_step_s(p, b, 100 * b), engine_decode_step_s(p, b, 100 * b) + 0.0015 + 0.0008 * b)
        for b in (1, 2, 4, 8)
    ]
    s = with_serving(p, pts, "colocated, 2 worker(s)")
    assert (s.serve_step_s, s.serve_s_per_seq) == pytest.approx((0.0015, 0.0008))
    assert s.serve_points == tuple(pts) and s.serve_system == "colocated, 2 worker(s)"
    assert (p.serve_step_s, p.serve_s_per_seq, p.serve_points) == (0.0, 0.0, ())  # the original untouched
    with pytest.raises(ValueError):
        with_serving(p, [], "x")


def test_the_serving_overhead_is_paid_once_per_step_and_per_token():
    base = ProfileCosts(synthetic())
    served = ProfileCosts(with_serving(synthetic(), [(1, 0, 0.0, 0.003), (3, 0, 0.0, 0.007)], "x"))  # 1 ms + 2 ms/tok
    assert served.profile.serve_step_s == pytest.approx(0.001)
    assert served.decode_step_s(4, 2000) == pytest.approx(base.decode_step_s(4, 2000) + 0.001 + 0.008)
    assert served.prefill_s(256) == pytest.approx(base.prefill_s(256) + 0.001)
    # a step with a chunk and decodes: the per-step part once, the per-token part per decode
    assert mixed_step_s(served, 256, 0, 4, 2000) == pytest.approx(mixed_step_s(base, 256, 0, 4, 2000) + 0.001 + 0.008)
    assert served.transfer_s(512) == pytest.approx(base.transfer_s(512))  # the KV's path is not the token's
    assert served.prefill_s(0) == 0.0


def test_the_serving_overhead_by_workers_busy():
    """All busy: 1 ms + 2 ms/token over the engine; one request alone on one of two workers: 0.5 ms.
    Each idle worker takes the difference at batch 1 (3 - 0.5 ms) off a step."""
    p = with_serving(synthetic(), [(1, 0, 0.0, 0.003), (3, 0, 0.0, 0.007)], "colocated, 2 worker(s)")
    assert serving_by_busy(p) is None  # not measured: the overhead as fitted, whatever the load
    s = with_serving_alone(p, [(1, 50, 0.010, 0.0105), (1, 60, 0.010, 0.0104), (1, 70, 0.010, 0.0106)], 2)
    assert s.serve_s_per_busy == pytest.approx(0.0025) and s.serve_workers == 2
    by_busy = serving_by_busy(s)
    assert by_busy is not None
    assert by_busy(2) == 0.0 and by_busy(1) == pytest.approx(-0.0025) and by_busy(0) == by_busy(1)
    # never below nothing: an alone figure above the all-busy one takes nothing off
    assert with_serving_alone(p, [(1, 0, 0.0, 0.009)], 2).serve_s_per_busy == 0.0
    with pytest.raises(ValueError):
        with_serving_alone(p, [(1, 0, 0.0, 0.001)], 1)
    with pytest.raises(ValueError):
        with_serving_alone(p, [], 2)


def test_a_profile_with_the_overhead_by_workers_busy_round_trips(tmp_path):
    p = with_serving(synthetic(), [(1, 100, 0.011, 0.013), (4, 400, 0.013, 0.019)], "colocated, 2 worker(s)")
    p = with_serving_alone(p, [(1, 100, 0.011, 0.0115)], 2)
    path = tmp_path / "profile.json"
    save_profile(p, str(path))
    assert load_profile(str(path)) == p
    data = json.loads(path.read_text())
    data["version"] = 5  # before the overhead by workers busy: read as not measured
    for k in ("serve_workers", "serve_alone_points", "serve_s_per_busy"):
        del data[k]
    path.write_text(json.dumps(data))
    assert serving_by_busy(load_profile(str(path))) is None


def test_the_serving_overhead_beside_busy_prefill_workers():
    """Idle prefill workers: 1 ms + 2 ms/token over the engine. Beside busy ones the gaps are 4 ms more
    at batch 1 and 8 ms more at batch 3: 2 ms + 2 ms/token more."""
    p = with_serving(synthetic(), [(1, 0, 0.0, 0.003), (3, 0, 0.0, 0.007)], "disaggregated, 1 worker(s)")
    assert serving_beside_prefill(p) is None  # not measured: nothing added
    s = with_serving_beside_prefill(p, [(1, 40, 0.010, 0.017), (3, 120, 0.020, 0.035)])
    assert (s.serve_prefill_step_s, s.serve_prefill_s_per_seq) == (pytest.approx(0.002), pytest.approx(0.002))
    beside = serving_beside_prefill(s)
    assert beside is not None and beside(4) == pytest.approx(0.010)
    # gaps no longer than with the prefill idle: no term comes out negative, and nothing is added
    same = with_serving_beside_prefill(p, [(1, 0, 0.010, 0.013), (3, 0, 0.020, 0.027)])
    assert (same.serve_prefill_step_s, same.serve_prefill_s_per_seq) == (0.0, 0.0)
    assert serving_beside_prefill(same) is None
    with pytest.raises(ValueError):
        with_serving_beside_prefill(p, [])


def test_a_profile_with_the_overhead_beside_prefill_round_trips(tmp_path):
    p = with_serving(synthetic(), [(1, 0, 0.0, 0.003), (3, 0, 0.0, 0.007)], "disaggregated, 1 worker(s)")
    p = with_serving_beside_prefill(p, [(1, 40, 0.010, 0.017), (3, 120, 0.020, 0.035)])
    path = tmp_path / "profile.json"
    save_profile(p, str(path))
    assert load_profile(str(path)) == p
    data = json.loads(path.read_text())
    data["version"] = 6  # before the overhead beside prefill: read as not measured
    for k in ("serve_prefill_points", "serve_prefill_step_s", "serve_prefill_s_per_seq"):
        del data[k]
    path.write_text(json.dumps(data))
    assert serving_beside_prefill(load_profile(str(path))) is None


def _record(start: float, ttft: float, gaps: list[float], prompt: int = 70) -> RequestRecord:
    return RequestRecord("plain", prompt, len(gaps) + 1, start, ttft, gaps, ttft + sum(gaps), None)


def test_serving_point_counts_only_the_gaps_while_every_request_decodes():
    p = synthetic()
    # two workers, two requests each; the last first token comes at 0.5 s: before it, the others'
    # gaps (0.2 s, a prefill in between) do not count; after it, every gap is 30 ms
    records = [
        _record(0.0, 0.1, [0.2, 0.2] + [0.03] * 20),
        _record(0.0, 0.3, [0.2] + [0.03] * 21),
        _record(0.0, 0.5, [0.03] * 22),
        _record(0.0, 0.5, [0.03] * 22),
    ]
    batch, context, engine_s, served_s = serving_point(records, 2, p)
    assert batch == 2
    assert served_s == pytest.approx(0.03)
    assert engine_s == pytest.approx(engine_decode_step_s(p, 2, context))
    assert 2 * (70 + 1) <= context <= 2 * (70 + 22)
    with pytest.raises(ValueError, match="evenly"):
        serving_point(records[:3], 2, p)
    with pytest.raises(ValueError, match="evenly"):  # failed requests are no samples
        serving_point([dataclasses.replace(r, error="boom") for r in records], 2, p)
    with pytest.raises(ValueError, match="no gap"):  # one request still prefilling when another ended
        serving_point(records[:3] + [_record(0.0, 1.5, [0.03])], 2, p)


def test_serving_load_flags_send_a_batch_per_worker_at_once():
    flags = serving_load_flags(4, 2, 7)
    assert flags[flags.index("--num-prompts") + 1] == "8"
    assert flags[flags.index("--request-rate") + 1] == "inf"
    assert "--ignore-eos" in flags and flags[flags.index("--dataset") + 1] == "random"


def test_a_profile_needs_sorted_prefill_points():
    with pytest.raises(ValueError):
        fit_profile("x", 512, 30, KV, [], [], [], [])
    good = synthetic()
    with pytest.raises(ValueError, match="sorted"):
        Profile(**{**good.__dict__, "prefill_points": ((64, 0.1), (16, 0.02))})


def test_records_at_the_calibration_speed_have_every_time_divided():
    r = RequestRecord("plain", 70, 3, 2.0, 0.5, [0.04, 0.06], 0.6, None, 16)
    (fast,) = at_calibration_speed([r], 2.0)
    assert (fast.start_s, fast.ttft_s, fast.itl_s, fast.latency_s) == (1.0, 0.25, [0.02, 0.03], 0.3)
    assert (fast.prompt_len, fast.output_len, fast.cached_len, fast.tag) == (70, 3, 16, "plain")
    assert at_calibration_speed([r], 1.0) == [r]


def test_the_speed_factor_is_the_probe_now_over_the_calibration(capsys):
    class Probe:
        def __init__(self) -> None:
            self.readings = iter([0.3, 0.15])

        def seconds(self) -> float:
            return next(self.readings)

    speed = Speed(Probe(), 0.2)
    assert speed.factor("colocated burst") == pytest.approx(1.5)
    assert speed.factor("colocated burst") == pytest.approx(0.75)
    assert "1.50x the calibration's time" in capsys.readouterr().out
    assert Speed(None, 0.0).factor("x") == 1.0  # a profile without a probe reading: taken as is


def test_a_load_is_simulated_at_the_lower_of_the_readings_around_it(capsys):
    class Probe:
        def __init__(self, after: float) -> None:
            self.after = after

        def seconds(self) -> float:
            return self.after

    # a reading pushed up before the load (the previous load's aftermath on the probe's core) gives way
    assert Speed(Probe(0.2), 0.2).around("disaggregated sharegpt@1-r1", 1.22) == pytest.approx(1.0)
    assert "simulated at 1.00x" in capsys.readouterr().out
    # a machine slow all through the load reads slow on both sides, and is simulated slow
    assert Speed(Probe(0.26), 0.2).around("colocated burst", 1.4) == pytest.approx(1.3)
    assert Speed(None, 0.0).around("x", 1.0) == 1.0


def test_the_speed_probe_times_a_fixed_piece_of_work_and_leaves_the_engine_empty():
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.random_model import random_weights, tiny_model_config
    from splitserve.plan.calibrate import _Runner

    cfg = tiny_model_config()
    engine = Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=256, max_num_batched_tokens=512))
    runner = _Runner(engine)
    assert runner.speed_probe() > 0.0
    assert not engine.has_work


def test_calibration_is_taken_again_while_the_machine_s_speed_moves_under_it():
    from splitserve.plan.calibrate import CalibrationConfig, _Measured, steadiest

    def attempt(before: float, after: float) -> _Measured:
        return _Measured([], [], [], [], before, after)

    said: list[str] = []
    cfg = CalibrationConfig(max_probe_drift=0.1, attempts=3)
    attempts = iter([attempt(1.5, 1.2), attempt(1.2, 1.25), attempt(9.0, 9.0)])
    got = steadiest(lambda: next(attempts), cfg, said.append)
    assert (got.probe_before, got.probe_after) == (1.2, 1.25)  # the second: within 10%, no third
    assert said == ["the machine's speed moved by 25% during attempt 1 of 3"]
    # never steady: the steadiest of the attempts allowed, and said so
    said.clear()
    attempts = iter([attempt(1.0, 1.5), attempt(1.0, 1.2), attempt(2.0, 1.0)])
    got = steadiest(lambda: next(attempts), cfg, said.append)
    assert (got.probe_before, got.probe_after) == (1.0, 1.2)
    assert said[-1] == "no attempt was steady: keeping the steadiest (its speed moved by 20%)"
