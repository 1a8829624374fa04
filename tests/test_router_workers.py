"""WorkerSet draining against fake workers over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.router.config import Deadlines, RouterConfig
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.workers import Worker, WorkerSet

pytestmark = pytest.mark.timeout(60)


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def with_a_poll_held(workers: WorkerSet, fake: FakePrefillWorker) -> Worker:
    """`fake` added and healthy, then a stats poll to it out with its answer held (until
    fake.stats_open is set): the worker's record."""
    workers.add(fake.address, "prefill")
    w = workers.get(fake.address)
    assert w is not None
    await until(lambda: w.healthy)
    fake.stats_open.clear()
    await until(lambda: fake.stats_held == 1)
    return w


def test_a_draining_worker_leaves_routing_and_is_drained_after_two_idle_polls():
    async def scenario() -> None:
        kv = FakeKVPlane()
        busy, other = FakePrefillWorker(kv, queued_tokens=300), FakePrefillWorker(kv)
        for f in (busy, other):
            await f.start()
        health_changes = []
        # polls far apart, so the test can look between two of them
        cfg = RouterConfig(deadlines=Deadlines(stats_interval_s=0.5))
        workers = WorkerSet(cfg, PrefixIndex(), on_health_change=lambda: health_changes.append(1))
        try:
            workers.add(busy.address, "prefill")
            workers.add(other.address, "prefill")
            w = workers.get(busy.address)
            assert w is not None
            await until(lambda: all(x.healthy for x in workers.all()))
            assert set(workers.prefill_queued_tokens()) == {busy.address, other.address}

            before = len(health_changes)
            workers.drain(busy.address)
            assert len(health_changes) == before + 1  # the health service hears that routing changed
            assert [x.address for x in workers.healthy("prefill")] == [other.address]
            assert set(workers.prefill_queued_tokens()) == {other.address}

            busy.queued_tokens = 301  # still polled while draining
            await until(lambda: w.stats is not None and w.stats.queued_tokens == 301)
            assert not workers.drained(busy.address) and w.idle_polls == 0

            busy.queued_tokens = 0
            await until(lambda: w.stats is not None and w.stats.queued_tokens == 0)
            assert not workers.drained(busy.address)  # one idle poll is not proof
            await until(lambda: workers.drained(busy.address))
            assert workers.get(busy.address) is w and w.healthy  # still there until the pool manager removes it

            busy.queued_tokens = 5  # work again (a late request): no longer drained
            await until(lambda: w.stats is not None and w.stats.queued_tokens == 5)
            assert not workers.drained(busy.address)
            assert not workers.drained(other.address) and not workers.drained("127.0.0.1:1")
        finally:
            await workers.close()
            for f in (busy, other):
                await f.stop()

    asyncio.run(scenario())


def test_tokens_routed_while_a_stats_poll_is_in_flight_survive_its_answer():
    # The poll's answer cannot show tokens routed after it went out; dropping them
    # made a burst's load vanish for one poll (and restarted the scaler's window).
    async def scenario() -> None:
        fake = FakePrefillWorker(FakeKVPlane(), queued_tokens=100)
        await fake.start()
        workers = WorkerSet(RouterConfig(deadlines=Deadlines(stats_interval_s=0.05)), PrefixIndex())
        try:
            w = await with_a_poll_held(workers, fake)
            workers.assigned(fake.address, 500)
            assert workers.prefill_queued_tokens() == {fake.address: 600}
            answered = w.stats
            fake.stats_open.set()  # answers the held poll...
            fake.stats_open.clear()  # ...and holds the next one
            await until(lambda: w.stats is not answered)
            assert workers.prefill_queued_tokens() == {fake.address: 600}  # still counted
            # the next poll went out after the routing: its answer accounts for those tokens
            await until(lambda: fake.stats_held == 1)
            answered = w.stats
            fake.stats_open.set()
            await until(lambda: w.stats is not answered)
            assert workers.prefill_queued_tokens() == {fake.address: 100}
        finally:
            await workers.close()
            await fake.stop()

    asyncio.run(scenario())


def test_a_worker_marked_failed_while_a_poll_is_in_flight_is_announced_healthy_when_it_answers():
    # The poll compared health before its call with health after its answer: a request that
    # marked the worker failed in between went unannounced when the answer restored it, and a
    # request waiting for a healthy decode worker slept out its whole wait (60 s).
    async def scenario() -> None:
        fake = FakePrefillWorker(FakeKVPlane())
        await fake.start()
        changes: list[int] = []
        cfg = RouterConfig(deadlines=Deadlines(stats_interval_s=0.05))
        workers = WorkerSet(cfg, PrefixIndex(), on_health_change=lambda: changes.append(1))
        try:
            w = await with_a_poll_held(workers, fake)
            before = len(changes)
            workers.mark_failed(fake.address)
            assert not w.healthy and len(changes) == before + 1
            fake.stats_open.set()  # the held poll answers: the worker is healthy again
            await until(lambda: w.healthy)
            assert len(changes) == before + 2
        finally:
            await workers.close()
            await fake.stop()

    asyncio.run(scenario())


def test_a_prefill_that_ended_leaves_the_workers_queue_at_once_not_a_poll_later():
    # Issue 22: counted only by the next poll, a worker that had just finished a long prompt looked
    # busy for a stats interval, and the next prompt went to the busier worker.
    async def scenario() -> None:
        fake = FakePrefillWorker(FakeKVPlane(), queued_tokens=600)
        await fake.start()
        workers = WorkerSet(RouterConfig(deadlines=Deadlines(stats_interval_s=0.05)), PrefixIndex())
        try:
            workers.add(fake.address, "prefill")
            w = workers.get(fake.address)
            assert w is not None
            await until(lambda: w.healthy and w.stats is not None and w.stats.queued_tokens == 600)
            fake.stats_open.clear()
            await until(lambda: fake.stats_held == 1)  # a poll is out, its answer held
            workers.ended(fake.address, 500)
            assert workers.prefill_queued_tokens() == {fake.address: 100}  # at once
            answered = w.stats
            fake.stats_open.set()  # the held poll, taken before the ending, shows the 600...
            fake.stats_open.clear()
            await until(lambda: w.stats is not answered)
            assert workers.prefill_queued_tokens() == {fake.address: 100}  # ...and the ending stays counted
            fake.queued_tokens = 100  # what the worker says from now on
            await until(lambda: fake.stats_held == 1)  # a poll that went out after the ending
            answered = w.stats
            fake.stats_open.set()
            await until(lambda: w.stats is not answered)
            assert workers.prefill_queued_tokens() == {fake.address: 100}  # counted once, by the worker
            workers.ended(fake.address, 10_000)
            assert workers.prefill_queued_tokens() == {fake.address: 0}  # never below empty
        finally:
            await workers.close()
            await fake.stop()

    asyncio.run(scenario())


def test_tokens_routed_to_arrive_as_kv_count_as_the_decode_workers_context_not_its_queue():
    # Issue 22: a remote prompt charged to the decode worker's queue made the next prompt of a
    # burst look cheaper to send remote (the decode worker seemed to have a prompt to prefill).
    async def scenario() -> None:
        fake = FakePrefillWorker(FakeKVPlane())
        await fake.start()
        workers = WorkerSet(RouterConfig(deadlines=Deadlines(stats_interval_s=60)), PrefixIndex())
        try:
            workers.add(fake.address, "prefill")  # its load() is what any worker's is
            w = workers.get(fake.address)
            assert w is not None
            await until(lambda: w.stats is not None)
            workers.assigned(fake.address, 1500, queued=False)
            assert (w.load().queued_tokens, w.load().running_tokens) == (0, 1500)
            workers.assigned(fake.address, 200)
            assert (w.load().queued_tokens, w.load().running_tokens) == (200, 1500)
        finally:
            await workers.close()
            await fake.stop()

    asyncio.run(scenario())


def test_a_worker_of_another_model_is_never_routed_to(caplog: pytest.LogCaptureFixture):
    """The first fingerprint reported is the cluster's model; a worker of another is not routable
    (and so no stream migrates onto it), logged once, until it reports the cluster's."""

    async def scenario() -> None:
        kv = FakeKVPlane()
        ours, stranger = FakePrefillWorker(kv), FakePrefillWorker(kv)
        ours.model_fingerprint, stranger.model_fingerprint = b"a" * 16, b"b" * 16
        for f in (ours, stranger):
            await f.start()
        workers = WorkerSet(RouterConfig(deadlines=Deadlines(stats_interval_s=0.02)), PrefixIndex())
        try:
            workers.add(ours.address, "prefill")
            await until(lambda: bool(workers.healthy("prefill")))
            workers.add(stranger.address, "prefill")
            w = workers.get(stranger.address)
            assert w is not None
            polled = stranger.stats_answered
            await until(lambda: stranger.stats_answered >= polled + 5)
            assert [x.address for x in workers.healthy("prefill")] == [ours.address] and w.stats is None
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert errors == [
                f"worker {stranger.address} serves another model (fingerprint {'62' * 16}, the cluster's {'61' * 16}): "
                "not routing to it"
            ]
            stranger.model_fingerprint = ours.model_fingerprint  # restarted with the cluster's model
            await until(lambda: w.healthy)
        finally:
            await workers.close()
            for f in (ours, stranger):
                await f.stop()

    caplog.set_level(logging.INFO, logger="splitserve.router.workers")
    asyncio.run(scenario())


def test_a_request_waits_for_a_starting_decode_worker_past_the_no_decode_wait_and_not_for_none():
    """With a replacement starting (the pool manager's word), the wait outlasts no_decode_wait_s
    and ends when the replacement is healthy; with none coming, it ends at no_decode_wait_s; and
    a replacement that fails to start (the word goes back to 0) ends the wait then."""

    async def scenario() -> tuple[bool, float, bool, float, bool, float]:
        kv = FakeKVPlane()
        d = FakeDecodeWorker(kv, [1, 2, 3], worker_id="d0")
        workers = WorkerSet(RouterConfig(deadlines=Deadlines(stats_interval_s=0.02)), PrefixIndex())
        loop = asyncio.get_running_loop()
        try:
            t = loop.time()
            alone = await workers.wait_for_decode(0.1, 30.0)  # nothing healthy, nothing starting
            alone_s = loop.time() - t

            workers.expect("decode", 1)
            t = loop.time()
            waiting = asyncio.create_task(workers.wait_for_decode(0.1, 30.0))
            await asyncio.sleep(0.5)  # five times no_decode_wait_s: still waiting for the replacement
            assert not waiting.done()
            await d.start()
            workers.add(d.address, "decode")
            replaced = await waiting
            replaced_s = loop.time() - t

            workers.remove(d.address)
            workers.expect("decode", 1)
            t = loop.time()
            waiting = asyncio.create_task(workers.wait_for_decode(0.3, 30.0))
            await asyncio.sleep(0.05)
            workers.expect("decode", 0)  # its start failed
            failed = await waiting
            failed_s = loop.time() - t
            return alone, alone_s, replaced, replaced_s, failed, failed_s
        finally:
            await workers.close()
            await d.stop()

    alone, alone_s, replaced, replaced_s, failed, failed_s = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not alone and alone_s < 5
    assert replaced and replaced_s >= 0.5
    assert not failed and failed_s < 5
