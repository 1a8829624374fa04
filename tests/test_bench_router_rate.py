"""bench router-rate (bench/router_rate.py): where its ladder stops, and a short run over mockers."""

from __future__ import annotations

import pytest

from splitserve.bench.router_rate import Step, sustained
from tests.cli_helpers import splitserve


def step(rate: float, routed_ms: float, direct_ms: float, lost: int = 0) -> Step:
    return Step(rate, (routed_ms / 1e3,) * 10, (direct_ms / 1e3,) * 10, lost, 0, 0.1, 0.2)


def test_the_ladder_stops_where_the_router_adds_more_than_5_ms() -> None:
    best, why = sustained([step(10, 101, 100), step(20, 104, 100), step(40, 110, 100)])
    assert best is not None and best.rate == 20 and "router adding +10.0 ms at 40" in why


def test_the_ladder_stops_where_the_fleet_saturates_whatever_the_router_adds() -> None:
    best, why = sustained([step(10, 100, 100), step(20, 250, 260)])
    assert best is not None and best.rate == 10 and "fleet saturating at 20" in why


def test_a_lost_request_ends_the_ladder_and_none_is_sustained_when_the_first_rate_fails() -> None:
    best, why = sustained([step(10, 120, 100), step(20, 100, 100)])
    assert best is None and "at 10" in why
    best, _ = sustained([step(10, 100, 100), step(20, 100, 100, lost=1)])
    assert best is not None and best.rate == 10


@pytest.mark.timeout(240)
def test_a_short_ladder_over_a_few_mockers_loses_nothing_and_names_its_stop() -> None:
    out = splitserve(
        *"bench router-rate --decode-workers 2 --prefill-workers 1 --rates 4,8 --seconds 2".split(),
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["4"], ["8"])]
    assert len(rows) >= 1 and all(r[-2:] == ["0", "0"] for r in rows), rows  # none lost, none wrong
    assert "every prefill-decode pair connected first: 2 pairs" in out.stdout
    assert "sustained within +5 ms p99:" in out.stdout and "stopped by" in out.stdout
