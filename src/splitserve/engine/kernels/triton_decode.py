"""Fused Triton kernels for the small operations of a CUDA decode step.

The GPU counterpart of decode.py, behind the same per-step interface, so that
DecoderModel._fused_decode runs either:

    step = triton_decode_kernels().step(h, kv_cache, meta, cos, sin, ...)
    x = step.norm(w_in)                       # x = RMSNorm(h)
    attn = step.attention(layer, qkv)         # RoPE on q and k, K/V into the cache, paged attention
    x = step.norm(w_post, residual=o)         # h += o, x = RMSNorm(h)
    act = step.silu_mul(gate_up)              # silu(gate) * up
    y = step.linear(x, w)                     # x @ w.T, on gemv_kernel at batch 1..4
    down = step.silu_mul_linear(gate_up, w)   # silu(gate) * up read straight into the down product

Plain PyTorch plus CUDA graphs leaves a decode step some fifty small kernels a
layer; these make it four beside the matrix products (two norms, RoPE with the
KV write, attention; SiLU * up is read into the down product), five where
attention's context is split across programs (split-K, "flash decoding", for
long contexts at small batch). At batch 1..4 the matrix products are weight
streams, and they run on gemv_kernel, which beats cuBLAS there (GEMV_MAX_ROWS).
Everything is capturable in a CUDA graph: grids come from shapes alone, no
value is read back to the host, buffers are allocated with torch (in the
graph's pool when captured), and the first launch, which compiles, happens in
the capture's warm-up runs (engine/cuda_graphs.py).

bf16, fp16 and fp32 tensors on one device: CUDA in serving, the CPU only under
Triton's interpreter (TRITON_INTERPRET=1, for the tests). The KV cache in the model's dtype,
or quantized (int8 or fp8 e4m3 with a scale per token and kv head, engine/kv_cache.py's
format), which attention reads in place; a quantized cache's write is the torch path's
`write_quantized` after the kernel's RoPE (the same bytes as the C++ kernel's write). `triton_decode_kernels()`
is None, and the model runs its torch code, when triton is not installed or
SPLITSERVE_NO_KERNELS is set; triton is imported only on its first call.
"""

from __future__ import annotations

import logging
import math
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from splitserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from splitserve.engine.blocks import cdiv
from splitserve.engine.kernels.decode import KV_KINDS, StepMetadata, cache_shape
from splitserve.engine.kernels.linear import DISABLE_ENV, PackedWeight, kernels_disabled
from splitserve.engine.kernels.once import Once
from splitserve.engine.kv_cache import KVCache, KVLayout, write_quantized
from splitserve.engine.layers import apply_rope, rms_norm

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LONG = torch.int64

# Context tokens per attention tile and warps per program: to be tuned on the GPU
# (tl.dot needs tiles of at least 16 on every side, hence the floors below).
ATTENTION_BLOCK_N = 32
ATTENTION_WARPS = 4
SILU_BLOCK = 1024
# Split-K ("flash decoding"): a step whose block tables are wide enough splits each sequence's
# context into parts attended by separate programs and combined after, so that batch 1 with
# eight kv heads still fills the GPU (a grid of sequences x kv heads is 8 programs on ~132 SMs).
# The split count follows from shapes only (the padded table width), as a CUDA graph needs.
# All three are first guesses, not measurements: tune them on the GPU.
SPLIT_TARGET_PROGRAMS = 264  # two per SM of an H100
SPLIT_MIN_TOKENS = 256  # below this, a guess, a split's reads do not pay for the combine
MAX_SPLITS = 64
# Matrix products of up to GEMV_MAX_ROWS rows run on gemv_kernel, past that on cuBLAS (F.linear).
# Measured on an H100 at batch 1 with cold weights (one copy per layer, replayed in a CUDA graph):
# Llama-3-8B's lm_head 336 us against cuBLAS's 393, its layer's four products 161 us against 165
# (qkv level, o, gate_up and down ahead by 1-5%), and SmolLM2's 1-4 MB matrices 2.2-4.2 us against
# 3.5-5.4, where a step is launch-bound. Tiles of 4 weight rows by a K chunk of 2048 (1024 below
# K 4096, where the smaller chunk won), shrunk as rows grow so that the product tile (rows x 4 x
# chunk) stays at 8192 values. Past a few rows a GEMM's tiles win.
GEMV_MAX_ROWS = 4
GEMV_BLOCK_N = 4
GEMV_TILE = 8192
# silu_mul_linear reads SiLU * up straight into the down product (one kernel fewer a layer) up to
# this intermediate size: at SmolLM2's 1536 the saved launch wins (a step's graph 0.945 -> 0.894
# ms), at Llama-3-8B's 14336 each program's recomputed activation costs more than it saves (6.25
# -> 6.63 ms).
FUSED_SILU_MAX_INTER = 4096


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _check_step_tensors(
    h: Tensor, kv_cache: Tensor, meta: StepMetadata, cos: Tensor, sin: Tensor, num_heads: int, kv_heads: int = 0
) -> None:
    """Every property of a step's fixed tensors that the kernels rely on (ValueError naming the first that fails)."""
    dtype, dev = h.dtype, h.device
    if dtype not in DTYPES:
        raise ValueError(f"Triton decode kernels take bf16, fp16 or fp32, not {dtype}")
    if h.dim() != 2 or not h.is_contiguous():
        raise ValueError("h must be a contiguous tensor [batch, hidden]")
    own = kv_cache.dtype == dtype or kv_cache.dtype in KV_KINDS
    if not kv_cache.is_contiguous() or not own or kv_cache.device != dev:
        raise ValueError(
            f"kv_cache must be a contiguous {dtype} tensor on {dev} [layers, blocks, 2, block_size, kv_heads, head_dim]"
            " or a quantized one (int8, float8_e4m3fn)"
        )
    _, _, _, kv_heads, head_dim = cache_shape(kv_cache, kv_heads, cos.shape[-1])
    if not meta.is_decode:
        raise ValueError("a decode step needs one new token per sequence")
    batch = h.shape[0]
    tables = meta.block_tables
    # the block table may be a column slice of a wider buffer (cuda_graphs.py): rows strided
    if tables.dim() != 2 or tables.shape[0] != batch or tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, width] with contiguous rows")
    for name, t in (
        ("slot_blocks", meta.slot_blocks),
        ("slot_offsets", meta.slot_offsets),
        ("context_lens", meta.context_lens),
        ("block_tables", tables),
    ):
        if t.dtype != _LONG or t.device != dev or t.shape[0] != batch or (t.dim() == 1 and not t.is_contiguous()):
            raise ValueError(f"{name} must be an int64 tensor on {dev} with {batch} rows")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != dtype or t.device != dev or tuple(t.shape) != (batch, head_dim) or t.stride(1) != 1:
            raise ValueError(f"{name} must be a {dtype} tensor [{batch}, {head_dim}] on {dev}")
    if num_heads <= 0 or num_heads % kv_heads or head_dim % 2:
        raise ValueError(f"num_heads {num_heads} must be a multiple of kv_heads {kv_heads}, head_dim even")


class TritonDecodeStep:
    """One decode step's fused operations over the residual stream `h` [B, hidden], in place.

    As decode.DecodeStep: each method's output is a buffer of the step, overwritten by the
    method's next call; a layer consumes each before that.
    """

    def __init__(
        self,
        ops: ModuleType,
        h: Tensor,
        kv_cache: Tensor,
        meta: StepMetadata,
        cos: Tensor,
        sin: Tensor,
        num_heads: int,
        scale: float,
        eps: float,
        intermediate_size: int,
        kv_heads: int = 0,
    ):
        _check_step_tensors(h, kv_cache, meta, cos, sin, num_heads, kv_heads)
        batch, hidden = h.shape
        layers, _, block_size, kv_heads, head_dim = cache_shape(kv_cache, kv_heads, cos.shape[-1])
        self._ops = ops
        self.h = h
        self.num_layers = layers
        self._kv_cache, self._meta, self._cos, self._sin = kv_cache, meta, cos, sin
        self._eps = float(eps)
        self._num_heads, self._kv_heads, self._head_dim, self._block_size = num_heads, kv_heads, head_dim, block_size
        self._qkv_shape = (batch, (num_heads + 2 * kv_heads) * head_dim)
        self._gate_up_shape = (batch, 2 * intermediate_size)
        self._intermediate = intermediate_size
        self._x = torch.empty_like(h)
        self._attn = h.new_empty(batch, num_heads * head_dim)
        self._act = h.new_empty(batch, intermediate_size)
        self._norm_block = _pow2(hidden)
        self._norm_warps = 4 if hidden <= 2048 else 8
        self._quant = KV_KINDS.get(kv_cache.dtype, 0)  # the attention kernel's KV_QUANT
        self._bind_cache(kv_cache)
        self._plan_attention(scale, meta.block_tables.shape[1])

    def _bind_cache(self, kv_cache: Tensor) -> None:
        """The cache's element strides (block, K/V, token, head) as the kernels address it, shared
        by every layer's view; a quantized cache's in bytes (the kernel finds its scales from them)."""
        if not self._quant:
            self._cache_strides = kv_cache.stride()[1:5]
            return
        bs, kvh, dim = self._block_size, self._kv_heads, self._head_dim
        # a block's scales start 4-byte aligned: 2 * bs * kvh * dim is a multiple of 4 (dim is even)
        self._cache_strides = (kv_cache.shape[2], bs * kvh * dim, kvh * dim, dim)

    def _plan_attention(self, scale: float, table_width: int) -> None:
        """The attention kernel's compile-time sizes, its context split and the split's part buffers."""
        h, num_heads, kv_heads, head_dim = self.h, self._num_heads, self._kv_heads, self._head_dim
        batch, dev = h.shape[0], h.device
        group = num_heads // kv_heads
        self._attn_meta = dict(
            NUM_HEADS=num_heads,
            BLOCK_SIZE=self._block_size,
            GROUP=group,
            GROUP_PAD=_pow2(group, 16),
            HEAD_DIM=head_dim,
            DIM_PAD=_pow2(head_dim, 16),
            BLOCK_N=ATTENTION_BLOCK_N,
            QK_PRECISION="ieee" if h.dtype is torch.float32 else "tf32",  # no TF32 for fp32 models
            KV_QUANT=self._quant,
        )
        self._scale_log2 = float(scale) * math.log2(math.e)
        self._splits, self._tokens_per_split = context_splits(batch, kv_heads, table_width * self._block_size)
        self._part_acc = self._part_ml = self._attn  # unread with one split
        if self._splits > 1:
            self._part_acc = torch.empty(batch, num_heads, self._splits, head_dim, dtype=torch.float32, device=dev)
            self._part_ml = torch.empty(batch, num_heads, self._splits, 2, dtype=torch.float32, device=dev)

    def norm(self, weight: Tensor, residual: Tensor | None = None) -> Tensor:
        """weight * RMSNorm(h), as engine.layers.rms_norm computes it; with `residual`, first h += residual."""
        h = self.h
        if weight.shape != h.shape[1:] or weight.dtype != h.dtype or not weight.is_contiguous():
            raise ValueError(f"norm weight must be a contiguous {h.dtype} tensor [{h.shape[1]}]")
        if residual is not None and (
            residual.shape != h.shape or residual.dtype != h.dtype or not residual.is_contiguous()
        ):
            raise ValueError(f"residual must be a contiguous {h.dtype} tensor {list(h.shape)}")
        self._ops.rms_norm_kernel[(h.shape[0],)](
            self._x,
            h,
            h if residual is None else residual,
            weight,
            h.shape[1],
            self._eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=self._norm_block,
            num_warps=self._norm_warps,
        )
        return self._x

    def _check(self, layer: int, qkv: Tensor) -> Tensor:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if tuple(qkv.shape) != self._qkv_shape or qkv.dtype != self.h.dtype or not qkv.is_contiguous():
            raise ValueError(f"qkv must be a contiguous {self.h.dtype} tensor {list(self._qkv_shape)}")
        return self._kv_cache[layer]

    def write_kv(self, layer: int, qkv: Tensor) -> None:
        """RoPE on q and k (in place in qkv) and K and V into each token's slot of the layer's cache."""
        cache = self._check(layer, qkv)
        meta = self._meta
        self._ops.rope_write_kv_kernel[(qkv.shape[0], self._num_heads + 2 * self._kv_heads)](
            qkv,
            self._cos,
            self._sin,
            cache,
            meta.slot_blocks,
            meta.slot_offsets,
            qkv.stride(0),
            self._cos.stride(0),
            *self._cache_strides,
            NUM_HEADS=self._num_heads,
            KV_HEADS=self._kv_heads,
            HEAD_DIM=self._head_dim,
            HALF_PAD=_pow2(self._head_dim // 2),
            STORE_KV=not self._quant,
            num_warps=1,
        )
        if self._quant:  # the rotated K and V quantized into their slots, as the torch path writes them
            q_size, kv_size = self._num_heads * self._head_dim, self._kv_heads * self._head_dim
            shape = (qkv.shape[0], self._kv_heads, self._head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(shape)
            v = qkv[:, q_size + kv_size :].view(shape)
            write_quantized(cache, k, v, meta.slot_blocks, meta.slot_offsets)

    def attention(self, layer: int, qkv: Tensor, write: bool = True) -> Tensor:
        """Attention output [B, heads * head_dim] (the o projection's input) of one layer.

        qkv is the fused projection's output, [B, (heads + 2 kv_heads) * head_dim]: q heads,
        then k heads, then v heads. With `write` (the default), `write_kv` runs first; without,
        it must have run for this layer and qkv.
        """
        if write:
            self.write_kv(layer, qkv)
        cache = self._check(layer, qkv)
        meta = self._meta
        batch, splits = qkv.shape[0], self._splits
        # e4m3 read as its bits (the kernel widens them exactly, with or without fp8 hardware)
        values = cache.view(torch.uint8) if self._quant == KV_KINDS[torch.float8_e4m3fn] else cache
        self._ops.paged_decode_attention_kernel[(batch, self._kv_heads, splits)](
            self._attn,
            self._part_acc,
            self._part_ml,
            qkv,
            values,
            meta.block_tables,
            meta.context_lens,
            qkv.stride(0),
            meta.block_tables.stride(0),
            *self._cache_strides,
            self._tokens_per_split,
            self._scale_log2,
            **self._attn_meta,
            NUM_SPLITS=splits,
            num_warps=ATTENTION_WARPS,
        )
        if splits > 1:
            self._ops.combine_splits_kernel[(batch, self._num_heads)](
                self._attn,
                self._part_acc,
                self._part_ml,
                NUM_HEADS=self._num_heads,
                HEAD_DIM=self._head_dim,
                DIM_PAD=self._attn_meta["DIM_PAD"],
                NUM_SPLITS=splits,
                SPLITS_PAD=_pow2(splits),
                num_warps=1,
            )
        return self._attn

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up from gate_up [B, 2 intermediate] = [gate | up], as F.silu(gate) * up rounds it."""
        self._check_gate_up(gate_up)
        grid = (gate_up.shape[0], cdiv(self._intermediate, SILU_BLOCK))
        self._ops.silu_mul_kernel[grid](self._act, gate_up, self._intermediate, BLOCK=SILU_BLOCK, num_warps=4)
        return self._act

    def _check_gate_up(self, gate_up: Tensor) -> None:
        if tuple(gate_up.shape) != self._gate_up_shape or gate_up.dtype != self.h.dtype or not gate_up.is_contiguous():
            raise ValueError(f"gate_up must be a contiguous {self.h.dtype} tensor {list(self._gate_up_shape)}")

    def linear(self, x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias), as F.linear: gemv_kernel for a few rows, cuBLAS past them (a new tensor).
        A GPU's weights are floats (a GGUF file's blocks are dequantized onto it)."""
        if not isinstance(w, Tensor):
            raise TypeError("the Triton decode step takes float weights; a GPU model dequantizes its blocks")
        if not self._gemv_fits(x, w, bias):
            return F.linear(x, w, bias)
        return self._gemv(x, w, bias, x.shape[1], silu_mul=False)

    def silu_mul_linear(self, gate_up: Tensor, w: Tensor | PackedWeight) -> Tensor:
        """linear(silu_mul(gate_up), w) in one kernel where gemv_kernel takes it (a new tensor)."""
        if not isinstance(w, Tensor):
            raise TypeError("the Triton decode step takes float weights; a GPU model dequantizes its blocks")
        self._check_gate_up(gate_up)
        rows = gate_up.shape[0]
        fused = rows <= GEMV_MAX_ROWS and self._intermediate <= FUSED_SILU_MAX_INTER
        if not fused or not _weight_fits(w, self._intermediate, gate_up):
            return F.linear(self.silu_mul(gate_up), w)
        return self._gemv(gate_up, w, None, self._intermediate, silu_mul=True)

    def _gemv_fits(self, x: Tensor, w: Tensor, bias: Tensor | None) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= GEMV_MAX_ROWS
            and x.is_contiguous()
            and _weight_fits(w, x.shape[1], x)
            and (bias is None or (bias.dtype == w.dtype and bias.shape == (w.shape[0],) and bias.is_contiguous()))
        )

    def _gemv(self, x: Tensor, w: Tensor, bias: Tensor | None, k: int, silu_mul: bool) -> Tensor:
        rows, n = x.shape[0], w.shape[0]
        y = x.new_empty(rows, n)
        rows_pad = _pow2(rows)
        chunk = 2048 if k >= 4096 else 1024
        block_k = min(_pow2(k, 16), chunk, GEMV_TILE // (rows_pad * GEMV_BLOCK_N))
        self._ops.gemv_kernel[(cdiv(n, GEMV_BLOCK_N),)](
            y,
            x,
            w,
            w if bias is None else bias,
            rows,
            n,
            k,
            x.shape[1],
            HAS_BIAS=bias is not None,
            SILU_MUL=silu_mul,
            ROWS_PAD=rows_pad,
            BLOCK_N=GEMV_BLOCK_N,
            BLOCK_K=block_k,
            num_warps=4,
        )
        return y


def _weight_fits(w: Tensor, k: int, x: Tensor) -> bool:
    """w can stream through gemv_kernel against x: [N, k] contiguous, x's dtype and device."""
    return w.dim() == 2 and w.shape[1] == k and w.dtype == x.dtype and w.device == x.device and w.is_contiguous()


def context_splits(batch: int, kv_heads: int, max_context: int) -> tuple[int, int]:
    """(splits, tokens per split) for attention over contexts of up to `max_context` tokens:
    enough splits to reach SPLIT_TARGET_PROGRAMS, none under SPLIT_MIN_TOKENS, each a whole
    number of attention tiles, none wholly past max_context."""
    splits = min(MAX_SPLITS, SPLIT_TARGET_PROGRAMS // (batch * kv_heads), max_context // SPLIT_MIN_TOKENS)
    if splits <= 1:
        return 1, max_context
    per_split = cdiv(cdiv(max_context, splits), ATTENTION_BLOCK_N) * ATTENTION_BLOCK_N
    return cdiv(max_context, per_split), per_split


class TritonDecodeKernels:
    """The kernels' front: `step` as decode.DecodeKernels.step. `reads_quantized`: whether a step
    may take an int8 or fp8 cache (False when that path failed its load-time self-test; the model
    then runs such steps on the torch path)."""

    def __init__(self, ops: ModuleType, reads_quantized: bool = True):
        self._ops = ops
        self.reads_quantized = reads_quantized

    def step(
        self,
        h: Tensor,
        kv_cache: Tensor,
        meta: StepMetadata,
        cos: Tensor,
        sin: Tensor,
        *,
        num_heads: int,
        scale: float,
        eps: float,
        intermediate_size: int,
        kv_heads: int = 0,
    ) -> TritonDecodeStep:
        """A decode step over residual stream h [B, hidden] and kv_cache (all layers).

        cos and sin are [B, head_dim] rows of the RoPE tables at each token's position, in h's
        dtype; meta is the step's AttentionMetadata (a decode step). `kv_heads`: the cache's KV
        heads, needed only for a quantized cache (whose blocks are bytes).
        """
        return TritonDecodeStep(
            self._ops, h, kv_cache, meta, cos, sin, num_heads, scale, eps, intermediate_size, kv_heads
        )


class _SelfTestSizes(NamedTuple):
    """The self-test step's sizes: two query heads per kv head, blocks of four tokens."""

    heads: int = 4
    kv_heads: int = 2
    dim: int = 16
    block_size: int = 4
    hidden: int = 32
    inter: int = 24
    eps: float = 1e-5


class _SelfTestInputs(NamedTuple):
    """The self-test step's random tensors, drawn in this order."""

    cache: Tensor
    h: Tensor
    norm_w: Tensor
    qkv: Tensor
    gate_up: Tensor
    down_w: Tensor
    linear_w: Tensor
    bias: Tensor


def _self_test(k: TritonDecodeKernels, device: torch.device) -> bool:
    """One small fp32 decode step's norm, RoPE + KV write + attention and SiLU * up against the
    torch code they replace. Triton compiles on first launch, on whatever GPU this is: a
    kernel that fails or disagrees there must cost the torch path, not wrong tokens."""
    z = _SelfTestSizes()
    meta, cos, sin = _self_test_positions(z, device)
    x = _self_test_inputs(z, device)
    want = _self_test_on_torch(z, x, meta, cos, sin)
    step = k.step(
        x.h.clone(), x.cache, meta, cos, sin, num_heads=z.heads, scale=z.dim**-0.5, eps=z.eps, intermediate_size=z.inter
    )
    got = (
        step.norm(x.norm_w),
        step.attention(0, x.qkv.clone()),
        step.silu_mul(x.gate_up),
        x.cache,
        step.silu_mul_linear(x.gate_up, x.down_w),
        step.linear(x.h, x.linear_w, x.bias),
    )
    close = all(
        torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-3, atol=1e-3) for a, b in zip(got, want, strict=True)
    )
    return bool(close)


def _self_test_quantized(k: TritonDecodeKernels, device: torch.device) -> bool:
    """The quantized read on both formats: one small fp32 step's attention over an int8 and an fp8
    cache written by the torch path, against the torch path's attention over the same bytes."""
    z = _SelfTestSizes()
    meta, cos, sin = _self_test_positions(z, device)
    x = _self_test_inputs(z, device)
    q_size, kv_size = z.heads * z.dim, z.kv_heads * z.dim
    ok = True
    for kind in ("int8", "fp8_e4m3"):
        cache = KVCache(KVLayout(1, z.kv_heads, z.dim, z.block_size, kind), 6, device).tensor
        k_old, v_old = x.cache[0, :, 0], x.cache[0, :, 1]  # every block's earlier tokens, as the torch path writes
        blocks = torch.arange(6, device=device).repeat_interleave(z.block_size)
        offsets = torch.arange(z.block_size, device=device).repeat(6)
        shape = (6 * z.block_size, z.kv_heads, z.dim)
        write_quantized(cache[0], k_old.reshape(shape), v_old.reshape(shape), blocks, offsets)
        want_cache = cache.clone()
        q = apply_rope(x.qkv[:, :q_size].view(2, z.heads, z.dim), cos, sin)
        kn = apply_rope(x.qkv[:, q_size : q_size + kv_size].view(2, z.kv_heads, z.dim), cos, sin)
        vn = x.qkv[:, q_size + kv_size :].view(2, z.kv_heads, z.dim)
        write_kv(want_cache[0], kn, vn, meta)
        want = paged_attention(q, kn, vn, want_cache[0], meta, z.dim**-0.5).reshape(2, q_size)
        step = k.step(
            x.h.clone(),
            cache,
            meta,
            cos,
            sin,
            num_heads=z.heads,
            scale=z.dim**-0.5,
            eps=z.eps,
            intermediate_size=z.inter,
            kv_heads=z.kv_heads,
        )
        got = step.attention(0, x.qkv.clone())
        ok &= torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
        ok &= torch.allclose(got.float().cpu(), want.float().cpu(), rtol=1e-3, atol=1e-3)
    return ok


def _self_test_positions(z: _SelfTestSizes, device: torch.device) -> tuple[AttentionMetadata, Tensor, Tensor]:
    """Two sequences' decode metadata and the RoPE rows at their new tokens' positions."""
    ctx = [5, 9]  # across block boundaries, the second table padded with block 0
    tables = torch.tensor([[1, 2, 0], [3, 4, 5]])
    last = torch.tensor(ctx) - 1
    meta = AttentionMetadata(
        slot_blocks=tables[torch.arange(2), last // z.block_size].to(device),
        slot_offsets=(last % z.block_size).to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(ctx, device=device),
        query_lens=[1, 1],
        context_lens_list=ctx,
        is_decode=True,
    )
    inv = 1.0 / (10000.0 ** (torch.arange(0, z.dim, 2).float() / z.dim))
    ang = last.float()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos().to(device), torch.cat((ang, ang), -1).sin().to(device)
    return meta, cos, sin


def _self_test_inputs(z: _SelfTestSizes, device: torch.device) -> _SelfTestInputs:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(device)

    return _SelfTestInputs(
        cache=rand(1, 6, 2, z.block_size, z.kv_heads, z.dim),
        h=rand(2, z.hidden),
        norm_w=rand(z.hidden),
        qkv=rand(2, (z.heads + 2 * z.kv_heads) * z.dim),
        gate_up=rand(2, 2 * z.inter),
        down_w=rand(z.hidden, z.inter),
        linear_w=rand(z.hidden, z.hidden),
        bias=rand(z.hidden),
    )


def _self_test_on_torch(
    z: _SelfTestSizes, x: _SelfTestInputs, meta: AttentionMetadata, cos: Tensor, sin: Tensor
) -> tuple[Tensor, ...]:
    """What the step's norm, attention, silu_mul, cache, silu_mul_linear and linear should give,
    by the torch code they replace (on a copy of the cache)."""
    q_size, kv_size = z.heads * z.dim, z.kv_heads * z.dim
    q = apply_rope(x.qkv[:, :q_size].view(2, z.heads, z.dim), cos, sin)
    kn = apply_rope(x.qkv[:, q_size : q_size + kv_size].view(2, z.kv_heads, z.dim), cos, sin)
    vn = x.qkv[:, q_size + kv_size :].view(2, z.kv_heads, z.dim)
    cache = x.cache.clone()
    write_kv(cache[0], kn, vn, meta)
    attn = paged_attention(q, kn, vn, cache[0], meta, z.dim**-0.5).reshape(2, q_size)
    gate, up = x.gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    return rms_norm(x.h, x.norm_w, z.eps), attn, act, cache, F.linear(act, x.down_w), F.linear(x.h, x.linear_w, x.bias)


def _load() -> TritonDecodeKernels | None:
    if kernels_disabled():
        log.info("%s is set: CUDA decode runs on torch", DISABLE_ENV)
        return None
    try:
        from splitserve.engine.kernels import triton_decode_ops
    except ImportError as e:
        log.info("triton is not importable (%s): CUDA decode runs on torch", e)
        return None
    k = TritonDecodeKernels(triton_decode_ops)
    if torch.cuda.is_available():  # on the CPU only the tests use them, under the interpreter
        try:
            ok = _self_test(k, torch.device("cuda"))
        except Exception as e:  # a compile error, a launch failure: the torch path is no worse
            log.warning(
                "Triton decode kernels failed their self-test (%s: %s); CUDA decode runs on torch", type(e).__name__, e
            )
            return None
        if not ok:
            log.warning("Triton decode kernels disagree with torch on their self-test; CUDA decode runs on torch")
            return None
        k.reads_quantized = _quantized_self_test_passes(k, torch.device("cuda"))
    return k


def _quantized_self_test_passes(k: TritonDecodeKernels, device: torch.device) -> bool:
    """The quantized read's self-test, apart: its failure costs int8/fp8 pools the torch path only."""
    try:
        if _self_test_quantized(k, device):
            return True
        log.warning("the Triton quantized KV read disagrees with torch; CUDA decode over int8/fp8 KV runs on torch")
    except Exception as e:  # as for the kernels as a whole
        log.warning("the Triton quantized KV read failed (%s: %s); int8/fp8 KV decodes on torch", type(e).__name__, e)
    return False


_KERNELS: Once[TritonDecodeKernels | None] = Once(_load)


def triton_decode_kernels() -> TritonDecodeKernels | None:
    """The kernels (None: triton missing or kernels disabled; see the module doc)."""
    return _KERNELS.get()
