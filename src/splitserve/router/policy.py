"""Routing as named pure functions: which decode worker, local or remote
prefill, which prefill worker.

The decode worker's cost is in one unit, tokens (as in Dynamo's KV router), with
the weight and block size from `RoutingConfig`:

    cost(w) = prefill_weight * uncached_prefill_tokens(w)   what w would have to prefill
              + queued_and_running_tokens(w)                the work w already has
              + kv_shortfall_tokens(w)                      the request's new KV that finds no free block on w

A worker whose context continues in a tier behind its pool (host RAM, disk:
engine/kv_tiers.py) is priced by the seconds until that context is in its pool
(`engine/tier_cost.prefix_cost`: each tier block loaded where that beats
recomputing it, at the worker's own measured bandwidths and prefill speed),
expressed in tokens of prefill at its speed: a tier hit is neither free nor a
full recompute. The tokens the chosen worker still has to prefill (past its pool
and its loads) are computed once and reused by the local-or-remote prefill
decision, which so weighs the same seconds (a tier load happens on the decode
worker either way; only the rest can move to a prefill worker). A `DecodeChooser`, selected once from config,
turns the candidates into a choice: `KvAwareChooser` (the cost above) or
`RoundRobinChooser` (the baseline that ignores caches and load).

Every term is a function of plain numbers or of the one config section it
reads; the only randomness (tie-breaking, softmax sampling) comes from the
`random.Random` passed in, so tests are exact. Each decision logs its formula
with the numbers filled in at debug level.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple, Protocol

from splitserve.engine.blocks import cdiv
from splitserve.engine.tier_cost import TierSpeeds, prefix_cost
from splitserve.router.config import RoutingConfig
from splitserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

PrefillMode = Literal["local", "remote"]


class WorkerLoad(NamedTuple):
    """A worker's last reported load (its WorkerStats), plus what the router sent since."""

    queued_tokens: int
    running_tokens: int
    free_blocks: int
    total_blocks: int
    speeds: TierSpeeds = TierSpeeds()  # its measured prefill speed and tier bandwidths (WorkerStats)
    running_requests: int = 0  # requests it decodes now: the streams a local prefill would stall

    @property
    def work_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


class DecodeCandidate(NamedTuple):
    worker: str
    overlap_blocks: int  # leading prompt blocks already in the worker's prefix cache
    uncached_tokens: int  # context tokens past them (and past its tier loads): what it would have to prefill
    load: WorkerLoad
    loaded_blocks: int = 0  # blocks after the cached ones it would load from a tier behind its pool
    prefill_tokens: float | None = None  # seconds until the context is in its pool, in its prefill tokens


class DecodeChoice(NamedTuple):
    worker: str
    overlap_blocks: int
    uncached_tokens: int
    cost: float  # tokens; 0 from the round-robin baseline, which prices nothing


class Route(NamedTuple):
    worker: str  # the decode worker
    mode: PrefillMode
    overlap_blocks: int
    uncached_tokens: int  # tokens the chosen worker would have to prefill


# ---- the cost's terms, all in tokens


def uncached_prefill_tokens(num_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Context tokens past the worker's cached prefix: what it (or a prefill worker for it) must prefill."""
    return max(0, num_tokens - overlap_blocks * block_size)


def queued_and_running_tokens(load: WorkerLoad) -> int:
    """The work the worker already has: prompts waiting for prefill plus the contexts it decodes."""
    return load.work_tokens


def kv_shortfall_tokens(uncached_tokens: int, free_blocks: int, block_size: int) -> int:
    """Tokens of the request's new KV for which the worker has no free block (cached, evictable
    blocks count as free): the request waits for running ones to finish, or is turned away.
    Zero while the worker has room, then grows block by block as its free blocks run out."""
    needed_blocks = cdiv(uncached_tokens, block_size)
    return max(0, needed_blocks - free_blocks) * block_size


def decode_cost(prefill_tokens: float, work_tokens: int, shortfall_tokens: int, prefill_weight: float) -> float:
    """Lower is better; every term in tokens."""
    return prefill_weight * prefill_tokens + work_tokens + shortfall_tokens


def pick(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """The index of the cheapest cost (ties broken by rng), or with temperature > 0 a softmax draw
    over -cost/T (T in the costs' unit)."""
    best = min(costs)
    if temperature == 0.0:
        tied = [i for i, c in enumerate(costs) if c == best]
        return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    weights = [math.exp(-(c - best) / temperature) for c in costs]
    r = rng.random() * sum(weights)
    for i, wt in enumerate(weights):
        r -= wt
        if r < 0:
            return i
    return len(weights) - 1


# ---- choosing the decode worker


class DecodeChooser(Protocol):
    def choose(self, candidates: Sequence[DecodeCandidate], rng: random.Random) -> DecodeChoice:
        """One of `candidates` (never empty)."""
        ...


class KvAwareChooser:
    """The cheapest candidate by the token cost (or a softmax draw with temperature > 0)."""

    def __init__(self, routing: RoutingConfig) -> None:
        self.routing = routing

    def choose(self, candidates: Sequence[DecodeCandidate], rng: random.Random) -> DecodeChoice:
        if not candidates:
            raise ValueError("no decode worker to choose from")
        r = self.routing
        costs = []
        for c in candidates:
            work = queued_and_running_tokens(c.load)
            new_kv = c.uncached_tokens + c.loaded_blocks * r.block_size  # loaded blocks take pool blocks too
            shortfall = kv_shortfall_tokens(new_kv, c.load.free_blocks, r.block_size)
            prefill = c.uncached_tokens if c.prefill_tokens is None else c.prefill_tokens
            cost = decode_cost(prefill, work, shortfall, r.prefill_weight)
            costs.append(cost)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "decode %s: cost = %g*uncached(%d) + load(%d queued + %d running) "
                    "+ shortfall(%d*max(0, %d blocks - %d free)) = %g",
                    c.worker,
                    r.prefill_weight,
                    c.uncached_tokens,
                    c.load.queued_tokens,
                    c.load.running_tokens,
                    r.block_size,
                    cdiv(c.uncached_tokens, r.block_size),
                    c.load.free_blocks,
                    cost,
                )
        i = pick(costs, r.temperature, rng)
        chosen = candidates[i]
        log.debug(
            "decode choice: %s (cost %g of %d candidates, T=%g)", chosen.worker, costs[i], len(costs), r.temperature
        )
        return DecodeChoice(chosen.worker, chosen.overlap_blocks, chosen.uncached_tokens, costs[i])


def round_robin(workers: Sequence[str], turn: int) -> str:
    """The baseline: workers in address order, one request each in turn."""
    ordered = sorted(workers)
    return ordered[turn % len(ordered)]


class RoundRobinChooser:
    """The baseline that ignores caches and load; it counts its own turns, so keep one per router."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[DecodeCandidate], rng: random.Random) -> DecodeChoice:
        if not candidates:
            raise ValueError("no decode worker to choose from")
        by_worker = {c.worker: c for c in candidates}
        chosen = by_worker[round_robin(list(by_worker), self.turn)]
        log.debug(
            "decode choice: %s (round robin, turn %d of %d candidates)", chosen.worker, self.turn, len(candidates)
        )
        self.turn += 1
        return DecodeChoice(chosen.worker, chosen.overlap_blocks, chosen.uncached_tokens, 0.0)


def decode_chooser(routing: RoutingConfig) -> DecodeChooser:
    """The chooser routing.decode_policy names; select it once (the round-robin one keeps state)."""
    if routing.decode_policy == "round_robin":
        return RoundRobinChooser()
    return KvAwareChooser(routing)


# ---- local or remote prefill, and which prefill worker


def ttft_saved_tokens(prefill_queue_tokens: int, decode_queue_tokens: int) -> int:
    """What a local prefill saves the new request's TTFT, in prefill tokens: the remote one starts
    after the prefill pool's queue, the local one after the decode worker's own."""
    return prefill_queue_tokens - decode_queue_tokens


def decode_stall_tokens(uncached_tokens: int, decode_running: int) -> int:
    """What a local prefill costs the decode worker's running streams, in prefill tokens: each of them
    waits out the prompt's prefill (its chunks share the steps), a stall in every one's ITL."""
    return uncached_tokens * decode_running


def choose_prefill_mode(
    uncached_tokens: int,
    prefill_queue_tokens: int,
    decode_queue_tokens: int,
    routing: RoutingConfig,
    decode_running: int = 0,
) -> PrefillMode:
    """Local when disaggregation costs more than it saves: a short uncached suffix (the KV transfer
    and the second hop cost more than the prefill itself), or a prefill pool so backed up that it
    could not start this prompt before the decode worker had finished it (`prefill_queue_tokens`:
    the least-queued prefill worker's; `decode_queue_tokens`: the decode worker's own prompt tokens
    yet to prefill). The second is Dynamo's prefill-load rule and llm-d's decider: a disaggregated
    prompt that waits in a queue pays for its ITL protection in TTFT, past what the SLO allows. It
    holds only while the TTFT it saves outweighs the stall it puts on the decode worker's
    `decode_running` streams (`routing.decode_stall_weight` per stalled stream's token; issue 22:
    with a 700-token backlog and no such weight, the second prompt of a burst went local and
    stalled four steady streams for its whole prefill)."""
    if routing.mode == "colocated":
        mode: PrefillMode = "local"
        why = "mode=colocated"
    elif routing.mode == "disaggregated":
        mode, why = "remote", "mode=disaggregated"
    else:
        short = uncached_tokens <= routing.local_prefill_max_tokens
        saved = ttft_saved_tokens(prefill_queue_tokens, decode_queue_tokens)
        stall = routing.decode_stall_weight * decode_stall_tokens(uncached_tokens, decode_running)
        backed_up = (
            prefill_queue_tokens >= routing.prefill_backlog_tokens
            and decode_queue_tokens + uncached_tokens <= prefill_queue_tokens
            and saved >= stall
        )
        mode = "local" if short or backed_up else "remote"
        why = (
            (
                f"uncached {uncached_tokens} <= {routing.local_prefill_max_tokens} is {short}; "
                f"prefill queue {prefill_queue_tokens} >= {routing.prefill_backlog_tokens} and decode queue "
                f"{decode_queue_tokens} + {uncached_tokens} <= it and TTFT saved {saved} >= stall "
                f"{routing.decode_stall_weight:g} x {uncached_tokens} x {decode_running} running is {backed_up}"
            )
            if log.isEnabledFor(logging.DEBUG)
            else ""
        )
    if log.isEnabledFor(logging.DEBUG):
        log.debug("prefill mode %s: %s", mode, why)
    return mode


def choose_prefill_worker(queued_tokens: Mapping[str, int], rng: random.Random) -> str:
    """The prefill worker with the fewest queued tokens (ties broken by rng)."""
    if not queued_tokens:
        raise ValueError("no prefill worker to choose from")
    least = min(queued_tokens.values())
    tied = [w for w, q in queued_tokens.items() if q == least]
    chosen = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    log.debug("prefill worker %s: queued %d tokens = least of %d", chosen, least, len(queued_tokens))
    return chosen


# ---- the terms together


def decode_candidates(
    hashes: Sequence[bytes],
    num_tokens: int,
    index: PrefixIndex,
    decode_loads: Mapping[str, WorkerLoad],
    block_size: int,
    tier_aware: bool = True,
) -> list[DecodeCandidate]:
    """Each decode worker with what it holds of the context: its pooled prefix, the tier blocks it
    would load, the tokens left to prefill, and the seconds of all that in its prefill tokens."""
    where = index.overlap_tiers(hashes, {w: load.speeds.order for w, load in decode_loads.items()})
    out = []
    for w, load in decode_loads.items():
        cost = prefix_cost(where.get(w, []), num_tokens, block_size, load.speeds, tier_aware)
        speed = load.speeds.prefill_tokens_per_s
        prefill = cost.equivalent_tokens(speed) if cost.loaded_blocks else None
        out.append(DecodeCandidate(w, cost.pool_blocks, cost.compute_tokens, load, cost.loaded_blocks, prefill))
    return out


def route(
    hashes: Sequence[bytes],
    num_tokens: int,
    index: PrefixIndex,
    decode_loads: Mapping[str, WorkerLoad],
    prefill_queued_tokens: Mapping[str, int],
    routing: RoutingConfig,
    rng: random.Random,
    chooser: DecodeChooser | None = None,
    tier_aware: bool | None = None,
) -> Route:
    """One routing decision: the decode worker, then local or remote prefill for it.

    `num_tokens` is the context length (prompt plus any tokens already generated);
    `hashes` its full blocks' chained hashes. With no prefill worker, prefill is local.
    `chooser`: the router's own (selected once from `routing`; the round-robin one counts
    its turns); None makes one for this decision alone. `tier_aware` (default: `routing.tier_aware`)
    False: the blocks behind the workers' pools count as uncached (the tier-blind baseline).
    """
    if chooser is None:
        chooser = decode_chooser(routing)
    aware = routing.tier_aware if tier_aware is None else tier_aware
    candidates = decode_candidates(hashes, num_tokens, index, decode_loads, routing.block_size, aware)
    choice = chooser.choose(candidates, rng)
    if prefill_queued_tokens:
        chosen = decode_loads[choice.worker]
        mode = choose_prefill_mode(
            choice.uncached_tokens,
            min(prefill_queued_tokens.values()),
            chosen.queued_tokens,
            routing,
            chosen.running_requests,
        )
    else:
        mode = "local"
    return Route(choice.worker, mode, choice.overlap_blocks, choice.uncached_tokens)
