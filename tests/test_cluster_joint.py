"""The joint controller's policy (cluster/joint.py), reading by reading, with time passed in."""

from __future__ import annotations

import math

import pytest

from splitserve.cluster.joint import (
    BUDGET,
    JointConfig,
    JointState,
    Observation,
    decide,
    prefill_rho,
)

CFG = JointConfig(
    slo_ttft_s=2.0,
    slo_itl_s=0.1,
    prefill_min=1,
    prefill_max=8,
    decode_min=1,
    decode_max=8,
    shrink_after_s=10.0,
    cooldown_s=20.0,
    decode_tokens_per_worker=10_000,
)
SPEED = 2000.0  # a prefill worker's tokens a second
PROMPT = 400  # uncached tokens a request


def reading(
    now: float,
    tokens: int,
    requests: int,
    context: int = 0,
    itl_s: float = 0.0,
    prefill: int = 1,
    decode: int = 1,
) -> Observation:
    return Observation(now, tokens, requests, SPEED, context, itl_s, prefill, decode)


def run(rates: list[float], cfg: JointConfig = CFG, **kw: int) -> list[tuple[int, int]]:
    """One reading a second at each prompt-token rate, the pools sized as decided each time."""
    state, tokens, out = JointState(), 0, []
    prefill, decode = kw.get("prefill", 1), kw.get("decode", 1)
    for t, rate in enumerate([0.0, *rates]):
        tokens += int(rate)
        obs = reading(float(t), tokens, tokens // PROMPT, kw.get("context", 0), 0.0, prefill, decode)
        d, state = decide(cfg, obs, state)
        prefill, decode = d.prefill, d.decode
        out.append((prefill, decode))
    return out[1:]


def test_rho_keeps_the_mean_md1_wait_within_the_ttft_budget() -> None:
    service = PROMPT / SPEED
    rho = prefill_rho(PROMPT, SPEED, CFG.slo_ttft_s)
    wait = rho * service / (2 * (1 - rho))
    assert 0 < rho <= 0.9
    if rho < 0.9:
        assert math.isclose(service + wait, BUDGET * CFG.slo_ttft_s, rel_tol=1e-9)
    # a prompt that alone takes the budget: the SLO is out of reach, queues are kept short
    assert prefill_rho(4000, SPEED, 1.0) == 0.5


def test_the_first_reading_holds_the_pools_as_they_are() -> None:
    d, state = decide(CFG, reading(0.0, 0, 0, prefill=3, decode=2), JointState())
    assert (d.prefill, d.decode) == (3, 2) and state.last is not None


def test_a_step_in_prompt_tokens_grows_the_prefill_pool_at_once_to_what_the_rate_needs() -> None:
    sizes = run([1000.0] * 3 + [6000.0])
    rho = prefill_rho(PROMPT, SPEED, CFG.slo_ttft_s)
    assert sizes[0][0] == 1  # 1000 tok/s on a 2000 tok/s worker within its rho
    assert sizes[-1][0] >= math.ceil(6000 / (SPEED * rho))  # the reading after the step, no window


def test_a_rising_rate_is_met_ahead_of_the_load_by_its_trend() -> None:
    ramp = [500.0 * (i + 1) for i in range(8)]  # +500 tok/s each second
    sizes = run(ramp)
    rho = prefill_rho(PROMPT, SPEED, CFG.slo_ttft_s)
    now_needs = math.ceil(ramp[-1] / (SPEED * rho))
    assert sizes[-1][0] > now_needs  # sized for the horizon, not for what was just seen


def test_the_decode_pool_follows_the_context_in_flight_and_learns_a_workers_capacity_from_itl() -> None:
    state = JointState()
    d, state = decide(CFG, reading(0.0, 0, 0, context=0), state)
    d, state = decide(CFG, reading(1.0, 0, 0, context=25_000), state)  # 25K over 10K a worker: 3
    assert d.decode == 3
    # at 3 workers and 25K tokens the steps took 0.2 s: a worker holds at most 8.3K x 0.08 / 0.2 = 3.3K
    d, state = decide(CFG, reading(2.0, 0, 0, context=25_000, itl_s=0.2, decode=3), state)
    assert state.decode_capacity is not None and 3000 < state.decode_capacity < 3500
    assert d.decode == 8  # capped by decode_max
    # 8 workers of 3.1K each within the budget: each holds at least that, never less
    d, state = decide(CFG, reading(3.0, 0, 0, context=25_000, itl_s=0.05, decode=8), state)
    assert state.decode_capacity is not None and state.decode_capacity >= 3125


def test_a_steps_fixed_time_does_not_make_the_decode_pool_chase_its_own_load() -> None:
    """Steps dominated by their fixed part (ITL barely moves with context): readings within the
    budget never lower a worker's capacity, so spreading the load over more workers does not ask
    for more still."""
    state = JointState()
    _, state = decide(CFG, reading(0.0, 0, 0, context=0), state)
    decode = 2
    for t in range(1, 30):
        obs = reading(float(t), 0, 0, context=12_000, itl_s=0.07, decode=decode)  # 70 ms, within 80
        d, state = decide(CFG, obs, state)
        decode = d.decode
    assert decode <= 2 and state.decode_capacity is not None and state.decode_capacity >= 10_000


def test_a_pool_shrinks_by_one_only_after_the_window_with_headroom_and_cooldown() -> None:
    state, tokens = JointState(), 0
    prefill = 6
    history = []
    for t in range(60):
        tokens += 1000  # needs one worker
        d, state = decide(CFG, reading(float(t), tokens, tokens // PROMPT, prefill=prefill), state)
        prefill = d.prefill
        history.append(prefill)
    shrinks = [t for t in range(1, 60) if history[t] < history[t - 1]]
    assert all(history[t - 1] - history[t] == 1 for t in shrinks)  # one worker at a time
    assert shrinks[0] >= CFG.shrink_after_s  # not before the window
    assert all(b - a >= CFG.cooldown_s for a, b in zip(shrinks, shrinks[1:], strict=False))
    assert history[-1] < 6


def test_targets_stay_within_each_pools_bounds() -> None:
    sizes = run([10.0] * 3 + [1e7] * 2, cfg=CFG)
    assert all(1 <= p <= 8 and 1 <= d <= 8 for p, d in sizes)
    assert sizes[-1][0] == 8


def test_a_prefill_speed_not_yet_measured_keeps_the_prefill_pool() -> None:
    state = JointState()
    _, state = decide(CFG, Observation(0.0, 0, 0, 0.0, 0, 0.0, 2, 1), state)
    d, _ = decide(CFG, Observation(1.0, 50_000, 100, 0.0, 0, 0.0, 2, 1), state)
    assert d.prefill == 2 and "not measured" in d.reason


@pytest.mark.parametrize(
    "bad",
    [
        {"slo_ttft_s": 0.0},
        {"slo_itl_s": float("nan")},
        {"prefill_min": 3, "prefill_max": 2},
        {"level_weight": 0.0},
        {"shrink_headroom": 0.5},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    args = {"slo_ttft_s": 1.0, "slo_itl_s": 0.1, **bad}
    with pytest.raises(ValueError):
        JointConfig(**args)  # type: ignore[arg-type]
