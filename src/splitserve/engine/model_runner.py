"""Runs one scheduled batch through the model: builds the step's inputs and
attention metadata from block tables, runs the forward pass, and samples the
next token of each sequence whose step ends at its last token.

On CUDA, pure-decode steps are replayed from CUDA graphs captured per (batch
size, block-table width) bucket: a decode step is hundreds of small kernels, and
launching them one by one costs more than running them.

Under tensor parallelism the runner is rank 0's: it sends each step's inputs
to the other ranks (engine/parallel/group.py) before running its own shard,
and samples alone. CUDA graphs are off there: a captured step would need the
ranks' collectives captured in lockstep too, which is left for later.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.handoff import TokenLogprob
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model import LlamaModel
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.step import StepInputs, run_step
from splitserve.engine.sampler import sample
from splitserve.engine.scheduler import Sampled, ScheduledBatch
from splitserve.engine.sequence import Sequence

# Called as each layer of a batch lands in the cache: (layer, the batch's seqs, their new token counts).
BatchLayerHook = Callable[[int, Seq[Sequence], Seq[int]], None]


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: KVCache, cfg: EngineConfig, tp: TensorParallelGroup | None = None
    ) -> None:
        """`tp`: the other ranks, which run every step with this one (None: no tensor parallelism)."""
        self.model = model
        self.kv_cache = kv_cache
        self.cfg = cfg
        self.tp = tp
        self.device = model.device
        self.block_size = cfg.block_size
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and cfg.use_cuda_graphs and tp is None:
            self.graphs = DecodeGraphs(model, kv_cache.tensor, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)  # for requests without a seed of their own
        self.eos_token_ids: tuple[int, ...] = ()  # what min_tokens holds back, with stop_token_ids
        # A matcher's next mask depends only on the tokens it accepted, all known before the step,
        # so on a GPU the masks are filled on a thread while the forward pass runs there (llguidance
        # releases the GIL). On the CPU the forward pass has every core and a mask takes
        # microseconds (0.12 ms at batch 8): measured on 2 cores, the thread gains nothing (0.99x
        # the step at batch 1 and 8) and on an oversubscribed machine it moved the step by +-10%
        # either way; there the masks are filled before the step, with no hand-off.
        self._masks: ThreadPoolExecutor | None = None
        self._overlap_masks = self.device.type == "cuda"
        self.prompt_rows: list[tuple[int, int, int]] = []  # this step's (batch index, position, logits row)

    def run(self, batch: ScheduledBatch, on_layer_done: BatchLayerHook | None = None) -> Sampled:
        """The next token of each sequence whose step ends at its last token (and of each fork of a
        fresh n > 1 request at its first)."""
        seqs = batch.seqs
        hook = None
        if on_layer_done is not None:
            hook = lambda layer: on_layer_done(layer, seqs, batch.num_new_tokens)  # noqa: E731 (None or this closure)
        ending = [s for s, n in zip(seqs, batch.num_new_tokens, strict=True) if s.num_computed_tokens + n == len(s)]
        masks = self._start_masks(ending)
        logits, indices = self.forward(seqs, batch.num_new_tokens, hook)
        prompt = self._prompt_logprobs(seqs, logits[len(indices) :])
        logits = logits[: len(indices)]
        if not indices:
            return Sampled([], [], [], prompt_logprobs=prompt)
        rows, draws, generators = self._draws([seqs[i] for i in indices])
        raw = logits if len(rows) == len(indices) else logits[rows]
        masked = raw
        if masks is not None:
            from splitserve.engine.grammar import apply_bitmask

            masked = raw.clone()
            apply_bitmask(masked, masks.result()[rows], [r for r, (s, _) in enumerate(draws) if s.matcher is not None])
        chosen = [s for s, _ in draws]
        result = sample(
            masked,
            [s.params for s in chosen],
            [s.token_ids[: s.num_prompt_tokens] for s in chosen],
            [s.output_token_ids for s in chosen],
            generators,
            self.generator,
            raw_logits=raw,
            stop_ids=[self._stop_ids(s) for s in chosen],
        )
        return Sampled([indices[r] for r in rows], result.token_ids, result.logprobs, [k for _, k in draws], prompt)

    def _want_prompt_logits(self, i: int, seq: Sequence, start: int, end: int, first_row: int) -> None:
        """With prompt_logprobs: the rows of the positions this step computes whose logits predict a
        prompt token (position p predicts token p + 1), noted as (batch index, p, row)."""
        if not seq.params.prompt_logprobs or seq.num_output_tokens:  # none, or reported before a preemption
            return
        for p in range(start, min(end, seq.num_prompt_tokens - 1)):
            self.prompt_rows.append((i, p, first_row + p - start))

    def _prompt_logprobs(self, seqs: Seq[Sequence], logits: torch.Tensor) -> list[tuple[int, TokenLogprob]]:
        """(batch index, logprob) of each prompt token the step's logits predict, in order, with the
        prompt_logprobs - 1 most likely others (raw distribution, as the output's)."""
        if not self.prompt_rows:
            return []
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.as_tensor([seqs[i].token_ids[p + 1] for i, p, _ in self.prompt_rows], device=logits.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        k = max(seqs[i].params.prompt_logprobs for i, _, _ in self.prompt_rows) - 1
        top_v, top_i = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        top_vl, top_il = top_v.tolist(), top_i.tolist()
        out = []
        for j, (i, _, _) in enumerate(self.prompt_rows):
            m = seqs[i].params.prompt_logprobs - 1
            out.append((i, TokenLogprob(chosen[j], tuple(zip(top_il[j][:m], top_vl[j][:m], strict=True)))))
        return out

    def _draws(self, chosen: list[Sequence]) -> tuple[list[int], list[tuple[Sequence, int]], list[Any]]:
        """Each draw's logits row, (sequence, sample index) and generator: one per sequence, and one
        more per fork of a fresh n > 1 request at its first output position, each from randomness
        of its own sample index."""
        rows: list[int] = []
        draws: list[tuple[Sequence, int]] = []
        generators: list[torch.Generator | None] = []
        for r, s in enumerate(chosen):
            rows.append(r)
            draws.append((s, s.sample_index))
            generators.append(s.next_draw_generator())  # right before the draw: reseeded for this token
            for k in s.fork_indices:
                rows.append(r)
                draws.append((s, k))
                generators.append(s.draw_generator(k))
        return rows, draws, generators

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.params
        return p.stop_token_ids if p.ignore_eos else (*self.eos_token_ids, *p.stop_token_ids)

    def _start_masks(self, ending: list[Sequence]) -> Future[torch.Tensor] | None:
        """The grammar masks of the sequences about to sample, one row per sequence (the forks of one
        share its row: same state): filled on a thread while the forward pass runs on a GPU, now on
        the CPU."""
        if not any(s.matcher is not None for s in ending):
            return None
        if not self._overlap_masks:
            done: Future[torch.Tensor] = Future()
            done.set_result(_fill_masks([s.matcher for s in ending], self.model.cfg.vocab_size))
            return done
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masks.submit(_fill_masks, [s.matcher for s in ending], self.model.cfg.vocab_size)

    def forward(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Logits [S, vocab] (fp32) for the sequences whose step ends at their last token,
        and those sequences' indices in `seqs`."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        context_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        self.prompt_rows = []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            pos = range(start, end)
            positions.extend(pos)
            table = seq.block_table
            slot_blocks.extend(table[p // bs] for p in pos)
            slot_offsets.extend(p % bs for p in pos)
            context_lens.append(end)
            if end == len(seq):
                logits_rows.append(len(input_ids) - 1)
                sampled.append(i)
            self._want_prompt_logits(i, seq, start, end, len(input_ids) - n)
        logits_rows += [row for _, _, row in self.prompt_rows]  # after the sampling rows
        is_decode = all(n == 1 for n in num_new_tokens)
        width = max(len(s.block_table) for s in seqs)

        if is_decode and self.graphs is not None and on_layer_done is None and self.graphs.fits(len(seqs), width):
            logits = self.graphs.run(seqs, input_ids, positions, slot_blocks, slot_offsets, context_lens)
            return logits, sampled

        tables = [seq.block_table for seq in seqs]
        step = StepInputs(
            input_ids,
            positions,
            slot_blocks,
            slot_offsets,
            tables,
            context_lens,
            list(num_new_tokens),
            logits_rows,
            is_decode,
        )
        if self.tp is not None:
            self.tp.broadcast(step)
        return run_step(self.model, self.kv_cache.tensor, step, on_layer_done), sampled


def _fill_masks(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """A bitmask with a row per matcher (None: a row left all allowed), filled in one call."""
    from splitserve.engine.grammar import allocate_bitmask, fill_masks

    bitmask = allocate_bitmask(len(matchers), vocab_size)
    fill_masks([(m, row) for row, m in enumerate(matchers) if m is not None], bitmask)
    return bitmask
