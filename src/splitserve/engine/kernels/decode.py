"""Fused CPU kernels for the small operations of a decode step (decode.cpp).

Once the weight matrices stream at memory speed (linear.py), what is left of a
CPU decode step is some fifty torch calls per layer on tensors of a few
hundred elements: RMSNorm, RoPE, the KV write, the block-table gather and SDPA
of decode attention, SiLU * up, residual adds. Each costs microseconds of
dispatch for nanoseconds of arithmetic. Here a layer is four calls:

    step = decode_kernels().step(h, kv_cache, meta, cos, sin, ...)   # checks the step's tensors once
    x = step.norm(w_in)                       # x = RMSNorm(h)
    attn = step.attention(layer, qkv)         # RoPE on q and k, K/V into the cache, paged attention
    x = step.norm(w_post, residual=o)         # h += o, x = RMSNorm(h)
    act = step.silu_mul(gate_up)              # silu(gate) * up
    y = step.linear(x, w)                     # x @ w.T: linear.py here, its own kernel on the GPU
    down = step.silu_mul_linear(gate_up, w)   # silu_mul, then linear (one kernel on the GPU)

bf16 and fp32 on the CPU only; the KV cache in the model's dtype, or quantized (int8 or fp8
e4m3 values with a scale per token and KV head, engine/kv_cache.py's format: `[layers,
blocks, block_bytes]` of torch.int8 or torch.float8_e4m3fn), which the kernel quantizes on
write and reads in place (kv_kind 1 or 2 below). Every property the C++ relies on (dtype,
shape, contiguity, device) is checked here, the step's fixed tensors once per
step and each layer's new tensor per call; the scheduler's indices (block
tables, slots, context lengths) are checked by the C++ before it touches
memory. `decode_kernels()` is None, and callers run their torch code, when
SPLITSERVE_NO_KERNELS is set, the platform is not x86-64 Linux, the build
fails or the freshly built binary disagrees with torch on its self-test.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor

from splitserve.engine.kernels.build import load_extension, passes_self_test
from splitserve.engine.kernels.linear import DISABLE_ENV, PackedWeight, kernels_disabled, linear
from splitserve.engine.kernels.once import Once

log = logging.getLogger(__name__)

_BF16 = torch.bfloat16
_F32 = torch.float32
_LONG = torch.int64

ISA_NAMES = {1: "x86-64", 2: "avx2", 3: "avx512"}

# decode_attention's kv_kind: the cache's element type (0: the model's dtype)
KV_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}
_SCALE_BYTES = 4  # engine/kv_cache.py's fp32 scale per token and KV head


class StepMetadata(Protocol):
    """What a step needs of engine.attention.AttentionMetadata (not imported: it imports nothing from here)."""

    # read-only, as the frozen dataclass has them
    @property
    def slot_blocks(self) -> Tensor: ...
    @property
    def slot_offsets(self) -> Tensor: ...
    @property
    def block_tables(self) -> Tensor: ...
    @property
    def context_lens(self) -> Tensor: ...
    @property
    def is_decode(self) -> bool: ...


def _is_index(t: Tensor, shape: tuple[int, ...]) -> bool:
    return t.dtype is _LONG and t.is_cpu and tuple(t.shape) == shape and t.is_contiguous()


def _fits(t: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous() and tuple(t.shape) == shape


def cache_shape(kv_cache: Tensor, kv_heads: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(layers, blocks, block_size, kv_heads, head_dim) of a cache in either format (ValueError if
    neither): the model's dtype, or quantized (then `kv_heads` is needed: a block is bytes)."""
    if kv_cache.dim() == 6 and kv_cache.dtype not in KV_KINDS:
        layers, blocks, _, block_size, kv_heads, head_dim = kv_cache.shape
        return layers, blocks, block_size, kv_heads, head_dim
    per_token = 2 * kv_heads * (head_dim + _SCALE_BYTES)
    if kv_cache.dim() != 3 or kv_cache.dtype not in KV_KINDS or kv_heads <= 0 or kv_cache.shape[2] % per_token:
        raise ValueError(
            "kv_cache must be [layers, blocks, 2, block_size, kv_heads, head_dim] in the model's dtype, or "
            "a quantized [layers, blocks, block_bytes] (int8 or float8_e4m3fn) with kv_heads given"
        )
    return kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[2] // per_token, kv_heads, head_dim


def _check_step_tensors(
    h: Tensor, kv_cache: Tensor, meta: StepMetadata, cos: Tensor, sin: Tensor, num_heads: int, kv_heads: int
) -> None:
    """Every property of a step's fixed tensors that the C++ relies on (ValueError naming the first that fails)."""
    dtype = h.dtype
    if dtype is not _BF16 and dtype is not _F32:
        raise ValueError(f"decode kernels take bf16 or fp32, not {dtype}")
    if h.dim() != 2 or not h.is_cpu or not h.is_contiguous():
        raise ValueError("h must be a contiguous CPU tensor [batch, hidden]")
    own = kv_cache.dtype is dtype or kv_cache.dtype in KV_KINDS
    if not kv_cache.is_cpu or not kv_cache.is_contiguous() or not own:
        raise ValueError(
            f"kv_cache must be a contiguous CPU {dtype} tensor [layers, blocks, 2, block_size, kv_heads, head_dim]"
            " or a quantized one (int8, float8_e4m3fn)"
        )
    _, _, _, kv_heads, head_dim = cache_shape(kv_cache, kv_heads, cos.shape[-1])
    if not meta.is_decode:
        raise ValueError("a decode step needs one new token per sequence")
    batch = h.shape[0]
    tables = meta.block_tables
    if tables.dim() != 2 or tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, width]")
    indices = (
        ("slot_blocks", meta.slot_blocks, (batch,)),
        ("slot_offsets", meta.slot_offsets, (batch,)),
        ("context_lens", meta.context_lens, (batch,)),
        ("block_tables", tables, tuple(tables.shape)),
    )
    for name, t, shape in indices:
        if not _is_index(t, shape):
            raise ValueError(f"{name} must be a contiguous CPU int64 tensor of shape {shape}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not _fits(t, dtype, (batch, head_dim)):
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor [{batch}, {head_dim}]")
    if num_heads <= 0 or num_heads % kv_heads or head_dim % 2:
        raise ValueError(f"num_heads {num_heads} must be a multiple of kv_heads {kv_heads}, head_dim even")


class DecodeStep:
    """One decode step's fused operations over the residual stream `h` [B, hidden], in place.

    The returned tensors are buffers of the step, overwritten by the next call of the same
    method: `norm`'s output by the next `norm`, and so on. A layer consumes each before that.
    """

    def __init__(
        self,
        ext: ModuleType,
        isa: int,
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
        self._ext, self._isa = ext, isa
        self.h = h
        self.dtype = h.dtype
        self.num_layers = kv_cache.shape[0]
        self._bf16 = int(h.dtype is _BF16)
        self._threads = torch.get_num_threads()
        self._eps = float(eps)
        self._kv_kind = KV_KINDS.get(kv_cache.dtype, 0)
        shape = cache_shape(kv_cache, kv_heads, cos.shape[-1])
        self._allocate_buffers(num_heads, shape[3], shape[4], intermediate_size)
        # Kept so that the pointers _bind_attention_args takes stay valid for the step's lifetime.
        self._keep = (kv_cache, meta, cos, sin)
        self._bind_attention_args(kv_cache, shape, meta, cos, sin, num_heads, scale)

    def _allocate_buffers(self, num_heads: int, kv_heads: int, head_dim: int, intermediate_size: int) -> None:
        """The expected shapes of each layer's new tensors, and the step's output buffers."""
        h = self.h
        batch, hidden = h.shape
        self._hidden_shape = (hidden,)
        self._qkv_shape = (batch, (num_heads + 2 * kv_heads) * head_dim)
        self._gate_up_shape = (batch, 2 * intermediate_size)
        self._intermediate = intermediate_size
        self._x = torch.empty_like(h)
        self._attn = h.new_empty(batch, num_heads * head_dim)
        self._act = h.new_empty(batch, intermediate_size)

    def _bind_attention_args(
        self,
        kv_cache: Tensor,
        shape: tuple[int, int, int, int, int],
        meta: StepMetadata,
        cos: Tensor,
        sin: Tensor,
        num_heads: int,
        scale: float,
    ) -> None:
        """decode_attention's arguments that stay fixed for the step: offsets, pointers and sizes."""
        _, blocks, block_size, kv_heads, head_dim = shape
        batch = self.h.shape[0]
        tables = meta.block_tables
        elt = self.h.element_size()
        self._k_off = num_heads * head_dim * elt
        self._v_off = (num_heads + kv_heads) * head_dim * elt
        self._cache = kv_cache.data_ptr()
        self._layer_bytes = kv_cache.stride(0) * kv_cache.element_size()
        width = self._qkv_shape[1]
        # decode_attention's arguments after k_new/v_new and after the cache pointer
        self._slots = (width, meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr())
        self._rest = (
            blocks,
            tables.data_ptr(),
            tables.shape[1],
            meta.context_lens.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            batch,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            self._bf16,
            float(scale),
        )

    def norm(self, weight: Tensor, residual: Tensor | None = None) -> Tensor:
        """weight * RMSNorm(h), as engine.layers.rms_norm computes it; with `residual`, first h += residual."""
        h = self.h
        if not _fits(weight, self.dtype, self._hidden_shape):
            raise ValueError(f"norm weight must be a contiguous CPU {self.dtype} tensor {list(self._hidden_shape)}")
        if residual is not None and not _fits(residual, self.dtype, tuple(h.shape)):
            raise ValueError(f"residual must be a contiguous CPU {self.dtype} tensor {list(h.shape)}")
        self._ext.rms_norm(
            self._x.data_ptr(),
            h.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            h.shape[0],
            h.shape[1],
            self._eps,
            self._bf16,
            self._threads,
            self._isa,
        )
        return self._x

    def _attend(self, layer: int, qkv: Tensor, write: bool, read: bool) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if not _fits(qkv, self.dtype, self._qkv_shape):
            raise ValueError(f"qkv must be a contiguous CPU {self.dtype} tensor {list(self._qkv_shape)}")
        p = qkv.data_ptr()
        self._ext.decode_attention(
            self._attn.data_ptr(),
            p,
            self._qkv_shape[1],
            p + self._k_off,
            p + self._v_off,
            *self._slots,
            self._cache + layer * self._layer_bytes,
            *self._rest,
            int(write),
            int(read),
            self._threads,
            self._isa,
            self._kv_kind,
        )

    def attention(self, layer: int, qkv: Tensor, write: bool = True) -> Tensor:
        """Attention output [B, heads * head_dim] (the o projection's input) of one layer.

        qkv is the fused projection's output, [B, (heads + 2 kv_heads) * head_dim]: q heads,
        then k heads, then v heads. With `write` (the default), RoPE is first applied to its q
        and k parts, in place, and each row's K and V go into its slot of the layer's cache;
        without, both must have been done by `write_kv`.
        """
        self._attend(layer, qkv, write, True)
        return self._attn

    def write_kv(self, layer: int, qkv: Tensor) -> None:
        """RoPE on q and k and the cache write only, for callers that act between write and attention."""
        self._attend(layer, qkv, True, False)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up from gate_up [B, 2 intermediate] = [gate | up], as F.silu(gate) * up rounds it."""
        if not _fits(gate_up, self.dtype, self._gate_up_shape):
            raise ValueError(f"gate_up must be a contiguous CPU {self.dtype} tensor {list(self._gate_up_shape)}")
        self._ext.silu_mul(
            self._act.data_ptr(),
            gate_up.data_ptr(),
            gate_up.shape[0],
            self._intermediate,
            self._bf16,
            self._threads,
            self._isa,
        )
        return self._act

    def linear(self, x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias): linear.py's kernel (the Triton step's counterpart takes its own)."""
        return linear(x, w, bias)

    def silu_mul_linear(self, gate_up: Tensor, w: Tensor | PackedWeight) -> Tensor:
        """linear(silu_mul(gate_up), w): two calls here, one kernel on the Triton step."""
        return linear(self.silu_mul(gate_up), w)


class DecodeKernels:
    """The built kernels. `isa` 0 runs the best code path this CPU has; 1..3 pin one (for tests)."""

    def __init__(self, ext: ModuleType, isa: int = 0):
        if not 0 <= isa <= int(ext.isa()):
            raise ValueError(f"ISA level {isa} not available (this CPU: {int(ext.isa())})")
        self._ext = ext
        self.isa = isa

    @property
    def best_isa(self) -> int:
        """1 x86-64, 2 AVX2+FMA, 3 AVX-512: the path `isa` 0 takes."""
        return int(self._ext.isa())

    def with_isa(self, isa: int) -> DecodeKernels:
        return DecodeKernels(self._ext, isa)

    def rms_norm(self, h: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
        """weight * RMSNorm(h) over h's rows (any number: a prefill's), as the step's `norm`: with
        `residual`, first h += residual, in place. h [T, hidden] and the others contiguous CPU, one dtype
        (bf16 or fp32); ValueError otherwise."""
        if not (h.dtype in (_BF16, _F32) and h.dim() == 2 and h.is_cpu and h.is_contiguous()):
            raise ValueError("rms_norm takes h as a contiguous CPU bf16 or fp32 tensor [T, hidden]")
        if not _fits(weight, h.dtype, (h.shape[1],)):
            raise ValueError(f"rms_norm weight must be a contiguous CPU {h.dtype} tensor [{h.shape[1]}]")
        if residual is not None and not _fits(residual, h.dtype, tuple(h.shape)):
            raise ValueError(f"residual must be a contiguous CPU {h.dtype} tensor {list(h.shape)}")
        out = torch.empty_like(h)
        self._ext.rms_norm(
            out.data_ptr(),
            h.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            h.shape[0],
            h.shape[1],
            float(eps),
            int(h.dtype is _BF16),
            torch.get_num_threads(),
            self.isa,
        )
        return out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up over gate_up's rows [T, 2 intermediate] = [gate | up], as the step's `silu_mul`."""
        if not (gate_up.dtype in (_BF16, _F32) and gate_up.dim() == 2 and gate_up.is_cpu and gate_up.is_contiguous()):
            raise ValueError("silu_mul takes a contiguous CPU bf16 or fp32 tensor [T, 2 intermediate]")
        if gate_up.shape[1] % 2:
            raise ValueError(f"gate_up's width {gate_up.shape[1]} is not even")
        n = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], n)
        self._ext.silu_mul(
            out.data_ptr(),
            gate_up.data_ptr(),
            gate_up.shape[0],
            n,
            int(gate_up.dtype is _BF16),
            torch.get_num_threads(),
            self.isa,
        )
        return out

    def draw(self, logits: Tensor, temperatures: Sequence[float], uniforms: Tensor | Sequence[float]) -> list[int]:
        """One token per row of logits [rows, vocab] (contiguous CPU fp32): where the CDF of
        softmax(row / temperature) passes the row's uniform draw in [0, 1), non-finite logits clamped
        as the sampler's `_finite` does; a token of probability 0 is never drawn. sampler.draw's
        arithmetic in two passes over the row and one block, in one call for every row."""
        if not (logits.dtype is _F32 and logits.dim() == 2 and logits.is_cpu and logits.is_contiguous()):
            raise ValueError("draw takes logits as a contiguous CPU fp32 tensor [rows, vocab]")
        rows = logits.shape[0]
        if len(temperatures) != rows or len(uniforms) != rows:
            raise ValueError(f"draw needs one temperature and one uniform per row ({rows})")
        temps = torch.tensor(temperatures, dtype=_F32)
        u = torch.as_tensor(uniforms, dtype=torch.float64, device="cpu").contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self._ext.draw(
            out.data_ptr(),
            logits.data_ptr(),
            temps.data_ptr(),
            u.data_ptr(),
            rows,
            logits.shape[1],
            torch.get_num_threads(),
            self.isa,
        )
        return out.tolist()

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
    ) -> DecodeStep:
        """A decode step over residual stream h [B, hidden] and kv_cache (all layers).

        cos and sin are [B, head_dim] rows of the RoPE tables at each token's position, in h's
        dtype; meta is the step's AttentionMetadata (a decode step). `kv_heads`: the cache's KV
        heads, needed only for a quantized cache (whose blocks are bytes).
        """
        return DecodeStep(
            self._ext, self.isa, h, kv_cache, meta, cos, sin, num_heads, scale, eps, intermediate_size, kv_heads
        )


def _self_test(k: DecodeKernels) -> bool:
    """A freshly built binary must agree with torch before it computes anything real."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    ok = True
    for dtype, tol in ((_BF16, 3e-2), (_F32, 1e-5)):
        b, heads, kv_heads, dim, bs, hidden, inter = 2, 4, 2, 32, 4, 40, 24
        h = torch.randn(b, hidden, generator=gen).to(dtype)
        y = torch.randn(b, hidden, generator=gen).to(dtype)
        w = torch.randn(hidden, generator=gen).to(dtype)
        cache = torch.zeros(1, 4, 2, bs, kv_heads, dim, dtype=dtype)
        meta = SimpleNamespace(
            slot_blocks=torch.tensor([1, 3]),
            slot_offsets=torch.tensor([0, 1]),
            block_tables=torch.tensor([[1, 0], [2, 3]]),
            context_lens=torch.tensor([1, 6]),
            is_decode=True,
        )
        ones, zeros = torch.ones(b, dim, dtype=dtype), torch.zeros(b, dim, dtype=dtype)
        step = k.step(h, cache, meta, ones, zeros, num_heads=heads, scale=dim**-0.5, eps=1e-5, intermediate_size=inter)
        hf = (h + y).float()
        ref = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        ok &= bool(torch.allclose(step.norm(w, residual=y).float(), ref.float(), rtol=tol, atol=tol))
        gu = torch.randn(b, 2 * inter, generator=gen).to(dtype)
        ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        ok &= bool(torch.allclose(step.silu_mul(gu).float(), ref.float(), rtol=tol, atol=tol))
        # sequence 0 sees only its new token: attention returns its v for every query head
        qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        out = step.attention(0, qkv)
        v0 = qkv[0, (heads + kv_heads) * dim :].view(kv_heads, dim).repeat_interleave(heads // kv_heads, 0)
        ok &= bool(torch.allclose(out[0].float(), v0.flatten().float(), rtol=tol, atol=tol))
        ok &= bool(torch.equal(cache[0, 1, 1, 0], v0[:: heads // kv_heads]))
    # probabilities 0.1, 0, 0.6, 0.3, 0 (at temperature 2): each draw lands in its token's CDF step
    logits = (torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]).log() * 2).repeat(4, 1).contiguous()
    ok &= k.draw(logits, [2.0] * 4, [0.05, 0.2, 0.8, 0.999]) == [0, 2, 3, 3]
    return ok


def _load() -> DecodeKernels | None:
    if kernels_disabled():
        log.info("%s is set: decode runs on torch", DISABLE_ENV)
        return None
    ext = load_extension("splitserve_decode", "decode.cpp", fallback="torch for decode's small operations")
    if ext is None:
        return None
    k = DecodeKernels(ext)
    return k if passes_self_test("decode kernels", lambda: _self_test(k), "torch for decode") else None


_KERNELS: Once[DecodeKernels | None] = Once(_load)


def decode_kernels() -> DecodeKernels | None:
    """The kernels, built on the first call (None: disabled or unavailable; see the module doc)."""
    return _KERNELS.get()
