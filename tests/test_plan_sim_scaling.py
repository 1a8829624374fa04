"""Pools resized while the simulator runs (plan/sim/scaling.py): starts from standby and from cold,
drains, what they cost; and `bench autoscale --fleet sim`, the pool manager's policies on it."""

from __future__ import annotations

import random

import pytest

from splitserve.plan.sim.scaling import PoolsView, Resize, SimScaling
from splitserve.plan.sim.simulate import ClusterSpec, Request, simulate
from tests.cli_helpers import splitserve
from tests.test_plan_simulate import Toy

pytestmark = pytest.mark.timeout(120)


def steady(n: int, gap: float, prompt: int = 100, output: int = 20) -> list[Request]:
    return [Request(i * gap, prompt, output) for i in range(n)]


class Script:
    """A policy that gives `orders[k]` at its k-th interval, and keeps what it saw."""

    def __init__(self, orders: dict[int, list[Resize]]) -> None:
        self.orders = orders
        self.seen: list[PoolsView] = []

    def __call__(self, view: PoolsView) -> list[Resize]:
        self.seen.append(view)
        return self.orders.get(len(self.seen) - 1, [])


def test_a_grow_takes_the_standby_worker_at_once_and_the_rest_from_cold() -> None:
    script = Script({0: [Resize("decode", start=2)]})
    scaling = SimScaling(script, interval_s=1.0, cold_start_s=5.0, activation_s=0.1, standby=(0, 1))
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1)
    r = simulate(steady(200, 0.05), spec, Toy(), random.Random(0), scaling=scaling)
    assert r.pools is not None
    by_second = {round(t): d for t, _, d in r.pools.sizes}
    assert by_second[1] == 2  # the standby worker, routed 0.1 s after the order
    assert by_second[4] == 2 and by_second[6] == 3  # the cold one after its 5 s
    assert script.seen[1].standby["decode"] == 0 and script.seen[1].starting["decode"] == 1
    assert script.seen[6].standby["decode"] == 1  # the standby worker taken was replaced, from cold
    used = {o.decode_worker for o in r.outcomes}
    assert len(used) == 3  # the router sent requests to every worker it was given
    # paid from the order on: 1 prefill + 1 decode, the 2 started, the standby one's replacement
    end = max(max(o.finish_s for o in r.outcomes), r.pools.sizes[-1][0])
    assert r.pools.worker_seconds == pytest.approx(5 * end)


def test_a_drained_worker_gets_no_new_request_and_its_own_finish() -> None:
    script = Script({3: [Resize("decode", drain=("decode1",))]})
    spec = ClusterSpec("disaggregated", decode_workers=2, prefill_workers=1)
    r = simulate(steady(200, 0.05), spec, Toy(), random.Random(0), scaling=SimScaling(script, interval_s=1.0))
    late = [o for o in r.outcomes if o.arrival_s > 3.0]
    assert late and all(o.decode_worker == "decode0" for o in late)
    assert any(o.decode_worker == "decode1" for o in r.outcomes if o.arrival_s < 3.0)
    assert script.seen[4].draining["decode"] + len(script.seen[4].routable["decode"]) >= 1
    assert list(script.seen[-1].routable["decode"]) == ["decode0"] and script.seen[-1].draining["decode"] == 0


def test_draining_the_last_worker_of_a_pool_is_refused() -> None:
    script = Script({0: [Resize("decode", drain=("decode0",))]})
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1)
    with pytest.raises(ValueError, match="decode0"):
        simulate(steady(5, 0.5), spec, Toy(), random.Random(0), scaling=SimScaling(script))


def test_the_joint_controller_meets_the_slos_of_a_burst_that_fixed_pools_miss() -> None:
    """1,024 workers at most, the pool manager's three policies, on the simulator."""
    out = splitserve(
        *"bench autoscale --fleet sim --prefill-max 768 --decode-max 256 --prefill-workers 24".split(),
        *"--decode-workers 8 --standby 48:8 --rate 48 --phases 10,20,10".split(),
        timeout=100,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        r[0]: r
        for r in (line.split() for line in out.stdout.splitlines())
        if r[:1] in (["fixed"], ["queue"], ["joint"])
    }
    met = {p: float(r[1].rstrip("%")) for p, r in rows.items()}
    paid = {p: float(r[2]) for p, r in rows.items()}
    assert met["joint"] >= 95 > met["fixed"], met
    assert met["queue"] < met["joint"] and paid["fixed"] < paid["queue"], (met, paid)
    assert int(rows["joint"][3].split(":")[0]) > 24  # the prefill pool grew
    assert all(r[-1] == "0" for r in rows.values())  # every request finished
