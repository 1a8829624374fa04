"""How KV heads map between two caches' tensor-parallel shards (KV re-sharding).

A cache at tensor-parallel size N holds the model's KV heads in N shards,
rank r having heads `r * per_rank .. (r+1) * per_rank - 1` (engine/kv_cache.py).
A stream sends one frame per (layer, run of blocks, receiver shard): its
payload is exactly that receiver shard's heads of the run, `[blocks, 2,
block_size, heads_per_receiver_rank, head_dim]`, the way they lie in the
receiver's shard, so the receiver reads every frame straight into one shard.

Where the payload comes from on the sender (`plan`):
- equal sizes: receiver shard q is sender shard q, whole: zero-copy, as before
  re-sharding existed (at TP 1 the one frame carries every head);
- N > M: receiver shard q is N/M whole sender shards side by side in the head
  dimension;
- N < M: receiver shard q is a slice of the heads of one sender shard.

Why the sender packs rather than the receiver scatters: a head slice of a run
of blocks is not contiguous in a `[blocks, 2, block_size, heads, head_dim]`
tensor, so one side copies. Packing on the sender (the parts copied side by
side into the stream's staging buffer, links.Packer) keeps the receiver's
path the same zero-copy read into a shard for every pair of sizes, keeps the
copy off the decode worker (whose steps set inter-token latency), and needs
no staging buffer on the receiver. Measured on this machine's two CPU cores
(`splitserve bench transfer --tp`, bench/results/transfer-tp.txt), the copy
alone costs about the same either way (one cached 8 MiB layer: pack 0.12-0.16
ms, scatter 0.11-0.14 ms; they move the same bytes with the same strides), so
where it runs decides, not its price.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from splitserve.engine.kv_cache import LAYOUT_FIELDS, KVLayout, describe_field


class Part(NamedTuple):
    """Some of one sender shard's heads, bound for a receiver shard."""

    src_rank: int
    src_first: int  # first head within the sender's shard
    head_count: int
    dst_offset: int  # where they go within the receiver's shard


class ShardFrame(NamedTuple):
    """One receiver shard's heads, the payload of one frame per run of blocks."""

    dst_rank: int
    first_head: int  # the model's head index: what the frame header says
    head_count: int
    parts: tuple[Part, ...]  # in head order, adjacent
    zero_copy: bool  # one sender shard whole: its block runs are contiguous as they lie in its cache


def plan(sender: KVLayout, receiver: KVLayout) -> tuple[ShardFrame, ...]:
    """Every receiver shard's frame and where its heads lie among the sender's shards.
    The layouts must map (`mapping_error` is None)."""
    src_per, dst_per = sender.kv_heads_per_rank, receiver.kv_heads_per_rank
    frames = []
    for q in range(receiver.tp_size):
        first = q * dst_per
        parts = []
        head = first
        while head < first + dst_per:
            r = head // src_per
            n = min((r + 1) * src_per, first + dst_per) - head
            parts.append(Part(r, head - r * src_per, n, head - first))
            head += n
        whole = len(parts) == 1 and parts[0].head_count == src_per
        frames.append(ShardFrame(q, first, dst_per, tuple(parts), whole))
    return tuple(frames)


def mapping_error(prefill: KVLayout, decode: KVLayout, dtype: bool = True) -> str | None:
    """Why the prefill side's KV cannot go into the decode side's cache, or None.

    Any two tensor-parallel sizes map as long as the model's KV (every head of
    every layer, head dim, block size, dtype) is the same on both sides; at
    equal sizes the message is the layout's own, naming the field. `dtype=False`:
    the dtypes may differ (a wire codec decodes into the receiver's, codec.py)."""
    if not dtype:
        prefill = dataclasses.replace(prefill, dtype=decode.dtype)
    if prefill.mismatch(decode) is None:
        return None
    f = next(f for f in LAYOUT_FIELDS if getattr(prefill, f) != getattr(decode, f))
    a, b = describe_field(getattr(prefill, f)), describe_field(getattr(decode, f))
    differs = f"KV layout mismatch on {f}: {a} at prefill, {b} at decode"
    if prefill.tp_size == decode.tp_size:
        return differs
    return (
        f"KV layout: prefill TP {prefill.tp_size} holds {_holds(prefill)}, cannot map to "
        f"decode TP {decode.tp_size} holding {_holds(decode)} ({differs})"
    )


def _holds(lay: KVLayout) -> str:
    return (
        f"{lay.num_kv_heads} KV heads ({lay.kv_heads_per_rank} per rank) of head dim {lay.head_dim}, "
        f"{lay.num_layers} layers, block size {lay.block_size}, {lay.dtype}"
    )


def receiver_rank(layout: KVLayout, first_head: int, head_count: int) -> int | None:
    """The rank whose shard a frame's heads are, exactly; None if they are no shard's.
    A head count of 0 means every head (frame.py): rank 0's at TP 1, no shard's otherwise."""
    if head_count == 0:
        return 0 if layout.tp_size == 1 and first_head == 0 else None
    per = layout.kv_heads_per_rank
    if head_count != per or first_head % per or not 0 <= first_head < layout.num_kv_heads:
        return None
    return first_head // per


def frame_elements(layout: KVLayout, blocks: int, head_count: int) -> int:
    """Tensor elements in a frame of `blocks` blocks of `head_count` heads (0: every head)."""
    heads = head_count or layout.num_kv_heads
    return blocks * 2 * layout.block_size * heads * layout.head_dim
