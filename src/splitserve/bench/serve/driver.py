"""Runs one load level: sessions start at their arrival times (at most
`max_concurrency` in flight), each sends its turns one after another, and
every request's record is collected.

A conversation's next turn carries the previous answer as the assistant's
message, so its prompt opens with everything the server has just seen (what a
prefix cache is for). The clock and the sleep are passed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from splitserve.bench.serve.backends import Backend, Prompt
from splitserve.bench.serve.datasets import Session, Turn
from splitserve.bench.serve.progress import Progress
from splitserve.measure.results import RequestRecord


class Clock(NamedTuple):
    now: Callable[[], float]  # seconds, monotonic
    sleep: Callable[[float], Awaitable[None]]


class RunRecords(NamedTuple):
    records: list[RequestRecord]
    duration_s: float  # first send -> last answer


def prompt_for(session: Session, history: Sequence[tuple[str, str]], turn: Turn) -> Prompt:
    """The request for `turn`, after the (user, answer) pairs already exchanged in the session."""
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for user, answer in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turn.user})
    # the completions form: the same content in order, so a shared system prompt is still a shared prefix
    text = "".join(m["content"] + "\n" for m in messages[:-1]) + turn.user
    return Prompt(messages, text, turn.prompt_len, turn.output_len, turn.tag)


async def run_session(
    backend: Backend,
    session: Session,
    t0: float,
    on_done: Callable[[bool], None],
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> list[RequestRecord]:
    """The session's turns in order; `sleep` waits the user's think time between an answer and the next turn."""
    records: list[RequestRecord] = []
    history: list[tuple[str, str]] = []
    for i, turn in enumerate(session.turns):
        if i and session.think_s > 0 and sleep is not None:
            await sleep(session.think_s)
        out = await backend.send(prompt_for(session, history, turn), t0)
        records.append(out.record)
        on_done(out.record.ok)
        if not out.record.ok:
            break  # the next turn would carry a broken answer; its requests are not sent
        history.append((turn.user, out.text))
    return records


async def run_load(
    backend: Backend,
    sessions: Sequence[Session],
    offsets_s: Sequence[float],
    max_concurrency: int | None,
    clock: Clock,
    progress: Progress,
) -> RunRecords:
    """Start session i at offsets_s[i] from now; returns every record, in send order."""
    if len(offsets_s) != len(sessions):
        raise ValueError("one arrival offset per session")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = clock.now()

    async def one(session: Session, at: float) -> list[RequestRecord]:
        wait = t0 + at - clock.now()
        if wait > 0:
            await clock.sleep(wait)
        if limit is None:
            return await run_session(backend, session, t0, progress.update, clock.sleep)
        async with limit:
            return await run_session(backend, session, t0, progress.update, clock.sleep)

    done = await asyncio.gather(*(one(s, at) for s, at in zip(sessions, offsets_s, strict=True)))
    duration = clock.now() - t0
    records = sorted((r for rs in done for r in rs), key=lambda r: r.start_s)
    return RunRecords(records, duration)
