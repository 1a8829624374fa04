"""One simulated engine: the step loop of engine/scheduler.py, priced by a cost model.

A step is what the scheduler builds: one decode token for every running request
that has its prompt done, then prefill chunks (running prefills first, then
waiting requests while the seats, the KV room and the token budget allow) up to
`max_num_batched_tokens`. The waiting ones start in the order a real worker's
engine loop puts them in before each step (engine/prefill_order.py: shortest
remaining prefill first, aged; `prefill_aging_tokens_per_s` None: arrival order),
and with a `long_prefill_token_threshold` a short prompt at the head of the queue
goes before the long prefills in progress, as the engine's scheduler lets it. Its time is `mixed_step_s`; its
results land at its end, where a finished prompt gives its first token.

Decoding requests are not visited each step: the worker keeps their count and
their total context, and each request's last step by number, so a step costs
O(1) plus the requests that start, finish or prefill in it. That is what lets a
256-worker cluster with tens of thousands of requests run in seconds.

A prefill worker (`prefill_only`) is the same loop whose requests leave when
their prompt is done; a decode worker also takes requests whose KV arrives from
elsewhere (`join_remote`), which hold a seat from their reservation on.

The router sees a simulated worker as it sees a real one: `load()` is the
`WorkerLoad` that router/workers.py builds from a worker's WorkerStats (queued
and running tokens, free and total KV blocks), and a decode worker reports the
prompt blocks it now holds (`on_cached`, a request's block hashes) where a real
one sends a BlocksStored event, so the cluster's `PrefixIndex` is fed as the
router's is.

With a `step_ratio` (the cluster's draw from a measured `StepSpread`), a step
that only decodes takes the cost model's figure times a ratio drawn for its
batch; a step with a prefill chunk keeps the model's figure (the spread was
measured on decode steps only). With a `prefill_factor` (the cluster's measured
prefill slowdown at the requests decoding now: a multiplier and a cost per
request), a step with a prefill chunk takes the model's figure times the
multiplier, plus the cost per request once if it finishes any prompt (measured
on prompts one at a time, each finishing in its own step).

A prefill worker keeps the chained hashes of every prompt it has prefilled
(`cached_tokens_of`): its engine's prefix cache, which spares it the shared
blocks of a later prompt it is sent. Nothing is evicted, as on decode workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.prefill_order import AGING_TOKENS_PER_S, Waiting, admission_order, spend_step_budget
from splitserve.plan.costs import CostModel, mixed_step_s
from splitserve.router.policy import WorkerLoad

# A worker without a KV limit (kv_capacity_tokens None) reports this many free blocks: never short.
UNBOUNDED_BLOCKS = 1 << 40


class SimRequest:
    """One request's life in the simulation; times in seconds from the start."""

    __slots__ = (
        "index",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
        "computed",
        "kv_held",
        "first_token_s",
        "finish_s",
        "remote",
        "hashes",
        "decode_worker",
    )

    def __init__(
        self,
        index: int,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
        hashes: tuple[BlockHash, ...] = (),
    ):
        if prompt_tokens < 1 or output_tokens < 1 or not 0 <= cached_tokens < prompt_tokens:
            raise ValueError(f"request {index}: prompt and output >= 1 token, cached below the prompt")
        self.index = index
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        # found in the cache of the worker that prefills it (once routed: its decode worker's overlap, or
        # a prefill worker's own hit): not computed
        self.cached_tokens = cached_tokens
        self.computed = cached_tokens  # prompt tokens whose KV is in the cache
        # its decode worker's overlap once routed: a remote prefill sends only the KV beyond it
        self.kv_held = cached_tokens
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.remote = False  # prefilled by a prefill worker
        # the chained hashes of the prompt's blocks that other requests may share (a unique tail is left
        # out: no other prompt has it, so no worker's cache could offer it to another request)
        self.hashes = hashes
        self.decode_worker = ""  # the router's choice, once routed


# a step's ITL samples: (gap in seconds, how many tokens waited that long)
ItlSink = Callable[[float, int], None]


class SimWorker:
    def __init__(
        self,
        name: str,
        costs: CostModel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_capacity_tokens: int | None,
        prefill_only: bool,
        on_prefilled: Callable[[SimWorker, SimRequest, float], None],
        on_finished: Callable[[SimWorker, SimRequest, float], None],
        itl: ItlSink,
        step_ratio: Callable[[int], float] | None = None,
        prefill_factor: Callable[[], tuple[float, float]] | None = None,
        block_size: int = 16,
        on_cached: Callable[[SimWorker, SimRequest], None] | None = None,
        busy_overhead: Callable[[int], float] | None = None,
        prefill_aging_tokens_per_s: float | None = AGING_TOKENS_PER_S,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.name = name
        self.costs = costs
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.kv_capacity = kv_capacity_tokens
        self.prefill_only = prefill_only
        self.on_prefilled = on_prefilled  # prefill_only: a prompt is done (its first token at this time)
        self.on_finished = on_finished
        self.itl = itl
        self.step_ratio = step_ratio  # a decode-only step of batch B takes the model's figure x step_ratio(B)
        # a step with a prefill chunk: (multiplier on its figure, seconds per prompt it finishes)
        self.prefill_factor = prefill_factor
        self.block_size = block_size  # the router's, for the free and total blocks it reads
        self.on_cached = on_cached  # decode worker: a request's prompt KV is here (its blocks stored)
        # seconds a step of this batch costs more or less than the model's with the workers busy now
        # (this one included; the model's overhead was measured with every decode worker busy)
        self.busy_overhead = busy_overhead
        self.prefill_aging_tokens_per_s = prefill_aging_tokens_per_s  # the waiting ones' order (None: arrival)
        self.long_prefill_token_threshold = long_prefill_token_threshold  # a prompt this short goes first (0: never)
        self.prefix_cache: set[BlockHash] = set()  # prefill_only: the blocks of the prompts it prefilled
        self.total_blocks = UNBOUNDED_BLOCKS if kv_capacity_tokens is None else kv_capacity_tokens // block_size
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.joining: list[SimRequest] = []  # remote KV arrived: decode from the next step
        self.reserved = 0  # seats held for requests whose KV is on its way
        self.num_decoding = 0
        self.context_tokens = 0  # the decoding requests' contexts, in all
        self.finishing: dict[int, list[SimRequest]] = {}  # step number -> decoders whose last token it makes
        self.step_no = 0
        self.busy = False
        self.kv_used = 0  # tokens of KV held (prompt + output, taken at admission)
        self.queued_tokens = 0  # prompt tokens waiting or prefilling, not computed yet (the router's load)
        self.running_tokens = 0  # the contexts of running and reserved requests
        # the step in flight
        self._chunks: list[tuple[SimRequest, int]] = []
        self._batch = 0
        self._fresh: list[SimRequest] = []  # remote joiners decoding in this step: their own first gap
        self._started = 0.0

    # ---- what the router sees and does

    @property
    def seats_used(self) -> int:
        return len(self.prefilling) + self.num_decoding + len(self.joining) + self.reserved

    def load(self) -> WorkerLoad:
        """What the router reads of this worker, as router/workers.py's `Worker.load()` gives it of a
        real one. The simulated stats are never stale, so there are no routed-but-unreported tokens
        to add; KV is held from admission for the whole request (prompt + output), so free blocks
        are the room not yet promised."""
        if self.kv_capacity is None:
            free = UNBOUNDED_BLOCKS
        else:
            free = max(0, self.kv_capacity - self.kv_used) // self.block_size
        return WorkerLoad(self.queued_tokens, self.running_tokens, free, self.total_blocks)

    def cached_tokens_of(self, req: SimRequest) -> int:
        """The tokens of `req`'s prompt this prefill worker's own cache holds: its leading blocks
        found, up to the first one missing (a chained hash finds only behind its whole prefix)."""
        n = 0
        for h in req.hashes:
            if h not in self.prefix_cache:
                break
            n += 1
        return n * self.block_size

    def has_seat(self) -> bool:
        return self.seats_used < self.max_num_seqs

    def fits(self, req: SimRequest) -> bool:
        return self.kv_capacity is None or self.kv_used + req.prompt_tokens + req.output_tokens <= self.kv_capacity

    def add(self, req: SimRequest, now: float, push: Callable[[float, SimWorker], None]) -> None:
        """A request to prefill here (and, unless prefill_only, decode here)."""
        self.waiting.append(req)
        self.queued_tokens += req.prompt_tokens - req.computed
        self._kick(now, push)

    def reserve(self, req: SimRequest) -> None:
        """A seat and KV room for a request prefilled elsewhere (the caller checked has_seat)."""
        self.reserved += 1
        self.kv_used += req.prompt_tokens + req.output_tokens
        self.running_tokens += req.prompt_tokens

    def join_remote(self, req: SimRequest, now: float, push: Callable[[float, SimWorker], None]) -> None:
        """The reserved request's KV has arrived."""
        self.reserved -= 1
        if self.on_cached is not None:
            self.on_cached(self, req)
        if req.output_tokens == 1:  # its one token came from the prefill worker
            self._finish(req, now, req.prompt_tokens)
            return
        self.joining.append(req)
        self._kick(now, push)

    def leftovers(self) -> list[str]:
        """What the worker still holds; empty once every request it had has left (the leak check)."""
        held = {
            "waiting": len(self.waiting),
            "prefilling": len(self.prefilling),
            "joining": len(self.joining),
            "reserved": self.reserved,
            "decoding": self.num_decoding,
            "context_tokens": self.context_tokens,
            "finishing": sum(len(v) for v in self.finishing.values()),
            "kv_used": self.kv_used,
            "queued_tokens": self.queued_tokens,
            "running_tokens": self.running_tokens,
            "busy": int(self.busy),
        }
        return [f"{self.name}.{k}={v}" for k, v in held.items() if v]

    # ---- the step loop

    def _kick(self, now: float, push: Callable[[float, SimWorker], None]) -> None:
        if not self.busy:
            self.start_step(now, push)

    def start_step(self, now: float, push: Callable[[float, SimWorker], None]) -> None:
        """Build the next step from what is here now and push its end; idle if there is nothing to do."""
        for req in self.joining:  # a request with n tokens so far finishes after output - n more steps
            self.num_decoding += 1
            self.context_tokens += req.prompt_tokens + 1
            self.running_tokens += 1
            self.finishing.setdefault(self.step_no + req.output_tokens - 2, []).append(req)
        self._fresh, self.joining = self.joining, []
        self._order_waiting(now)
        batch = self.num_decoding
        budget = self.budget - batch
        chunks = self._plan_chunks(budget)
        tokens = sum(n for _, n in chunks)
        weighted_cached = sum(n * req.computed for req, n in chunks)
        if not chunks and batch == 0:
            self.busy = False
            return
        self.busy = True
        self._chunks, self._batch, self._started = chunks, batch, now
        cached = weighted_cached // tokens if tokens else 0
        t = mixed_step_s(self.costs, tokens, cached, batch, self.context_tokens)
        if self.busy_overhead is not None:
            t = max(0.0, t + self.busy_overhead(batch))
        if self.step_ratio is not None and not tokens:
            t *= self.step_ratio(batch)
        elif self.prefill_factor is not None and tokens:
            # the cost per prompt was measured on prompts sent one at a time, each finishing in a step of
            # its own; charged once per step that finishes any (its first tokens handed out together),
            # since charging it per prompt made a burst's first tokens wait for each other's (replay)
            scale, per_prompt = self.prefill_factor()
            finishes = any(req.computed + n >= req.prompt_tokens for req, n in chunks)
            t = t * scale + (per_prompt if finishes else 0.0)
        push(now + t, self)

    def _plan_chunks(self, budget: int) -> list[tuple[SimRequest, int]]:
        """This step's prefill chunks, spent as engine/scheduler.py's `schedule` spends them (the same
        `spend_step_budget`): the prefills in progress, then waiting prompts while the budget, the seats
        and the KV room allow; with a `long_prefill_token_threshold`, a short prompt waiting at the head
        goes before the long prefills in progress, which take what the step has left."""
        chunks: list[tuple[SimRequest, int]] = []

        def take(req: SimRequest, budget: int, _may_preempt: bool) -> int:
            n = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, n))
            return n

        spend_step_budget(
            self.prefilling,
            lambda req: req.prompt_tokens - req.computed,
            self.waiting[0].prompt_tokens if self.waiting else None,
            self.long_prefill_token_threshold,
            budget,
            take,
            lambda budget, max_tokens: self._admit_waiting(chunks, budget, max_tokens),
        )
        return chunks

    def _admit_waiting(self, chunks: list[tuple[SimRequest, int]], budget: int, max_tokens: int = 0) -> int:
        """Waiting prompts start (their first chunk into `chunks`) while the budget, a seat and the KV
        room allow (with `max_tokens`, only while the next is that short); returns the budget left."""
        while self.waiting and budget > 0 and self.has_seat() and self.fits(self.waiting[0]):
            if max_tokens and self.waiting[0].prompt_tokens > max_tokens:
                break
            req = self.waiting.popleft()
            self.prefilling.append(req)
            self.kv_used += req.prompt_tokens + req.output_tokens
            self.running_tokens += req.prompt_tokens
            n = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, n))
            budget -= n
        return budget

    def _order_waiting(self, now: float) -> None:
        """The waiting requests in the order the engine loop gives its queue before a step (it admits
        from the head); a request's wait counts from its arrival, when the router sent it here."""
        aging = self.prefill_aging_tokens_per_s
        if aging is None or len(self.waiting) < 2:
            return
        waiting = self.waiting
        order = admission_order(
            [Waiting(r.prompt_tokens - r.computed, now - r.arrival_s, False) for r in waiting], aging
        )
        self.waiting = deque(waiting[i] for i in order)

    def end_step(self, now: float, push: Callable[[float, SimWorker], None]) -> None:
        """The step in flight is done: its tokens are out; then the next step starts."""
        gap = now - self._started
        fresh = len(self._fresh)
        if self._batch > fresh:
            self.itl(gap, self._batch - fresh)
        for req in self._fresh:
            self.itl(now - req.first_token_s, 1)
        self._fresh = []
        self.context_tokens += self._batch
        self.running_tokens += self._batch
        for req in self.finishing.pop(self.step_no, ()):
            self.num_decoding -= 1
            self.context_tokens -= req.prompt_tokens + req.output_tokens
            self._finish(req, now, req.prompt_tokens + req.output_tokens)
        for req, n in self._chunks:
            req.computed += n
            self.queued_tokens -= n
            if req.computed < req.prompt_tokens:
                continue
            self.prefilling.remove(req)
            req.first_token_s = now
            if self.on_cached is not None and not self.prefill_only:
                self.on_cached(self, req)
            if self.prefill_only:
                self.prefix_cache.update(req.hashes)
                self.kv_used -= req.prompt_tokens + req.output_tokens
                self.running_tokens -= req.prompt_tokens
                self.on_prefilled(self, req, now)
            elif req.output_tokens == 1:
                self._finish(req, now, req.prompt_tokens)
            else:  # decodes from the next step on, its first gap that step's length
                self.num_decoding += 1
                self.context_tokens += req.prompt_tokens + 1
                self.running_tokens += 1
                self.finishing.setdefault(self.step_no + req.output_tokens - 1, []).append(req)
        self._chunks = []
        self.step_no += 1
        self.start_step(now, push)

    def _finish(self, req: SimRequest, now: float, context: int) -> None:
        """`context`: the tokens it counts in running_tokens now."""
        req.finish_s = now
        self.kv_used -= req.prompt_tokens + req.output_tokens
        self.running_tokens -= context
        self.on_finished(self, req, now)
