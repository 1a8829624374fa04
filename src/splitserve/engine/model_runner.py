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
from typing import Any, NamedTuple

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.handoff import TokenLogprob
from splitserve.engine.kernels.decode import decode_kernels
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.lora.rows import LoraRows
from splitserve.engine.model import DecoderModel
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.step import StepInputs, run_step
from splitserve.engine.sampler import DrawRows, sample
from splitserve.engine.scheduler import Sampled, ScheduledBatch
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.verify import accepted_tokens

# Called as each layer of a batch lands in the cache: (layer, the batch's seqs, their new token counts).
BatchLayerHook = Callable[[int, Seq[Sequence], Seq[int]], None]


class ModelRunner:
    def __init__(
        self, model: DecoderModel, kv_cache: KVCache, cfg: EngineConfig, tp: TensorParallelGroup | None = None
    ) -> None:
        """`tp`: the other ranks, which run every step with this one (None: no tensor parallelism)."""
        self.model = model
        self.kv_cache = kv_cache
        self.cfg = cfg
        self.tp = tp
        self.device = model.device
        self.block_size = cfg.block_size
        self.graphs: DecodeGraphs | None = None
        # (a grouped cache's windowed layers read translated tables, which the graphs do not stage)
        if self.device.type == "cuda" and cfg.use_cuda_graphs and tp is None and kv_cache.groups is None:
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
        self.lora_rows: LoraRows | None = None  # this step's rows of each LoRA adapter
        # The CPU kernel that draws a step's temperature-only rows in one call: torch's dozen operator
        # calls for them took ~0.8 ms of a 13 ms batch-4 SmolLM2 step (sampler.py's `draw` otherwise).
        kernels = decode_kernels() if self.device.type == "cpu" else None
        self._draw_rows: DrawRows | None = kernels.draw if kernels is not None else None

    def run(self, batch: ScheduledBatch, on_layer_done: BatchLayerHook | None = None) -> Sampled:
        """The next token of each sequence whose step ends at its last token (and of each fork of a
        fresh n > 1 request at its first); a sequence with a draft (`batch.drafts`) gets the tokens
        its verified draft yields (engine/spec/verify.py), one or more, in order."""
        seqs = batch.seqs
        drafts = batch.drafts or [[] for _ in seqs]
        todo = zip(seqs, batch.num_new_tokens, drafts, strict=True)
        ending = [(s, d) for s, n, d in todo if s.num_computed_tokens + n == len(s)]
        masks = self._start_masks([m for s, d in ending for m in _row_matchers(s, d)])
        logits, indices = self._forward_apart(seqs, batch.num_new_tokens, on_layer_done, drafts)
        num_rows = sum(1 + len(drafts[i]) for i in indices)
        prompt = self._prompt_logprobs(seqs, logits[num_rows:])
        logits = logits[:num_rows]
        if not indices:
            return Sampled([], [], [], prompt_logprobs=prompt)
        draws = self._draws([(seqs[i], drafts[i]) for i in indices])
        rows = [d.row for d in draws]
        raw = logits if len(rows) == num_rows else logits[rows]
        masked = raw
        if masks is not None:
            from splitserve.engine.grammar import apply_bitmask

            masked = raw.clone()
            apply_bitmask(masked, masks.result()[rows], [r for r, d in enumerate(draws) if d.seq.matcher is not None])
        result = sample(
            masked,
            [d.seq.params for d in draws],
            [d.seq.token_ids[: d.seq.num_prompt_tokens] for d in draws],
            [d.seq.output_token_ids + d.ahead for d in draws],
            [d.generator for d in draws],
            self.generator,
            raw_logits=raw,
            stop_ids=[self._stop_ids(d.seq) for d in draws],
            draw_rows=self._draw_rows,
        )
        return _verified(indices, [drafts[i] for i in indices], draws, result.token_ids, result.logprobs, prompt)

    def _forward_apart(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        on_layer_done: BatchLayerHook | None,
        drafts: Seq[Seq[int]],
    ) -> tuple[torch.Tensor, list[int]]:
        """forward(), but a step that mixes decode rows with prefill chunks computes its decode rows
        as a pure decode step computes them (the fused decode kernels, where they run). In a mixed
        step a decode row took the torch path (attention over the gathered blocks, torch's norms), so
        a seeded request's text depended on whether another prompt was prefilled while it decoded
        (issue 45: the six-prompt check kept 5 of 6 texts colocated). Where the model `joins` the
        two kinds (on a CPU, every matrix on its row-wise kernel) that is one pass with attention
        apart; else two passes, the decode rows first, each part's sequences hearing the layer hook
        (a sequence still hears each layer once)."""
        one = [
            i
            for i, (s, n) in enumerate(zip(seqs, num_new_tokens, strict=True))
            if drafts[i] or (n == 1 and _output_row(s))  # a seeded resume's outputs too
        ]
        if self.cfg.batch_invariant == "off" or not one or len(one) == len(seqs):
            return self.forward(seqs, num_new_tokens, _layer_hook(on_layer_done, seqs, num_new_tokens), drafts)
        alone = set(one)
        rest = [i for i in range(len(seqs)) if i not in alone]
        joined = self._forward_joined(seqs, num_new_tokens, on_layer_done, drafts, one + rest, len(one))
        if joined is not None:
            return joined
        parts = []
        for group in (one, rest):
            part, counts = [seqs[i] for i in group], [num_new_tokens[i] for i in group]
            logits, got = self.forward(
                part, counts, _layer_hook(on_layer_done, part, counts), [drafts[i] for i in group]
            )
            parts.append((group, logits, got))
        self.prompt_rows = [(rest[i], p, row) for i, p, row in self.prompt_rows]  # the chunks' (the second)
        spans: list[tuple[int, int, int]] = []
        at = 0
        for group, _, got in parts:
            for j in got:
                n = 1 + len(drafts[group[j]])
                spans.append((group[j], at, n))
                at += n
        return _in_batch_order(torch.cat([parts[0][1], parts[1][1]]), spans, at)  # decode rows: no prompt rows

    def _forward_joined(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        on_layer_done: BatchLayerHook | None,
        drafts: Seq[Seq[int]],
        order: list[int],
        decoding: int,
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The mixed step as one pass, its sequences in `order` (the first `decoding` of them decode
        rows, then the chunks); None where the model does not join them (or tensor parallelism)."""
        if self.tp is not None:
            return None
        part, counts = [seqs[i] for i in order], [num_new_tokens[i] for i in order]
        part_drafts = [drafts[i] for i in order]
        step, sampled = self._step_inputs(part, counts, part_drafts)
        rows = sum(1 + len(d) for d in part_drafts[:decoding])
        if not self.model.joins(self.kv_cache.tensor, step.context_lens[:rows], len(step.input_ids)):
            return None
        hook = _layer_hook(on_layer_done, part, counts)
        logits = run_step(self.model, self.kv_cache.tensor, step, hook, rows, self.lora_rows)
        self.prompt_rows = [(order[i], p, row) for i, p, row in self.prompt_rows]
        spans: list[tuple[int, int, int]] = []
        at = 0
        for j in sampled:
            n = 1 + len(part_drafts[j])
            spans.append((order[j], at, n))
            at += n
        return _in_batch_order(logits, spans, at)

    @staticmethod
    def _wants_prompt_rows(seq: Sequence) -> bool:
        return bool(seq.params.prompt_logprobs) and not seq.num_output_tokens

    def _want_prompt_logits(self, i: int, seq: Sequence, start: int, end: int, first_row: int) -> None:
        """With prompt_logprobs: the rows of the positions this step computes whose logits predict a
        prompt token (position p predicts token p + 1), noted as (batch index, p, row)."""
        if not self._wants_prompt_rows(seq):  # none, or reported before a preemption
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

    def _draws(self, chosen: list[tuple[Sequence, list[int]]]) -> list[Draw]:
        """Each draw of the step, in logits-row order: one per sequence and draft token (a draft's
        row j draws output position len + j, as if the draft tokens before it were accepted), and
        one more per fork of a fresh n > 1 request at its first output position, each from
        randomness of its own sample index."""
        draws: list[Draw] = []
        row = 0
        for s, draft in chosen:
            # right before the draw: reseeded for this token
            draws.append(Draw(row, s, s.sample_index, s.next_draw_generator(), []))
            for k in s.fork_indices:
                draws.append(Draw(row, s, k, s.draw_generator(k), []))
            for j in range(1, len(draft) + 1):
                draws.append(Draw(row + j, s, s.sample_index, s.draw_generator(s.sample_index, ahead=j), draft[:j]))
            row += 1 + len(draft)
        return draws

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.params
        return p.stop_token_ids if p.ignore_eos else (*self.eos_token_ids, *p.stop_token_ids)

    def _start_masks(self, matchers: list[Any]) -> Future[torch.Tensor] | None:
        """The grammar masks of the step's logits rows, one per row (`matchers`: a row's matcher,
        None for an unconstrained row; the forks of a sequence share its row: same state): filled
        on a thread while the forward pass runs on a GPU, now on the CPU."""
        if not any(m is not None for m in matchers):
            return None
        if not self._overlap_masks:
            done: Future[torch.Tensor] = Future()
            done.set_result(_fill_masks(matchers, self.model.cfg.vocab_size))
            return done
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masks.submit(_fill_masks, matchers, self.model.cfg.vocab_size)

    def forward(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        on_layer_done: Callable[[int], None] | None = None,
        drafts: Seq[Seq[int]] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Logits (fp32) for the sequences whose step ends at their last token, one row each and
        one more per draft token (`drafts`), then the prompt-logprob rows; and those sequences'
        indices in `seqs`."""
        step, sampled = self._step_inputs(seqs, num_new_tokens, drafts or [()] * len(seqs))
        width = max(len(t) for t in step.block_tables)
        if (
            step.is_decode
            and self.lora_rows is None  # the graphs replay the base model's step
            and len(step.query_lens) == len(seqs)  # no draft rows: the graphs take a row per sequence
            and self.graphs is not None
            and on_layer_done is None
            and self.graphs.fits(len(seqs), width)
        ):
            return self.graphs.run(
                seqs, step.input_ids, step.positions, step.slot_blocks, step.slot_offsets, step.context_lens
            ), sampled
        if self.tp is not None:
            self.tp.broadcast(step)
        return run_step(self.model, self.kv_cache.tensor, step, on_layer_done, lora=self.lora_rows), sampled

    def _step_inputs(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], drafts: Seq[Seq[int]]
    ) -> tuple[StepInputs, list[int]]:
        """The step's rows. A sequence with a draft brings its last token and the draft's, each
        a query of one token at its own position and context length: to attention (the fused
        decode kernel too, which writes every row's K/V before any row attends) these are decode
        rows, computed as plain decode computes them one step at a time."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        rows_per_seq: list[int] = []
        self.prompt_rows = []
        for i, (seq, n, draft) in enumerate(zip(seqs, num_new_tokens, drafts, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            chunks = [(start, end)] if not draft else [(p, p + 1) for p in range(start, end + len(draft))]
            tokens = seq.token_ids[start:end] + list(draft)
            rows_per_seq.append(len(tokens))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            slot_blocks.extend(seq.block_table[p // bs] for p in range(start, start + len(tokens)))
            for a, b in chunks:
                tables.append(seq.block_table)
                context_lens.append(b)
                query_lens.append(b - a)
            if end == len(seq):
                logits_rows.extend(range(len(ids) - 1 - len(draft), len(ids)))
                sampled.append(i)
            self._want_prompt_logits(i, seq, start, end, len(ids) - n - len(draft))
        logits_rows += [row for _, _, row in self.prompt_rows]  # after the sampling rows
        self.lora_rows = LoraRows.of([s.adapter for s in seqs], rows_per_seq, self.device)
        window_slots, window_tables = self._window_pages(seqs, slot_blocks, tables)
        step = StepInputs(
            ids,
            positions,
            slot_blocks,
            [p % bs for p in positions],
            tables,
            context_lens,
            query_lens,
            logits_rows,
            # a prompt's token is a prefill row even alone in its chunk: computed as a prefill computes it
            all(q == 1 for q in query_lens) and all(_output_row(s) or d for s, d in zip(seqs, drafts, strict=True)),
            window_slots,
            window_tables,
        )
        return step, sampled

    def _window_pages(
        self, seqs: Seq[Sequence], slot_blocks: list[int], tables: list[list[int]]
    ) -> tuple[list[list[int]], list[list[list[int]]]]:
        """A grouped cache's step addressed to each group of windowed pages: the slots' and the block
        tables' pages. A block past the sequence's windows reads the scratch page: the window masks it."""
        groups = self.kv_cache.groups
        if groups is None:
            return [], []
        held = self.kv_cache.window_pages
        scratch = self.kv_cache.num_blocks - 1
        held_from = {id(seq.block_table): seq.window_held_from for seq in seqs}
        per_table: dict[int, list[tuple[int, ...]]] = {}
        for t in tables:
            if id(t) not in per_table:
                start = held_from[id(t)]
                rows = [(scratch,) * groups.window_pages] * start
                per_table[id(t)] = rows + [held[b] or (scratch,) * groups.window_pages for b in t[start:]]
        slot_pages = [held[b] for b in slot_blocks]
        if any(p is None for p in slot_pages):
            raise RuntimeError("a step writes into a block that holds no windowed pages")
        return (
            [[p[g] for p in slot_pages] for g in range(groups.window_pages)],  # type: ignore[index]
            [[[p[g] for p in per_table[id(t)]] for t in tables] for g in range(groups.window_pages)],
        )


class Draw(NamedTuple):
    """One draw of a step: its logits row, whose it is, its generator (None: the engine's) and
    the draft tokens assumed accepted before it (a verified draft's rows)."""

    row: int
    seq: Sequence
    sample_index: int
    generator: torch.Generator | None
    ahead: list[int]


def _output_row(seq: Sequence) -> bool:
    """Whether `seq`'s next token is an output token's (a decode row), not a prompt token's: a prompt
    chunk of one token (an ITL-capped chunk's last, a prefix hit's remainder) is a prefill row, as
    the rest of its prompt was; on the decode kernels its K/V took other bits and a seeded text
    parted from its run alone three tokens later."""
    return seq.num_computed_tokens >= seq.num_prompt_tokens


def _in_batch_order(logits: torch.Tensor, spans: list[tuple[int, int, int]], at: int) -> tuple[torch.Tensor, list[int]]:
    """A step run in another order put back: each sampled sequence's rows (`spans`: its batch index,
    first row, rows) in batch order, as the grammar masks are, then the prompt rows (from `at` on);
    and the sampled sequences' batch indices."""
    spans = sorted(spans)
    order = [r for _, first, n in spans for r in range(first, first + n)] + list(range(at, logits.shape[0]))
    return logits[torch.as_tensor(order, dtype=torch.long, device=logits.device)], [i for i, _, _ in spans]


def _layer_hook(
    on_layer_done: BatchLayerHook | None, seqs: Seq[Sequence], counts: Seq[int]
) -> Callable[[int], None] | None:
    """The model's per-layer callback for a forward pass over `seqs`: the batch hook told which
    sequences and how many tokens each (None: no hook)."""
    if on_layer_done is None:
        return None
    return lambda layer: on_layer_done(layer, seqs, counts)


def _row_matchers(seq: Sequence, draft: list[int]) -> list[Any]:
    """The grammar state at each of `seq`'s logits rows: its matcher, then copies advanced past
    each draft token (the speculator kept only the draft tokens the grammar allows)."""
    if seq.matcher is None:
        return [None] * (1 + len(draft))
    rows = [seq.matcher]
    for t in draft:
        ahead = rows[-1].fork()
        ahead.accept(t)
        rows.append(ahead)
    return rows


def _verified(
    indices: list[int],
    drafts: list[list[int]],
    draws: list[Draw],
    tokens: list[int],
    logprobs: list[TokenLogprob | None],
    prompt: list[tuple[int, TokenLogprob]],
) -> Sampled:
    """The step's `Sampled`: every draw of a sequence without a draft; of a verified draft's rows,
    the tokens `accepted_tokens` keeps (its draws are in row order, each its own sample's)."""
    out_i: list[int] = []
    out_t: list[int] = []
    out_lp: list[TokenLogprob | None] = []
    out_k: list[int] = []
    at = 0
    for i, draft in zip(indices, drafts, strict=True):
        n = 1 + len(draft) + len(draws[at].seq.fork_indices)
        mine = list(range(at, at + n))
        if draft:
            mine = mine[: len(accepted_tokens(draft, [tokens[r] for r in mine]))]
        for r in mine:
            out_i.append(i)
            out_t.append(tokens[r])
            out_lp.append(logprobs[r])
            out_k.append(draws[r].sample_index)
        at += n
    return Sampled(out_i, out_t, out_lp, out_k, prompt)


def _fill_masks(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """A bitmask with a row per matcher (None: a row left all allowed), filled in one call."""
    from splitserve.engine.grammar import allocate_bitmask, fill_masks

    bitmask = allocate_bitmask(len(matchers), vocab_size)
    fill_masks([(m, row) for row, m in enumerate(matchers) if m is not None], bitmask)
    return bitmask
