"""The engine thread that both workers run.

The engine is not thread-safe, so one thread owns it. gRPC handler threads
talk to it by submitting small functions (`call`) that run between steps, and
hear back through per-request sinks called with each `StepOutput`. Block
events and a stats snapshot are published after every step for the router.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.sequence import Sequence

log = logging.getLogger(__name__)

T = TypeVar("T")
LayerHook = Callable[[int, list[Sequence], list[int]], None]


class Stats(NamedTuple):
    queued_tokens: int
    running_tokens: int
    free_blocks: int
    total_blocks: int
    queue_length: int
    running_requests: int
    reserved_requests: int  # decode role: waiting for their KV
    prefix_cache_queries: int  # full blocks looked up at admission, since start
    prefix_cache_hits: int


def engine_stats(engine: Engine) -> Stats:
    sched = engine.scheduler
    queued = sum(len(s) for s in sched.waiting) + sum(
        len(s) - s.num_computed_tokens for s in sched.running if len(s) - s.num_computed_tokens > 1
    )
    running = sum(len(s) for s in sched.running)
    return Stats(
        queued_tokens=queued,
        running_tokens=running,
        free_blocks=engine.blocks.num_free_blocks,
        total_blocks=engine.blocks.num_blocks,
        queue_length=len(sched.waiting),
        running_requests=len(sched.running),
        reserved_requests=len(engine.awaiting_kv),
        prefix_cache_queries=engine.blocks.stats.queries,
        prefix_cache_hits=engine.blocks.stats.hits,
    )


class EngineLoop:
    def __init__(self, engine: Engine, on_layer_done: LayerHook | None = None, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.on_layer_done = on_layer_done
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StepOutput], None]] = {}
        self._subscribers: list[Callable[[list[BlockEvent]], None]] = []
        self._sub_lock = threading.Lock()
        self._stop = threading.Event()
        self.stats = engine_stats(engine)
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

    def subscribe_blocks(self, callback: Callable[[list[BlockEvent]], None]) -> Future[list[BlockEvent]]:
        """Follow the prefix cache: resolves to a snapshot, after which `callback` gets every change."""

        def snapshot(engine: Engine) -> list[BlockEvent]:
            with self._sub_lock:
                self._subscribers.append(callback)
            hashes = tuple(engine.blocks.hash_to_block)
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
            if engine.has_work:
                try:
                    outputs = engine.step(self.on_layer_done)
                except Exception:
                    log.exception("engine step failed; aborting its requests")
                    outputs = self._abort_all()
                self.steps += 1
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
            self._publish()
        self._fail_pending_calls()

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
        self.stats = engine_stats(self.engine)
        events = self.engine.drain_block_events()
        if events:
            with self._sub_lock:
                subs = list(self._subscribers)
            for cb in subs:
                cb(events)

    def _abort_all(self) -> list[StepOutput]:
        outs = []
        for rid in list(self.engine.requests):
            seq = self.engine.requests[rid]
            self.engine.abort(rid)
            outs.append(StepOutput(rid, -1, None, True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens))
        return outs

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine loop stopped"))
