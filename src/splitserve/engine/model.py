"""The decoder every family in engine/models/ runs on: RMSNorm, RoPE (with linear or
llama3 scaling), grouped-query attention over the paged KV cache (q/k/v bias and a
per-head q/k RMSNorm where the family has them), a SwiGLU MLP or a mixture of SwiGLU
experts, tied or untied embeddings. Llama 2/3, Mistral, Mixtral, Qwen2, Qwen3 and
Qwen3-MoE (and SmolLM, a Llama). RMSNorm and
RoPE are pure functions in engine/layers.py, below both this model and the kernels
that check themselves against them.

Weights arrive under Hugging Face names and are fused at load time into the slots
the family's module declares (q, k and v into one matrix, gate and up into another)
so a layer runs four matrix products: fewer, larger kernels, which is what decode on
a CPU or a GPU wants.
Matrix products go through engine/kernels' `linear`, which streams bf16 weights
at memory speed for decode-sized batches on a CPU and is F.linear otherwise.
A bf16 or fp32 decode step on a CPU runs everything else on engine/kernels' fused
decode kernels too (four calls a layer instead of some fifty torch operations);
a decode step on CUDA runs them on the Triton kernels of
engine/kernels/triton_decode.py, behind the same interface (and inside the
CUDA graphs engine/cuda_graphs.py captures). Every other step, and any machine
where those are unavailable or switched off (SPLITSERVE_NO_KERNELS=1, no
triton), runs the torch code below, which they reproduce.

Under tensor parallelism (engine/parallel/) each rank builds this model from its
shard of the weights and the shapes of `parallel.shard.rank_config` (its heads,
KV heads and slice of the MLP), and passes `reduce`: the outputs of o and down
are then partial sums that `reduce` completes in place, so the residual stream
is whole on every rank. Both paths, the fused kernels included, run per shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels import quant as quant_kernel
from splitserve.engine.kernels.decode import KV_KINDS as QUANTIZED_KV_KINDS
from splitserve.engine.kernels.decode import DecodeKernels, decode_kernels
from splitserve.engine.kernels.linear import kernel_available, linear, linear_max_rows
from splitserve.engine.kernels.prefill import prefill_attention
from splitserve.engine.kernels.triton_decode import DTYPES as TRITON_DECODE_DTYPES
from splitserve.engine.kernels.triton_decode import TritonDecodeKernels, triton_decode_kernels
from splitserve.engine.kv_groups import OWN_PAGE, CacheGroups
from splitserve.engine.layers import apply_rope, rms_norm, rope_tables
from splitserve.engine.lora.rows import LoraRows
from splitserve.engine.models import registry
from splitserve.engine.models.declare import layer_slots
from splitserve.engine.quant.weight import QuantizedWeight, Weight, nbytes

# Model dtypes whose CPU decode steps take the fused kernels. fp32 too: the
# kernels sum in another order than torch (RMSNorm's mean, attention's dot
# products), a few ulps of fp32, and tests/test_smollm2_vs_hf.py still finds
# every greedy token equal to transformers'. Without them an fp32 decode step at
# batch 32 spends half its time in torch's small operations.
FUSED_DECODE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class LayerWeights:
    """One layer's slots (engine/models/declare.py's `TensorDecl.slot`), fused and on the device."""

    input_norm: torch.Tensor
    qkv: Weight  # [q + 2 kv, hidden]; a matrix may be a QuantizedWeight (GGUF blocks, on a CPU)
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None = None  # [2 intermediate, hidden]; None in a mixture of experts
    down: Weight | None = None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim], with ModelConfig.qk_norm
    k_norm: torch.Tensor | None = None
    # a mixture of experts (ModelConfig.num_experts): the router [experts, hidden] and the
    # experts' SwiGLU, stacked: [experts, 2 moe_intermediate, hidden] and [experts, hidden, moe_intermediate]
    router: Weight | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    # ModelConfig.sandwich_norms (Gemma 3): the attention's and the MLP's outputs normed before their adds
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None


def _placed(t: Weight, device: torch.device, dtype: torch.dtype, batch_invariant: bool) -> Weight:
    """A weight as the model holds it: a QuantizedWeight on its blocks on a CPU (every row on the
    kernel with `batch_invariant`), dequantized on a GPU; a float tensor in `dtype` on `device`."""
    if isinstance(t, QuantizedWeight):
        if device.type != "cpu":
            return t.dequantize(dtype).to(device)
        return t.invariant() if batch_invariant else t
    return t.to(device=device, dtype=dtype).contiguous()


LayerHook = Callable[[int], None]  # called with the layer index once its KV is in the cache
# Sums a tensor over the tensor-parallel ranks, in place (torch.distributed's all-reduce).
AllReduce = Callable[[torch.Tensor], None]


class DecoderModel:
    """Functional decoder over plain tensors; the runner owns the cache and metadata."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Weight],
        device: torch.device,
        dtype: torch.dtype,
        reduce: AllReduce | None = None,
        batch_invariant: bool = False,
    ):
        """`cfg`: the shapes this process computes (a rank's, under tensor parallelism);
        `reduce`: the all-reduce over the ranks, None without tensor parallelism;
        `batch_invariant` (EngineConfig.batch_invariant): quantized matrices compute every row alike,
        whatever rows share its step."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.reduce = reduce

        def w(name: str) -> Weight:
            if name not in weights:
                raise ValueError(f"weights lack tensor {name!r}")
            return _placed(weights[name], device, dtype, batch_invariant)

        def dense(name: str) -> torch.Tensor:  # a norm's gain: never quantized
            t = w(name)
            assert isinstance(t, torch.Tensor), name
            return t

        arch = registry.for_config(cfg)
        self.embed = w("model.embed_tokens.weight")
        # a layer's norms and biases are tensors: only matrices are ever kept in blocks
        self.layers = [LayerWeights(**layer_slots(arch, cfg, w, i)) for i in range(cfg.num_layers)]  # type: ignore[arg-type]
        self.norm = dense("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_embeddings else w("lm_head.weight")
        self.cos, self.sin = rope_tables(cfg, device)
        # the windowed layers' own RoPE base (Gemma 3), else the same tables
        local = cfg.rope_local_theta and any(cfg.windows)
        self.cos_local, self.sin_local = rope_tables(cfg, device, local_theta=True) if local else (self.cos, self.sin)
        self.scale = cfg.attention_scale
        self._min_window = min((w for w in cfg.windows if w), default=0)
        # where each layer's K/V is in a cache of pages (engine/kv_groups.py): its row of the tensor,
        # and which group of windowed pages it reads through (OWN_PAGE: the block tables as they are);
        # a cache of one row per layer is read as it is
        groups = CacheGroups.of(cfg.windows)
        self._plain_rows = tuple((i, OWN_PAGE) for i in range(cfg.num_layers))
        self._paged_rows = groups.layer_rows if groups is not None else self._plain_rows
        # what the fused decode kernels compute: a SwiGLU layer of two norms, one RoPE table over whole heads
        self._kernels_fit = (
            not cfg.sandwich_norms
            and cfg.hidden_act == "silu"
            and cfg.embedding_scale == 1.0
            and not local
            and cfg.rotary_dim == cfg.head_dim
        )
        # a prefill's attention on our CPU kernel where it takes the call (bf16, AVX-512 BF16), else SDPA
        self._prefill_kernel = prefill_attention if device.type == "cpu" else None
        self._row_wise: int | None = None  # _row_wise_rows, once the kernels are built

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step (embedding rows excluded: only B rows are read)."""
        per_layer = sum(nbytes(t) for lw in self.layers for t in vars(lw).values() if t is not None)
        return per_layer + nbytes(self.norm) + nbytes(self.lm_head)

    @property
    def weight_formats(self) -> tuple[str, ...]:
        """The formats the matrices are computed in: the dtype's name, and each GGUF block format kept."""
        found = {str(self.dtype).removeprefix("torch.")}
        for t in [self.embed, self.lm_head, *(t for lw in self.layers for t in vars(lw).values())]:
            if isinstance(t, QuantizedWeight):
                found.update(t.format_names)
        return tuple(sorted(found))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, blocks, 2, bs, kv_heads, head_dim] (quantized: engine/kv_cache.py)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose logits are wanted
        on_layer_done: LayerHook | None = None,
        decode_rows: int = 0,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Logits of the `logits_indices` rows. `decode_rows`: the step's first rows are that many
        decode rows and the rest prefill chunks, run in one pass (`joins` said the step may);
        `lora`: the rows each adapter's update applies to (engine/lora/rows.py)."""
        if decode_rows:
            head, tail = meta.split(decode_rows)
            joined = self._cpu_decode_kernels(kv_cache, head)
            if joined is None:
                raise ValueError("a joined step where the fused decode kernels do not run (ask `joins` first)")
            return self._joined(joined, input_ids, positions, kv_cache, head, tail, logits_indices, on_layer_done, lora)
        kernels = self._decode_kernels(kv_cache, meta)
        if kernels is not None:
            return self._fused_decode(
                kernels, input_ids, positions, kv_cache, meta, logits_indices, on_layer_done, lora
            )
        return self._torch_forward(input_ids, positions, kv_cache, meta, logits_indices, on_layer_done, lora)

    def _torch_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_done: LayerHook | None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """forward() on the torch path: a prefill, a mixed step, or a decode step the fused kernels
        do not take (on a CPU its norms and SiLU are still the kernels', `_row_kernels`)."""
        cfg = self.cfg
        rows = self._row_kernels()
        h = self._embed(input_ids)
        glob = (self.cos[positions].to(self.dtype), self.sin[positions].to(self.dtype))
        # the windowed layers' own tables where they have them (Gemma 3), else the same rows
        local = glob if self.cos_local is self.cos else (self.cos_local[positions], self.sin_local[positions])
        rope = {False: glob, True: (local[0].to(self.dtype), local[1].to(self.dtype))}
        q_size, kv_size = cfg.q_size, cfg.kv_size
        cache_rows = self._plain_rows if kv_cache.shape[0] == cfg.num_layers else self._paged_rows
        h, x = self._add_norm(rows, h, None, self.layers[0].input_norm)
        for i, lw in enumerate(self.layers):
            qkv = linear(x, lw.qkv, lw.qkv_bias)
            _adapt(qkv, x, i, "qkv", lora)
            q = qkv[:, :q_size].view(-1, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            if lw.q_norm is not None and lw.k_norm is not None:
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            window = cfg.window(i)
            cos, sin = rope[window > 0]
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            row, pages = cache_rows[i]
            layer_cache = kv_cache[row]
            layer_meta = meta if pages == OWN_PAGE else meta.windowed[pages]
            write_kv(layer_cache, k, v, layer_meta)
            if on_layer_done is not None and self.reduce is None:
                on_layer_done(i)
            attn = self._prefill_attention(q, k, v, layer_cache, layer_meta, i)
            o = linear(attn, lw.o)
            _adapt(o, attn, i, "o", lora)
            self._all_reduce(o, i, on_layer_done)
            if lw.post_attn_norm is not None:
                o = rms_norm(o, lw.post_attn_norm, cfg.rms_norm_eps)
            h, x = self._add_norm(rows, h, o, lw.post_norm)
            down = self._mlp(rows, x, lw, lora, i)
            if self.reduce is not None:
                self.reduce(down)
            if lw.post_mlp_norm is not None:
                down = rms_norm(down, lw.post_mlp_norm, cfg.rms_norm_eps)
            h, x = self._add_norm(rows, h, down, self._norm_after(i))
        if logits_indices.numel() == 0:  # a chunk that ends no prompt, or a rank other than 0
            return h.new_empty((0, self.lm_head.shape[0]), dtype=torch.float32)
        return linear(x[logits_indices], self.lm_head).float()

    def _norm_after(self, layer: int) -> torch.Tensor:
        """The norm after `layer`'s residual add: the next layer's input norm or the final one (on
        every row, as the fused decode step computes it: a prompt's last row normed as a decode row)."""
        return self.layers[layer + 1].input_norm if layer + 1 < len(self.layers) else self.norm

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: int,
    ) -> torch.Tensor:
        """Attention of a step's prompt rows in `layer` (their K/V written), [rows, q_size]."""
        window = self.cfg.window(layer)
        kernel = self._prefill_kernel if not window else None  # the C++ prefill kernel attends to all
        return paged_attention(q, k, v, layer_cache, meta, self.scale, kernel, window).reshape(-1, self.cfg.q_size)

    def _mlp(
        self,
        rows: DecodeKernels | None,
        x: torch.Tensor,
        lw: LayerWeights,
        lora: LoraRows | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """The layer's MLP on the normed rows `x`: SwiGLU (with `lora`'s updates of `layer`), or a
        mixture of experts."""
        if lw.gate_up is None or lw.down is None:
            return self._experts(x, lw)
        gate_up = linear(x, lw.gate_up)
        _adapt(gate_up, x, layer, "gate_up", lora)
        if rows is not None and self.cfg.hidden_act == "silu":
            act = rows.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")) * up
        down = linear(act, lw.down)
        _adapt(down, act, layer, "down", lora)
        return down

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input rows, scaled in the model's dtype where the family scales them (Gemma)."""
        h = self._embedding(input_ids)
        if self.cfg.embedding_scale != 1.0:
            h = h * torch.tensor(self.cfg.embedding_scale, dtype=self.dtype)
        return h

    def _embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for `input_ids`; a quantized embedding dequantizes only those."""
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.embedding(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    def _experts(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        """A mixture of experts: each row's top-k experts by the router's softmax (in fp32, as
        transformers computes it), weighted by their probabilities (renormalized over the k with
        norm_topk_prob). Grouped by expert: each expert runs once on all the rows routed to it,
        and each row's outputs are summed in its expert order."""
        assert lw.router is not None and lw.experts_gate_up is not None and lw.experts_down is not None
        cfg = self.cfg
        probs = torch.softmax(linear(x, lw.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [rows, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        routed = torch.bincount(chosen.flatten(), minlength=cfg.num_experts).tolist()
        for e, count in enumerate(routed):
            if not count:
                continue
            row, slot = torch.nonzero(chosen == e, as_tuple=True)
            gate, up = linear(x[row], lw.experts_gate_up[e]).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, lw.experts_down[e]) * weights[row, slot, None]
            out.index_add_(0, row, y)
        return out

    def _norm_qk(self, qkv: torch.Tensor, lw: LayerWeights) -> None:
        """The per-head RMSNorm of q and of k (Qwen3), in place in a decode step's fused qkv rows,
        before the kernels' attention applies RoPE to them (a no-op for the families without it)."""
        if lw.q_norm is None or lw.k_norm is None:
            return
        cfg = self.cfg
        q = qkv[:, : cfg.q_size].view(-1, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(-1, cfg.num_kv_heads, cfg.head_dim)
        q.copy_(rms_norm(q, lw.q_norm, cfg.rms_norm_eps))
        k.copy_(rms_norm(k, lw.k_norm, cfg.rms_norm_eps))

    def _row_kernels(self) -> DecodeKernels | None:
        """The CPU kernels' RMSNorm and SiLU * up for a step's rows (a prefill's): one pass each over
        the rows where torch takes five to eight (the casts, squares, mean and products), the same
        arithmetic as the decode step's; None where the torch path runs (GPU, other dtypes, no build)."""
        if self.device.type == "cpu" and self.dtype in FUSED_DECODE_DTYPES:
            return decode_kernels()
        return None

    def _add_norm(
        self, rows: DecodeKernels | None, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h + residual (if any) and weight * RMSNorm of it; the kernel adds into h in place."""
        if rows is not None and h.is_contiguous() and (residual is None or residual.is_contiguous()):
            return h, rows.rms_norm(h, weight, self.cfg.rms_norm_eps, residual)
        if residual is not None:
            h = h + residual
        return h, rms_norm(h, weight, self.cfg.rms_norm_eps)

    def _all_reduce(self, o: torch.Tensor, layer: int, on_layer_done: LayerHook | None) -> None:
        """Complete the o projection's partial sums over the ranks (a no-op without them). Once
        that returns every rank has written this layer's K/V into its shard, so a layer hook
        (which may read every shard) runs here under tensor parallelism."""
        if self.reduce is None:
            return
        self.reduce(o)
        if on_layer_done is not None:
            on_layer_done(layer)

    def _decode_kernels(
        self, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> DecodeKernels | TritonDecodeKernels | None:
        """The fused kernels when this step can take them, else None (the torch path)."""
        if not meta.is_decode or not self._decode_fits(kv_cache, meta.context_lens_list):
            return None
        if self.device.type == "cpu":
            return self._cpu_decode_kernels(kv_cache, meta)
        quantized = kv_cache.dtype in QUANTIZED_KV_KINDS
        if self.device.type == "cuda" and self.dtype in TRITON_DECODE_DTYPES and kv_cache.device.type == "cuda":
            kernels = triton_decode_kernels()
            # a quantized cache only where the kernels' quantized read passed its self-test on this GPU
            return kernels if kernels is not None and (kernels.reads_quantized or not quantized) else None
        return None

    def _decode_fits(self, kv_cache: torch.Tensor, context_lens: Sequence[int]) -> bool:
        """Whether the fused decode kernels compute this model's layers over this cache at these contexts."""
        quantized = kv_cache.dtype in QUANTIZED_KV_KINDS
        if (kv_cache.dtype != self.dtype and not quantized) or not self._kernels_fit:
            return False
        if kv_cache.shape[0] != self.cfg.num_layers:  # a cache of pages: the kernels index rows by layer
            return False
        # the kernels see every key
        return not (self._min_window and context_lens and max(context_lens) > self._min_window)

    def _cpu_decode_kernels(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> DecodeKernels | None:
        if not self._decode_fits(kv_cache, meta.context_lens_list):
            return None
        if self.device.type == "cpu" and self.dtype in FUSED_DECODE_DTYPES and kv_cache.is_cpu:
            return decode_kernels()
        return None

    def joins(self, kv_cache: torch.Tensor, decode_context_lens: Sequence[int], rows: int) -> bool:
        """Whether a step of decode rows (their contexts `decode_context_lens`) and prefill chunks,
        `rows` in all, runs as one pass (`forward`'s `decode_rows`) and gives each row the bits it
        gets in a step of its own kind: on a CPU, where the fused decode kernels take the decode rows
        and every matrix computes each of the `rows` on its row-wise kernel (linear.py's up to its
        MAX_ROWS, a file's blocks up to quant.max_rows()). Else the runner runs the two apart."""
        if self.device.type != "cpu" or self.dtype not in FUSED_DECODE_DTYPES or self.reduce is not None:
            return False
        if rows > self._row_wise_rows() or decode_kernels() is None:
            return False
        return kv_cache.is_cpu and self._decode_fits(kv_cache, decode_context_lens)

    def _row_wise_rows(self) -> int:
        """The most rows of a step on which every matrix computes each row alone: the least of the
        dense ones' linear.py limit and the blocks' quant.max_rows() (strict blocks: any rows)."""
        if self._row_wise is None:
            limits = [1 << 30]
            for t in (self.lm_head, *(t for lw in self.layers for t in vars(lw).values())):
                for m in t if isinstance(t, list | tuple) else [t]:
                    if isinstance(m, QuantizedWeight):
                        limits.append(1 << 30 if m.batch_invariant else quant_kernel.max_rows())
                    elif isinstance(m, torch.Tensor) and m.dim() >= 2:  # dense matrices (norms are 1-D)
                        limits.append(linear_max_rows(self.dtype) if kernel_available() else 0)
            self._row_wise = min(limits)
        return self._row_wise

    def _joined(
        self,
        kernels: DecodeKernels,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        head: AttentionMetadata,
        tail: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_done: LayerHook | None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """forward() for a step of decode rows (the first head.num_seqs rows) and prefill chunks (the
        rest) in one pass over the weights: the matrices, norms and SiLU on every row together (their
        kernels compute each row alone), attention apart, the decode rows' on the fused kernel as a
        decode step attends and the chunks' as a prefill does. Issue 45: run as two passes, a step
        that prefilled a 14-token prompt beside four streams took 45 to 65 ms against a decode step's
        18, the steady streams' ITL p99."""
        cfg = self.cfg
        d = head.num_seqs
        h = self._embedding(input_ids)
        step = kernels.step(
            h[:d],
            kv_cache,
            head,
            self.cos[positions[:d]].to(self.dtype),
            self.sin[positions[:d]].to(self.dtype),
            num_heads=cfg.num_heads,
            scale=self.scale,
            eps=cfg.rms_norm_eps,
            intermediate_size=cfg.intermediate_size,
            **({"kv_heads": cfg.num_kv_heads} if kv_cache.dtype in QUANTIZED_KV_KINDS else {}),
        )
        cos, sin = self.cos[positions[d:]].to(self.dtype), self.sin[positions[d:]].to(self.dtype)
        q_size, kv_size = cfg.q_size, cfg.kv_size
        h, x = self._add_norm(kernels, h, None, self.layers[0].input_norm)
        for i, lw in enumerate(self.layers):
            qkv = linear(x, lw.qkv, lw.qkv_bias)
            _adapt(qkv, x, i, "qkv", lora)
            self._norm_qk(qkv, lw)
            chunks = qkv[d:]
            q = apply_rope(chunks[:, :q_size].view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(chunks[:, q_size : q_size + kv_size].view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = chunks[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            step.write_kv(i, qkv[:d])  # RoPE on the decode rows' q and k, in place, and their K/V
            write_kv(kv_cache[i], k, v, tail)
            if on_layer_done is not None:
                on_layer_done(i)
            chunks_attn = self._prefill_attention(q, k, v, kv_cache[i], tail, i)
            attn = torch.cat([step.attention(i, qkv[:d], write=False), chunks_attn])
            o = linear(attn, lw.o)
            _adapt(o, attn, i, "o", lora)
            h, x = self._add_norm(kernels, h, o, lw.post_norm)
            down = self._mlp(kernels, x, lw, lora, i)
            h, x = self._add_norm(kernels, h, down, self._norm_after(i))
        if logits_indices.numel() == 0:
            return x.new_empty((0, self.lm_head.shape[0]), dtype=torch.float32)
        return linear(x[logits_indices], self.lm_head).float()

    def _fused_decode(
        self,
        kernels: DecodeKernels | TritonDecodeKernels,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_done: LayerHook | None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """forward() for a decode step: the same computation, layer for layer, on the fused kernels."""
        cfg = self.cfg
        h = self._embedding(input_ids)  # the residual stream, updated in place from here on
        step = kernels.step(
            h,
            kv_cache,
            meta,
            self.cos[positions].to(self.dtype),
            self.sin[positions].to(self.dtype),
            num_heads=cfg.num_heads,
            scale=self.scale,
            eps=cfg.rms_norm_eps,
            intermediate_size=cfg.intermediate_size,
            **({"kv_heads": cfg.num_kv_heads} if kv_cache.dtype in QUANTIZED_KV_KINDS else {}),
        )
        x = step.norm(self.layers[0].input_norm)
        for i, lw in enumerate(self.layers):
            qkv = step.linear(x, lw.qkv, lw.qkv_bias)
            _adapt(qkv, x, i, "qkv", lora)
            self._norm_qk(qkv, lw)
            if on_layer_done is None or self.reduce is not None:
                attn = step.attention(i, qkv)  # RoPE on q and k, K/V into the cache, attention
            else:
                step.write_kv(i, qkv)
                on_layer_done(i)
                attn = step.attention(i, qkv, write=False)
            o = step.linear(attn, lw.o)
            _adapt(o, attn, i, "o", lora)
            self._all_reduce(o, i, on_layer_done)
            x = step.norm(lw.post_norm, residual=o)
            if lw.gate_up is not None and lw.down is not None and lora is not None:
                gate_up = step.linear(x, lw.gate_up)
                _adapt(gate_up, x, i, "gate_up", lora)
                act = step.silu_mul(gate_up)
                down = step.linear(act, lw.down)
                _adapt(down, act, i, "down", lora)
            elif lw.gate_up is not None and lw.down is not None:
                down = step.silu_mul_linear(step.linear(x, lw.gate_up), lw.down)
            else:  # a mixture of experts: the torch path's, between the kernels' norms
                down = self._mlp(None, x, lw)
            if self.reduce is not None:
                self.reduce(down)
            # the next layer's input norm, or the final one, with this layer's residual add
            x = step.norm(self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm, residual=down)
        if logits_indices.numel() == 0:  # a rank other than 0
            return x.new_empty((0, self.lm_head.shape[0]), dtype=torch.float32)
        return step.linear(x[logits_indices], self.lm_head).float()


def _adapt(y: torch.Tensor, x: torch.Tensor, layer: int, slot: str, lora: LoraRows | None) -> None:
    """y += the LoRA updates of `slot` in `layer` on their rows of x (none: nothing)."""
    if lora is not None:
        lora.apply(y, x, layer, slot)
