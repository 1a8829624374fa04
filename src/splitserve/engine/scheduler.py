"""Every request state of one engine, and the block manager: which tokens of
which requests run in the next step, and what a step's results do to them.

The states (and the one container that holds each):

    WAITING -> RUNNING -> FINISHED                      local prefill: `add`
    RESERVED -> RUNNING -> FINISHED                     decode role, KV from elsewhere: `reserve`, `commit_remote`
    WAITING -> RUNNING -> HELD -> FINISHED              prefill role: blocks kept for the KV sender until `release`

`requests` maps every unfinished id to its sequence, so `abort` is one lookup.
Admission is one check for every path (`free_seats`): a request holds a seat
from the moment it runs or is reserved, and at most `max_num_seqs` do; the
workers' bounded queue counts with the same seats (`waiting_for_seat`).

The waiting queue is the scheduler's, and so is its order: before each step it
is put in the order its prompts should start (`cfg.prefill_order`: arrival, or
shortest remaining first, aged, fairly across the router's tenants, whose
started prompt tokens it counts), by the pure rules of engine/prefill_order.py
that the simulator (plan/sim/worker.py) runs too.

One token budget per step (`max_num_batched_tokens`) is shared by everything:
running requests first (a decoding request takes one token, a request still
prefilling takes its next chunk), then waiting requests from the head while
the budget, the seats and the free blocks allow. A prompt longer than the
budget is prefilled in chunks over several steps. With
`long_prefill_token_threshold`, a long prefill in progress lets a short prompt
waiting at the head of the queue go first, and takes what the step has left
(`spend_step_budget`). When a decoding request
needs a block and none is free, the newest running request is preempted: its
blocks are freed and it is recomputed later (its full blocks usually come back
from the prefix cache).

Only the scheduler touches the block manager; the runner sees block tables.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.block_manager import BlockEvent, BlockManager
from splitserve.engine.blocks import blocks_to_fill
from splitserve.engine.config import EngineConfig
from splitserve.engine.handoff import Handoff, TokenLogprob
from splitserve.engine.lora.rows import adapter_root
from splitserve.engine.prefill_order import (
    AGING_TOKENS_PER_S,
    RecentTokens,
    Waiting,
    admission_order,
    spend_step_budget,
)
from splitserve.engine.sequence import SeqStatus, Sequence
from splitserve.engine.stats import StatsRecorder

if TYPE_CHECKING:
    from splitserve.engine.kv_tiers import Fetched, TierStore


class DuplicateRequest(ValueError):
    """The request id belongs to a request this engine still holds (a held one included)."""


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step
    # per sequence, draft tokens the step verifies after its last one (engine/spec/); [] for none.
    # The speculator adds them, with their blocks (`reserve_draft`), after `schedule`.
    drafts: list[list[int]] = []


class Sampled(NamedTuple):
    """A step's draws: for the sequences whose step ended at their last token. A fresh request
    with n > 1 has one draw per sample at its first output position (its `fork_indices`)."""

    indices: list[int]  # into the batch's seqs
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    sample_indices: list[int] | None = None  # per draw (None: each sequence's own)
    prompt_logprobs: list[tuple[int, TokenLogprob]] = []  # (batch index, next prompt token's), in order


class StepOutput(NamedTuple):
    request_id: str  # the request's (a fork's outputs carry its group's id)
    token_id: int  # -1: no token (an abort, a failed transfer)
    logprob: TokenLogprob | None
    finished: bool  # this sample finished
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefill_done" | a transfer failure code | None
    num_prompt_tokens: int
    num_cached_tokens: int
    sample_index: int = 0
    remaining: int = 0  # samples of the request still unfinished after this output
    handoff: Handoff | None = None  # prefill role, "prefill_done": what the decode worker continues from
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs: on a sample's first output


class RemoteBlocks(NamedTuple):
    """Blocks of a reserved request that a remote prefill must fill."""

    block_ids: list[int]  # the blocks to fill, in prompt order (after the cached prefix)
    num_cached_tokens: int  # the prefix already in this cache (a whole number of blocks)


class SchedulerStats(NamedTuple):
    queued_tokens: int
    running_tokens: int
    free_blocks: int
    total_blocks: int
    queue_length: int
    running_requests: int
    reserved_requests: int  # decode role: waiting for their KV
    prefix_cache_queries: int  # full blocks looked up at admission, since start
    prefix_cache_hits: int


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        blocks: BlockManager,
        eos_token_ids: frozenset[int],
        max_position: int,
        recorder: StatsRecorder,
    ) -> None:
        self.cfg = cfg
        self.recorder = recorder  # told as requests run, get tokens and finish (for metrics)
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.max_position = max_position
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.requests: dict[str, Sequence] = {}
        # aborted while reserved, but the connector could not yet promise that no write into their
        # blocks can land: the blocks stay with them until the transfer's outcome comes (by transfer id)
        self.aborting: dict[bytes, Sequence] = {}
        self.num_preemptions = 0
        # requests of more than one sequence (n > 1 forks, a migrated request's samples): group id ->
        # its unfinished sequences, so that abort and lookup by the request's id find them all
        self.groups: dict[str, list[Sequence]] = {}
        # (source, destination) blocks the engine copies before the next step: a fork's partial
        # last block, which it cannot share (both would write their next token into it)
        self.block_copies: list[tuple[int, int]] = []
        # the tiers behind the prefix cache (engine/kv_tiers.py), if any: a prompt whose
        # prefix continues there has those blocks loaded at allocation, when that beats recomputing
        self.tiers: TierStore | None = None
        # each tenant's prompt tokens started lately, for the fair order of the queue
        self.prefill_shares = RecentTokens()

    # ---- admission ----

    def free_seats(self) -> int:
        """Seats (`max_num_seqs`) no running or reserved request holds."""
        return max(0, self.cfg.max_num_seqs - len(self.running) - len(self.reserved))

    def waiting_for_seat(self) -> int:
        """Waiting requests that the free seats will not take at the next step."""
        return len(self.waiting) - self.free_seats()

    def add(self, seq: Sequence) -> None:
        self._check_id(seq)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def reserve(self, seq: Sequence) -> RemoteBlocks | None:
        """Admit a request whose context KV is written by someone else; None if no seat or blocks now."""
        self._check_id(seq)  # before any block is taken
        # the whole context arrives at once: every block in the window holds its window pages now
        if not self.free_seats() or not self._allocate(seq, eager_windows=True):
            return None
        self.requests[seq.request_id] = seq
        seq.status = SeqStatus.RESERVED
        self.reserved[seq.request_id] = seq
        # its windowed layers receive only what their windows still see (the sender skips the rest)
        self._release_windows(seq, len(seq))
        span = blocks_to_fill(len(seq), seq.num_cached_tokens, self.blocks.block_size)
        return RemoteBlocks([seq.block_table[i] for i in span], seq.num_cached_tokens)

    def _release_windows(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the windowed pages of `seq`'s blocks past every window of a context of `num_tokens`
        (a grouped cache's). Not a prefill role's: its KV sender may still be reading them."""
        if not seq.prefill_only:
            seq.window_held_from = self.blocks.release_behind(seq.block_table, seq.window_held_from, num_tokens)

    def _cache_blocks(self, seq: Sequence) -> None:
        """`seq`'s full, computed blocks into the prefix cache, unless their KV is not whole."""
        if seq.prefix_cacheable:
            self.blocks.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_computed_tokens, adapter_root(seq.adapter)
            )

    def _check_id(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise DuplicateRequest(f"request_id {seq.request_id!r} is already in use")

    def _allocate(self, seq: Sequence, eager_windows: bool = False) -> bool:
        """Give `seq` a block table for all its tokens, its cached prefix reused; False (nothing
        changed) when the free blocks do not suffice. Sets block_table and num_cached_tokens. A
        grouped cache's blocks get their window pages as far as a first chunk reaches (or all of
        them: `eager_windows`, and where tiers may load blocks); `_grow` gives the rest theirs."""
        # prompt logprobs need every prompt position's logits: nothing of the prompt comes from the cache
        root = adapter_root(seq.adapter)  # KV of one adapter's weights is no other's prefix
        hashes = [] if seq.params.prompt_logprobs else block_hashes(seq.token_ids, self.blocks.block_size, root)
        cached = self.blocks.cached_prefix(hashes, len(seq))
        reach = len(cached) * self.blocks.block_size + self.cfg.max_num_batched_tokens
        # a prefill role's sequence keeps every window page until its KV is sent: all of them at once
        eager = eager_windows or seq.prefill_only or self.tiers is not None
        window_blocks = None if eager else self.blocks.blocks_needed(reach)
        # admitted only where its prefill's window pages, at their most, fit beside what the running
        # prefills will still take: else the newest prefill would be preempted, again and again
        span = self.blocks.window_span(self.cfg.max_num_batched_tokens)
        peak = None if window_blocks is None else len(cached) + span
        if not self.blocks.can_allocate(len(seq), cached, peak, self._promised_window_pages()):
            return False
        fetched = self._fetch_from_tiers(seq, hashes, len(cached)) if self.tiers is not None and hashes else []
        seq.block_table, seq.num_cached_tokens = self.blocks.allocate(len(seq), hashes, window_blocks)
        seq.window_held_from = self.blocks.held_from(seq.num_cached_tokens)
        table_len = len(seq.block_table)
        seq.window_held_to = table_len if window_blocks is None else min(window_blocks, table_len)
        pooled = seq.num_cached_tokens
        if fetched:
            seq.num_cached_tokens += self._install(seq, fetched)
        if self.tiers is not None:  # one record per admitted prompt of where its prefix came from
            self.tiers.note_prefix(
                len(seq), pooled, fetched[: (seq.num_cached_tokens - pooled) // self.blocks.block_size]
            )
        if self.blocks.enable_prefix_caching:
            self.recorder.prefix_lookup(len(seq), seq.num_cached_tokens)
        return True

    def _fetch_from_tiers(self, seq: Sequence, hashes: list[bytes], num_cached: int) -> list[Fetched]:
        """The checked bytes of the blocks after `seq`'s pooled prefix that continue in a tier, as far
        as loading beats recomputing (read before the allocation's evictions can move them)."""
        assert self.tiers is not None
        usable = min(len(hashes), (len(seq) - 1) // self.blocks.block_size)  # the last prompt token is computed
        return self.tiers.fetch(hashes[num_cached:usable])

    def _install(self, seq: Sequence, fetched: list[Fetched]) -> int:
        """Write the fetched blocks into `seq`'s fresh blocks after its pooled prefix; the tokens loaded."""
        assert self.tiers is not None
        bs = self.blocks.block_size
        first = seq.num_cached_tokens // bs
        loaded = 0
        for i, f in enumerate(fetched):
            if f.hash in self.blocks.hash_to_block:  # in the pool after all: the rest is computed
                break
            b = seq.block_table[first + i]
            self.tiers.install(f, b)
            self.blocks.adopt(b, f.hash)
            loaded += 1
        return loaded * bs

    # ---- a step ----

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float, prefill_cap: int | None = None) -> ScheduledBatch | None:
        """The next step: the queue put in its order, then the step's token budget spent
        (engine/prefill_order.py has both rules, shared with the simulator). `prefill_cap`: where
        the step carries decode rows, at most this many prompt tokens (engine/itl_budget.py)."""
        self._order_waiting(now)
        seqs: list[Sequence] = []
        counts: list[int] = []
        decoding = any(len(s) - s.num_computed_tokens == 1 for s in self.running)
        capped = prefill_cap is not None and decoding
        left = prefill_cap or 0  # the cap's prompt tokens left, where `capped`

        def take(seq: Sequence, budget: int, may_preempt: bool) -> int | None:
            # A long prefill deferred behind short prompts is taken without preemption: the newest
            # running requests may be in this step already, and a prompt's blocks were all
            # allocated at admission, so a chunk never needs a new one.
            nonlocal left
            if not may_preempt and seq.status is not SeqStatus.RUNNING:  # preempted meanwhile
                return None
            prompt = capped and len(seq) - seq.num_computed_tokens > 1
            if prompt:
                if left <= 0:
                    return 0
                budget = min(budget, left)
            n = self._take_running(seq, budget, may_preempt)
            if n is not None:
                seqs.append(seq)
                counts.append(n)
                left -= n if prompt else 0
            return n

        def admit(budget: int, max_tokens: int) -> int:
            nonlocal left
            if not capped:
                return self._admit_waiting(seqs, counts, budget, now, max_tokens)
            allowed = min(budget, left)
            if allowed <= 0:
                return budget
            spent = allowed - self._admit_waiting(seqs, counts, allowed, now, max_tokens)
            left -= spent
            return budget - spent

        spend_step_budget(
            self.running,
            lambda seq: len(seq) - seq.num_computed_tokens,
            len(self.waiting[0]) if self.waiting else None,
            self.cfg.long_prefill_token_threshold,
            self.cfg.max_num_batched_tokens,
            take,
            admit,
        )
        return ScheduledBatch(seqs, counts) if seqs else None

    def _order_waiting(self, now: float) -> None:
        """The queue in the order its prompts should start (it admits from the head): arrival, or
        shortest remaining first, aged, fairly across tenants (`cfg.prefill_order`)."""
        aging = AGING_TOKENS_PER_S if self.cfg.prefill_order == "shortest" else None
        waiting = self.waiting
        if aging is None or len(waiting) < 2:
            return
        seen = [
            Waiting(len(s) - s.num_computed_tokens, now - s.times.arrival, len(s) > s.num_prompt_tokens, s.share)
            for s in waiting
        ]
        order = admission_order(seen, aging, self.prefill_shares.served(now))
        if order != sorted(order):
            ordered = [waiting[i] for i in order]
            waiting.clear()
            waiting.extend(ordered)

    def _take_running(self, seq: Sequence, budget: int, may_preempt: bool = True) -> int | None:
        """Tokens of running `seq` in this step, blocks made room for by preempting the newest
        running requests; None when `seq` itself had to be preempted (or, without `may_preempt`,
        when its blocks do not fit)."""
        n = step_tokens(seq, budget, self.cfg.batch_invariant != "off")
        while not self._grow(seq, seq.num_computed_tokens + n):
            if not may_preempt:
                return None
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                break
        return n if seq.status is SeqStatus.RUNNING else None

    def _promised_window_pages(self) -> int:
        """Window pages the running prefills will still take before they are done (a grouped cache's)."""
        groups = self.blocks.groups
        if groups is None:
            return 0
        span = self.blocks.window_span(self.cfg.max_num_batched_tokens)
        more = 0
        for s in self.running:
            if s.num_computed_tokens < len(s):
                peak = min(span, len(s.block_table) - s.window_held_from)
                more += max(0, peak - (s.window_held_to - s.window_held_from))
        return more * groups.window_pages

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `seq`'s first `num_tokens` tokens, with the window pages of those a grouped
        cache's windowed layers will read; False (nothing new held) if the pool lacks them."""
        grew = len(seq.block_table)
        if not self.blocks.append_slot(seq.block_table, num_tokens):  # new blocks come with their windows
            return False
        if seq.window_held_to >= grew:
            seq.window_held_to = len(seq.block_table)
        upto = min(self.blocks.blocks_needed(num_tokens), len(seq.block_table))
        if upto > seq.window_held_to:  # a prompt's blocks, as its prefill reaches them
            if not self.blocks.hold_windows(seq.block_table, seq.window_held_to, upto):
                return False
            seq.window_held_to = upto
        return True

    def _admit_waiting(
        self, seqs: list[Sequence], counts: list[int], budget: int, now: float, max_tokens: int = 0
    ) -> int:
        """Start waiting requests from the head while budget, seats and blocks allow (with
        `max_tokens`, only while the next one is that short), each tenant's started prompt tokens
        counted for the fair order; returns the budget left."""
        while self.waiting and budget > 0 and self.free_seats():
            seq = self.waiting[0]
            if max_tokens and len(seq) > max_tokens:
                break
            if not self._allocate(seq):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.recorder.scheduled(seq)
            if seq.share.tenant:
                self.prefill_shares.started(seq.share.tenant, len(seq) - seq.num_computed_tokens, now)
            n = step_tokens(seq, budget, self.cfg.batch_invariant != "off")
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return budget

    def postprocess(self, batch: ScheduledBatch, sampled: Sampled) -> list[StepOutput]:
        """Record a step: the computed tokens' KV is in the cache, the sampled tokens join their
        sequences (a fork draw becomes a new sequence first, while its parent's blocks are held)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self._cache_blocks(seq)
            self._release_windows(seq, seq.num_computed_tokens)
        for i, prompt_lp in sampled.prompt_logprobs:
            batch.seqs[i].prompt_logprobs.append(prompt_lp)
        own: list[tuple[Sequence, int, TokenLogprob | None]] = []
        outs: list[StepOutput] = []
        indices = sampled.sample_indices or [batch.seqs[i].sample_index for i in sampled.indices]
        for i, t, lp, k in zip(sampled.indices, sampled.token_ids, sampled.logprobs, indices, strict=True):
            seq = batch.seqs[i]
            if k == seq.sample_index:
                own.append((seq, t, lp))
            elif seq.prefill_only:
                seq.first_draws.append((k, t, lp))
            else:
                outs.append(self.fork(seq, k, t, lp))
        runs: dict[int, list[tuple[Sequence, int, TokenLogprob | None]]] = {}
        for draw in own:  # a verified draft's tokens come as one run, in order
            runs.setdefault(id(draw[0]), []).append(draw)
        for run in runs.values():
            run[0][0].fork_indices = []
            outs += self._append_run(run) if len(run) > 1 else [self._append(*run[0])]
        return outs

    def reserve_draft(self, seq: Sequence, num_draft: int) -> bool:
        """Blocks for `seq`'s next token and `num_draft` draft tokens after it, from the free blocks
        only (a draft never preempts anyone); False (nothing changed) if they do not suffice."""
        return self._grow(seq, seq.num_computed_tokens + 1 + num_draft)

    def _append_run(self, run: list[tuple[Sequence, int, TokenLogprob | None]]) -> list[StepOutput]:
        """A verified draft's tokens joining `seq` in order, up to the first that finishes it. Each
        token after the first means the draft token before it was accepted, and so its K/V, computed
        by the step, is valid; the blocks that only rejected draft tokens reached are freed."""
        seq = run[0][0]
        outs: list[StepOutput] = []
        for j, (_, t, lp) in enumerate(run):
            if j:
                seq.num_computed_tokens += 1
            outs.append(self._append(seq, t, lp))
            if outs[-1].finished:
                return outs
        self._cache_blocks(seq)
        keep = self.blocks.blocks_needed(len(seq))  # what the next step writes into, too
        if len(seq.block_table) > keep:
            self.blocks.free_blocks(seq.block_table[keep:])  # the newest: each holds its window
            del seq.block_table[keep:]
            seq.window_held_to = min(seq.window_held_to, keep)
        return outs

    def fork(self, parent: Sequence, sample_index: int, token: int, logprob: TokenLogprob | None) -> StepOutput:
        """Sample `sample_index` of `parent`'s request, branching off at `parent`'s current length
        with `token`: it shares the parent's full blocks (copy on write: a full block is never
        written again) and gets a copy of the partial last one, or, without a free block for that,
        waits to be recomputed (its prompt blocks then come from the prefix cache)."""
        child = parent.forked(f"{parent.group_id}#{sample_index}", sample_index)
        self._check_id(child)
        self.requests[child.request_id] = child
        group = self.groups.setdefault(parent.group_id, [parent])
        group.append(child)
        bs = self.blocks.block_size
        full = parent.num_computed_tokens // bs
        partial = parent.num_computed_tokens % bs
        if not partial or self.blocks.num_free_blocks:
            child.block_table = self.blocks.share(parent.block_table[:full], parent.window_held_from)
            child.window_held_from = parent.window_held_from
            child.window_held_to = full + bool(partial)
            if partial:
                child.block_table += self.blocks.take(1)
                self.block_copies.append((parent.block_table[full], child.block_table[-1]))
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SeqStatus.RUNNING
            self.running.append(child)
            self.recorder.scheduled(child)
        else:
            self.waiting.appendleft(child)
        return self._append(child, token, logprob)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table, seq.window_held_from, seq.window_held_to)
        seq.window_held_from = seq.window_held_to = 0
        seq.num_computed_tokens = 0
        if not seq.num_output_tokens:
            seq.prompt_logprobs.clear()  # computed again from the start
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, sampled: bool = True) -> StepOutput:
        seq.token_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.accept(token)  # a token drawn under the grammar's mask is always accepted
        self.recorder.token(seq, sampled)
        p = seq.params
        reason = None
        if seq.prefill_only:
            reason = "prefill_done"
        elif (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_output_tokens or len(seq) >= self.max_position:
            reason = "length"
        if reason == "prefill_done":
            self.running.remove(seq)
            seq.status = SeqStatus.HELD
            self.held[seq.request_id] = seq
            self.recorder.finished(seq, reason)  # done as far as its latency goes; `release` frees it
        elif reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
        out = self._output(seq, token, logprob, reason)
        if p.prompt_logprobs and seq.num_output_tokens == 1:
            out = out._replace(prompt_logprobs=list(seq.prompt_logprobs))
        return out

    def _output(self, seq: Sequence, token: int, logprob: TokenLogprob | None, reason: str | None) -> StepOutput:
        group = self.groups.get(seq.group_id)
        remaining = sum(1 for s in group if s is not seq) + (reason is None) if group else int(reason is None)
        return StepOutput(
            seq.group_id,
            token,
            logprob,
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.sample_index,
            remaining,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is not SeqStatus.HELD:  # a held one was recorded when its prefill finished
            self.recorder.finished(seq, reason)
        del self.requests[seq.request_id]
        self.blocks.free_blocks(seq.block_table, seq.window_held_from, seq.window_held_to)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.remove(seq)
            if not group:
                del self.groups[seq.group_id]

    # ---- the remote half of a request's life ----

    def commit_remote(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> list[StepOutput] | None:
        """A reserved request's KV has arrived: it runs, with the first token of each sample that the
        prefill worker sampled (`handoff`: the reserved sequence's sample continues, the others fork
        from it). None if that transfer's request is no longer reserved (aborted meanwhile)."""
        seq = self.reserved.get(request_id)
        if seq is None or seq.transfer_id != transfer_id:
            return None
        context = len(seq)
        done = len(seq.output_token_ids)
        firsts = {s.index: s.output_token_ids[-1] for s in handoff.samples if len(s.output_token_ids) > done}
        if seq.sample_index not in firsts:
            raise ValueError(f"the handoff has no next token for sample {seq.sample_index}")
        del self.reserved[request_id]
        seq.num_computed_tokens = context
        self._cache_blocks(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)  # its seat was taken at reserve
        self.recorder.scheduled(seq)
        # The router has the first tokens from the prefill worker already: they join the sequences,
        # but the outputs carry no token, only whether it finished the sample.
        outs = [self.fork(seq, k, t, None) for k, t in sorted(firsts.items()) if k != seq.sample_index]
        outs.append(self._append(seq, firsts[seq.sample_index], None, sampled=False))
        return [o._replace(token_id=-1, logprob=None) for o in outs]

    def fail_transfer(self, request_id: str, transfer_id: bytes, code: str) -> StepOutput | None:
        """A request's KV transfer failed, and nothing writes or reads its blocks for it any more: the
        request ends with the failure's code (a reserved one on a decode worker, a prefilling or held
        one on a prefill worker). None if that transfer's request is gone already."""
        seq = self.aborting.pop(transfer_id, None)
        if seq is not None:  # aborted earlier; its blocks waited for this
            self.blocks.free_blocks(seq.block_table, seq.window_held_from, seq.window_held_to)
            return None
        seq = self.requests.get(request_id)
        if seq is None or seq.transfer_id != transfer_id:
            return None
        self.abort(request_id, cancel_transfer=lambda _: True)
        seq.finish_reason = code
        return StepOutput(seq.group_id, -1, None, True, code, seq.num_prompt_tokens, seq.num_cached_tokens)

    def release(self, request_id: str, transfer_id: bytes | None = None) -> bool:
        """Prefill role: a held request's KV has been sent (on `transfer_id`, when given); free its
        blocks. False if no such request is held."""
        seq = self.held.get(request_id)
        if seq is None or (transfer_id is not None and seq.transfer_id != transfer_id):
            return False
        del self.held[request_id]
        self._finish(seq, "prefill_done")
        return True

    def lookup(self, request_id: str) -> Sequence | None:
        """An unfinished sequence of the request (held ones included)."""
        seq = self.requests.get(request_id)
        if seq is None and request_id in self.groups:
            seq = self.groups[request_id][0]
        return seq

    def abort(self, request_id: str, cancel_transfer: Callable[[bytes], bool]) -> bool:
        """Stop a request (every sample of it) wherever it is and free its blocks; False if unknown.

        A reserved request's blocks are freed only once `cancel_transfer` promises that no
        write into them can still land; otherwise they wait for the transfer's outcome.
        """
        found = False
        for seq in list(self.groups.get(request_id, ())):
            found = self._abort_one(seq.request_id, cancel_transfer) or found
        return self._abort_one(request_id, cancel_transfer) or found

    def abort_sample(self, request_id: str, sample_index: int, cancel_transfer: Callable[[bytes], bool]) -> bool:
        """`abort` for one sample of the request: the others go on."""
        seqs = self.groups.get(request_id) or [s for s in (self.requests.get(request_id),) if s is not None]
        seq = next((s for s in seqs if s.sample_index == sample_index), None)
        return seq is not None and self._abort_one(seq.request_id, cancel_transfer)

    def _abort_one(self, request_id: str, cancel_transfer: Callable[[bytes], bool]) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        status = seq.status
        if status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif status is SeqStatus.HELD:
            del self.held[request_id]
        elif status is SeqStatus.RESERVED:
            del self.reserved[request_id]
            if not cancel_transfer(seq.transfer_id):
                self.recorder.finished(seq, "abort")
                del self.requests[request_id]
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
                self.aborting[seq.transfer_id] = seq
                return True
        self._finish(seq, "abort")
        return True

    # ---- what the worker reports ----

    def stats(self) -> SchedulerStats:
        queued = sum(len(s) for s in self.waiting) + sum(
            len(s) - s.num_computed_tokens for s in self.running if len(s) - s.num_computed_tokens > 1
        )
        return SchedulerStats(
            queued_tokens=queued,
            running_tokens=sum(len(s) for s in self.running),
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            queue_length=len(self.waiting),
            running_requests=len(self.running),
            reserved_requests=len(self.reserved),
            prefix_cache_queries=self.blocks.stats.queries,
            prefix_cache_hits=self.blocks.stats.hits,
        )

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Tokens of `token_ids` this cache holds now (whole blocks), those it would load from a tier
        behind it included (what a request's usage reports as cached)."""
        bs = self.blocks.block_size
        hashes = block_hashes(token_ids, bs)
        n = len(self.blocks.cached_prefix(hashes, len(token_ids)))
        if self.tiers is not None and self.blocks.enable_prefix_caching:
            n += self.tiers.loadable(hashes[n : min(len(hashes), (len(token_ids) - 1) // bs)])
        return n * bs

    def drain_block_events(self) -> list[BlockEvent]:
        return self.blocks.drain_events()

    def cached_block_hashes(self) -> tuple[bytes, ...]:
        return tuple(self.blocks.hash_to_block)


def step_tokens(seq: Sequence, budget: int, invariant: bool = True) -> int:
    """The tokens of `seq` to compute in a step of `budget`: as many as are left, but a seeded
    request's output tokens (its context again after a migration or a preemption) one a step and
    its prompt's chunk stopping where they begin. Decoding computed each output token's KV as a
    step's one row, and a row's bits do not depend on what else the step holds (the block kernel,
    model_runner.py's `_forward_apart`), so the recomputed KV is the same bits and the seed gives
    the text it would have given (issue 45: 3 of 6 seeded prompts kept theirs after a decode
    worker was killed). It costs one step per output token, so only a seed asks for it, and not
    with `invariant` off (--batch-invariant off)."""
    left = len(seq) - seq.num_computed_tokens
    if not invariant or seq.params.seed is None or len(seq) <= seq.num_prompt_tokens:
        return min(left, budget)
    if seq.num_computed_tokens >= seq.num_prompt_tokens:
        return min(1, budget)
    return min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
