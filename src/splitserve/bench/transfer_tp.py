"""`splitserve bench transfer --tp 1:1,2:1,1:2,2:2`: what re-sharding KV between
tensor-parallel sizes costs per layer, against the plain transfer of the same bytes.

For each transport and each sender:receiver pair, back to back `repeats` times
(alternating which goes first, so drift on a shared machine favours neither):
the whole cache through KVSender -> KVReceiver from a cache at the sender's
size into one at the receiver's, and the plain transfer, TP 1 into TP 1 (one
zero-copy frame of every head per layer). Printed per layer, with the median
ratio of the pairs. The destination's whole KV is checked against the source's
once per pair, so a fast wrong figure cannot pass.

Then the copy that re-sharding adds, alone, for one layer: the sender packing
each receiver shard's heads into one buffer (what kv_transfer does, heads.py)
against the receiver scattering per-sender-rank buffers into strided views of
its shards (the alternative); the figures behind heads.py's choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.bench.transfer_timing import whole_cache_seconds
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer import heads, links
from splitserve.kv_transfer.reservation import TransportName


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """ "2:1,1:2" -> [(2, 1), (1, 2)]: sender TP, receiver TP."""
    pairs = []
    for item in text.split(","):
        n, sep, m = item.partition(":")
        if not sep or not n.strip().isdigit() or not m.strip().isdigit():
            raise ValueError(f"--tp wants SENDER:RECEIVER pairs like 2:1, got {item!r}")
        pairs.append((int(n), int(m)))
    return pairs


def run_tp(args: argparse.Namespace, layout: KVLayout, blocks: int, transports: list[TransportName]) -> None:
    pairs = parse_pairs(args.tp)
    whole = torch.randn((layout.num_layers, blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim))
    whole = whole.to(layout.torch_dtype)
    sources: dict[int, KVCache] = {}
    dests: dict[int, KVCache] = {}

    def source(tp: int) -> KVCache:
        if tp not in sources:
            c = sources[tp] = KVCache(dataclasses.replace(layout, tp_size=tp), blocks)
            for rank, shard in enumerate(c.shards):
                r = c.layout.rank_heads(rank)
                shard.copy_(whole[:, :, :, :, r.start : r.stop])
        return sources[tp]

    def dest(tp: int) -> KVCache:
        if tp not in dests:
            dests[tp] = KVCache(dataclasses.replace(layout, tp_size=tp), blocks)  # zeros: touched by the first run
        return dests[tp]

    layers = layout.num_layers
    mib = blocks * layout.bytes_per_block / 2**20
    print(
        f"\nre-sharding against the plain transfer (TP 1 -> TP 1) of the same {mib:.1f} MiB per layer; "
        f"per layer = whole cache / {layers} layers; medians over {args.repeats} back-to-back pairs"
    )
    for kind in transports:
        for n, m in pairs:
            src, dst = source(n), dest(m)
            plain_src, plain_dst = source(1), dest(1)
            runs = []
            for i in range(args.repeats):
                if i % 2:
                    resharded = whole_cache_seconds(kind, src, dst, args.checksum)
                    runs.append((whole_cache_seconds(kind, plain_src, plain_dst, args.checksum), resharded))
                else:
                    plain = whole_cache_seconds(kind, plain_src, plain_dst, args.checksum)
                    runs.append((plain, whole_cache_seconds(kind, src, dst, args.checksum)))
                if i == 0 and not torch.equal(torch.cat(dst.shards, dim=4), whole):
                    raise AssertionError(f"TP {n} -> TP {m} over {kind}: the destination's KV is not the source's")
            plain_ms = statistics.median(p for p, _ in runs) / layers * 1e3
            resharded_ms = statistics.median(r for _, r in runs) / layers * 1e3
            ratio = statistics.median(r / p for p, r in runs)
            each = " ".join(f"{r / p:.2f}" for p, r in runs)
            frames = len(heads.plan(src.layout, dst.layout))
            print(
                f"  {kind:4s} TP {n} -> TP {m}: {frames} frame(s) per block run   plain {plain_ms:7.2f} ms/layer   "
                f"re-sharded {resharded_ms:7.2f} ms/layer   ratio {ratio:4.2f} (pairs: {each})"
            )

    print("\nthe copy re-sharding adds, one layer alone, median of 7: sender packs (kv_transfer) | receiver scatters")
    for n, m in pairs:
        if n == m:
            continue
        src, dst = source(n), dest(m)
        packer = links.Packer()  # the stream's, reused frame after frame
        pack_ms = _median_ms(lambda: _pack(src, dst, packer))  # noqa: B023 (called here, in this iteration)
        scatter_ms = _median_ms(lambda: _scatter(src, dst))  # noqa: B023
        print(f"  TP {n} -> TP {m}: pack {pack_ms:6.2f} ms   scatter {scatter_ms:6.2f} ms")


def _median_ms(fn: Callable[[], None]) -> float:
    fn()  # warm
    times = []
    for _ in range(7):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _pack(src: KVCache, dst: KVCache, packer: links.Packer) -> None:
    """What the sender does: each receiver shard's heads of layer 0 packed into one contiguous buffer."""
    for f in heads.plan(src.layout, dst.layout):
        packer.pack(
            [
                (p.dst_offset, src.shards[p.src_rank][0, :, :, :, p.src_first : p.src_first + p.head_count])
                for p in f.parts
            ]
        )


def _scatter(src: KVCache, dst: KVCache) -> None:
    """The alternative: each sender shard's layer 0 arrives as it lies (the sender's own contiguous
    memory stands for the receiver's staging buffer) and is copied into strided views of the
    receiver's shards."""
    for f in heads.plan(src.layout, dst.layout):
        for p in f.parts:
            arrived = src.shards[p.src_rank][0]
            dst.shards[f.dst_rank][0, :, :, :, p.dst_offset : p.dst_offset + p.head_count].copy_(
                arrived[:, :, :, p.src_first : p.src_first + p.head_count]
            )
