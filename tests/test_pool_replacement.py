"""A pool that lost its routed worker and its standby worker together (one node held both) starts
two: a replacement and a new standby worker. Whichever is up first serves; the other lands on
standby. The launcher here starts nothing: each start after the first two waits for the test."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitserve.cluster.pool import PoolManager, PoolSpec
from splitserve.router.config import RouterConfig
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.workers import WorkerSet
from splitserve.workers.common.config import WorkerConfig

pytestmark = pytest.mark.timeout(30)


class GatedLauncher:
    def __init__(self, free_starts: int) -> None:
        self.free_starts = free_starts
        self.started = 0
        self.gates: dict[int, asyncio.Event] = {}  # start number -> opened by the test
        self.dead: set[int] = set()

    async def start(self, spec: Any, cfg: Any, timeout_s: float) -> tuple[Any, str, str | None]:
        self.started += 1
        n = self.started
        if n > self.free_starts:
            self.gates[n] = asyncio.Event()
            await self.gates[n].wait()
        return n, f"127.0.0.1:{20000 + n}", None

    async def ping(self, handle: Any) -> None:
        if handle in self.dead:
            raise RuntimeError("the actor died")

    async def stop(self, handle: Any) -> None:
        pass

    def kill(self, handle: Any) -> None:
        self.dead.add(handle)

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        pass


async def until(check: Any) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def scenario() -> dict[str, Any]:
    workers = WorkerSet(RouterConfig(), PrefixIndex())
    launcher = GatedLauncher(free_starts=2)
    spec = PoolSpec("decode", 1, WorkerConfig(role="decode"), standby=1)
    pools = PoolManager([spec], workers, watch_interval_s=0.02, launcher=launcher)
    try:
        await pools.start()
        launcher.dead |= {1, 2}  # the routed worker and the standby one, on one node
        await until(lambda: len(launcher.gates) == 2)  # a replacement and a new standby worker, starting
        first_up, later = sorted(launcher.gates)  # the standby top-up was asked for first
        launcher.gates[first_up].set()
        await until(lambda: pools.members["decode"])
        serving_first = [m.actor for m in pools.members["decode"]]
        counts_between = (pools.pending["decode"], pools.standby_pending["decode"])
        launcher.gates[later].set()
        await until(lambda: pools.standby["decode"])
        return {
            "first_up": first_up,
            "later": later,
            "serving_first": serving_first,
            "between": counts_between,
            "serving": [m.actor for m in pools.members["decode"]],
            "standby": [m.actor for m in pools.standby["decode"]],
            "after": (pools.pending["decode"], pools.standby_pending["decode"]),
        }
    finally:
        await pools.stop()
        await workers.close()


def test_the_first_worker_up_serves_and_the_later_one_lands_on_standby() -> None:
    out = asyncio.run(scenario())
    assert out["serving_first"] == [out["first_up"]]  # started for standby, serving at once
    assert out["between"] == (0, 1)  # no routed start left pending; the other now counts as standby
    assert out["serving"] == [out["first_up"]] and out["standby"] == [out["later"]]
    assert out["after"] == (0, 0)
