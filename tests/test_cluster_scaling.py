"""The pool controller's policy (cluster/scaling.py), term by term, with time passed in."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.cluster.scaling import ScalerState, ScalingConfig, ScalingDecision, decide, least_loaded
from splitserve.router.policy import WorkerLoad

CFG = ScalingConfig(
    min_replicas=1,
    max_replicas=3,
    metric="queued_tokens",
    target_tokens_per_worker=1000,
    low_water_tokens_per_worker=100,
    grow_after_s=5.0,
    shrink_after_s=20.0,
    cooldown_s=30.0,
)


def load(queued: int = 0, running: int = 0, free: int = 100, total: int = 100) -> WorkerLoad:
    return WorkerLoad(queued, running, free, total)


def pool(*queued: int) -> dict[str, WorkerLoad]:
    return {f"w{i}": load(q) for i, q in enumerate(queued)}


FRESH = ScalerState()  # frozen: one shared default is safe


def run(
    steps: list[tuple[float, dict[str, WorkerLoad]]],
    cfg: ScalingConfig = CFG,
    pending: int = 0,
    draining: int = 0,
    state: ScalerState = FRESH,
) -> tuple[list[ScalingDecision], ScalerState]:
    """Apply the policy at each (time, loads), threading its state; every decision in order."""
    out = []
    for now, loads in steps:
        d, state = decide(cfg, loads, pending, draining, now, state)
        out.append(d)
    return out, state


def actions(ds: list[ScalingDecision]) -> list[str]:
    return [d.action for d in ds]


# ---- growing


def test_grows_when_the_queue_stays_over_target_for_the_window():
    ds, state = run([(0.0, pool(1500)), (2.5, pool(1500)), (4.9, pool(1500)), (5.0, pool(1500))])
    assert actions(ds) == ["hold", "hold", "hold", "grow"]
    assert ds[-1].num_workers == 1 and "over target" in ds[-1].reason and "1500" in ds[-1].reason
    assert state == ScalerState(last_change=5.0)  # the windows start again after a change


def test_a_one_poll_spike_does_not_grow():
    steps = [(0.0, pool(5000)), (1.0, pool(200)), (5.5, pool(5000)), (10.0, pool(5000))]
    ds, _ = run(steps)
    assert actions(ds) == ["hold"] * 4  # the spike at 5.5 starts its own window, 4.5 s is not enough
    ds, _ = run(steps + [(10.5, pool(5000))])
    assert ds[-1].action == "grow"


def test_grows_by_what_the_load_asks_for():
    ds, _ = run([(0.0, pool(2500)), (5.0, pool(2500))])  # 2500 tokens: 3 workers of 1000
    assert ds[-1] == ScalingDecision("grow", 2, None, ds[-1].reason)


def test_never_grows_beyond_max():
    ds, _ = run([(0.0, pool(9000)), (5.0, pool(9000))])
    assert ds[-1].action == "grow" and ds[-1].num_workers == 2  # to max_replicas 3, not 9
    ds, _ = run([(0.0, pool(5000, 5000, 5000)), (60.0, pool(5000, 5000, 5000))])
    assert actions(ds) == ["hold", "hold"] and "at max_replicas" in ds[-1].reason


def test_counts_pending_starts_so_a_booting_worker_is_not_doubled():
    ds, _ = run([(0.0, pool(1500)), (5.0, pool(1500)), (60.0, pool(1500))], pending=1)
    assert actions(ds) == ["hold", "hold", "hold"]  # 1500 tokens want 2 workers: one is running, one starting
    assert "starting cover it" in ds[-1].reason
    ds, _ = run([(0.0, pool(2500)), (5.0, pool(2500))], pending=1)
    assert ds[-1].action == "grow" and ds[-1].num_workers == 1  # 3 wanted, 1 running, 1 starting


def test_cooldown_holds_after_a_change_and_then_lets_the_next_one_through():
    always_over = [(t, pool(1500)) for t in (0.0, 5.0, 6.0, 34.9, 35.0)]
    ds, _ = run(always_over)
    assert actions(ds) == ["hold", "grow", "hold", "hold", "grow"]
    assert "cooldown" in ds[3].reason
    # after a shrink too
    ds, _ = run([(0.0, pool(0, 0)), (20.0, pool(0, 0)), (21.0, pool(0, 0))])
    assert actions(ds) == ["hold", "shrink", "hold"] and "cooldown" in ds[-1].reason


def test_free_block_pressure_grows_a_decode_pool_whatever_its_token_load():
    cfg = dataclasses.replace(CFG, metric="work_tokens", min_free_block_fraction=0.2)
    full = {"d0": load(queued=0, running=300, free=10, total=100)}
    ds, _ = run([(0.0, full), (5.0, full)], cfg=cfg)
    assert ds[-1].action == "grow" and ds[-1].num_workers == 1 and "free blocks below 0.20" in ds[-1].reason
    ds, _ = run([(0.0, full), (5.0, full)], cfg=cfg, pending=1)
    assert ds[-1].action == "hold"  # the one starting is what the pressure asked for


def test_work_tokens_count_running_tokens_and_queued_tokens_do_not():
    busy = {"d0": load(queued=200, running=1300)}
    ds, _ = run([(0.0, busy), (5.0, busy)], cfg=dataclasses.replace(CFG, metric="work_tokens"))
    assert ds[-1].action == "grow"
    ds, _ = run([(0.0, busy), (5.0, busy)])  # metric queued_tokens: 200 is under target
    assert ds[-1].action == "hold"


# ---- shrinking


def test_shrinks_only_when_below_low_water_for_the_window():
    ds, _ = run([(0.0, pool(50, 10)), (10.0, pool(50, 10)), (19.9, pool(50, 10)), (20.0, pool(50, 10))])
    assert actions(ds) == ["hold", "hold", "hold", "shrink"]
    assert ds[-1].num_workers == 1 and "under low water" in ds[-1].reason


def test_a_one_poll_dip_does_not_shrink():
    ds, _ = run([(0.0, pool(50, 10)), (10.0, pool(300, 300)), (25.0, pool(50, 10)), (40.0, pool(50, 10))])
    assert actions(ds) == ["hold"] * 4  # under again from 25.0: 15 s is not the window


def test_load_between_low_water_and_target_never_shrinks():
    ds, _ = run([(t, pool(150, 150)) for t in range(0, 1000, 50)])
    assert set(actions(ds)) == {"hold"}


def test_does_not_shrink_when_the_rest_would_be_over_target_at_once():
    cfg = dataclasses.replace(CFG, target_tokens_per_worker=100, low_water_tokens_per_worker=90)
    ds, _ = run([(0.0, pool(80, 80)), (100.0, pool(80, 80))], cfg=cfg)  # one worker would hold 160 > 100
    assert actions(ds) == ["hold", "hold"]


def test_shrink_drains_the_least_loaded_worker():
    loads = {"a": load(90), "b": load(5), "c": load(40)}
    ds, _ = run([(0.0, loads), (20.0, loads)])
    assert ds[-1].action == "shrink" and ds[-1].worker == "b"
    assert "draining b" in ds[-1].reason


def test_least_loaded_breaks_ties_by_work_then_blocks_then_address():
    assert least_loaded({"a": load(0, running=50), "b": load(0, running=10)}, "queued_tokens") == "b"
    assert least_loaded({"a": load(0, free=50), "b": load(0, free=90)}, "queued_tokens") == "b"
    assert least_loaded({"b": load(0), "a": load(0)}, "queued_tokens") == "a"


def test_never_shrinks_below_min():
    ds, _ = run([(t, pool(0)) for t in range(0, 1000, 50)])
    assert set(actions(ds)) == {"hold"}
    cfg = dataclasses.replace(CFG, min_replicas=2)
    ds, _ = run([(t, pool(0, 0)) for t in range(0, 1000, 50)], cfg=cfg)
    assert set(actions(ds)) == {"hold"}


def test_no_shrink_while_a_worker_starts_or_another_drains():
    steps = [(0.0, pool(0, 0)), (100.0, pool(0, 0))]
    ds, _ = run(steps, pending=1)
    assert actions(ds) == ["hold", "hold"]
    ds, _ = run(steps, draining=1)
    assert actions(ds) == ["hold", "hold"] and "drain is in progress" in ds[-1].reason


# ---- bounds corrected at once


def test_below_min_grows_at_once_counting_pending_starts():
    cfg = dataclasses.replace(CFG, min_replicas=2)
    d, state = decide(cfg, pool(0), 0, 0, 0.0, ScalerState(last_change=-1.0))  # inside a cooldown, too
    assert d.action == "grow" and d.num_workers == 1 and "below min_replicas" in d.reason
    assert state.last_change == 0.0
    d, _ = decide(cfg, pool(0), 1, 0, 0.0, ScalerState())
    assert d.action == "hold"


def test_above_max_shrinks_at_once():
    cfg = dataclasses.replace(CFG, max_replicas=2)
    d, _ = decide(cfg, pool(500, 0, 900), 0, 0, 0.0, ScalerState(last_change=0.0))
    assert d.action == "shrink" and d.worker == "w1" and "above max_replicas" in d.reason


def test_decide_keeps_no_state_of_its_own():
    first = decide(CFG, pool(1500), 0, 0, 0.0, ScalerState())
    again = decide(CFG, pool(1500), 0, 0, 0.0, ScalerState())
    assert first == again and first[1] == ScalerState(over_since=0.0)


# ---- the config


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_replicas=0),
        dict(min_replicas=3, max_replicas=2),
        dict(metric="free_blocks"),
        dict(target_tokens_per_worker=0),
        dict(low_water_tokens_per_worker=1000),  # not below the target
        dict(min_free_block_fraction=1.0),
        dict(cooldown_s=-1.0),
        dict(grow_after_s=float("nan")),
        dict(interval_s=0.0),
        dict(drain_timeout_s=float("inf")),
    ],
)
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        dataclasses.replace(CFG, **bad)


def test_config_knows_whether_it_scales():
    assert CFG.scales
    assert not ScalingConfig(min_replicas=2, max_replicas=2).scales


# ---- the serve flags


def serve_args(*flags: str):
    """The serve flags as `serve` reads them: parsed, the tuned choices filled in."""
    from splitserve.cli import build_parser
    from splitserve.cluster.serve import with_tuned

    return with_tuned(build_parser(["serve", *flags]).parse_args(["serve", *flags]))[0]


def test_serve_flags_make_a_pool_scale_only_when_its_max_is_above_its_size():
    from splitserve.cluster.serve import scaling_config

    a = serve_args()
    assert scaling_config(a, "prefill") is None and scaling_config(a, "decode") is None
    a = serve_args("--prefill-workers", "2", "--prefill-workers-max", "2")
    assert scaling_config(a, "prefill") is None
    a = serve_args(
        "--prefill-workers-max",
        "3",
        "--prefill-target-tokens",
        "2000",
        "--decode-workers",
        "2",
        "--decode-workers-max",
        "4",
    )
    p, d = scaling_config(a, "prefill"), scaling_config(a, "decode")
    assert p is not None and d is not None
    assert (p.min_replicas, p.max_replicas, p.metric, p.target_tokens_per_worker) == (1, 3, "queued_tokens", 2000)
    assert p.low_water_tokens_per_worker < p.target_tokens_per_worker and p.min_free_block_fraction == 0
    assert (d.min_replicas, d.max_replicas, d.metric) == (2, 4, "work_tokens") and d.min_free_block_fraction > 0
    with pytest.raises(ValueError, match="--decode-workers-max"):
        scaling_config(serve_args("--decode-workers", "3", "--decode-workers-max", "2"), "decode")


def test_serve_flags_give_standby_to_a_pool_that_scales_within_its_max_and_build_the_joint_controller():
    from splitserve.cluster.serve import configure, joint_config, standby_count

    a = serve_args("--prefill-workers-max", "3", "--decode-workers", "2", "--decode-workers-max", "3")
    assert standby_count(a, "prefill", scaling_config_of(a, "prefill")) == 1
    a = serve_args("--decode-standby", "4", "--decode-workers", "2", "--decode-workers-max", "3")
    assert standby_count(a, "decode", scaling_config_of(a, "decode")) == 1  # within the maximum
    assert standby_count(serve_args("--decode-standby", "2"), "decode", None) == 2  # a fixed pool: as asked
    assert standby_count(serve_args(), "decode", None) == 0
    with pytest.raises(ValueError, match="--prefill-standby"):
        standby_count(serve_args("--prefill-standby", "-1"), "prefill", None)
    a = serve_args(
        *"--scaling joint --slo-ttft-ms 800 --slo-itl-ms 50 --prefill-workers 2 --prefill-workers-max 6".split()
    )
    j = joint_config(a)
    assert (j.slo_ttft_s, j.slo_itl_s, j.prefill_min, j.prefill_max, j.decode_min, j.decode_max) == (
        0.8,
        0.05,
        2,
        6,
        1,
        1,
    )
    assert configure(a).controller == j
    assert configure(serve_args()).controller is None
    with pytest.raises(ValueError, match="--slo-itl-ms"):
        joint_config(serve_args(*"--scaling joint --prefill-workers-max 3 --slo-itl-ms 0".split()))
    with pytest.raises(ValueError, match="--prefill-workers-max or --decode-workers-max"):
        joint_config(serve_args("--scaling", "joint"))


def scaling_config_of(a, role):
    from splitserve.cluster.serve import scaling_config

    return scaling_config(a, role)
