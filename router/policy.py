"""Routing as named pure functions: which decode worker, local or remote
prefill, which prefill worker.

Every term is a function of plain numbers and the frozen RouterConfig; the only
randomness (tie-breaking, softmax sampling) comes from the `random.Random`
passed in, so tests are exact. Each decision logs its formula with the numbers
filled in at debug level.

    cost(w) = load_weight * load_score(w) - overlap_weight * overlap_score(w)
    load_score(w)    = token_load_weight * (queued + running) / load_token_scale
                       + block_load_weight * (1 - free_blocks / total_blocks)
    overlap_score(w) = cached leading blocks / prompt blocks
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from splitserve.router.config import RouterConfig
from splitserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

PrefillMode = Literal["local", "remote"]


class WorkerLoad(NamedTuple):
    """A worker's last reported load (its WorkerStats), plus what the router sent since."""

    queued_tokens: int
    running_tokens: int
    free_blocks: int
    total_blocks: int

    @property
    def work_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


class DecodeCandidate(NamedTuple):
    worker: str
    overlap_blocks: int  # leading prompt blocks already in the worker's prefix cache
    load: WorkerLoad


class DecodeChoice(NamedTuple):
    worker: str
    overlap_blocks: int
    cost: float


class Route(NamedTuple):
    worker: str  # the decode worker
    mode: PrefillMode
    overlap_blocks: int
    uncached_tokens: int  # tokens the chosen worker would have to prefill


def overlap_score(overlap_blocks: int, prompt_blocks: int) -> float:
    """Fraction of the prompt's full blocks already cached on the worker, in [0, 1]."""
    if prompt_blocks <= 0:
        return 0.0
    return min(overlap_blocks, prompt_blocks) / prompt_blocks


def load_score(load: WorkerLoad, cfg: RouterConfig) -> float:
    """Work queued and running (in units of load_token_scale) plus the used-block fraction."""
    used = 1.0 if load.total_blocks <= 0 else 1.0 - load.free_blocks / load.total_blocks
    return cfg.token_load_weight * load.work_tokens / cfg.load_token_scale + cfg.block_load_weight * used


def decode_cost(overlap: float, load: float, cfg: RouterConfig) -> float:
    """Lower is better."""
    return cfg.load_weight * load - cfg.overlap_weight * overlap


def choose_decode_worker(
    candidates: Sequence[DecodeCandidate], prompt_blocks: int, cfg: RouterConfig, rng: random.Random
) -> DecodeChoice:
    """The cheapest candidate (ties broken by rng), or with temperature > 0 a softmax draw over -cost/T."""
    if not candidates:
        raise ValueError("no decode worker to choose from")
    costs = []
    for c in candidates:
        ov = overlap_score(c.overlap_blocks, prompt_blocks)
        ld = load_score(c.load, cfg)
        cost = decode_cost(ov, ld, cfg)
        costs.append(cost)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decode %s: cost = %g*load(%g*%d/%g + %g*(1 - %d/%d) = %.4f) - %g*overlap(%d/%d = %.4f) = %.4f",
                c.worker, cfg.load_weight, cfg.token_load_weight, c.load.work_tokens, cfg.load_token_scale, cfg.block_load_weight,
                c.load.free_blocks, c.load.total_blocks, ld, cfg.overlap_weight, c.overlap_blocks,
                prompt_blocks, ov, cost,
            )
    best = min(costs)
    if cfg.temperature == 0.0:
        tied = [i for i, c in enumerate(costs) if c - best <= 1e-12]
        i = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    else:
        weights = [math.exp(-(c - best) / cfg.temperature) for c in costs]
        r = rng.random() * sum(weights)
        i = len(weights) - 1
        for j, wt in enumerate(weights):
            r -= wt
            if r < 0:
                i = j
                break
    chosen = candidates[i]
    log.debug("decode choice: %s (cost %.4f of %d candidates, T=%g)", chosen.worker, costs[i], len(costs), cfg.temperature)
    return DecodeChoice(chosen.worker, chosen.overlap_blocks, costs[i])


def choose_prefill_mode(
    uncached_tokens: int, prefill_queue_tokens: int, decode_worker_idle: bool, cfg: RouterConfig
) -> PrefillMode:
    """Local when disaggregation costs more than it saves: a short uncached suffix,
    or a backed-up prefill pool while the decode worker has nothing else to do."""
    if cfg.mode == "colocated":
        mode: PrefillMode = "local"
        why = "mode=colocated"
    elif cfg.mode == "disaggregated":
        mode, why = "remote", "mode=disaggregated"
    else:
        short = uncached_tokens <= cfg.local_prefill_max_tokens
        backed_up = prefill_queue_tokens >= cfg.prefill_backlog_tokens and decode_worker_idle
        mode = "local" if short or backed_up else "remote"
        why = (
            f"uncached {uncached_tokens} <= {cfg.local_prefill_max_tokens} is {short}; "
            f"prefill queue {prefill_queue_tokens} >= {cfg.prefill_backlog_tokens} and decode idle "
            f"{decode_worker_idle} is {backed_up}"
        ) if log.isEnabledFor(logging.DEBUG) else ""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("prefill mode %s: %s", mode, why)
    return mode


def is_idle(load: WorkerLoad, cfg: RouterConfig) -> bool:
    return load.work_tokens <= cfg.decode_idle_tokens


def choose_prefill_worker(queued_tokens: Mapping[str, int], rng: random.Random) -> str:
    """The prefill worker with the fewest queued tokens (ties broken by rng)."""
    if not queued_tokens:
        raise ValueError("no prefill worker to choose from")
    least = min(queued_tokens.values())
    tied = [w for w, q in queued_tokens.items() if q == least]
    chosen = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    log.debug("prefill worker %s: queued %d tokens = least of %d", chosen, least, len(queued_tokens))
    return chosen


def round_robin(workers: Sequence[str], turn: int) -> str:
    """The baseline: workers in address order, one request each in turn."""
    ordered = sorted(workers)
    return ordered[turn % len(ordered)]


def route(
    hashes: Sequence[bytes],
    num_tokens: int,
    index: PrefixIndex,
    decode_loads: Mapping[str, WorkerLoad],
    prefill_queued_tokens: Mapping[str, int],
    cfg: RouterConfig,
    rng: random.Random,
    turn: int = 0,
) -> Route:
    """One routing decision: the decode worker, then local or remote prefill for it.

    `num_tokens` is the context length (prompt plus any tokens already generated);
    `hashes` its full blocks' chained hashes. With no prefill worker, prefill is local.
    `turn` counts the router's decisions (the round-robin baseline uses it).
    """
    overlaps = index.overlap(hashes)
    if cfg.decode_policy == "round_robin":
        w = round_robin(list(decode_loads), turn)
        choice = DecodeChoice(w, overlaps.get(w, 0), 0.0)
    else:
        candidates = [DecodeCandidate(w, overlaps.get(w, 0), load) for w, load in decode_loads.items()]
        choice = choose_decode_worker(candidates, len(hashes), cfg, rng)
    uncached = num_tokens - choice.overlap_blocks * cfg.block_size
    if prefill_queued_tokens:
        mode = choose_prefill_mode(
            uncached, min(prefill_queued_tokens.values()), is_idle(decode_loads[choice.worker], cfg), cfg
        )
    else:
        mode = "local"
    return Route(choice.worker, mode, choice.overlap_blocks, uncached)
