"""The single-process engine: add requests, step, stream outputs.

A step is three moves (nano-vllm's shape): the scheduler picks the batch, the
runner runs it, the engine records the result. The workers wrap this same
object in their roles:

- prefill role: `add_request(..., prefill_only=True)` finishes a request after
  its first token but keeps its blocks until `release()`, because the KV
  sender is still reading them; `step(on_layer_done=...)` tells the caller as
  each layer's KV lands in the cache.
- decode role: `reserve()` admits a request whose prompt KV will be written by
  someone else into the returned blocks, `commit_kv()` adds it to the running
  batch with the first token, `cancel_reservation()` frees the blocks.

The engine is not thread-safe: one thread owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.engine.block_manager import BlockEvent, BlockManager
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.engine.model import LlamaModel
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import sample
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqStatus


class StepOutput(NamedTuple):
    request_id: str
    token_id: int
    logprob: float | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int


class Reservation(NamedTuple):
    """Blocks of a decode-side request that a remote prefill must fill."""

    block_ids: list[int]  # the blocks to fill, in prompt order
    first_block_index: int  # index in the prompt's block table of block_ids[0] (= cached blocks)
    num_cached_tokens: int


class Engine:
    def __init__(
        self,
        model_cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        cfg: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.eos_token_ids = frozenset(eos_token_ids or model_cfg.eos_token_ids)
        self.model = LlamaModel(model_cfg, weights, cfg.torch_device, cfg.torch_dtype)
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            block_size=cfg.block_size,
            dtype=cfg.dtype,
        )
        # One block more than the block manager hands out: padding rows of CUDA graphs write there.
        self.kv_cache = KVCache(self.layout, cfg.num_blocks + 1, cfg.torch_device)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefill role: finished, blocks kept until release()
        self.awaiting_kv: dict[str, Sequence] = {}  # decode role: reserved, KV not yet arrived
        self._arrivals = 0

    @staticmethod
    def from_path(path: str | None, cfg: EngineConfig, progress: bool = True) -> tuple[Engine, object]:
        """Load weights and tokenizer from a GGUF file or a HF directory (None: the default model)."""
        from splitserve.engine.weights import load_model

        loaded = load_model(path, cfg.torch_dtype, progress=progress)
        engine = Engine(loaded.config, loaded.weights, cfg, tuple(loaded.tokenizer.eos_token_ids))
        return engine, loaded.tokenizer

    # ---- requests ----

    def _new_sequence(
        self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool, prior_output: list[int]
    ) -> Sequence:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in (*prompt, *prior_output) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(prompt) + len(prior_output) + (1 if prefill_only else params.max_tokens)
        if total > self.model_cfg.max_position:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.model_cfg.max_position} tokens"
            )
        # A request that alone outgrows the whole cache would preempt itself for ever.
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens needs {self.blocks.blocks_needed(total)} KV blocks; "
                f"the cache has {self.blocks.num_blocks}"
            )
        self._arrivals += 1
        return Sequence(request_id, prompt, params, self._arrivals, prefill_only, prior_output)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """`output_token_ids`: tokens a worker that died generated before (migration)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, output_token_ids or [])
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return self.release(request_id) or self.cancel_reservation(request_id)
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        return True

    def release(self, request_id: str) -> bool:
        """Prefill role: the KV of a finished request has been sent; free its blocks."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free_blocks(seq.block_table)
        return True

    # ---- decode role: remote prefill ----

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> Reservation | None:
        """Admit a request whose context KV a prefill worker will write; None if blocks are short now."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, output_token_ids or [])
        if not self.scheduler.allocate_blocks(seq):
            return None
        seq.status = SeqStatus.AWAITING_KV
        self.awaiting_kv[request_id] = seq
        first = seq.num_cached_tokens // self.cfg.block_size
        return Reservation(list(seq.block_table[first:]), first, seq.num_cached_tokens)

    def commit_kv(self, request_id: str, first_token: int, logprob: float | None = None) -> StepOutput:
        """The prompt KV has arrived: the request joins the running batch with its first token."""
        seq = self.awaiting_kv.pop(request_id)
        seq.num_computed_tokens = len(seq)
        self.blocks.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        seq.status = SeqStatus.RUNNING
        self.requests[request_id] = seq
        out = self._append_token(seq, first_token, logprob)
        if not seq.is_finished:
            self.scheduler.running.append(seq)
        return out

    def cancel_reservation(self, request_id: str) -> bool:
        seq = self.awaiting_kv.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free_blocks(seq.block_table)
        seq.status = SeqStatus.FINISHED
        return True

    # ---- the step ----

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self, on_layer_done: Callable[[int, list[Sequence], list[int]], None] | None = None) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        hook = None
        if on_layer_done is not None:
            hook = lambda layer: on_layer_done(layer, batch.seqs, batch.num_new_tokens)  # noqa: E731
        logits, sampled = self.runner.run(batch.seqs, batch.num_new_tokens, hook)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.blocks.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        if not sampled:
            return []
        seqs = [batch.seqs[i] for i in sampled]
        result = sample(
            logits,
            [s.params for s in seqs],
            [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.generator for s in seqs],
            self.generator,
        )
        return [self._append_token(s, t, lp) for s, t, lp in zip(seqs, result.token_ids, result.logprobs)]

    def _append_token(self, seq: Sequence, token: int, logprob: float | None) -> StepOutput:
        seq.token_ids.append(token)
        p = seq.params
        reason = None
        if seq.prefill_only:
            reason = "prefill_done"
        elif (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_output_tokens or len(seq) >= self.model_cfg.max_position:
            reason = "length"
        if reason is not None:
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
            self._finish(seq, reason)
        return StepOutput(
            seq.request_id, token, logprob, reason is not None, reason, seq.num_prompt_tokens, seq.num_cached_tokens
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.prefill_only and reason == "prefill_done":
            self.held[seq.request_id] = seq
        else:
            self.blocks.free_blocks(seq.block_table)

    def drain_block_events(self) -> list[BlockEvent]:
        return self.blocks.drain_events()

    # ---- convenience ----

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; the output token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work:
            for out in self.step():
                outputs[out.request_id].append(out.token_id)
        return [outputs[rid] for rid in ids]
