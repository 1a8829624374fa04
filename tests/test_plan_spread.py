"""The measured spread of decode steps: its quantile table (`costs.StepSpread`), how a profile
keeps it (the engine's timed steps, a client's gaps), and the simulator's draws from it: none
for a spread of zero (the result exactly that of no spread), the measured ratio of ITL p90 to
p50 for one, the same result for the same seed."""

from __future__ import annotations

import random

import pytest

from splitserve.plan.calibrate import PREFILL_TOKENS, serving_gap_ratios, serving_point
from splitserve.plan.costs import SPREAD_LEVELS, StepSpread, spread_quantiles
from splitserve.plan.profile import (
    ProfileCosts,
    engine_decode_step_s,
    fit_profile,
    load_profile,
    save_profile,
    spread_table,
    with_serving,
)
from splitserve.plan.sim.simulate import ClusterSpec, Request, simulate

pytestmark = pytest.mark.timeout(60)

KV = 46080


def _profile(decode_noise: tuple[float, ...] = (1.0,), per_ctx: float = 1e-6):
    """Prefill 5 ms + 1 ms/token; decode 10 ms + 0.5 ms/request + `per_ctx` s/context token, each
    timed step that times the `decode_noise` factors in turn (one factor: every step on the model)."""
    prefill = [(n, 0.005 + 0.001 * n) for n in (16, 64, 256, 512)]
    decode = []
    k = 0
    for b in (1, 2, 4, 8, 16):
        for c in (64 * b, 512 * b):
            for _ in range(10):
                decode.append((b, c, (0.010 + 0.0005 * b + per_ctx * c) * decode_noise[k % len(decode_noise)]))
                k += 1
    return fit_profile("synthetic", 512, 30, KV, prefill, [], decode, [(64 * KV, 0.002)])


def _linear_spread(width: float) -> StepSpread:
    """At every batch the ratio at level q is 1 + width x (q - 0.5): median 1, p90/p50 1 + 0.4 width."""
    ratios = tuple(1.0 + width * (q - 0.5) for q in SPREAD_LEVELS)
    return StepSpread(SPREAD_LEVELS, ((1, ratios), (64, ratios)))


def test_spread_quantiles_and_the_inverse_distribution():
    assert spread_quantiles([1.0, 2.0, 3.0], (0.0, 0.5, 1.0)) == (1.0, 2.0, 3.0)
    s = StepSpread((0.1, 0.5, 0.9), ((2, (0.8, 1.0, 1.4)), (6, (0.6, 1.0, 1.8))))
    assert s.ratio(2, 0.5) == 1.0
    assert s.ratio(2, 0.7) == pytest.approx(1.2)  # halfway between the p50 and p90 ratios
    assert s.ratio(2, 0.0) == 0.8 and s.ratio(2, 0.99) == 1.4  # flat past the end levels
    assert s.quantiles(4) == pytest.approx((0.7, 1.0, 1.6))  # between measured batches: interpolated
    assert s.quantiles(1) == (0.8, 1.0, 1.4) and s.quantiles(64) == (0.6, 1.0, 1.8)  # outside: the nearest
    assert not s.is_zero and StepSpread((0.5,), ((1, (1.0,)),)).is_zero
    with pytest.raises(ValueError, match="fall"):
        StepSpread((0.1, 0.9), ((1, (1.2, 0.9)),))
    with pytest.raises(ValueError, match="one positive ratio per level"):
        StepSpread((0.1, 0.9), ((1, (1.0,)),))
    with pytest.raises(ValueError, match="sorted"):
        StepSpread((0.5,), ((4, (1.0,)), (2, (1.0,))))


def test_the_profile_keeps_the_engine_steps_spread_around_its_fit():
    exact = _profile().step_spread()
    assert exact is not None and exact.is_zero
    p = _profile((0.9, 0.95, 1.0, 1.05, 1.1))  # symmetric: the fit stays on the model
    assert (p.decode_base_s, p.decode_s_per_seq, p.decode_s_per_ctx_token) == pytest.approx((0.010, 0.0005, 1e-6))
    assert [b for b, _ in p.decode_spread] == [1, 2, 4, 8, 16]
    for _, ratios in p.decode_spread:
        assert ratios[SPREAD_LEVELS.index(0.5)] == pytest.approx(1.0)
        assert ratios[SPREAD_LEVELS.index(0.1)] == pytest.approx(0.9)
        assert ratios[SPREAD_LEVELS.index(0.9)] == pytest.approx(1.1)


def test_serving_gap_ratios_measure_each_gap_against_the_served_model():
    from splitserve.measure.results import RequestRecord

    p = _profile()
    # one worker, two requests decoding together from 0.2 s; the gaps alternate 27 and 33 ms
    gaps = [0.027, 0.033] * 10
    records = [RequestRecord("plain", 70, 21, 0.0, 0.2, gaps, 0.2 + sum(gaps), None) for _ in range(2)]
    ratios = serving_gap_ratios(records, 1, p)
    assert len(ratios) == 40 and {b for b, _ in ratios} == {2}
    batch, context, engine_s, served_s = serving_point(records, 1, p)
    overhead = served_s - engine_s
    # the model grows 2 us a step (2 requests x 1 us/context token): the lowest ratio is the last
    # 27 ms gap's, the 19th token's, read over 70 + 19 tokens each
    lowest = 0.027 / (engine_decode_step_s(p, 2, 2 * (70 + 19)) + overhead)
    assert min(r for _, r in ratios) == pytest.approx(lowest)
    assert sorted(r for _, r in ratios)[20] == pytest.approx(0.033 / 0.030, rel=0.002)


def test_the_served_gaps_spread_is_the_one_drawn_from_and_survives_json(tmp_path):
    p = _profile((0.95, 1.05))
    served = with_serving(p, [(2, 142, 0.011, 0.030)], "colocated, 1 worker(s)", [(2, 0.9), (2, 1.0), (2, 1.2)])
    assert served.serve_spread == spread_table([(2, 0.9), (2, 1.0), (2, 1.2)])
    spread = served.step_spread()
    assert spread is not None and spread.by_batch == served.serve_spread  # not the engine's
    engine = p.step_spread()
    assert engine is not None and engine.by_batch == p.decode_spread
    path = tmp_path / "profile.json"
    save_profile(served, str(path))
    assert load_profile(str(path)) == served


def _decode_heavy() -> list[Request]:
    """Four requests arriving together, 400 tokens each: about 400 decode-only steps at batch 4."""
    return [Request(0.0, 32, 400) for _ in range(4)]


def test_a_spread_of_zero_gives_exactly_the_result_without_one():
    costs = ProfileCosts(_profile())
    spec = ClusterSpec("colocated", decode_workers=2)
    reqs = _decode_heavy() + [Request(0.5 + 0.1 * i, 100 + 37 * i, 20) for i in range(12)]
    before = simulate(reqs, spec, costs, random.Random(3), rate=1.0)
    zero = StepSpread(SPREAD_LEVELS, ((1, tuple(1.0 for _ in SPREAD_LEVELS)),))
    assert simulate(reqs, spec, costs, random.Random(3), rate=1.0, spread=zero) == before
    fitted = costs.profile.step_spread()  # the fit of exact points: ratios 1 to its rounding
    assert simulate(reqs, spec, costs, random.Random(3), rate=1.0, spread=fitted) == before


def test_with_a_spread_the_simulated_itl_p90_over_p50_is_the_measured_one():
    costs = ProfileCosts(_profile(per_ctx=0.0))  # every step at batch 4 the same on the model
    spec = ClusterSpec("colocated", decode_workers=1)
    plain = simulate(_decode_heavy(), spec, costs, random.Random(5), rate=1.0)
    assert plain.itl.p90 / plain.itl.p50 == pytest.approx(1.0)  # one figure per step
    spread = _linear_spread(0.5)  # p90/p50 = 1.2
    sim = simulate(_decode_heavy(), spec, costs, random.Random(5), rate=1.0, spread=spread)
    assert sim.itl.p90 / sim.itl.p50 == pytest.approx(spread.ratio(4, 0.9) / spread.ratio(4, 0.5), rel=0.02)
    assert sim.itl.p50 == pytest.approx(plain.itl.p50, rel=0.02)  # the median step stays the model's
    assert sim.ttft == plain.ttft  # the prefill step is not drawn: the spread was measured on decodes
    # deterministic per seed; another seed draws other steps
    assert simulate(_decode_heavy(), spec, costs, random.Random(5), rate=1.0, spread=spread) == sim
    assert simulate(_decode_heavy(), spec, costs, random.Random(6), rate=1.0, spread=spread).itl != sim.itl


def test_prefill_lengths_put_the_linear_kernels_edge_between_two_points():
    from splitserve.engine.kernels.linear import MAX_ROWS, MAX_ROWS_F32

    for edge in (MAX_ROWS, MAX_ROWS_F32):
        assert edge in PREFILL_TOKENS and edge + 1 in PREFILL_TOKENS
    assert all(n in PREFILL_TOKENS for n in range(8, 129, 8)) and max(PREFILL_TOKENS) == 512
    assert list(PREFILL_TOKENS) == sorted(set(PREFILL_TOKENS))


def test_plan_check_caches_the_chat_templates_opening_in_whole_blocks():
    from splitserve.bench.plan_check import chat_prefix_cached_tokens

    def encode_chat(messages):
        system = list(range(24))  # the template's opening, the same in every prompt
        return system + [100 + ord(c) for _, text in messages for c in text] + [1, 2]

    assert chat_prefix_cached_tokens(encode_chat, 16) == 16
    assert chat_prefix_cached_tokens(encode_chat, 8) == 24
    assert chat_prefix_cached_tokens(lambda m: [ord(c) for _, t in m for c in t], 16) == 0
