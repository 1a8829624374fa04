"""Paged attention over the block-layout KV cache, and the per-step metadata
the model runner builds for it.

Tokens of all sequences in a step are flattened into one batch. Each layer
writes the new tokens' K and V into their cache slots, then attends over each
sequence's whole context read back through its block table. Two paths:

- decode (every sequence brings one token): one batched gather of the block
  tables and one masked SDPA call, shapes fixed by the padded block table, so
  that it can be captured in a CUDA graph;
- mixed or prefill steps: per-sequence causal attention offset by the cached
  prefix: the caller's `prefill_kernel` where it takes the sequence (the model
  passes engine/kernels/prefill.py's, bf16 on a CPU with AVX-512 BF16, which
  reads the cache through the block table), else SDPA with a causal mask.
  Prefill is compute-bound, so the Python loop costs nothing that shows.

A quantized cache (int8 or fp8 values with a scale per token and KV head, the format in
engine/kv_cache.py) is written through `write_quantized` and read back dequantized, block
by gathered block, to fp32, where its attention is computed (as the C++ decode kernel reads
the values and scales exactly); a cache of another float dtype than the model's is cast to
the model's. Such caches always read K/V back from the cache, even for a prompt's first
chunk, so that prefill and decode attend over exactly the same (quantized) K/V.

A bf16 or fp32 decode step on a CPU does not come here: the model runs it on the fused
kernel in engine/kernels/decode.py, which writes the new K/V and attends over
the cache through the block table in one call, without the gather, and which
this module's code is the reference for. Nor does a decode step on CUDA where
triton is installed: engine/kernels/triton_decode.py does the same there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.blocks import cdiv
from splitserve.engine.kv_cache import gather_dequantized, quantized_block_size, quantized_kind, write_quantized

# (q [q_len, heads, dim], layer_cache, block_table row, ctx_len, scale) -> output, or None where it
# does not take the call: engine/kernels/prefill.py's prefill_attention
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor | None]


@dataclass(frozen=True)
class AttentionMetadata:
    """What one step's attention needs. Built by the runner, passed down, never global."""

    slot_blocks: torch.Tensor  # [T] long: cache block of each new token
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    context_lens: torch.Tensor  # [B] long: tokens in the cache after this step
    query_lens: list[int]  # [B] new tokens of each sequence
    context_lens_list: list[int]  # the same as context_lens, on the host
    is_decode: bool  # every query_len == 1
    # a grouped cache (engine/kv_groups.py): the same step addressed to each group of windowed
    # layers' pages, their block tables and slots translated (a block past the window: any page,
    # never read, as the window masks it)
    windowed: tuple[AttentionMetadata, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def split(self, rows: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The step's first `rows` queries, each of one token (its decode rows), and the rest (its
        prefill chunks, however short), each as a step of its own: the model attends to them apart
        in one pass."""
        if self.windowed or not 0 < rows < self.num_seqs or any(q != 1 for q in self.query_lens[:rows]):
            raise ValueError(f"cannot split {rows} one-token rows off a step of query lengths {self.query_lens}")
        lens = self.context_lens_list
        head = AttentionMetadata(
            self.slot_blocks[:rows],
            self.slot_offsets[:rows],
            self.block_tables[:rows],
            self.context_lens[:rows],
            self.query_lens[:rows],
            lens[:rows],
            is_decode=True,
        )
        tail = AttentionMetadata(
            self.slot_blocks[rows:],
            self.slot_offsets[rows:],
            self.block_tables[rows:],
            self.context_lens[rows:],
            self.query_lens[rows:],
            lens[rows:],
            is_decode=False,  # prompt rows, a one-token chunk's too: attended as a prefill attends
        )
        return head, tail


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store new K and V ([T, kv_heads, head_dim]) into `layer_cache` [blocks, 2, bs, kv_heads, head_dim]
    (quantized: [blocks, block_bytes], engine/kv_cache.py's format)."""
    if quantized_kind(layer_cache) is not None:
        write_quantized(layer_cache, k, v, meta.slot_blocks, meta.slot_offsets)
        return
    layer_cache[meta.slot_blocks, 0, meta.slot_offsets] = k.to(layer_cache.dtype)
    layer_cache[meta.slot_blocks, 1, meta.slot_offsets] = v.to(layer_cache.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_new: torch.Tensor,  # [T, kv_heads, head_dim]
    v_new: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    prefill_kernel: PrefillKernel | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention output [T, heads, head_dim]. The new K/V must already be written. `prefill_kernel`
    computes a prefill's sequences where it takes them (None: SDPA for all); `window` > 0: the
    query at position p sees the keys at p - window + 1 .. p only (a sliding-window layer)."""
    if meta.is_decode:
        return _decode_attention(q, layer_cache, meta, scale, k_new.shape[1], window)
    return _prefill_attention(q, k_new, v_new, layer_cache, meta, scale, prefill_kernel, window)


def gather_blocks(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """`[*block_ids.shape, 2, bs, kv_heads, head_dim]` in `dtype`: the blocks' K and V, dequantized
    from a quantized cache, cast from a cache of another dtype."""
    if quantized_kind(layer_cache) is not None:
        return gather_dequantized(layer_cache, block_ids, kv_heads, head_dim, dtype)
    return layer_cache[block_ids].to(dtype)


def _decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_heads: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """`kv_heads`: needed for a quantized cache only (a block of it is bytes)."""
    bsz, heads, dim = q.shape
    kv_heads = kv_heads or layer_cache.shape[3]
    work = _work_dtype(layer_cache, q.dtype)
    ctx = gather_blocks(layer_cache, meta.block_tables, kv_heads, dim, work)  # [B, max_blocks, 2, bs, kv_heads, dim]
    max_len = ctx.shape[1] * ctx.shape[3]
    k = ctx[:, :, 0].reshape(bsz, max_len, kv_heads, dim).transpose(1, 2)
    v = ctx[:, :, 1].reshape(bsz, max_len, kv_heads, dim).transpose(1, 2)
    positions = torch.arange(max_len, device=q.device)
    visible = positions[None, :] < meta.context_lens[:, None]
    if window:  # the new token at position ctx - 1 sees ctx - window .. ctx - 1
        visible &= positions[None, :] >= meta.context_lens[:, None] - window
    mask = visible[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :].to(work), k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads
    )
    return out[:, :, 0, :].to(q.dtype)


def _work_dtype(layer_cache: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What attention computes in: fp32 over a quantized cache (the values dequantized exactly, as
    the C++ decode kernel reads them), else the model's dtype."""
    return torch.float32 if quantized_kind(layer_cache) is not None else dtype


def _prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernel: PrefillKernel | None = None,
    window: int = 0,
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_new.shape[1]
    same = layer_cache.dtype == q.dtype  # else K/V are read back from the cache, as decode reads them
    work = _work_dtype(layer_cache, q.dtype)
    bs = layer_cache.shape[2] if layer_cache.dim() == 5 else quantized_block_size(layer_cache, kv_heads, dim)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_list, strict=True)):
        got = (
            None
            if kernel is None
            else kernel(q[start : start + q_len], layer_cache, meta.block_tables[i], ctx_len, scale)
        )
        if got is not None:
            out[start : start + q_len] = got
            start += q_len
            continue
        qi = q[start : start + q_len].transpose(0, 1)[None].to(work)  # [1, heads, q_len, dim]
        if ctx_len == q_len and same and (not window or q_len <= window):
            # nothing cached before this chunk (and no key out of the window): the new tokens only
            ki = k_new[start : start + q_len].transpose(0, 1)[None]
            vi = v_new[start : start + q_len].transpose(0, 1)[None]
            mask = None
            causal = q_len > 1
        else:
            nb = cdiv(ctx_len, bs)
            blocks = gather_blocks(layer_cache, meta.block_tables[i, :nb], kv_heads, dim, work)
            ki = blocks[:, 0].reshape(nb * bs, kv_heads, dim)[:ctx_len].transpose(0, 1)[None]
            vi = blocks[:, 1].reshape(nb * bs, kv_heads, dim)[:ctx_len].transpose(0, 1)[None]
            # query j sits at absolute position ctx_len - q_len + j and sees keys up to it
            qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            kpos = torch.arange(ctx_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            if window:
                mask &= kpos[None, :] > qpos[:, None] - window
            causal = False
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads
        )
        out[start : start + q_len] = oi[0].transpose(0, 1).to(q.dtype)
        start += q_len
    return out
