"""The engine's speculation: drafts for a scheduled decode step, and what the step taught.

`plan` runs after the scheduler picked the step: each decoding sequence's draft (ngram.py,
cut where its grammar would refuse a token), lengths chosen by the policy (policy.py: the
measured acceptance against the measured step costs; `--speculative ngram` takes every
draft whole) and blocks for them from the free ones (`Scheduler.reserve_draft`). `observe`
runs after the model: each sequence's acceptance, the engine's, the step's cost by its rows,
and the counts for metrics.

Only steps where every sequence decodes speculate: their cost is what the policy measures,
and a step with a prompt chunk in it is bound by the chunk. A sequence the policy leaves
without a draft still has its draft's first token checked against the token it gets (a free
measurement), so a sequence that starts copying turns speculation on for itself.

Everything a sequence's speculation needs is derived here from its tokens and its steps on
this engine; a handoff (migration, a remote prefill) carries tokens only, and the next engine
starts the record afresh from its own engine-wide acceptance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from splitserve.engine.config import EngineConfig
from splitserve.engine.kernels.linear import MAX_ROWS
from splitserve.engine.scheduler import Sampled, ScheduledBatch, Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.ngram import propose
from splitserve.engine.spec.policy import Acceptance, StepCosts, plan_drafts

# What an engine that has verified nothing yet expects of a draft token: about what prompt
# lookup reaches on text that copies its prompt, so that the first drafts are tried and measured.
INITIAL_RATE = 0.5
# Rows in a step at most, drafts included: up to this many rows the CPU's matrix products run on
# the decode kernel (engine/kernels/linear.py), whose rows do not depend on each other, so a draft's
# rows compute exactly what plain decode computes; past it oneDNN's GEMM takes over.
MAX_STEP_ROWS = MAX_ROWS


@dataclass
class SpecState:
    """One sequence's speculation record (its `Sequence.speculation`)."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: int | None = None  # the first token of a draft it did not verify, checked when it arrives


class Speculator:
    def __init__(self, cfg: EngineConfig, max_position: int, scheduler: Scheduler) -> None:
        if cfg.speculative not in ("ngram", "auto"):
            raise ValueError(f"no speculator for speculative={cfg.speculative!r}")
        self.cfg = cfg
        self.max_position = max_position
        self.scheduler = scheduler
        self.costs = StepCosts()  # decode steps' seconds by rows
        self.acceptance = Acceptance()  # the engine's, every sequence's measurements together

    def plan(self, batch: ScheduledBatch) -> ScheduledBatch:
        """`batch` with drafts (and their blocks) where they are expected to pay."""
        if any(n != 1 for n in batch.num_new_tokens):
            return batch
        cands = [(i, seq, self._draft(seq)) for i, seq in enumerate(batch.seqs) if self._may_draft(seq)]
        cands = [c for c in cands if c[2]]
        if not cands:
            return batch
        rows = len(batch.seqs)
        prior = self.acceptance.rate(INITIAL_RATE)
        states = [_state(seq) for _, seq, _ in cands]
        if self.cfg.speculative == "ngram":
            lens = _fill([len(d) for _, _, d in cands], MAX_STEP_ROWS - rows)
        else:
            rates = [st.acceptance.rate(prior) for st in states]
            lens = plan_drafts(rates, [len(d) for _, _, d in cands], rows, self.costs.seconds, MAX_STEP_ROWS)
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        for (i, seq, draft), st, k in zip(cands, states, lens, strict=True):
            if k and self.scheduler.reserve_draft(seq, k):
                drafts[i] = draft[:k]
                st.shadow = None
            else:
                st.shadow = draft[0]
        return batch._replace(drafts=drafts) if any(drafts) else batch

    def observe(self, batch: ScheduledBatch, sampled: Sampled, seconds: float) -> None:
        """After the step: acceptance per sequence and engine-wide, the step's cost, the counts."""
        got: dict[int, list[int]] = defaultdict(list)
        own = sampled.sample_indices or [batch.seqs[i].sample_index for i in sampled.indices]
        for i, t, k in zip(sampled.indices, sampled.token_ids, own, strict=True):
            if k == batch.seqs[i].sample_index:
                got[i].append(t)
        drafts = batch.drafts or [[] for _ in batch.seqs]
        drafted = accepted = 0
        for i, (seq, draft) in enumerate(zip(batch.seqs, drafts, strict=True)):
            st = seq.speculation
            if st is None or not got[i]:
                continue
            if draft:
                n = len(got[i]) - 1
                drafted, accepted = drafted + len(draft), accepted + n
                self._record(st, len(draft), n)
            elif st.shadow is not None:
                self._record(st, 1, int(got[i][0] == st.shadow))
            st.shadow = None
        if all(n == 1 for n in batch.num_new_tokens):
            self.costs.record(len(batch.seqs) + sum(len(d) for d in drafts), seconds)
        if drafted:
            self.scheduler.recorder.drafts(drafted, accepted)

    def _record(self, st: SpecState, drafted: int, accepted: int) -> None:
        st.acceptance.record(drafted, accepted)
        self.acceptance.record(drafted, accepted)

    def _may_draft(self, seq: Sequence) -> bool:
        """A sequence past its first output token, decoding its last one (not a fresh n > 1 request
        about to fork, nor a prefill worker's request, which ends at its first token)."""
        return (
            seq.num_computed_tokens + 1 == len(seq)
            and seq.num_output_tokens > 0
            and not seq.fork_indices
            and not seq.prefill_only
        )

    def _draft(self, seq: Sequence) -> list[int]:
        """`seq`'s draft: no longer than its max_tokens and the model's context leave room for
        (the step emits one token more than it drafts), cut at the first token its grammar refuses."""
        room = min(
            self.cfg.num_speculative_tokens,
            seq.max_output_tokens - seq.num_output_tokens - 1,
            self.max_position - len(seq),
        )
        if room <= 0:
            return []
        draft = propose(seq.token_ids, room, self.cfg.ngram_min, self.cfg.ngram_max)
        if draft and seq.matcher is not None:
            draft = draft[: seq.matcher.allowed_prefix(draft)]
        return draft


def _state(seq: Sequence) -> SpecState:
    if seq.speculation is None:
        seq.speculation = SpecState()
    st: SpecState = seq.speculation
    return st


def _fill(lens: list[int], room: int) -> list[int]:
    """Whole drafts in order while `room` rows last; the one that does not fit is cut to it."""
    out = []
    for k in lens:
        take = max(0, min(k, room))
        out.append(take)
        room -= take
    return out
