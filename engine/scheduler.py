"""Which tokens of which requests run in the next step.

One token budget per step (`max_num_batched_tokens`) is shared by everything:
running requests first (a decoding request takes one token, a request still
prefilling takes its next chunk), then new requests in arrival order while the
budget, the running-request limit and the free blocks allow. A prompt longer
than the budget is prefilled in chunks over several steps. When a decoding
request needs a block and none is free, the newest running request is
preempted: its blocks are freed and it is recomputed later (its full blocks
usually come back from the prefix cache).

Only the scheduler touches the block manager; the runner sees block tables.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.sequence import Sequence, SeqStatus


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.cfg.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.blocks.append_slot(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:  # preempted itself: nothing left to take from
                break
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self.allocate_blocks(seq):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n

        return ScheduledBatch(seqs, counts) if seqs else None

    def allocate_blocks(self, seq: Sequence) -> bool:
        """Give `seq` a block table for all its tokens, its cached prefix reused; False (nothing
        changed) when the free blocks do not suffice. Sets block_table and num_cached_tokens."""
        hashes = block_hashes(seq.token_ids, self.blocks.block_size)
        if not self.blocks.can_allocate(len(seq), self.blocks.cached_prefix(hashes, len(seq))):
            return False
        seq.block_table, seq.num_cached_tokens = self.blocks.allocate(len(seq), hashes)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it (finish or abort); its blocks stay with it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
