"""What the engine counts and times for metrics, with no metrics library in it.

Each request carries its timestamps (`RequestTimes`, on its Sequence); the
scheduler tells a `StatsRecorder` as a request is scheduled, gets a token and
finishes, and the recorder gathers one `IterationStats` (vLLM's name and shape:
token counts, TTFTs, ITLs, finished requests) that the engine loop drains after
every step for the worker's Prometheus side (workers/common/metrics.py). Gauges
(running, waiting, KV usage) are not here: they are the scheduler's snapshot,
`SchedulerStats`.

Every time is the engine's own view. A decode worker that receives a request's
KV from a prefill worker counts that request's queue from its reservation to
the arrival of its KV (when it joins the running batch), its first token is the
prefill worker's (known on arrival, not sampled here), and its prefill time is 0.

The clock is passed in (`time.monotonic` in a worker, a fake in tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

Clock = Callable[[], float]


@dataclass(slots=True)
class RequestTimes:
    """One request's timestamps on the engine's clock."""

    arrival: float  # admitted: `add_request` or `reserve`
    scheduled: float | None = None  # first ran (local prefill) or its remote KV arrived
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0  # tokens that joined it here, a remote first token included


class TimedRequest(Protocol):
    """What the recorder reads and writes of a request: an engine's Sequence (engine/sequence.py,
    which carries a RequestTimes and so stands on this module, not under it)."""

    times: RequestTimes
    num_prompt_tokens: int

    def __len__(self) -> int: ...  # prompt and output tokens so far


class FinishedRequest(NamedTuple):
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int  # tokens that joined it here (a remote first token included)
    e2e_latency: float  # arrival to finish
    queue_time: float | None  # arrival to first scheduled; None: never scheduled
    prefill_time: float | None  # first scheduled to first token; None: no first token
    decode_time: float | None  # first token to last token; None: no first token
    time_per_output_token: float | None  # decode_time per token after the first; None below 2 tokens


@dataclass
class IterationStats:
    """What happened since the last drain (normally one engine step)."""

    prompt_tokens: int = 0  # context tokens of requests whose first token this engine sampled
    generation_tokens: int = 0  # tokens this engine sampled
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at allocation
    prefix_cache_hits: int = 0  # of those, found cached
    ttfts: list[float] = field(default_factory=list)  # arrival to first token
    itls: list[float] = field(default_factory=list)  # between two tokens of one request
    finished: list[FinishedRequest] = field(default_factory=list)
    draft_tokens: int = 0  # speculation (engine/spec/): draft tokens the target verified
    accepted_draft_tokens: int = 0  # of those, accepted (each one a decode step saved)

    @property
    def empty(self) -> bool:
        return not (
            self.prompt_tokens
            or self.generation_tokens
            or self.prefix_cache_queries
            or self.ttfts
            or self.itls
            or self.finished
            or self.draft_tokens
        )


class StatsRecorder:
    """The scheduler's notes for metrics; not thread-safe (the engine thread owns it)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._it = IterationStats()

    def prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        self._it.prefix_cache_queries += num_tokens
        self._it.prefix_cache_hits += num_cached_tokens

    def scheduled(self, seq: TimedRequest) -> None:
        """`seq` runs (a preempted one runs again: its first time stays)."""
        if seq.times.scheduled is None:
            seq.times.scheduled = self.clock()

    def token(self, seq: TimedRequest, sampled: bool) -> None:
        """A token has joined `seq`; `sampled`: this engine drew it (not a remote prefill's first token)."""
        now = self.clock()
        t = seq.times
        if t.first_token is None:
            t.first_token = now
            self._it.ttfts.append(now - t.arrival)
            if sampled:
                self._it.prompt_tokens += len(seq) - 1  # the context the first token came from
        elif t.last_token is not None:
            self._it.itls.append(now - t.last_token)
        t.last_token = now
        t.num_tokens += 1
        if sampled:
            self._it.generation_tokens += 1

    def drafts(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` draft tokens and accepted `accepted` of them."""
        self._it.draft_tokens += drafted
        self._it.accepted_draft_tokens += accepted

    def finished(self, seq: TimedRequest, reason: str) -> None:
        now = self.clock()
        t = seq.times
        queue = prefill = decode = tpot = None
        if t.scheduled is not None:
            queue = t.scheduled - t.arrival
        if t.first_token is not None and t.last_token is not None:
            prefill = t.first_token - (t.scheduled if t.scheduled is not None else t.arrival)
            decode = t.last_token - t.first_token
            if t.num_tokens > 1:
                tpot = decode / (t.num_tokens - 1)
        self._it.finished.append(
            FinishedRequest(reason, seq.num_prompt_tokens, t.num_tokens, now - t.arrival, queue, prefill, decode, tpot)
        )

    def drain(self) -> IterationStats:
        it, self._it = self._it, IterationStats()
        return it
