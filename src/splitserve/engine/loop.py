"""The engine thread that both workers run.

The engine is not thread-safe, so one thread owns it. gRPC handler threads
talk to it by submitting small functions (`call`) that run between steps, and
hear back through per-request sinks called with each `StepOutput`. Once per
iteration the loop polls the engine's KV connector for transfers that ended
(a decode worker's arriving KV), so the KV plane's threads never touch the
engine. Block events and a stats snapshot are published after every step for
the router, and the step's `IterationStats` go to `on_iteration` (the worker's
metrics) on this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.scheduler import SchedulerStats
from splitserve.engine.stats import IterationStats

log = logging.getLogger(__name__)

T = TypeVar("T")

Stats = SchedulerStats  # what GetStats reports, snapshotted after every step


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        idle_wait_s: float = 0.05,
        on_iteration: Callable[[IterationStats], None] | None = None,
    ) -> None:
        """`on_iteration` is called on the engine thread with what each step counted; it must not block."""
        self.engine = engine
        self.on_iteration = on_iteration
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StepOutput], None]] = {}
        self._subscribers: list[Callable[[list[BlockEvent]], None]] = []
        self._sub_lock = threading.Lock()
        self._stop = threading.Event()
        self.stats = engine.stats()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- from any thread ----

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread before the next step."""
        fut: Future[T] = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("engine loop stopped"))
            return fut
        self._calls.put((fn, fut))
        return fut

    def set_sink(self, request_id: str, sink: Callable[[StepOutput], None]) -> None:
        """`sink` is called on the engine thread with each output of the request; it must not block."""
        self._sinks[request_id] = sink

    def drop_sink(self, request_id: str, sink: Callable[[StepOutput], None]) -> None:
        """Remove `sink` if it is still the request's (a later call's sink for the same id stays)."""
        if self._sinks.get(request_id) == sink:
            self._sinks.pop(request_id, None)

    def wake(self) -> None:
        """From any thread: end an idle wait now (the connector has news for the next poll)."""
        self._calls.put((lambda e: None, Future()))

    def subscribe_blocks(self, callback: Callable[[list[BlockEvent]], None]) -> Future[list[BlockEvent]]:
        """Follow the prefix cache: resolves to a snapshot, after which `callback` gets every change."""

        def snapshot(engine: Engine) -> list[BlockEvent]:
            with self._sub_lock:
                self._subscribers.append(callback)
            hashes = engine.scheduler.cached_block_hashes()
            return [BlockEvent("cleared", ()), BlockEvent("stored", hashes)] if hashes else [BlockEvent("cleared", ())]

        return self.call(snapshot)

    def unsubscribe_blocks(self, callback: Callable[[list[BlockEvent]], None]) -> None:
        with self._sub_lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._calls.put((lambda e: None, Future()))
        self._thread.join(timeout)

    # ---- the engine thread ----

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._run_calls(block=not engine.has_work)
            self._deliver(engine.apply_transfers(engine.connector.poll()))
            if engine.has_work:
                try:
                    outputs = engine.step()
                except Exception:
                    log.exception("engine step failed; aborting its requests")
                    outputs = self._abort_all()
                self.steps += 1
                self._deliver(outputs)
            self._publish()
        self._fail_pending_calls()

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
            if out.finished:
                self._sinks.pop(out.request_id, None)

    def _run_calls(self, block: bool) -> None:
        try:
            fn, fut = self._calls.get(timeout=self.idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller, who knows what it means
                    fut.set_exception(e)
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return

    def _publish(self) -> None:
        self.stats = self.engine.stats()
        it = self.engine.drain_iteration_stats()
        if self.on_iteration is not None and not it.empty:
            self.on_iteration(it)
        events = self.engine.drain_block_events()
        if events:
            with self._sub_lock:
                subs = list(self._subscribers)
            for cb in subs:
                cb(events)

    def _abort_all(self) -> list[StepOutput]:
        """After a failed step: end every request that was in it or could be (not the reserved ones,
        whose KV is still on its way and which no step has touched)."""
        outs = []
        sched = self.engine.scheduler
        for seq in [*sched.waiting, *sched.running]:
            self.engine.abort(seq.request_id)
            outs.append(
                StepOutput(seq.request_id, -1, None, True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens)
            )
        return outs

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine loop stopped"))
