"""The engine thread that both workers run.

The engine is not thread-safe, so one thread owns it. gRPC handler threads
talk to it by submitting typed commands (engine/commands.py) that run between
steps in the order submitted, each answered through a Future; an admitted
request's outputs go to the sink given with its admission, called with each
`StepOutput` on this thread (and dropped with its last output or its abort).
Once per iteration the loop polls the engine's KV connector for transfers that
ended (a decode worker's arriving KV, a prefill worker's confirmed send), so
the KV plane's threads never touch the engine. Block events and a stats
snapshot are published after every step for the router, and the step's
`IterationStats` go to `on_iteration` (the worker's metrics) on this thread.

The stats the router polls (`stats`) are never older than what it has sent:
the snapshot is taken again as soon as commands ran (an admitted prompt shows
at once, not after the step that follows, which may be a long prefill chunk),
before a step's outputs are handed out (a request's last token never reaches
the router ahead of a snapshot without it), and the prompts posted but not yet
admitted (waiting in the inbox while a step runs) count as queued. The router
drops its own record of a request it routed once a poll sent after it answers;
a snapshot from before the request arrived made a worker busy with a long
prefill look idle to the router until that step ended.
With a core lease (engine/core_lease.py) each step's torch threads are sized at
its boundary: a prefill borrows the machine's idle cores, and an idle loop lends
its own; a step that borrowed gives back, between its layers, what the owners
claim. Which waiting prompt starts next is the scheduler's (engine/scheduler.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.commands import Abort, Admit, Admitted, Command, Reserve
from splitserve.engine.core_lease import CoreLease
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.scheduler import Scheduler, SchedulerStats
from splitserve.engine.stats import IterationStats
from splitserve.engine.tier_cost import TierSpeeds

log = logging.getLogger(__name__)

Stats = SchedulerStats  # what GetStats reports, snapshotted after every step
Sink = Callable[[StepOutput], None]
BlockCallback = Callable[[list[BlockEvent]], None]


class _Subscribe(NamedTuple):
    """The loop's own command: follow the prefix cache (`subscribe_blocks`)."""

    callback: BlockCallback


class _Posted(NamedTuple):
    command: Command | _Subscribe | None  # None: only wake the loop
    sink: Sink | None
    future: Future[Any]


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        waiting_limit: int | None = None,
        idle_wait_s: float = 0.05,
        on_iteration: Callable[[IterationStats], None] | None = None,
        core_lease: CoreLease | None = None,
        decode_borrows: bool = False,
    ) -> None:
        """`waiting_limit`: requests an `Admit` lets wait for a seat (None: no limit);
        `on_iteration` is called on the engine thread with what each step counted; it must not block;
        `core_lease`: the machine's cores shared with its other workers (None: torch's threads as set);
        `decode_borrows`: decode steps borrow idle cores too (else only a step that prefills does)."""
        self.engine = engine
        self.core_lease = core_lease
        self.decode_borrows = decode_borrows
        self.waiting_limit = waiting_limit
        self.on_iteration = on_iteration
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue[_Posted] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._subscribers: list[BlockCallback] = []
        self._sub_lock = threading.Lock()
        self._stop = threading.Event()
        self._snapshot = engine.stats()
        self._posted_lock = threading.Lock()
        self._posted_tokens = 0  # prompt tokens of Admits in the inbox, not yet run
        self._posted_admits = 0
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- from any thread ----

    def submit(self, command: Command, sink: Sink | None = None) -> Future[Any]:
        """Run `command` on the engine thread before the next step; the Future answers it (see
        engine/commands.py). `sink` gets the outputs of the request an Admit or Reserve admits,
        from the admission on: it must not block.

        A request's grammar is compiled here, on the caller's thread and within its budget
        (engine/grammar.py), so the engine thread finds it compiled: a grammar that takes seconds
        holds its own call, never the batch. InvalidSamplingParam (a ValueError) when it does not
        compile or runs past the budget, raised here rather than through the Future."""
        if isinstance(command, Admit | Reserve) and command.params.grammar is not None:
            self.engine.grammars().compile_within(command.params.grammar)
        return self._post(command, sink)

    @property
    def stats(self) -> Stats:
        """What GetStats reports: the last snapshot, and the prompts posted since that the engine has
        not admitted yet counted as waiting (see the module's note)."""
        with self._posted_lock:
            tokens, admits = self._posted_tokens, self._posted_admits
        s = self._snapshot
        if not admits:
            return s
        return s._replace(queued_tokens=s.queued_tokens + tokens, queue_length=s.queue_length + admits)

    def wake(self) -> None:
        """From any thread: end an idle wait now (the connector has news for the next poll)."""
        self._inbox.put(_Posted(None, None, Future()))

    def tier_speeds(self) -> TierSpeeds:
        """The engine's measured prefill speed and its tiers' bandwidths (engine/kv_tiers.py; none
        without tiers); plain numbers, safe to read from any thread."""
        tiers = self.engine.tiers
        if tiers is not None:
            return tiers.speeds()
        return TierSpeeds(self.engine.prefill_tokens_per_s or 0.0, 0, ())

    def subscribe_blocks(self, callback: BlockCallback) -> Future[list[BlockEvent]]:
        """Follow the prefix cache: resolves to a snapshot, after which `callback` gets every change."""
        return self._post(_Subscribe(callback), None)

    def unsubscribe_blocks(self, callback: BlockCallback) -> None:
        with self._sub_lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout)

    def _post(self, command: Command | _Subscribe, sink: Sink | None) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("engine loop stopped"))
            return fut
        if isinstance(command, Admit):
            self._count_posted(command, 1)
        self._inbox.put(_Posted(command, sink, fut))
        return fut

    def _count_posted(self, cmd: Admit, sign: int) -> None:
        with self._posted_lock:
            self._posted_tokens += sign * (len(cmd.prompt) + len(cmd.prior))
            self._posted_admits += sign

    # ---- the engine thread ----

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._run_commands(block=not engine.has_work)
            self._deliver(engine.apply_transfers(engine.connector.poll()))
            if engine.has_work:
                self._size_step()
                try:
                    outputs = engine.step(self._give_back if self._borrowed() else None)
                except Exception:
                    log.exception("engine step failed; aborting its requests")
                    outputs = self._abort_all()
                self.steps += 1
                self._publish()  # before the outputs: a finished request leaves the stats first
                self._deliver(outputs)
            else:
                if self.core_lease is not None:
                    self.core_lease.release()
                self._publish()
        self._fail_pending()
        if self.core_lease is not None:
            self.core_lease.close()

    def _size_step(self) -> None:
        """The next step's threads, from the lease: set here, on the thread that runs the step,
        because OpenMP keeps the thread count per calling thread."""
        if self.core_lease is None:
            return
        threads = self.core_lease.acquire(borrows=self.decode_borrows or prefills_next(self.engine.scheduler))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _borrowed(self) -> bool:
        return self.core_lease is not None and self.core_lease.claimed > self.core_lease.own_cores

    def _give_back(self) -> None:
        assert self.core_lease is not None
        give_back(self.core_lease)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
            if out.finished and not out.remaining:  # the request's last sample
                self._sinks.pop(out.request_id, None)

    def _run_commands(self, block: bool) -> None:
        try:
            posted = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        admits: list[Admit] = []
        while True:
            if isinstance(posted.command, Admit):
                admits.append(posted.command)
            if posted.command is not None and posted.future.set_running_or_notify_cancel():
                try:
                    posted.future.set_result(self._execute(posted.command, posted.sink))
                except BaseException as e:  # handed to the caller, who knows what it means
                    posted.future.set_exception(e)
            try:
                posted = self._inbox.get_nowait()
            except queue.Empty:
                break
        # the admitted prompts in the snapshot before they leave the posted count (a reader between
        # the two counts them twice, never not at all)
        self._snapshot = self.engine.stats()
        for cmd in admits:
            self._count_posted(cmd, -1)

    def _execute(self, command: Command | _Subscribe, sink: Sink | None) -> Any:
        if isinstance(command, Admit):
            return self._admit(command, sink)
        if isinstance(command, Reserve):
            return self._reserve(command, sink)
        if isinstance(command, Abort):
            return self._abort(command)
        return self._subscribe(command.callback)

    def _admit(self, cmd: Admit, sink: Sink | None) -> Admitted:
        admitted = self.engine.admit(cmd, self.waiting_limit)
        if sink is not None:
            self._sinks[cmd.request_id] = sink
        return admitted

    def _reserve(self, cmd: Reserve, sink: Sink | None) -> Admitted | None:
        remote = self.engine.reserve(cmd.request_id, cmd.prompt, cmd.params, cmd.lease_s, cmd.prior, cmd.sample_index)
        seq = self.engine.lookup(cmd.request_id)
        if remote is None or seq is None:
            return None
        if sink is not None:
            self._sinks[cmd.request_id] = sink
        return Admitted(seq.times, remote.num_cached_tokens, remote.transfer)

    def _abort(self, cmd: Abort) -> bool:
        if cmd.sample_index is not None:  # the request's call, and its sink, go on with the others
            return self.engine.abort_sample(cmd.request_id, cmd.sample_index)
        seq = self.engine.lookup(cmd.request_id)
        if seq is None or (cmd.transfer_id is not None and seq.transfer_id != cmd.transfer_id):
            return False
        self._sinks.pop(cmd.request_id, None)
        return self.engine.abort(cmd.request_id)

    def _subscribe(self, callback: BlockCallback) -> list[BlockEvent]:
        with self._sub_lock:
            self._subscribers.append(callback)
        hashes = self.engine.scheduler.cached_block_hashes()
        events = [BlockEvent("cleared", ()), BlockEvent("stored", hashes)] if hashes else [BlockEvent("cleared", ())]
        if self.engine.tiers is not None:  # the blocks behind the pool, each at its tier
            events += [BlockEvent("stored", held, tier) for tier, held in self.engine.tiers.held()]
        return events

    def _publish(self) -> None:
        self._snapshot = self.engine.stats()
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
            if self.engine.abort(seq.group_id):  # every sample at once: one output for the request
                outs.append(
                    StepOutput(seq.group_id, -1, None, True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens)
                )
        return outs

    def _fail_pending(self) -> None:
        while True:
            try:
                posted = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(posted.command, Admit):
                self._count_posted(posted.command, -1)
            fut = posted.future
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine loop stopped"))


def prefills_next(sched: Scheduler) -> bool:
    """Whether the next step computes prompt tokens: a request waits, or one runs with its prompt
    (or a preempted one's recompute) not all in the cache. Such a step may borrow idle cores."""
    return bool(sched.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)


def give_back(lease: CoreLease) -> None:
    """Between a borrowing step's layers: the cores their owners claimed since it began (a decode
    step started) are given back now, on the thread that runs the step, rather than when the step
    ends. A 1,500-token prefill on two borrowed cores runs for a second or more, and a decode step
    beside it shared its own core with the prefill's second thread all that time (issue 45: the
    steady streams' ITL during bursts)."""
    threads = lease.acquire(borrows=True)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
