"""bench autoscale (bench/autoscale.py): its load, its recovery arithmetic, and a short run of the
joint controller over real services."""

from __future__ import annotations

import argparse
import math

import pytest

from splitserve.bench.autoscale import arrivals
from splitserve.bench.autoscale_plan import Outcome, Record
from tests.cli_helpers import splitserve


def load_args(**kw: object) -> argparse.Namespace:
    base = {"prompt_tokens": "8:16", "phases": "20,40,20", "rate": 5.0, "burst_factor": 4.0, "seed": 1}
    return argparse.Namespace(**{"arrivals": "poisson", "gamma_shape": 0.5, **base, **kw})


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_the_load_runs_its_phases_at_their_rates(kind: str) -> None:
    reqs = arrivals(load_args(arrivals=kind))
    counts = [sum(lo <= r.at_s < hi for r in reqs) for lo, hi in ((0, 20), (20, 60), (60, 80))]
    expected = (100, 800, 100)
    for got, want in zip(counts, expected, strict=True):
        assert abs(got - want) < 5 * math.sqrt(want) * (2 if kind == "gamma" else 1), (counts, expected)
    assert all(8 <= len(r.prompt) <= 16 for r in reqs) and reqs == sorted(reqs)


def test_the_slos_hold_again_from_the_first_moment_every_later_window_meets_them() -> None:
    bad, good = (2.0, 0.01), (0.1, 0.01)
    records = [Record(t / 10, *(bad if 20 <= t / 10 < 27 else good)) for t in range(0, 600)]
    o = Outcome("joint", records, 0.0, (1, 1), 20.0, slo_ttft_s=1.0, slo_itl_s=0.05)
    assert o.recovered_after_s is not None and 6.5 <= o.recovered_after_s <= 7.0
    assert math.isclose(o.attainment, 1 - 70 / 600)
    never = Outcome("fixed", [Record(t, *bad) for t in range(30)], 0.0, (1, 1), 20.0, 1.0, 0.05)
    assert never.recovered_after_s is None


@pytest.mark.timeout(240)
def test_a_short_burst_grows_the_pools_of_the_joint_controller_and_loses_no_request() -> None:
    out = splitserve(
        *"bench autoscale --policies joint --phases 1,3,1 --prefill-max 6 --decode-max 3 --standby 2:1".split(),
        *"--cold-start-s 1 --rate 4".split(),
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (row,) = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["joint"]]
    prefill, decode = (int(x) for x in row[3].split(":"))
    assert prefill > 3 and decode >= 1  # grown from 3 prefill workers under the burst
    assert row[-1] == "0"  # no request failed
