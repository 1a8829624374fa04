"""The router's seats: how many requests run on the workers at once (`Limits.max_running`).

Beyond that many, a request waits in the router for a seat. A free seat goes to a waiting request
in the order router/fair_share.py gives (priority bands, then each tenant's weighted share in
tokens), and only to a tenant that may take it (fair_share.may_sit). A tenant is within its share
when the tokens its seated requests asked lately, over its weight, are below an equal cut of all
active tenants' ("active": running or waiting now, or seen within the last `recent_s`, so a quiet
tenant between two requests still counts); its share of the seats is the capacity x its weight /
the weights of the active tenants.

- A tenant over its share takes a free seat only while a free seat stays for each other tenant
  within its share: a tenant sending ten times the others' tokens fills the seats the others
  leave idle, but cannot hold the seat a quiet tenant's next request needs.
- A tenant within its share is never made to wait for a seat lent to one over it: with all seats
  taken it runs beyond the limit, by at most the seats lent, and the lenders get no new seat
  until the count is back under it (seats are not preempted: a lent seat may be held for a
  noisy tenant's whole long request).

Without the limit every admitted request runs at once, and the workers' own queues order them.
A request that takes a seat gives it back when its stream ends; a waiting one whose client goes
away leaves the queue (or, if a seat reached it in that instant, passes the seat on).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.engine.prefill_order import RecentTokens
from splitserve.router.fair_share import FairShare, may_sit
from splitserve.router.tenants import Tenant

RECENT_S = 5.0

Turn = tuple["asyncio.Future[None]", str, int]  # a waiting request: its wake-up, tenant, token cost


class Seats:
    def __init__(
        self,
        capacity: int | None,
        clock: Callable[[], float] = time.monotonic,
        recent_s: float = RECENT_S,
        quantum_tokens: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.clock = clock
        self.recent_s = recent_s
        self.taken = 0
        self.running: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._seen: dict[str, float] = {}
        q = () if quantum_tokens is None else (quantum_tokens,)
        self.share: FairShare[Turn] = FairShare(*q)
        self._retry: asyncio.TimerHandle | None = None
        self.tokens = RecentTokens()  # what each tenant's seated requests asked lately

    async def take(self, tenant: Tenant, cost: int, band: int) -> None:
        """A seat for a request of `tenant` that costs `cost` tokens, once its turn comes."""
        if self.capacity is None:
            return
        self._seen[tenant.name] = self.clock()
        self._weights[tenant.name] = tenant.weight
        turn: Turn = (asyncio.get_running_loop().create_future(), tenant.name, cost)
        self.share.push(turn, tenant.name, cost, tenant.weight, band)
        self._dispatch()
        try:
            await turn[0]
        except asyncio.CancelledError:
            if not self.share.remove(turn):  # the seat was handed over as the client left
                self.give_back(tenant)
            raise

    def give_back(self, tenant: Tenant) -> None:
        """The request's seat is free: to the next waiting request that may take it."""
        if self.capacity is None:
            return
        self.taken -= 1
        self.running[tenant.name] -= 1
        self._seen[tenant.name] = self.clock()
        self._dispatch()

    def _dispatch(self) -> None:
        assert self.capacity is not None
        while True:
            turn = self.share.pop(self._eligible())
            if turn is None:
                if len(self.share) and self.taken < self.capacity:
                    # all who wait are over their share: look again once the others go quiet
                    self._look_again_later()
                return
            future, name, cost = turn
            if future.done():  # cancelled as it waited; its task is taking it out
                continue
            self.taken += 1
            self.running[name] = self.running.get(name, 0) + 1
            self.tokens.started(name, cost, self.clock())
            future.set_result(None)

    def _eligible(self) -> Callable[[str], bool]:
        assert self.capacity is not None
        now = self.clock()
        recent = {t for t, seen in self._seen.items() if now - seen < self.recent_s}
        asked = self.tokens.served(now)
        return may_sit(self.capacity, self.running, self._weights, self.share.waiting(), recent, asked)

    def _look_again_later(self) -> None:
        if self._retry is None or self._retry.cancelled():

            def again() -> None:
                self._retry = None
                self._dispatch()

            self._retry = asyncio.get_running_loop().call_later(self.recent_s / 4, again)

    def waiting(self) -> dict[str, int]:
        return self.share.waiting()
