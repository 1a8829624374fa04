"""The order in which waiting prompts start: by priority band, fairly across tenants, and within
a tenant shortest remaining prefill first, aged.

Arrival order lets one long prompt hold every short one behind it for all of its
chunks, and the short ones are most of the requests and so most of the TTFT
percentiles (issue 22: TTFT p99 1.3-1.4x vLLM's). Shortest first bounds the short
ones' wait; alone it would starve a long prompt under a steady stream of short
ones, so a prompt's rank improves with the time it has waited: each second of
waiting counts as `aging_tokens_per_s` tokens fewer. A prompt of L tokens is then
passed over by shorter ones for at most L / aging_tokens_per_s seconds.

Requests that already ran (a preempted one, whose recompute goes first so that
its stream resumes) keep their place at the head, in the order they are in.

Tenants (the router's, carried to the worker in each request's `Share`): a
higher band goes first, wholly. Within a band, prefill tokens are shared by
weight: each tenant's prompt tokens started lately (`RecentTokens`, decayed
over seconds) over its weight is its virtual time, and the next prompt is the
best-ranked one of the tenant furthest behind, its tokens then added to that
tenant's time (weighted fair queueing by token cost). So a tenant sending ten
times the others' prompts queues behind its own backlog, not theirs, without
the worker knowing any tenant's rate in advance. With one tenant the order is
the rank order above.

Within a step (`spend_step_budget`): the running requests take their tokens
first, then waiting prompts start while the budget allows. With a long-prefill
threshold, a short prompt at the head of the queue goes before the long
prefills in progress, which then take what the step has left: a short prompt
behind a long one would otherwise wait out all of the long one's chunks.

Everything here is pure (the clock is passed in, the scheduler's and the
simulator's own actions are passed as calls): engine/scheduler.py orders its
queue and spends each step's budget with it, and plan/sim/worker.py does the
same, so the simulated order is the served one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import NamedTuple, TypeVar

T = TypeVar("T")

# About one core's prefill rate for a small model (SmolLM2-135M in bf16: ~450-500 tokens/s on one
# core): a prompt is passed over for at most about as long as it takes to prefill itself.
AGING_TOKENS_PER_S = 500.0

PREFILL_ORDERS = ("shortest", "arrival")  # --prefill-order: shortest remaining first, aged; or arrival order


class Share(NamedTuple):
    """Whose request it is: the tenant the router found from its key, the tenant's weight, and the
    request's priority band (0 high, 1 normal, 2 low: router/tenants.py)."""

    tenant: str = ""
    weight: float = 1.0
    band: int = 1


NO_TENANT = Share()


class Waiting(NamedTuple):
    """What the order reads of one waiting request."""

    remaining_tokens: int  # prompt tokens still to compute
    waited_s: float  # since it was admitted to the queue
    resumed: bool  # it ran before (preempted): it keeps its place at the head
    share: Share = NO_TENANT


def prefill_rank(w: Waiting, aging_tokens_per_s: float = AGING_TOKENS_PER_S) -> float:
    """Lower starts first: the tokens left, less what the wait has earned."""
    return w.remaining_tokens - aging_tokens_per_s * w.waited_s


def admission_order(
    waiting: Seq[Waiting], aging_tokens_per_s: float = AGING_TOKENS_PER_S, served: Mapping[str, float] | None = None
) -> list[int]:
    """Indices into `waiting` in the order they should start: the resumed ones first as they are,
    then the rest by band, fairly across tenants (`served`: each tenant's prompt tokens started
    lately, RecentTokens), each tenant's by rank (ties in arrival order, so equal prompts stay
    first come, first served)."""
    resumed = [i for i, w in enumerate(waiting) if w.resumed]
    fresh = [i for i, w in enumerate(waiting) if not w.resumed]
    rank = {i: prefill_rank(waiting[i], aging_tokens_per_s) for i in fresh}
    fresh.sort(key=lambda i: (rank[i], i))
    if len({(waiting[i].share.tenant, waiting[i].share.band) for i in fresh}) <= 1:
        return resumed + fresh
    order: list[int] = []
    for band in sorted({waiting[i].share.band for i in fresh}):
        queues: dict[str, deque[int]] = {}
        for i in fresh:
            if waiting[i].share.band == band:
                queues.setdefault(waiting[i].share.tenant, deque()).append(i)
        weight = {t: max(waiting[q[0]].share.weight, 1e-3) for t, q in queues.items()}
        virtual = {t: (served or {}).get(t, 0.0) / weight[t] for t in queues}
        while queues:  # the tenant furthest behind; even ones by their next prompt's rank
            tenant = min(queues, key=lambda t: (virtual[t], rank[queues[t][0]], queues[t][0]))
            i = queues[tenant].popleft()
            order.append(i)
            virtual[tenant] += waiting[i].remaining_tokens / weight[tenant]
            if not queues[tenant]:
                del queues[tenant]
    return resumed + order


def spend_step_budget(
    running: Seq[T],
    remaining: Callable[[T], int],
    head_tokens: int | None,
    long_prefill_tokens: int,
    budget: int,
    take: Callable[[T, int, bool], int | None],
    admit: Callable[[int, int], int],
) -> int:
    """Spend one step's token `budget` in the order the module's note gives; the budget left.

    `running` (read by index: `take` may shorten it by preempting) is offered in order;
    `remaining(r)`: its prompt tokens still to compute; `head_tokens`: the length of the prompt
    at the head of the queue (None: none waits); `long_prefill_tokens`: the threshold (0: off).
    `take(r, budget, may_preempt)` puts r's next tokens in the step and says how many (None: none;
    in the first pass that ends the pass, as a request that preempted itself leaves nothing to take
    from); `admit(budget, max_tokens)` starts waiting prompts (with `max_tokens`, only while the
    next is that short) and returns the budget left."""
    yields = bool(long_prefill_tokens and head_tokens is not None and head_tokens <= long_prefill_tokens)
    deferred: list[T] = []
    i = 0
    while i < len(running) and budget > 0:
        item = running[i]
        i += 1
        if yields and remaining(item) > long_prefill_tokens:
            deferred.append(item)
            continue
        n = take(item, budget, True)
        if n is None:
            break
        budget -= n
    if deferred:  # the short prompts first, then the long prefills take what is left
        budget = admit(budget, long_prefill_tokens)
        for item in deferred:
            if budget <= 0:
                break
            n = take(item, budget, False)
            budget -= n or 0
    return admit(budget, 0)


class RecentTokens:
    """Each tenant's tokens of the last seconds: a count that decays by e every `window_s`, so
    that a tenant's next request is weighed against what it had lately, and a tenant idle for a
    while starts even again. The prefill order counts prompt tokens started; the router's seats
    (router/fair_share.py), the tokens of the requests seated."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._count: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, as of)

    def started(self, tenant: str, tokens: int, now: float) -> None:
        # the long idle are forgotten here, where the count changes anyway: a read changes nothing
        self._count = {t: (v, at) for t, (v, at) in self._count.items() if self._at(t, now) >= 1.0}
        self._count[tenant] = (self._at(tenant, now) + tokens, now)

    def served(self, now: float) -> dict[str, float]:
        """Each tenant's decayed count now; under a token counts as none."""
        at = {t: self._at(t, now) for t in self._count}
        return {t: v for t, v in at.items() if v >= 1.0}

    def _at(self, tenant: str, now: float) -> float:
        tokens, at = self._count.get(tenant, (0.0, now))
        return tokens * math.exp(-max(0.0, now - at) / self.window_s)
