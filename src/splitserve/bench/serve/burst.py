"""The interference scenario: steady streams (short prompts, long answers,
each restarted as it finishes) run the whole time, and every `interval_s` a
burst of long prompts arrives at once. What it measures is how much a burst's
prefill slows the tokens of requests already decoding: the steady streams' ITL
inside burst windows against the quiet spells (`metrics.burst_summary`).

A burst window runs from sending the burst until its last request's first
token. The schedule is quiet spell, burst, quiet spell, burst, ..., quiet
spell; the steady streams finish the request they are on and stop after it.
"""

from __future__ import annotations

import asyncio

from splitserve.bench.serve.backends import Backend
from splitserve.bench.serve.datasets import BurstPlan, Session
from splitserve.bench.serve.driver import Clock, RunRecords, run_session
from splitserve.bench.serve.progress import Progress
from splitserve.measure.results import RequestRecord


async def run_bursts(
    backend: Backend, plan: BurstPlan, interval_s: float, clock: Clock, progress: Progress
) -> tuple[RunRecords, list[tuple[float, float]]]:
    """Returns the records (steady and burst) and the burst windows, in seconds from the start."""
    t0 = clock.now()
    stop = asyncio.Event()
    records: list[RequestRecord] = []

    async def steady(session: Session) -> None:
        while not stop.is_set():
            got = await run_session(backend, session, t0, progress.update)
            records.extend(got)
            if not all(r.ok for r in got):
                return  # a failing server: counting more failures says nothing more

    async def one_burst(sessions: list[Session]) -> tuple[float, float]:
        sent = clock.now() - t0
        done = await asyncio.gather(*(run_session(backend, s, t0, progress.update) for s in sessions))
        burst = [r for rs in done for r in rs]
        records.extend(burst)
        # the window closes at the last first token (of those that got one)
        return sent, max((r.start_s + r.ttft_s for r in burst if r.ok), default=sent)

    streams = [asyncio.create_task(steady(s)) for s in plan.steady]
    bursts: list[asyncio.Task[tuple[float, float]]] = []
    try:
        for sessions in plan.bursts:
            await clock.sleep(interval_s)  # the quiet spell before it: this is the schedule, not a wait for state
            bursts.append(asyncio.create_task(one_burst(sessions)))
        windows = list(await asyncio.gather(*bursts))
        await clock.sleep(interval_s)  # the last quiet spell
    finally:
        stop.set()
        await asyncio.gather(*streams)
    duration = clock.now() - t0
    return RunRecords(sorted(records, key=lambda r: r.start_s), duration), windows
