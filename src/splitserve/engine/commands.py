"""What the workers' gRPC handlers ask of the engine thread, as plain data.

Work enters the engine thread as typed commands (vLLM's EngineCoreRequestType
ADD/ABORT, mini-sglang's typed messages), not as closures written inside the
services: `EngineLoop.submit(command)` queues one, the loop runs it between
steps in the order submitted, and the returned Future answers it. So an `Abort`
submitted after an `Admit` always finds what that admission admitted.

Admission is bounded (`waiting_limit` of the loop): a request that cannot start
at once waits in the scheduler's queue for a seat (`max_num_seqs`) or for KV
blocks. Past a short queue, waiting only turns overload into missed deadlines
for everyone queued, so `Admit` refuses at once (`QueueFull`: RESOURCE_EXHAUSTED;
the router tries another worker, and answers the client 429 when every one is
full). The check runs on the engine thread, in the command that queues the
request, so the count is exact; the seats are the scheduler's
(`Scheduler.waiting_for_seat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from splitserve.engine.handoff import SampleState
from splitserve.engine.prefill_order import NO_TENANT, Share
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.stats import RequestTimes


class QueueFull(Exception):
    """The worker's waiting queue is at its limit: RESOURCE_EXHAUSTED, try elsewhere or later."""


@dataclass(frozen=True)
class Admit:
    """Queue a request that this engine prefills: locally (decode role) or prefill-only (prefill
    role: it finishes after its first token and is held until its KV send ends). Answers
    `Admitted`; raises QueueFull past the waiting limit, ValueError for what the engine refuses
    (DuplicateRequest for an id it still holds)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    prior: list[int] = field(default_factory=list)  # output generated elsewhere before (migration)
    prefill_only: bool = False
    # a request of several samples handed over (n > 1 migrated): each one's output so far
    samples: list[SampleState] = field(default_factory=list)
    transfer_id: bytes = b""  # prefill role: the ticket of the reservation its KV goes to
    share: Share = NO_TENANT  # whose it is: the prefill order shares prefill tokens across tenants


@dataclass(frozen=True)
class Reserve:
    """Decode role: admit a request whose context KV a prefill worker writes into blocks reserved
    now. Answers `Admitted` (with the connector's transfer), or None without a free seat or
    enough free blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    lease_s: float  # how long the reservation waits for its KV
    prior: list[int] = field(default_factory=list)
    sample_index: int = 0  # the sample `prior` belongs to


@dataclass(frozen=True)
class Abort:
    """End the request wherever it is and free its blocks (a reserved one's once no transfer can
    write them). Answers whether it was found."""

    request_id: str
    # only if the request's transfer is this one: a prefill call's cleanup never touches a newer
    # request that reuses the id (None: whichever request holds the id)
    transfer_id: bytes | None = None
    sample_index: int | None = None  # only this sample of an n > 1 request (None: all of it)


Command = Admit | Reserve | Abort


class Admitted(NamedTuple):
    """What an admission answers."""

    times: RequestTimes  # the engine's timestamps of the request, set as it runs (engine/stats.py)
    num_cached_tokens: int  # context tokens the prefix cache holds now (0 for a prefill-only request)
    transfer: Any = None  # Reserve: the connector's record, for the prefill worker
