"""Which waiting request takes the next free seat (router/seats.py): priority bands first, then
deficit round robin across tenants by token cost (Shreedhar and Varghese's DRR), so tenants of one
band share the seats by weight in tokens, not in requests: a tenant sending prompts ten times as
long, or ten times as often, gets its weight's share and waits for it, and the others' requests
do not queue behind its backlog.

Each round a tenant with requests waiting is credited `quantum x weight` tokens; it sends
requests from the head of its own queue while their cost fits its credit. A tenant whose queue
empties loses its credit (it cannot bank a share while idle). Within one tenant, arrival order.

Pure: no clock, no waiting; the caller pushes, pops and removes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

# credit a round: below a typical request's prompt and answer, so that tenants alternate request by
# request (a request larger than it waits its tenant's few rounds, its credit carried over)
DEFAULT_QUANTUM_TOKENS = 256


@dataclass
class _Queue(Generic[T]):
    weight: float
    items: deque[tuple[int, T]] = field(default_factory=deque)  # (cost, item)
    deficit: float = 0.0


class FairShare(Generic[T]):
    def __init__(self, quantum_tokens: int = DEFAULT_QUANTUM_TOKENS) -> None:
        if quantum_tokens < 1:
            raise ValueError(f"quantum_tokens must be >= 1, got {quantum_tokens}")
        self.quantum = quantum_tokens
        # band -> tenant -> its queue, in round-robin order (the head is served next)
        self._bands: dict[int, OrderedDict[str, _Queue[T]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, item: T, tenant: str, cost: int, weight: float = 1.0, band: int = 1) -> None:
        """`item` waits at the tail of `tenant`'s queue in `band` (0 is served first)."""
        queues = self._bands.setdefault(band, OrderedDict())
        q = queues.get(tenant)
        if q is None:
            q = queues[tenant] = _Queue(weight)
        q.weight = weight
        q.items.append((max(cost, 1), item))
        self._len += 1

    def pop(self, eligible: Callable[[str], bool] | None = None) -> T | None:
        """The request that takes the next seat, or None when nothing waits. `eligible`: which
        tenants may take it now (router/seats.py keeps one over its share from the seats the
        others are owed); the others keep their place and earn no credit meanwhile."""
        for band in sorted(self._bands):
            queues = self._bands[band]
            ok = {t for t in queues if eligible is None or eligible(t)}
            if ok:
                return self._pop_band(queues, ok)
        return None

    def _pop_band(self, queues: OrderedDict[str, _Queue[T]], ok: set[str]) -> T:
        while True:
            tenant = next(t for t in queues if t in ok)
            q = queues[tenant]
            cost, item = q.items[0]
            if cost <= q.deficit:
                q.items.popleft()
                q.deficit -= cost
                self._len -= 1
                if not q.items:
                    del queues[tenant]  # idle: no credit banked
                return item
            # a round for this tenant: credit it and move it behind the others
            q.deficit += self.quantum * q.weight
            queues.move_to_end(tenant)

    def remove(self, item: T) -> bool:
        """Take a waiting `item` out (its client went away); whether it was waiting."""
        for queues in self._bands.values():
            for tenant, q in queues.items():
                for i, (_, it) in enumerate(q.items):
                    if it is item:
                        del q.items[i]
                        self._len -= 1
                        if not q.items:
                            del queues[tenant]
                        return True
        return False

    def waiting(self) -> dict[str, int]:
        """Requests waiting, by tenant."""
        out: dict[str, int] = {}
        for queues in self._bands.values():
            for tenant, q in queues.items():
                out[tenant] = out.get(tenant, 0) + len(q.items)
        return out


def shares(
    capacity: int,
    running: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Mapping[str, int],
    recent: set[str],
) -> dict[str, float]:
    """Each active tenant's share of the seats: capacity x its weight / the weights of the active
    tenants (running or waiting now, or in `recent`), at least one seat."""
    active = {t for t, n in running.items() if n} | {t for t, n in waiting.items() if n} | recent
    total = sum(weights.get(t, 1.0) for t in active) or 1.0
    return {t: max(1.0, capacity * weights.get(t, 1.0) / total) for t in active}


def may_sit(
    capacity: int,
    running: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Mapping[str, int],
    recent: set[str],
    tokens: Mapping[str, float],
) -> Callable[[str], bool]:
    """Which tenants may take a seat now (the `eligible` of `FairShare.pop`).

    "Within its share": the tokens a tenant's seated requests asked lately (`tokens`,
    engine/prefill_order.py RecentTokens), over its weight, are below those of all active tenants
    over theirs: it asked less than an equal cut, so max-min fairness gives it all it asks. Judged
    on tokens, not on seats held: a quiet tenant's requests come in bursts, and on a loaded worker
    they run slowly and hold their seats long, which says nothing of what it asked.

    - A free seat: a tenant within its share may always take it; one over it only while a free
      seat stays for each other tenant within its share with nothing waiting (its next request
      finds a seat at once). So spare seats are lent, never the one a quiet tenant is owed.
    - No free seat: a tenant within its share still takes one, beyond `capacity`, while the
      tenants that asked more than it hold more seats beyond their shares of the seats (`shares`:
      lent when seats were spare) than are taken beyond `capacity`; the others wait. A lent seat
      is held for a whole request (seats are not preempted), and a noisy tenant's request may run
      for seconds: a quiet tenant's request does not wait for it to end but runs beside it, and
      the lenders get no new seat until the count is back under `capacity`. So the count exceeds
      `capacity` by at most the seats lent, for about one request's time."""
    share = shares(capacity, running, weights, waiting, recent)

    def used(t: str) -> float:
        return tokens.get(t, 0.0) / weights.get(t, 1.0)

    even = sum(tokens.get(t, 0.0) for t in share) / (sum(weights.get(t, 1.0) for t in share) or 1.0)

    def within(t: str) -> bool:
        return used(t) < even

    free = capacity - sum(running.values())
    owed = [t for t in share if within(t) and not waiting.get(t)]

    def lent_to(t: str) -> float:
        return sum(max(0.0, n - share.get(u, 1.0)) for u, n in running.items() if u != t and used(u) > used(t))

    def eligible(t: str) -> bool:
        if free > 0:
            return within(t) or free - 1 >= sum(1 for o in owed if o != t)
        return within(t) and 1 - free <= lent_to(t)

    return eligible
