"""`prefill_attention`: a prefill chunk's causal attention over the paged bf16 KV cache (prefill.cpp).

torch's CPU flash attention reaches about a quarter of the core's bf16 matmul rate at
SmolLM2's head size and was 37% of a 1,000-token prefill; the kernel runs both of
attention's products on AVX-512 BF16 dot products, reads K/V through the block table
(no gather, no mask tensor for a chunk after a cached prefix) and is exact causal
attention for any chunk (the query at position ctx_len - q_len + j sees keys 0 .. that).

It runs where the CPU has AVX-512 BF16 and the call fits (bf16 q and cache, head size
32, 64 or 128, no autograd); `attention.py` runs torch's SDPA otherwise, and on CPUs
without AVX-512 BF16 (AVX2 machines, where SDPA in bf16 is the better path there is).
SPLITSERVE_NO_KERNELS=1 turns it off with the other CPU kernels.
"""

from __future__ import annotations

import logging
import struct
from types import ModuleType

import torch
from torch import Tensor

from splitserve.engine.kernels.build import load_extension, passes_self_test
from splitserve.engine.kernels.linear import DISABLE_ENV, kernels_disabled
from splitserve.engine.kernels.once import Once

log = logging.getLogger(__name__)

HEAD_DIMS = (32, 64, 128)


def _scale_bits(scale: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", scale))[0])


def _run(ext: ModuleType, q: Tensor, layer_cache: Tensor, block_table: Tensor, ctx_len: int, scale: float) -> Tensor:
    """On checked arguments: q [q_len, heads, dim] contiguous bf16, layer_cache [blocks, 2, bs,
    kv_heads, dim] contiguous bf16, block_table int64 contiguous with >= cdiv(ctx_len, bs) entries."""
    q_len, heads, dim = q.shape
    out = torch.empty_like(q)
    with torch.profiler.record_function("splitserve::prefill_attention"):  # named in a profile (a few us)
        ext.prefill_attention(
            out.data_ptr(),
            q.data_ptr(),
            layer_cache.data_ptr(),
            block_table.data_ptr(),
            layer_cache.shape[0],
            layer_cache.shape[2],
            q_len,
            ctx_len,
            heads,
            layer_cache.shape[3],
            dim,
            _scale_bits(scale),
            torch.get_num_threads(),
        )
    return out


def sdpa_reference(
    q: Tensor, layer_cache: Tensor, block_table: Tensor, ctx_len: int, scale: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The same attention on torch's SDPA in `dtype` (fp32: the self-test's and the tests' yardstick;
    bf16: what attention.py runs without the kernel, for the benchmark's side-by-side)."""
    q_len, heads, dim = q.shape
    bs, kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    nb = -(-ctx_len // bs)
    blocks = layer_cache[block_table[:nb]].to(dtype)  # [nb, 2, bs, kv_heads, dim]
    # [1, heads, len, dim] as attention.py passes them: SDPA takes its flash path only with a batch dim
    k = blocks[:, 0].reshape(nb * bs, kv_heads, dim)[:ctx_len].transpose(0, 1)[None]
    v = blocks[:, 1].reshape(nb * bs, kv_heads, dim)[:ctx_len].transpose(0, 1)[None]
    qpos = torch.arange(ctx_len - q_len, ctx_len)
    # no prefix: the causal flag (SDPA's faster path, as attention.py takes it); else a mask
    mask = None if q_len == ctx_len else torch.arange(ctx_len)[None, :] <= qpos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1)[None],
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q_len > 1,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out[0].transpose(0, 1)


def _self_test(ext: ModuleType) -> bool:
    """A freshly built binary must agree with torch before it computes anything real."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(9, 2, 16, 2, 64, generator=gen).to(torch.bfloat16)
    table = torch.tensor([3, 7, 0, 5, 8, 1], dtype=torch.int64)
    q = torch.randn(37, 6, 64, generator=gen).to(torch.bfloat16)
    got = _run(ext, q, cache, table, 85, 0.125).float()
    return bool(torch.allclose(got, sdpa_reference(q, cache, table, 85, 0.125), rtol=2e-2, atol=2e-2))


def _load() -> ModuleType | None:
    if kernels_disabled():
        log.info("%s is set: prefill attention runs on torch's SDPA", DISABLE_ENV)
        return None
    ext = load_extension("splitserve_prefill", "prefill.cpp", fallback="torch's SDPA for prefill attention")
    if ext is None or ext.isa() == 0:
        return None  # no AVX-512 BF16: SDPA is this CPU's path, nothing to warn about
    ok = passes_self_test("prefill attention kernel", lambda: _self_test(ext), "torch's SDPA")
    return ext if ok else None


_EXT: Once[ModuleType | None] = Once(_load)


def prefill_kernel_available() -> bool:
    """True when `prefill_attention` runs the kernel on this CPU (building it now if not yet built)."""
    return _EXT.get() is not None


def prefill_attention(q: Tensor, layer_cache: Tensor, block_table: Tensor, ctx_len: int, scale: float) -> Tensor | None:
    """Attention output [q_len, heads, dim] (bf16) of q [q_len, heads, dim] whose last row sits at
    position ctx_len - 1, over keys 0 .. ctx_len - 1 of `layer_cache` [blocks, 2, bs, kv_heads, dim]
    read through `block_table` (a row of the step's block tables). The new tokens' K/V must already
    be in the cache. None where the kernel does not run (the caller runs SDPA)."""
    ext = _EXT.value if _EXT.done else _EXT.get()
    if ext is None or q.dtype is not torch.bfloat16 or layer_cache.dtype is not torch.bfloat16:
        return None
    if not (q.is_cpu and layer_cache.is_cpu and q.dim() == 3 and layer_cache.dim() == 5):
        return None
    q_len, heads, dim = q.shape
    kv_heads = layer_cache.shape[3]
    bs = layer_cache.shape[2]
    fits = (
        dim in HEAD_DIMS
        and layer_cache.shape[1] == 2
        and layer_cache.shape[4] == dim
        and heads % kv_heads == 0
        and 0 < q_len <= ctx_len
        and block_table.is_cpu
        and block_table.dtype is torch.int64
        and block_table.dim() == 1
        and block_table.shape[0] * bs >= ctx_len
        and layer_cache.is_contiguous()
        and not (torch.is_grad_enabled() and q.requires_grad)
    )
    if not fits:
        return None
    return _run(ext, q.contiguous(), layer_cache, block_table.contiguous(), ctx_len, scale)
