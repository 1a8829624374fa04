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

import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any, NamedTuple

from splitserve.engine.block_manager import BlockEvent, BlockManager
from splitserve.engine.commands import Admit, Admitted, QueueFull
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.connector import KVConnector, NullConnector, TransferOutcome
from splitserve.engine.fingerprint import model_fingerprint
from splitserve.engine.handoff import Handoff, SampleState
from splitserve.engine.itl_budget import ItlBudget
from splitserve.engine.kv_cache import KVCache, KVLayout, pool_blocks
from splitserve.engine.kv_groups import CacheGroups
from splitserve.engine.kv_tier import KVTier
from splitserve.engine.kv_tier_blocks import configured_tiers
from splitserve.engine.kv_tiers import TierStore
from splitserve.engine.lora.adapter import AdapterError, LoraAdapter, load_peft
from splitserve.engine.model import DecoderModel
from splitserve.engine.model_runner import BatchLayerHook, ModelRunner
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.process_group import rank_devices
from splitserve.engine.parallel.shard import check_tp_size, rank_config, shard_weights, split_on_blocks
from splitserve.engine.quant.weight import Weight
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerStats, StepOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.speculator import Speculator
from splitserve.engine.stats import Clock, IterationStats, StatsRecorder
from splitserve.engine.tokenizer import Tokenizer

__all__ = ["Engine", "RemotePrefill", "StepOutput"]


class RemotePrefill(NamedTuple):
    """A reserved request: the connector's transfer (what the prefill worker needs) and the cached prefix."""

    transfer: Any  # the connector's record (a kv_transfer Reservation on a decode worker)
    num_cached_tokens: int


def kv_layout(model_cfg: ModelConfig, cfg: EngineConfig, weights: Mapping[str, Weight]) -> KVLayout:
    """The KV blocks' shape, dtype and model fingerprint, as the pool and its transfers see them."""
    return KVLayout(
        num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        block_size=cfg.block_size,
        dtype=cfg.kv_dtype,
        tp_size=cfg.tensor_parallel_size,
        windows=model_cfg.windows if any(model_cfg.windows) else (),
        model_fingerprint=model_fingerprint(model_cfg, weights),
    )


class Engine:
    def __init__(
        self,
        model_cfg: ModelConfig,
        weights: Mapping[str, Weight],
        cfg: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnector | None = None,
        clock: Clock = time.monotonic,
        tokenizer: Tokenizer | None = None,
        kv_tiers: list[KVTier] | None = None,
    ) -> None:
        """`clock` times requests for metrics (engine/stats.py); `tokenizer`: for grammars (without one, a
        grammar is refused); `kv_tiers`: the tiers behind the prefix cache (None: the ones `cfg` sizes)."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        tp = cfg.tensor_parallel_size
        check_tp_size(model_cfg, tp)
        self.layout = kv_layout(model_cfg, cfg, weights)
        if cfg.kv_cache_bytes:  # the pool sized in bytes: the blocks that fit in the KV dtype
            cfg = self.cfg = replace(cfg, num_blocks=pool_blocks(self.layout, cfg.kv_cache_bytes))
        self.kv_cache = self._make_cache(model_cfg, cfg)
        if tp > 1:  # blocks where every rank's columns are whole blocks, floats where they are not
            weights = split_on_blocks(model_cfg, weights, tp, cfg.torch_dtype)
        self.tp_group = TensorParallelGroup.start(model_cfg, weights, cfg, self.kv_cache) if tp > 1 else None
        try:
            self.model = DecoderModel(
                rank_config(model_cfg, tp),
                shard_weights(model_cfg, weights, 0, tp),
                cfg.torch_device,
                cfg.torch_dtype,
                reduce=self.tp_group.all_reduce if self.tp_group is not None else None,
                batch_invariant=cfg.batch_invariant == "strict",
            )
        except BaseException:
            self.close()
            raise
        cache = self.kv_cache
        self.blocks = BlockManager(
            cache.num_blocks - 1, cfg.block_size, cfg.enable_prefix_caching, cache.groups, cache.window_pages
        )
        eos = frozenset(eos_token_ids or model_cfg.eos_token_ids)
        self.clock = clock
        self.scheduler = Scheduler(cfg, self.blocks, eos, model_cfg.max_position, StatsRecorder(clock))
        # the prompt tokens a step beside decode rows may take (engine/itl_budget.py)
        self.itl_budget = ItlBudget(cfg.itl_target, cfg.max_num_batched_tokens)
        self.loras: dict[str, LoraAdapter] = {}  # the LoRA adapters loaded, by name (engine/lora/)
        self.tiers = self._start_tiers(cfg, kv_tiers)
        self.prefill_tokens_per_s: float | None = None  # measured on steps of prompts alone (_observe_prefill)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg, self.tp_group)
        self.runner.eos_token_ids = tuple(sorted(eos))
        self.speculator = Speculator(cfg, model_cfg.max_position, self.scheduler) if cfg.speculative != "off" else None
        self.connector: KVConnector = connector or NullConnector()
        self._arrivals = 0
        self.tokenizer = tokenizer
        self._grammars: Any = None  # engine/grammar.py's GrammarCompiler, made at the first grammar
        self._grammars_made = threading.Lock()  # by whichever call handler's thread asks first

    def _make_cache(self, model_cfg: ModelConfig, cfg: EngineConfig) -> KVCache:
        """The KV pool of `cfg.num_blocks` blocks' memory. A model of windowed and global layers keeps
        it in pages (engine/kv_groups.py), as many as that memory holds, each of `rows` layers. One
        block (page) more than the block manager hands out: padding rows of CUDA graphs write there.
        Every rank's shard lives here; the other ranks map theirs (shared memory on a CPU)."""
        groups = CacheGroups.of(self.layout.windows) if cfg.hybrid_kv_cache else None
        pages = cfg.num_blocks if groups is None else cfg.num_blocks * model_cfg.num_layers // groups.rows
        devices = rank_devices(cfg.torch_device, cfg.tensor_parallel_size)
        shared = cfg.tensor_parallel_size > 1 and devices[0].type == "cpu"
        return KVCache(self.layout, pages + 1, cfg.torch_device, list(devices), shared=shared, groups=groups)

    def _start_tiers(self, cfg: EngineConfig, kv_tiers: list[KVTier] | None) -> TierStore | None:
        """The tiers behind the prefix cache (engine/kv_tiers.py), if there are any."""
        if not cfg.enable_prefix_caching:
            return None
        if kv_tiers is None:
            kv_tiers = configured_tiers(cfg)
        if not kv_tiers:
            return None
        tiers = TierStore(self.kv_cache, kv_tiers)
        self.blocks.on_evict = tiers.evicted
        self.scheduler.tiers = tiers
        return tiers

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

        loaded = load_model(path, cfg.torch_dtype, progress=progress, quantization=cfg.quantization)
        engine = Engine(
            loaded.config, loaded.weights, cfg, tuple(loaded.tokenizer.eos_token_ids), tokenizer=loaded.tokenizer
        )
        return engine, loaded.tokenizer

    def weights_line(self) -> str:
        """What the start line says of the weights: their formats, their bytes, the kernels they run on."""
        from splitserve.engine.kernels import quant

        formats = self.model.weight_formats
        blocks = [f for f in formats if f.startswith("Q")]
        kernel = f", blocks on the {quant.PATH_NAMES[quant.best_path()]} kernel" if blocks else ""
        return f"{'+'.join(formats)}, {self.model.weight_bytes / 1e6:.0f} MB read a decode step{kernel}"

    # ---- requests ----

    def _new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        prefill_only: bool,
        sample: SampleState,
    ) -> Sequence:
        prior = sample.output_token_ids
        self._check_request(prompt, prior, params, prefill_only)
        self._arrivals += 1
        seq = Sequence(request_id, prompt, params, self._arrivals, prefill_only, prior, self.clock(), sample.index)
        if params.grammar is not None:
            from splitserve.engine.grammar import Matcher

            seq.matcher = Matcher(self.grammars().compile(params.grammar))
            seq.matcher.replay(prior)  # ValueError: the tokens handed over break the grammar
        return seq

    def _check_request(self, prompt: list[int], prior: list[int], params: SamplingParams, prefill_only: bool) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in (*prompt, *prior) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prior) >= params.max_tokens:
            raise ValueError(f"{len(prior)} output tokens handed over, max_tokens is {params.max_tokens}")
        total = len(prompt) + (len(prior) + 1 if prefill_only else params.max_tokens)
        if total > self.model_cfg.max_position:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.model_cfg.max_position} tokens"
            )
        # A request that alone outgrows the whole cache would preempt itself for ever.
        if not self.blocks.fits_alone(len(prompt), total):
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens needs {self.blocks.blocks_needed(total)} KV blocks; "
                f"the cache has {self.blocks.num_blocks}"
            )

    def grammars(self) -> Any:
        """The grammar compiler (engine/grammar.py), made at the first request with a grammar."""
        with self._grammars_made:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError(
                        "grammar: this engine was built without a tokenizer, so it cannot compile grammars"
                    )
                from splitserve.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.model_cfg.vocab_size, self.runner.eos_token_ids)
            return self._grammars

    def admit(self, cmd: Admit, waiting_limit: int | None = None) -> Admitted:
        """Queue `cmd`'s request (the engine loop's `Admit`), or refuse it with QueueFull when
        `waiting_limit` requests already wait for a seat (None: no limit). Every sequence of the
        request carries its transfer id and its tenant's share (the queue's fair order reads it)."""
        waiting = self.scheduler.waiting_for_seat()
        if waiting_limit is not None and waiting >= waiting_limit:
            raise QueueFull(
                f"{waiting} requests already wait for a seat on this worker (limit {waiting_limit}); retry later"
            )
        seq = self.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.prefill_only, cmd.prior, cmd.samples)
        for each in self.scheduler.groups.get(cmd.request_id, [seq]):
            each.transfer_id = cmd.transfer_id
            each.share = cmd.share
        # a prefill-only request's cached prefix is found when it runs, and told in its output
        cached = 0 if cmd.prefill_only else self.scheduler.cached_prefix_tokens(cmd.prompt + cmd.prior)
        return Admitted(seq.times, cached)

    def load_lora(self, name: str, path: str, max_rank: int = 0) -> LoraAdapter:
        """Load the PEFT LoRA adapter in directory `path` under `name` (a name loaded again takes the
        new weights: requests name it, the cache knows it by its content); AdapterError naming what
        is wrong. Tensor parallelism does not split adapters yet: refused."""
        if self.cfg.tensor_parallel_size > 1:
            raise AdapterError(f"adapter {name!r}: LoRA under tensor parallelism is not served yet")
        adapter = load_peft(path, name, self.model_cfg, self.cfg.torch_dtype, max_rank)
        self.loras[name] = adapter
        return adapter

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        samples: list[SampleState] | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        """`output_token_ids`: tokens a worker that died generated before (migration), for sample 0;
        `samples`: each sample's, for a request of several (n > 1) handed over. A fresh request
        with n > 1 runs as one sequence until its first token, and forks then. `adapter`: a loaded
        LoRA adapter's name (None: the base model)."""
        lora = None
        if adapter is not None:
            lora = self.loras.get(adapter)
            if lora is None:
                loaded = ", ".join(sorted(self.loras)) or "none"
                raise ValueError(f"adapter {adapter!r} is not loaded (loaded: {loaded})")
        states = samples or [SampleState(0, list(output_token_ids or []))]
        if prefill_only and len(states) > 1:
            raise ValueError("a prefill continues one sample, not several")
        seqs = [
            self._new_sequence(
                request_id if i == 0 else f"{request_id}#{s.index}", prompt_token_ids, params, prefill_only, s
            )
            for i, s in enumerate(states)
        ]
        if not samples and not output_token_ids:
            seqs[0].fork_indices = list(range(1, params.n))
        for seq in seqs:
            seq.group_id = request_id
            seq.adapter = lora
            self.scheduler.add(seq)
        if len(seqs) > 1:
            self.scheduler.groups[request_id] = list(seqs)
        return seqs[0]

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lease_s: float,
        output_token_ids: list[int] | None = None,
        sample_index: int = 0,
    ) -> RemotePrefill | None:
        """Decode role: admit a request whose context KV a prefill worker will write; None if there
        is no seat (`max_num_seqs`) or no blocks for it now. One sample continues (`sample_index`,
        with its `output_token_ids`); a fresh n > 1 request forks when its KV arrives."""
        state = SampleState(sample_index, list(output_token_ids or []))
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, state)
        blocks = self.scheduler.reserve(seq)
        if blocks is None:
            return None
        if any(self.layout.windows) and self.kv_cache.groups is None:
            # its windowed layers receive only what their windows still see: its blocks are not a
            # whole prefix for a later request to reuse (a cache of pages knows which blocks lack
            # their windowed pages, and its prefix hits ask for them: BlockManager.cached_prefix)
            seq.prefix_cacheable = False
        try:
            first = blocks.num_cached_tokens // self.cfg.block_size
            transfer = self.connector.reserve(request_id, blocks.block_ids, lease_s, len(seq), first)
        except Exception as e:  # nothing can write blocks that were never handed out
            self.scheduler.abort(request_id, cancel_transfer=lambda _: True)
            raise RuntimeError(f"KV reservation failed: {e}") from None
        seq.transfer_id = transfer.ticket
        return RemotePrefill(transfer, blocks.num_cached_tokens)

    def apply_transfers(self, outcomes: list[TransferOutcome]) -> list[StepOutput]:
        """The connector's ended transfers: completed ones run (decode role) or free the held
        request's blocks (prefill role: the receiver confirmed them); failed ones end."""
        outs: list[StepOutput] = []
        for o in outcomes:
            if o.first_token is not None:
                if self.scheduler.release(o.request_id, o.transfer_id):
                    continue
                committed = self._commit(o)
                outs.extend(committed)
                if committed:
                    self._copy_blocks()
                continue
            out = self.scheduler.fail_transfer(o.request_id, o.transfer_id, o.code or "transfer_failed")
            if out is not None:
                outs.append(out)
        return outs

    def _commit(self, o: TransferOutcome) -> list[StepOutput]:
        """A reserved request's KV arrived: it runs from the prefill worker's handoff (a bare first
        token is sample 0's). A handoff that does not continue the reserved request fails it."""
        seq = self.scheduler.reserved.get(o.request_id)
        if seq is None:
            return []
        handoff = o.handoff
        if handoff is None:
            assert o.first_token is not None
            handoff = Handoff(
                seq.token_ids[: seq.num_prompt_tokens],
                seq.params,
                [SampleState(seq.sample_index, [*seq.output_token_ids, o.first_token])],
            )
        try:
            if handoff.prompt_token_ids != seq.token_ids[: seq.num_prompt_tokens]:
                raise ValueError("the handoff's prompt is not the reserved request's")
            return self.scheduler.commit_remote(o.request_id, o.transfer_id, handoff) or []
        except ValueError:
            out = self.scheduler.fail_transfer(o.request_id, o.transfer_id, "bad_handoff")
            return [out] if out is not None else []

    def _copy_blocks(self) -> None:
        """The forks' partial last blocks, copied from their parents' before the next step writes."""
        copies, self.scheduler.block_copies = self.scheduler.block_copies, []
        if copies:
            self.kv_cache.copy_blocks(copies)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks (a reserved one's once its transfer
        can no longer write them). False if unknown."""
        return self.scheduler.abort(request_id, self.connector.cancel)

    def abort_sample(self, request_id: str, sample_index: int) -> bool:
        """Stop one sample of a request whose others go on, and free its blocks (its shared ones
        stay with the others). False if no such sample is unfinished. No output tells of it: the
        caller ended it already."""
        return self.scheduler.abort_sample(request_id, sample_index, self.connector.cancel)

    def lookup(self, request_id: str) -> Sequence | None:
        """An unfinished sequence of the request with this id (held ones included)."""
        return self.scheduler.lookup(request_id)

    # ---- the step ----

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def forget_prefill_speed(self) -> None:
        """Drop the prefill speed measured so far: a warm-up's prompt of a few tokens is all fixed
        cost (SmolLM2 in float32 on one thread: 123 tok/s, against 332 on a 200-token prompt), and a
        running average started there reported a worker far below its speed for its first dozen
        prompts (on a multi-node Ray cluster the joint controller grew the prefill pool on it at once)."""
        self.prefill_tokens_per_s = None
        if self.tiers is not None:
            self.tiers.prefill_tokens_per_s = None

    def _observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.2) -> None:
        """The prefill speed's running average: a tier load is weighed against it (engine/kv_tiers.py),
        and the stats report it, for the router's tier pricing and the joint pool controller."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - alpha) * old + alpha * rate
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds, alpha)

    def step(self, between_layers: Callable[[], None] | None = None) -> list[StepOutput]:
        """One step of the scheduler's choosing; its outputs. `between_layers`: called as each layer
        ends (the loop gives a borrowed core back there, engine/loop.py)."""
        cap = None if self.itl_budget.off else self.itl_budget.prefill_tokens()
        batch = self.scheduler.schedule(self.clock(), cap)
        if batch is None:
            return []
        if self.speculator is not None:
            batch = self.speculator.plan(batch)
        hook: BatchLayerHook | None = self.connector.on_layer_done if self.connector.wants_layers else None
        if between_layers is not None:
            hook = _and_then(hook, between_layers)
        t0 = time.perf_counter()
        sampled = self.runner.run(batch, hook)
        seconds = time.perf_counter() - t0
        if self.speculator is not None:
            self.speculator.observe(batch, sampled, seconds)
        prefill = sum(n for n in batch.num_new_tokens if n > 1)
        self.itl_budget.observe(sum(n == 1 for n in batch.num_new_tokens), prefill, seconds)
        if prefill and prefill == sum(batch.num_new_tokens):  # a step of prompts alone: the prefill speed
            self._observe_prefill(prefill, seconds)
        outs = self.scheduler.postprocess(batch, sampled)
        self._copy_blocks()
        for n, out in enumerate(outs):
            if out.finish_reason == "prefill_done":  # held: the connector ends the send now
                seq = self.scheduler.held[out.request_id]
                handoff = self.handoff(seq, out)
                outs[n] = out._replace(handoff=handoff)
                self.connector.on_prefill_done(out.request_id, seq.transfer_id, handoff)
        return outs

    def handoff(self, seq: Sequence, out: StepOutput) -> Handoff:
        """Prefill role: the record the decode worker continues `seq` from once its first output
        position is drawn (`out`: its own sample's draw; `seq.first_draws`: the other samples')."""
        prior = seq.output_token_ids[:-1]
        samples = [SampleState(seq.sample_index, seq.output_token_ids, [out.logprob] if out.logprob else [])]
        samples += [SampleState(k, [*prior, t], [lp] if lp else []) for k, t, lp in seq.first_draws]
        samples.sort(key=lambda s: s.index)
        return Handoff(
            seq.token_ids[: seq.num_prompt_tokens], seq.params, samples, list(seq.prompt_logprobs), seq.share
        )

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def drain_block_events(self) -> list[BlockEvent]:
        """The prefix cache's changes since the last drain, the tiers' after the pool's."""
        events = self.scheduler.drain_block_events()
        if self.tiers is not None:
            events += self.tiers.drain_events()
        return events

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
                if out.sample_index == 0:
                    outputs[out.request_id].append(out.token_id)
        return [outputs[rid] for rid in ids]


def _and_then(hook: BatchLayerHook | None, then: Callable[[], None]) -> BatchLayerHook:
    """The step's layer hook (None: none), then `then`."""

    def both(layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        if hook is not None:
            hook(layer, seqs, counts)
        then()

    return both
