"""A discrete-event simulation of a splitserve cluster: what users would see at a
request rate, colocated, disaggregated, or deciding per request, on a cost model
measured here (`plan/profile.py`) or from the roofline (`plan/costs.py`).

    requests = poisson_requests(rate=4.0, lengths=[(1000, 200)] * 2000, rng=random.Random(0))
    result = simulate(requests, ClusterSpec("disaggregated", decode_workers=6, prefill_workers=2),
                      costs, random.Random(0), Slo(ttft_s=1.0, tpot_s=0.05))
    result.goodput, result.ttft.p90, result.itl.p50

The workers are `plan/sim/worker.py`'s step loops; this module is the router
and the clock. Routing is the router's own code, as Dynamo's mocker puts
simulated engines behind the real router: each request goes through
router/policy.py's `route` with the spec's `RoutingConfig` and the chooser that
config selects, so the decode worker is the one the router's cost picks (the
uncached prefill, the queued and running tokens, the KV shortfall; ties drawn
from the `random.Random` passed in) and, in mode auto, local or remote prefill
is `choose_prefill_mode`'s answer. The router reads each simulated worker's
`load()` (the `WorkerLoad` of a real worker's stats) and a `PrefixIndex` fed by
the decode workers' stored blocks, as a real router's is by their events.

A request's prompt is a synthetic chain of engine/block_hash.py's chained
hashes: its first `cached_tokens` are the same in every request and in every
decode worker's cache from the start (a system prompt, the chat template:
each worker's warm-up stored them), the next ones up to `prefix_tokens` are
shared with the other requests of its `prefix_group` (a conversation's
history, a document) and cached where one of them ran, and the rest is its
own. A request prefilled on its decode worker computes what that worker's
cache does not hold. One prefilled remotely computes what the prefill worker's
own cache does not hold (the prompts it prefilled before: the real one admits
the whole context into its own engine, whose prefix cache is its own), and
sends only the KV its decode worker lacks (the reservation covers those
blocks): the decode worker's hit saves the transfer, not the prefill. A
worker's cache holds every prefix it has stored until the end: nothing is
evicted.

A remote prefill reserves its seat and KV room on the decode worker first (and
waits in that worker's line while it has none), then goes to the prefill
worker `choose_prefill_worker` picks (the fewest queued tokens). The first
token comes from the prefill worker when its prompt is done, as in the real
path (the router streams it at once); the KV's last layers then cross the link
(`transfer_s`) and the request decodes on its decode worker from the next step.

A measured `StepSpread` (`spread`) makes each decode-only step draw its time
from the measured distribution around the cost model's figure, from the same
generator; without one, or with one of zero spread, nothing is drawn and a
step is the model's figure. A measured `prefill_slowdown` (plan/profile.py's
prefill under load: a multiplier and a cost per request, each at the requests
decoding in the whole cluster as a step starts) makes each step that carries a
prefill chunk take the model's figure times the multiplier, plus the cost per
request once if it finishes a prompt (see plan/sim/worker.py).

There is no wall clock and no randomness but the generator passed in: the
same inputs give the same result. Each event is one step of one worker (or a
KV arrival), so the cost grows with simulated steps, not with requests x tokens;
routing a request costs what it costs the router (a look at every decode worker,
and the prompt's shared blocks in the prefix index).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from splitserve.engine.block_hash import ROOT_HASH, BlockHash, hash_block
from splitserve.engine.prefill_order import AGING_TOKENS_PER_S
from splitserve.engine.tuned import LONG_PREFILL_TOKEN_THRESHOLD
from splitserve.measure.metrics import percentile
from splitserve.plan.costs import CostModel, StepSpread
from splitserve.plan.sim.scaling import PoolsUsage, Role, SimPools, SimScaling
from splitserve.plan.sim.worker import SimRequest, SimWorker
from splitserve.router.config import RoutingConfig
from splitserve.router.policy import choose_prefill_worker, decode_chooser, route
from splitserve.router.prefix_index import PrefixIndex

Mode = Literal["colocated", "disaggregated", "auto"]
MODES: tuple[Mode, ...] = ("colocated", "disaggregated", "auto")


class Request(NamedTuple):
    """One request of a workload: when it comes, how long it is, and what of its prompt it shares."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prefix already in every worker's cache (a prefix-reuse rate, as tokens)
    # the opening tokens (cached ones included) that every request of `prefix_group` shares: cached
    # on the decode workers where one of them ran, so the router's prefix term sees them
    prefix_tokens: int = 0
    prefix_group: int = 0


@dataclass(frozen=True)
class ClusterSpec:
    mode: Mode
    decode_workers: int  # colocated: every worker (each prefills and decodes)
    prefill_workers: int = 0
    max_num_seqs: int = 64  # per worker, as the engine's flag
    max_num_batched_tokens: int = 512  # per step: the prefill chunk plus the decodes
    kv_capacity_tokens: int | None = None  # KV room per worker in tokens; None: never the limit
    gpus_per_worker: int = 1  # tensor parallelism: a worker is this many GPUs (for GPU counts and splits)
    # the order waiting prompts start in on every worker, as the workers' --prefill-order: shortest
    # remaining first, each second waited counting as this many tokens fewer (None: "arrival")
    prefill_aging_tokens_per_s: float | None = AGING_TOKENS_PER_S
    # as the workers' --long-prefill-token-threshold (engine/tuned.py's default): a waiting prompt of
    # this many tokens or fewer goes before the long prefills in progress (0: it waits them out)
    long_prefill_token_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD
    # the router's own config section (block size, cost weights, the local-or-remote thresholds);
    # its mode is made this spec's `mode` at construction, the cluster's shape deciding it
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.decode_workers < 1 or self.prefill_workers < 0 or self.gpus_per_worker < 1:
            raise ValueError("at least one decode worker; worker counts and GPUs per worker not negative")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: off)")
        if self.prefill_aging_tokens_per_s is not None and not self.prefill_aging_tokens_per_s >= 0:
            raise ValueError("prefill_aging_tokens_per_s must be >= 0 (or None: arrival order)")
        if self.mode != "colocated" and self.prefill_workers < 1:
            raise ValueError(f"mode {self.mode} needs at least one prefill worker")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.routing.mode != self.mode:  # construction, not a later patch (as RouterConfig's shorthands)
            object.__setattr__(self, "routing", replace(self.routing, mode=self.mode))

    @property
    def gpus(self) -> int:
        return (self.decode_workers + (self.prefill_workers if self.mode != "colocated" else 0)) * self.gpus_per_worker


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


class Percentiles(NamedTuple):
    """Seconds; all 0.0 with no sample."""

    mean: float
    p50: float
    p90: float
    p99: float


class Outcome(NamedTuple):
    """One request as its user saw it; seconds from the start."""

    arrival_s: float
    ttft_s: float
    finish_s: float
    output_tokens: int
    remote: bool  # prefilled on a prefill worker
    decode_worker: str  # where the router sent it ("decode0", ...)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.finish_s - self.arrival_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SimResult:
    mode: Mode
    rate: float  # requests/s offered (nan: arrivals from a trace)
    gpus: int
    completed: int
    duration_s: float  # first arrival to last finish
    goodput: float  # requests/s meeting both SLOs (0.0 without SLOs)
    slo_attainment: float  # share of requests meeting both (0.0 without)
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    remote_share: float  # share of requests prefilled on a prefill worker
    steps: int  # worker steps simulated
    outcomes: tuple[Outcome, ...]
    pools: PoolsUsage | None = None  # with `scaling`: the worker-seconds and sizes it cost


def simulate(
    requests: Sequence[Request],
    cluster: ClusterSpec,
    costs: CostModel,
    rng: random.Random,
    slo: Slo | None = None,
    rate: float = math.nan,
    prefill_costs: CostModel | None = None,
    spread: StepSpread | None = None,
    prefill_slowdown: Callable[[int], tuple[float, float]] | None = None,
    serve_by_busy: Callable[[int], float] | None = None,
    serve_beside_prefill: Callable[[int], float] | None = None,
    scaling: SimScaling | None = None,
) -> SimResult:
    """Run every request to its last token. `prefill_costs`: the prefill workers' own model when
    they differ from the decode workers (another tensor-parallel size); default `costs`.
    `spread`: the measured spread of decode steps around `costs`; `prefill_slowdown`: at N requests
    decoding in the cluster, a prefill step's multiplier and its seconds per prompt finished (see
    the module's note); `serve_by_busy`: at N decode workers stepping at once, the seconds a step's
    serving overhead changes by from the cost model's (measured with all of them busy);
    `serve_beside_prefill`: what a decode step of batch B costs more with every prefill worker busy
    (a share of it for a share of them). `scaling`: pools resized while it runs (plan/sim/scaling.py);
    the spec's worker counts are where they start."""
    sim = _Cluster(
        cluster, costs, prefill_costs or costs, rng, spread, prefill_slowdown, serve_by_busy, serve_beside_prefill
    )
    for r in requests:
        if cluster.kv_capacity_tokens is not None and r.prompt_tokens + r.output_tokens > cluster.kv_capacity_tokens:
            raise ValueError(f"a request of {r.prompt_tokens}+{r.output_tokens} tokens never fits a worker's KV room")
        if not 0 <= r.prefix_tokens < r.prompt_tokens or r.prefix_group < 0:
            raise ValueError(f"a shared prefix of {r.prefix_tokens} tokens in a prompt of {r.prompt_tokens}")
    chains = PromptChains(cluster.routing.block_size)
    reqs = [
        SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.cached_tokens, chains.hashes(r))
        for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s))
    ]
    sim.warm_up(chains.everywhere(max((r.cached_tokens for r in requests), default=0)))
    pools = SimPools(sim, scaling) if scaling is not None else None
    if pools is not None and reqs:
        pools.begin(reqs[0].arrival_s)
    sim.run(reqs)
    # a bug, not a result: every request finishes, and every worker ends empty
    unfinished = sum(1 for r in reqs if r.finish_s < 0)
    left = [x for w in sim.by_name.values() for x in w.leftovers()]
    if unfinished or left or any(sim.lines.values()):
        raise RuntimeError(f"simulation ended with {unfinished} requests unfinished; left: {left[:8]}")
    result = _result(reqs, sim, cluster, slo, rate)
    if pools is None:
        return result
    return replace(result, pools=pools.usage(max((r.finish_s for r in reqs), default=0.0)))


class PromptChains:
    """The block hashes of the workload's synthetic prompts (engine/block_hash.py's chain): token id
    0 for the prefix every request shares (`cached_tokens`), 1 + its group for the prefix the
    requests of one `prefix_group` share. Only the shared blocks are hashed: a prompt's own tail
    matches no other prompt. Each chain is hashed once and extended as longer prompts need."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[tuple[int, int], list[BlockHash]] = {}  # (where the group starts, group) -> chain

    def everywhere(self, tokens: int) -> tuple[BlockHash, ...]:
        """The full blocks of the first `tokens` tokens that every prompt shares."""
        return self._chain(-1, 0, tokens // self.block_size)

    def hashes(self, r: Request) -> tuple[BlockHash, ...]:
        if r.prefix_tokens <= r.cached_tokens:
            return self.everywhere(r.cached_tokens)
        return self._chain(r.cached_tokens, r.prefix_group, r.prefix_tokens // self.block_size)

    def _chain(self, start: int, group: int, blocks: int) -> tuple[BlockHash, ...]:
        """`start` < 0: all of it the shared opening; else the group's own tokens from `start` on."""
        chain = self._chains.setdefault((start, group), [])
        bs = self.block_size
        while len(chain) < blocks:
            first = len(chain) * bs
            tokens = [1 + group if 0 <= start <= t else 0 for t in range(first, first + bs)]
            chain.append(hash_block(chain[-1] if chain else ROOT_HASH, tokens))
        return tuple(chain[:blocks])


class _Cluster:
    """The router (router/policy.py's `route`, its prefix index and chooser) and the event queue."""

    def __init__(
        self,
        spec: ClusterSpec,
        costs: CostModel,
        prefill_costs: CostModel,
        rng: random.Random,
        spread: StepSpread | None = None,
        prefill_slowdown: Callable[[int], tuple[float, float]] | None = None,
        serve_by_busy: Callable[[int], float] | None = None,
        serve_beside_prefill: Callable[[int], float] | None = None,
    ) -> None:
        self.spec = spec
        self.serve_by_busy = serve_by_busy
        self.serve_beside_prefill = serve_beside_prefill
        self.prefill_costs = prefill_costs
        self.rng = rng
        self.chooser = decode_chooser(spec.routing)  # selected once, as the router's WorkerSet does
        self.index = PrefixIndex()
        self.events: list[tuple[float, int, SimWorker, SimRequest | None]] = []
        self.seq = 0
        self.itl_samples: list[tuple[float, int]] = []
        self.target: dict[int, SimWorker] = {}  # request index -> its decode worker, for remote prefills
        self.lines: dict[SimWorker, deque[SimRequest]] = {}  # remote prefills waiting for a seat
        self.steps = 0
        # resized pools (plan/sim/scaling.py): timed callbacks, the drained workers, the router's counters
        self.control: list[tuple[float, int, Callable[[float], None]]] = []
        self.draining: list[SimWorker] = []
        self.unrouted = 0  # requests not arrived yet
        self.prompt_tokens = 0  # uncached prompt tokens routed
        self.requests = 0
        self._models = (costs, spread, prefill_slowdown)
        self._warm: Sequence[BlockHash] = ()
        self.decode = [
            self._worker(f"decode{i}", costs, False, spread, prefill_slowdown) for i in range(spec.decode_workers)
        ]
        n_prefill = spec.prefill_workers if spec.mode != "colocated" else 0
        self.prefill = [
            self._worker(f"prefill{i}", prefill_costs, True, spread, prefill_slowdown) for i in range(n_prefill)
        ]
        self.by_name = {w.name: w for w in self.decode + self.prefill}
        for w in self.decode:
            self.lines[w] = deque()

    def _worker(
        self,
        name: str,
        model: CostModel,
        prefill_only: bool,
        spread: StepSpread | None,
        prefill_slowdown: Callable[[int], tuple[float, float]] | None,
    ) -> SimWorker:
        rng, spec = self.rng, self.spec
        step_ratio: Callable[[int], float] | None = None
        if spread is not None and not spread.is_zero:
            measured = spread

            def step_ratio(batch: int) -> float:
                return measured.ratio(batch, rng.random())

        prefill_factor: Callable[[], tuple[float, float]] | None = None
        if prefill_slowdown is not None:
            slowdown = prefill_slowdown

            def prefill_factor() -> tuple[float, float]:  # only steps with a prefill chunk ask: O(decode workers) each
                return slowdown(sum(w.num_decoding for w in self.decode))

        busy_overhead = None if prefill_only else self._busy_overhead()
        return SimWorker(
            name,
            model,
            spec.max_num_seqs,
            spec.max_num_batched_tokens,
            spec.kv_capacity_tokens,
            prefill_only,
            self._prefilled,
            self._finished,
            self._itl,
            step_ratio,
            prefill_factor,
            block_size=spec.routing.block_size,
            on_cached=None if prefill_only else self._cached,
            busy_overhead=busy_overhead,
            prefill_aging_tokens_per_s=spec.prefill_aging_tokens_per_s,
            long_prefill_token_threshold=spec.long_prefill_token_threshold,
        )

    def _busy_overhead(self) -> Callable[[int], float] | None:
        """A decode worker's step-time change by what else is busy: the decode workers stepping
        (`serve_by_busy`) and the prefill workers computing (`serve_beside_prefill`). O(workers) a step."""
        by_busy, beside = self.serve_by_busy, self.serve_beside_prefill
        if by_busy is None and beside is None:
            return None

        def at(batch: int) -> float:
            t = 0.0 if by_busy is None else by_busy(sum(w.busy for w in self.decode))
            if beside is not None and self.prefill:
                t += beside(batch) * sum(w.busy for w in self.prefill) / len(self.prefill)
            return t

        return at

    def warm_up(self, hashes: Sequence[BlockHash]) -> None:
        """Every worker holds the prefix that every prompt shares (its warm-up stored it)."""
        self._warm = hashes
        for w in self.decode + self.prefill:
            self._warm_one(w)

    def _warm_one(self, w: SimWorker) -> None:
        if not self._warm:
            return
        if w.prefill_only:  # its own cache
            w.prefix_cache.update(self._warm)
        else:  # the router's index, fed by its events
            self.index.stored(w.name, self._warm)

    # ---- resized pools: what plan/sim/scaling.py's SimPools calls

    def later(self, t: float, fn: Callable[[float], None]) -> None:
        self.seq += 1
        heapq.heappush(self.control, (t, self.seq, fn))

    def work_left(self) -> bool:
        return bool(self.unrouted or self.events)

    def routable(self, role: Role) -> Sequence[SimWorker]:
        return self.prefill if role == "prefill" else self.decode

    def draining_count(self, role: Role) -> int:
        return sum(w.prefill_only == (role == "prefill") for w in self.draining)

    def add_worker(self, role: Role) -> None:
        """A new worker, routed from now, its warm-up's blocks stored (names are never reused)."""
        costs, spread, slowdown = self._models
        name = f"{role}{len(self.by_name)}"
        if role == "prefill":
            w = self._worker(name, self.prefill_costs, True, spread, slowdown)
            self.prefill.append(w)
        else:
            w = self._worker(name, costs, False, spread, slowdown)
            self.decode.append(w)
            self.lines[w] = deque()
        self.by_name[name] = w
        self._warm_one(w)

    def drain_worker(self, name: str) -> None:
        """Out of routing now; its requests (and a decode worker's line) finish where they are."""
        w = self.by_name[name]
        pool = self.prefill if w.prefill_only else self.decode
        if w not in pool or len(pool) == 1:
            raise ValueError(f"{name}: not a routable worker, or its pool's last")
        pool.remove(w)
        self.draining.append(w)
        if not w.prefill_only:
            self.index.cleared(name)

    def retire_drained(self) -> None:
        for w in [w for w in self.draining if not w.leftovers() and not self.lines.get(w)]:
            self.draining.remove(w)

    def push_step(self, t: float, w: SimWorker) -> None:
        self.seq += 1
        self.steps += 1
        heapq.heappush(self.events, (t, self.seq, w, None))

    def run(self, reqs: list[SimRequest]) -> None:
        events, control, i, n = self.events, self.control, 0, len(reqs)
        while i < n or events or control:
            self.unrouted = n - i
            if (
                control
                and (i == n or control[0][0] < reqs[i].arrival_s)
                and (not events or control[0][0] < events[0][0])
            ):
                t, _, fn = heapq.heappop(control)
                fn(t)
                continue
            if i < n and (not events or reqs[i].arrival_s <= events[0][0]):
                self._route(reqs[i], reqs[i].arrival_s)
                i += 1
                continue
            t, _, w, req = heapq.heappop(events)
            if req is None:
                w.end_step(t, self.push_step)
            else:
                w.join_remote(req, t, self.push_step)

    # ---- routing: the router's own functions on the simulated workers' view

    def _route(self, req: SimRequest, now: float) -> None:
        r = route(
            req.hashes,
            req.prompt_tokens,
            self.index,
            {w.name: w.load() for w in self.decode},
            {p.name: p.queued_tokens for p in self.prefill},
            self.spec.routing,
            self.rng,
            self.chooser,
        )
        d = self.by_name[r.worker]
        req.decode_worker = d.name
        # what the chosen worker's cache holds: it computes none of that, nor is it sent there
        req.kv_held = max(req.cached_tokens, r.overlap_blocks * self.spec.routing.block_size)
        self.requests += 1
        self.prompt_tokens += req.prompt_tokens - req.kv_held
        if r.mode == "local":
            req.cached_tokens = req.computed = req.kv_held
            d.add(req, now, self.push_step)
            return
        line = self.lines[d]
        if line or not (d.has_seat() and d.fits(req)):
            line.append(req)
            return
        self._send_remote(req, d, now)

    def _send_remote(self, req: SimRequest, d: SimWorker, now: float) -> None:
        d.reserve(req)
        self.target[req.index] = d
        req.remote = True
        p = self.by_name[choose_prefill_worker({p.name: p.queued_tokens for p in self.prefill}, self.rng)]
        # the prefill worker computes what its own cache lacks, whatever the decode worker holds
        req.cached_tokens = req.computed = max(req.cached_tokens, p.cached_tokens_of(req))
        p.add(req, now, self.push_step)

    def _cached(self, w: SimWorker, req: SimRequest) -> None:
        """A decode worker's BlocksStored event: the request's prompt blocks are in its cache."""
        if req.hashes:
            self.index.stored(w.name, req.hashes)

    def _itl(self, gap: float, count: int) -> None:
        self.itl_samples.append((gap, count))

    def _prefilled(self, p: SimWorker, req: SimRequest, now: float) -> None:
        self.seq += 1
        t = now + self.prefill_costs.transfer_s(req.prompt_tokens - req.kv_held)  # what the decode worker lacks
        heapq.heappush(self.events, (t, self.seq, self.target.pop(req.index), req))

    def _finished(self, w: SimWorker, req: SimRequest, now: float) -> None:
        line = self.lines.get(w)
        while line and w.has_seat() and w.fits(line[0]):
            self._send_remote(line.popleft(), w, now)


# ---- figures -------------------------------------------------------------------------------------


def weighted_percentiles(samples: Sequence[tuple[float, int]], qs: Sequence[float]) -> list[float]:
    """`percentile` of the list in which each value appears `count` times, without building it."""
    total = sum(c for _, c in samples)
    if total == 0:
        return [0.0 for _ in qs]
    s = sorted(samples)
    out = []
    for q in qs:
        k = (total - 1) * q / 100.0
        lo = math.floor(k)
        out.append(_at_rank(s, lo) + (_at_rank(s, min(lo + 1, total - 1)) - _at_rank(s, lo)) * (k - lo))
    return out


def _at_rank(s: Sequence[tuple[float, int]], rank: int) -> float:
    seen = 0
    for v, c in s:
        seen += c
        if rank < seen:
            return v
    return s[-1][0]


def _stats(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0, 0.0, 0.0)
    return Percentiles(
        sum(values) / len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99)
    )


def _result(reqs: list[SimRequest], sim: _Cluster, spec: ClusterSpec, slo: Slo | None, rate: float) -> SimResult:
    outcomes = tuple(
        Outcome(r.arrival_s, r.first_token_s - r.arrival_s, r.finish_s, r.output_tokens, r.remote, r.decode_worker)
        for r in reqs
    )
    ttfts = [o.ttft_s for o in outcomes]
    tpots = [t for o in outcomes if (t := o.tpot_s) is not None]
    start = min((r.arrival_s for r in reqs), default=0.0)
    duration = max((r.finish_s for r in reqs), default=0.0) - start
    good = 0
    if slo is not None:
        good = sum(1 for o in outcomes if o.ttft_s <= slo.ttft_s and (o.tpot_s or 0.0) <= slo.tpot_s)
    samples = sim.itl_samples
    total = sum(c for _, c in samples)
    itl = Percentiles(
        sum(g * c for g, c in samples) / total if total else 0.0, *weighted_percentiles(samples, (50, 90, 99))
    )
    return SimResult(
        mode=spec.mode,
        rate=rate,
        gpus=spec.gpus,
        completed=len(reqs),
        duration_s=duration,
        goodput=good / duration if duration > 0 else 0.0,
        slo_attainment=good / len(reqs) if reqs else 0.0,
        ttft=_stats(ttfts),
        tpot=_stats(tpots),
        itl=itl,
        remote_share=sum(o.remote for o in outcomes) / len(reqs) if reqs else 0.0,
        steps=sim.steps,
        outcomes=outcomes,
    )
