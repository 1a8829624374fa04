"""The order in which waiting prompts start: shortest remaining prefill first, aged.

Arrival order lets one long prompt hold every short one behind it for all of its
chunks, and the short ones are most of the requests and so most of the TTFT
percentiles (issue 22: TTFT p99 1.3-1.4x vLLM's). Shortest first bounds the short
ones' wait; alone it would starve a long prompt under a steady stream of short
ones, so a prompt's rank improves with the time it has waited: each second of
waiting counts as `aging_tokens_per_s` tokens fewer. A prompt of L tokens is then
passed over by shorter ones for at most L / aging_tokens_per_s seconds.

Requests that already ran (a preempted one, whose recompute goes first so that
its stream resumes) keep their place at the head, in the order they are in.

`prefill_rank` and `admission_order` are pure (the clock is passed in); the
engine loop applies the order to the scheduler's queue between steps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

# About one core's prefill rate for a small model (SmolLM2-135M in bf16: ~450-500 tokens/s on one
# core): a prompt is passed over for at most about as long as it takes to prefill itself.
AGING_TOKENS_PER_S = 500.0


class Waiting(NamedTuple):
    """What the order reads of one waiting request."""

    remaining_tokens: int  # prompt tokens still to compute
    waited_s: float  # since it was admitted to the queue
    resumed: bool  # it ran before (preempted): it keeps its place at the head


def prefill_rank(w: Waiting, aging_tokens_per_s: float = AGING_TOKENS_PER_S) -> float:
    """Lower starts first: the tokens left, less what the wait has earned."""
    return w.remaining_tokens - aging_tokens_per_s * w.waited_s


def admission_order(waiting: Seq[Waiting], aging_tokens_per_s: float = AGING_TOKENS_PER_S) -> list[int]:
    """Indices into `waiting` in the order they should start: the resumed ones first as they are,
    then the rest by rank (ties in arrival order, so equal prompts stay first come, first served)."""
    resumed = [i for i, w in enumerate(waiting) if w.resumed]
    fresh = [i for i, w in enumerate(waiting) if not w.resumed]
    fresh.sort(key=lambda i: (prefill_rank(waiting[i], aging_tokens_per_s), i))
    return resumed + fresh
