"""Cases and references shared by the fused decode kernel tests: the C++ CPU kernels
(test_kernels_decode.py, test_kv_cache_dtypes.py) and the Triton CUDA kernels
(test_kernels_triton.py) are held against the same torch code on the same random paged
caches, in the model's dtype or quantized."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from splitserve.engine.attention import AttentionMetadata, write_kv
from splitserve.engine.blocks import cdiv
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.engine.model import DecoderModel


class Kernels(Protocol):  # engine.kernels.decode.DecodeKernels, engine.kernels.triton_decode.TritonDecodeKernels
    def step(self, *args: Any, **kwargs: Any) -> Any: ...


def decode_batch(
    gen: torch.Generator,
    dtype: torch.dtype,
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    layers: int = 2,
    pad: int = 2,
    slack: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A random cache whose sequences hold scattered blocks, block tables padded with 0 past
    each sequence's blocks (and `pad` columns more), and one qkv row per sequence. With
    `slack`, the tables are a column slice of a wider buffer, as cuda_graphs.py passes them."""
    need = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(layers, num_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the padding value
    width = max(need) + pad
    buffer = torch.full((len(context_lens), width + slack), -1, dtype=torch.long)  # -1: never to be read
    tables = buffer[:, :width]
    tables.zero_()
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    ctx = torch.tensor(context_lens)
    last = ctx - 1  # the new token's position
    meta = AttentionMetadata(
        slot_blocks=tables[torch.arange(len(context_lens)), last // block_size].contiguous(),
        slot_offsets=last % block_size,
        block_tables=tables,
        context_lens=ctx,
        query_lens=[1] * len(context_lens),
        context_lens_list=list(context_lens),
        is_decode=True,
    )
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    return cache, meta, qkv


def rope_rows(positions: list[int], head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_step(
    k: Kernels,
    h: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    heads: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    intermediate: int = 8,
) -> Any:
    dim = cache.shape[-1]
    if cos is None:  # RoPE as the identity
        cos = torch.ones(h.shape[0], dim, dtype=h.dtype)
        sin = torch.zeros(h.shape[0], dim, dtype=h.dtype)
    return k.step(h, cache, meta, cos, sin, num_heads=heads, scale=dim**-0.5, eps=1e-5, intermediate_size=intermediate)


def fp32_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain fp32 attention of q [B, heads, dim] over each sequence's context in `cache` (one layer)."""
    bs, kv_heads, dim = cache.shape[2], cache.shape[3], cache.shape[4]
    out = []
    for b, n in enumerate(meta.context_lens_list):
        blocks = cache[meta.block_tables[b, : cdiv(n, bs)]].float()
        k = blocks[:, 0].reshape(-1, kv_heads, dim)[:n].repeat_interleave(q.shape[1] // kv_heads, 1)
        v = blocks[:, 1].reshape(-1, kv_heads, dim)[:n].repeat_interleave(q.shape[1] // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


def decode_logits(
    model: DecoderModel, tokens: list[int], prompt_len: int, block_size: int = 16, on_layer_done=None
) -> torch.Tensor:
    """Prefill `prompt_len` tokens of one sequence, then decode the rest one by one (teacher-forced):
    the logits of every decode step."""
    cfg = model.cfg
    nb = cdiv(len(tokens), block_size) + 1
    cache = torch.zeros(cfg.num_layers, nb + 1, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    table = (torch.arange(nb) + 1).flip(0)[None].contiguous()  # blocks in descending order, 0 unused

    def meta(pos: list[int], decode: bool) -> AttentionMetadata:
        p = torch.tensor(pos)
        return AttentionMetadata(
            table[0, p // block_size].contiguous(),
            p % block_size,
            table,
            torch.tensor([pos[-1] + 1]),
            [len(pos)],
            [pos[-1] + 1],
            decode,
        )

    out = []
    with torch.inference_mode():
        pos = list(range(prompt_len))
        model.forward(
            torch.tensor(tokens[:prompt_len]),
            torch.tensor(pos),
            cache,
            meta(pos, False),
            torch.tensor([prompt_len - 1]),
        )
        for p in range(prompt_len, len(tokens)):
            out.append(
                model.forward(
                    torch.tensor([tokens[p]]),
                    torch.tensor([p]),
                    cache,
                    meta([p], True),
                    torch.tensor([0]),
                    on_layer_done,
                )[0]
            )
    return torch.stack(out)


def quantized_batch(
    gen: torch.Generator, kind: str, dtype: torch.dtype, ctx: list[int], kv_heads: int, dim: int, bs: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A quantized 2-layer cache whose sequences hold scattered blocks, their contexts written
    through the torch path but for each one's last token, and the decode step's metadata."""
    need = [(n + bs - 1) // bs for n in ctx]
    lay = KVLayout(2, kv_heads, dim, bs, kind)
    cache = KVCache(lay, sum(need) + 2).tensor
    order = (torch.randperm(sum(need) + 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(ctx), max(need) + 1, dtype=torch.long)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    for b, n in enumerate(ctx):
        pos = torch.arange(n - 1)
        if n > 1:
            kv = torch.randn(2, n - 1, kv_heads, dim, generator=gen).to(dtype)
            for layer in range(2):
                write_kv(cache[layer], kv[0], kv[1], _slots_meta(tables[b, pos // bs], pos % bs))
    last = torch.tensor(ctx) - 1
    meta = AttentionMetadata(
        slot_blocks=tables[torch.arange(len(ctx)), last // bs].contiguous(),
        slot_offsets=last % bs,
        block_tables=tables,
        context_lens=torch.tensor(ctx),
        query_lens=[1] * len(ctx),
        context_lens_list=list(ctx),
        is_decode=True,
    )
    return cache, meta


def _slots_meta(blocks: torch.Tensor, offsets: torch.Tensor) -> AttentionMetadata:
    n = blocks.numel()
    return AttentionMetadata(blocks, offsets, torch.zeros(1, 1, dtype=torch.long), torch.ones(1), [n], [n], False)
