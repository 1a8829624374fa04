"""The engine: add requests, step, stream outputs.

A step is three moves (nano-vllm's shape): the scheduler picks the batch, the
runner runs it (and samples), the scheduler records the result. The scheduler
owns every request state and the blocks; the engine checks what a request asks
for and joins the scheduler, the runner and the KV connector (engine/connector.py).
The workers wrap this same object in their roles:

- prefill role: `add_request(..., prefill_only=True)` finishes a request after
  its first token but holds its blocks, because the KV sender is still reading
  them; the connector's `on_layer_done` hears as each layer's KV lands in the
  cache and `on_prefill_done` when the first token is sampled, and its poll
  (`apply_transfers()`) frees the blocks once the send is confirmed, or ends
  the request when it failed.
- decode role: `reserve()` admits a request whose prompt KV the connector will
  receive into the returned blocks; `apply_transfers()` (the engine loop's
  poll) runs it once its KV has arrived, or ends it with the failure's code.

With `tensor_parallel_size` N > 1 this process is rank 0 of N (engine/parallel/):
it holds rank 0's shard of the weights and every rank's KV shard, and the other
ranks run each step with it; `close()` stops them.

The engine is not thread-safe: one thread owns it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from splitserve.engine.block_manager import BlockEvent, BlockManager
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.connector import KVConnector, NullConnector, TransferOutcome
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.engine.model import LlamaModel
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.process_group import rank_devices
from splitserve.engine.parallel.shard import check_tp_size, rank_config, shard_weights
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerStats, StepOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.stats import Clock, IterationStats, StatsRecorder
from splitserve.engine.tokenizer import Tokenizer

__all__ = ["Engine", "RemotePrefill", "StepOutput"]


class RemotePrefill(NamedTuple):
    """A reserved request: the connector's transfer (what the prefill worker needs) and the cached prefix."""

    transfer: Any  # the connector's record (a kv_transfer Reservation on a decode worker)
    num_cached_tokens: int


class Engine:
    def __init__(
        self,
        model_cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        cfg: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnector | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`clock` times requests for metrics (engine/stats.py)."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        tp = cfg.tensor_parallel_size
        check_tp_size(model_cfg, tp)
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            block_size=cfg.block_size,
            dtype=cfg.dtype,
            tp_size=tp,
        )
        # One block more than the block manager hands out: padding rows of CUDA graphs write there.
        # Every rank's shard lives here; the other ranks map theirs (shared memory on a CPU).
        devices = rank_devices(cfg.torch_device, tp)
        self.kv_cache = KVCache(
            self.layout, cfg.num_blocks + 1, cfg.torch_device, list(devices), shared=tp > 1 and devices[0].type == "cpu"
        )
        self.tp_group = TensorParallelGroup.start(model_cfg, weights, cfg, self.kv_cache) if tp > 1 else None
        try:
            self.model = LlamaModel(
                rank_config(model_cfg, tp),
                shard_weights(model_cfg, weights, 0, tp),
                cfg.torch_device,
                cfg.torch_dtype,
                reduce=self.tp_group.all_reduce if self.tp_group is not None else None,
            )
        except BaseException:
            self.close()
            raise
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        eos = frozenset(eos_token_ids or model_cfg.eos_token_ids)
        self.clock = clock
        self.scheduler = Scheduler(cfg, self.blocks, eos, model_cfg.max_position, StatsRecorder(clock))
        self.runner = ModelRunner(self.model, self.kv_cache, cfg, self.tp_group)
        self.connector: KVConnector = connector or NullConnector()
        self._arrivals = 0

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent). The engine runs no step afterwards."""
        if self.tp_group is not None:
            self.tp_group.close()

    def connect(self, connector: KVConnector) -> None:
        """A worker's KV connector, once, before the engine loop starts (it needs this engine's cache)."""
        self.connector = connector

    @staticmethod
    def from_path(path: str | None, cfg: EngineConfig, progress: bool = True) -> tuple[Engine, Tokenizer]:
        """Load weights and tokenizer from a GGUF file or a HF directory (None: the default model)."""
        from splitserve.engine.weights import load_model

        loaded = load_model(path, cfg.torch_dtype, progress=progress)
        engine = Engine(loaded.config, loaded.weights, cfg, tuple(loaded.tokenizer.eos_token_ids))
        return engine, loaded.tokenizer

    # ---- requests ----

    def _new_sequence(
        self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool, prior_output: list[int]
    ) -> Sequence:
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
        return Sequence(request_id, prompt, params, self._arrivals, prefill_only, prior_output, self.clock())

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> Sequence:
        """`output_token_ids`: tokens a worker that died generated before (migration)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, output_token_ids or [])
        self.scheduler.add(seq)
        return seq

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lease_s: float,
        output_token_ids: list[int] | None = None,
    ) -> RemotePrefill | None:
        """Decode role: admit a request whose context KV a prefill worker will write; None if there
        is no seat (`max_num_seqs`) or no blocks for it now."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, output_token_ids or [])
        blocks = self.scheduler.reserve(seq)
        if blocks is None:
            return None
        try:
            transfer = self.connector.reserve(request_id, blocks.block_ids, lease_s)
        except Exception as e:  # nothing can write blocks that were never handed out
            self.scheduler.abort(request_id, cancel_transfer=lambda _: True)
            raise RuntimeError(f"KV reservation failed: {e}") from None
        seq.transfer_id = transfer.ticket
        return RemotePrefill(transfer, blocks.num_cached_tokens)

    def apply_transfers(self, outcomes: list[TransferOutcome]) -> list[StepOutput]:
        """The connector's ended transfers: completed ones run (decode role) or free the held
        request's blocks (prefill role: the receiver confirmed them); failed ones end."""
        outs = []
        for o in outcomes:
            if o.first_token is not None:
                if self.scheduler.release(o.request_id, o.transfer_id):
                    continue
                out = self.scheduler.commit_remote(o.request_id, o.transfer_id, o.first_token)
            else:
                out = self.scheduler.fail_transfer(o.request_id, o.transfer_id, o.code or "transfer_failed")
            if out is not None:
                outs.append(out)
        return outs

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks (a reserved one's once its transfer
        can no longer write them). False if unknown."""
        return self.scheduler.abort(request_id, self.connector.cancel)

    def lookup(self, request_id: str) -> Sequence | None:
        """The unfinished request with this id (held ones included)."""
        return self.scheduler.requests.get(request_id)

    # ---- the step ----

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        hook = self.connector.on_layer_done if self.connector.wants_layers else None
        outs = self.scheduler.postprocess(batch, self.runner.run(batch, hook))
        for out in outs:
            if out.finish_reason == "prefill_done":  # held: the connector ends the send now
                seq = self.scheduler.held[out.request_id]
                self.connector.on_prefill_done(out.request_id, seq.transfer_id, out.token_id)
        return outs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def drain_block_events(self) -> list[BlockEvent]:
        return self.scheduler.drain_block_events()

    def drain_iteration_stats(self) -> IterationStats:
        """Token counts and request times since the last drain (engine/stats.py)."""
        return self.scheduler.recorder.drain()

    # ---- convenience ----

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; the output token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work:
            for out in self.step():
                outputs[out.request_id].append(out.token_id)
        return [outputs[rid] for rid in ids]
