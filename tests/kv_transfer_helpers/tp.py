"""Caches at several tensor-parallel sizes for the KV re-sharding tests, compared by the model's whole KV."""

from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.kv_cache import KVCache, KVLayout

# 4 KV heads: TP 1, 2 and 4 all divide them.
TP_LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16")


def at_tp(tp_size: int, layout: KVLayout = TP_LAYOUT) -> KVLayout:
    return dataclasses.replace(layout, tp_size=tp_size)


def full_kv(cache: KVCache) -> torch.Tensor:
    """Every rank's shard side by side in the head dimension: `[layers, blocks, 2, bs, heads, hd]`,
    the cache as one tensor-parallel size 1 cache would hold it."""
    return torch.cat([s.to("cpu") for s in cache.shards], dim=4)


def random_tp_cache(
    tp_size: int, num_blocks: int = 48, seed: int = 0, device: str = "cpu", layout: KVLayout = TP_LAYOUT
) -> KVCache:
    """A cache at `tp_size` whose whole KV (`full_kv`) is the same random tensor whatever the size."""
    cache = KVCache(at_tp(tp_size, layout), num_blocks, device)
    g = torch.Generator().manual_seed(seed)
    lay = cache.layout
    whole = torch.randn(
        (lay.num_layers, num_blocks, 2, lay.block_size, lay.num_kv_heads, lay.head_dim), generator=g
    ).to(lay.torch_dtype)
    for rank, shard in enumerate(cache.shards):
        heads = lay.rank_heads(rank)
        shard.copy_(whole[:, :, :, :, heads.start : heads.stop])
    return cache


def assert_kv_arrived(dst: KVCache, src: KVCache, dst_ids, src_ids) -> None:
    """Block by block, every head of every layer: the destination's whole KV is the source's."""
    d, s = full_kv(dst), full_kv(src)
    for di, si in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(d[:, di], s[:, si]), f"block {si} -> {di} differs"


def assert_kv_zero(cache: KVCache, ids) -> None:
    for rank, shard in enumerate(cache.shards):
        for b in ids:
            assert not shard[:, b].any(), f"block {b} of rank {rank}'s shard was not reset"
