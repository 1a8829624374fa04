"""CUDA IPC: same-GPU peers copy KV device to device, with no host round trip.

CUDA IPC is a way for a stream's layer payloads to travel, settled at its
handshake (links.py decides; see frame.py for the handshake's value): the
frames themselves go over a TCP connection like any other stream's. The decode
side exports the CUDA IPC handle of each of its cache's shards (one per
tensor-parallel rank) in the handshake's ack (plain bytes and integers, never
pickled: the fields of torch's own `reduce_tensor` for CUDA tensors, packed
with `struct`). The prefill side maps them once per receiver and, for each
layer frame, `DeviceCopy` copies its heads straight into the reserved blocks
of the receiver shard that holds them (from one or several of its own shards,
heads.py) and waits for the copies; the stream then sends the layer frame with
no payload, so the receiver can count it.

Trust: the mapped tensor is the whole decode cache, so here the bounds are
kept by the sender's code, not checked by the receiver. Same-GPU peers share a
machine and an operator; that is the boundary this transport assumes.

A sender in the decode worker's own process (a benchmark, a test, one process
serving both roles) cannot open its own IPC handle: CUDA refuses that. The
mapping therefore also names the exporting process and a random key, and a
sender in that process is handed the cache tensor itself.

Imports without CUDA; exporting and mapping a cache need it.
"""

from __future__ import annotations

import os
import struct
import uuid
import weakref
from collections.abc import Sequence

import torch

from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer.frame import CHECKSUM_NONE, FrameError

# device, num_blocks, storage size, storage offset, tensor offset, refcount offset, event sync, gpu uuid,
# exporting process id, key of the export in that process
_FIXED = struct.Struct("<iQQQqQB16sq16s")

# This process's exported caches by key, for a sender in the same process (see the top).
_EXPORTED: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()


def can_map(cache: KVCache) -> bool:
    """Whether `cache` can take part in CUDA IPC (it lives on a CUDA device, in one row per layer:
    the mapped peer writes at block offsets, which a grouped cache's windowed layers do not have)."""
    return cache.tensor.is_cuda and cache.groups is None


def _uuid(device: int) -> bytes:
    """The GPU's 16-byte UUID, to refuse a peer on another GPU (zeros where torch does not say)."""
    u = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if u is None:
        return b"\0" * 16
    raw = getattr(u, "bytes", None)  # a list of 16 ints from torch's binding, or bytes
    if raw is not None and not isinstance(raw, str):
        return bytes(bytearray(raw))[:16].ljust(16, b"\0")
    try:  # torch's str() of the UUID, "GPU-" prefixed on some builds
        return uuid.UUID(str(u).removeprefix("GPU-")).bytes
    except ValueError:
        return b"\0" * 16


def export_cache(cache: KVCache) -> bytes:
    """The mapping of every shard of `cache` (one per tensor-parallel rank, each on its rank's device)."""
    return struct.pack("<B", len(cache.shards)) + b"".join(_export_shard(t, cache.num_blocks) for t in cache.shards)


def _export_shard(t: torch.Tensor, num_blocks: int) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (
        _,
        _,
        _,
        tensor_offset,
        _,
        _,
        device,
        handle,
        size_bytes,
        offset_bytes,
        _,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    blobs = [bytes(handle), bytes(ref_handle), bytes(event_handle or b"")]
    key = next((k for k, v in list(_EXPORTED.items()) if v is t), None)  # one key per shard, however many handshakes
    if key is None:
        key = os.urandom(16)
        _EXPORTED[key] = t
    fixed = _FIXED.pack(
        device,
        num_blocks,
        size_bytes,
        offset_bytes,
        tensor_offset,
        ref_offset,
        int(event_sync),
        _uuid(device),
        os.getpid(),
        key,
    )
    return fixed + b"".join(struct.pack("<H", len(b)) + b for b in blobs)


def import_cache(blob: bytes, local: KVCache) -> torch.Tensor:
    """Rank 0's shard of the peer's cache (the whole cache at tensor-parallel size 1), for a
    peer whose layout is `local`'s."""
    return import_shards(blob, local.layout)[0]


def import_shards(blob: bytes, layout: KVLayout) -> list[torch.Tensor]:
    """Every shard of the peer's cache, mapped into this process; `layout` is the peer's
    (its reservation's: the shard shapes and how many there are)."""
    if len(blob) < 1:
        raise FrameError("CUDA IPC mapping too short")
    (count,) = struct.unpack_from("<B", blob)
    if count != layout.tp_size:
        raise FrameError(f"CUDA IPC mapping of {count} shards for tensor-parallel size {layout.tp_size}")
    shards, pos = [], 1
    for _ in range(count):
        t, pos = _import_shard(blob, pos, layout)
        shards.append(t)
    return shards


def _import_shard(blob: bytes, pos: int, lay: KVLayout) -> tuple[torch.Tensor, int]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(blob) < pos + _FIXED.size:
        raise FrameError("CUDA IPC mapping too short")
    (device, num_blocks, size_bytes, offset_bytes, tensor_offset, ref_offset, event_sync, gpu, pid, key) = (
        _FIXED.unpack_from(blob, pos)
    )
    pos += _FIXED.size
    blobs = []
    for _ in range(3):
        if len(blob) < pos + 2:
            raise FrameError("CUDA IPC mapping too short")
        (n,) = struct.unpack_from("<H", blob, pos)
        blobs.append(blob[pos + 2 : pos + 2 + n])
        pos += 2 + n
    if pid == os.getpid():
        own = _EXPORTED.get(key)
        if own is None:
            raise FrameError("CUDA IPC mapping from this process names no live cache")
        return own, pos
    handle, ref_handle, event_handle = blobs
    if gpu != _uuid(device):
        raise FrameError("CUDA IPC peer is on another GPU")
    shape = (lay.num_layers, num_blocks, 2, lay.block_size, lay.kv_heads_per_rank, lay.head_dim)
    stride = torch.empty(shape, device="meta").stride()
    t = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(shape),
        stride,
        tensor_offset,
        torch.storage.TypedStorage,
        lay.torch_dtype,
        device,
        handle,
        size_bytes,
        offset_bytes,
        False,
        ref_handle,
        ref_offset,
        event_handle or None,
        bool(event_sync),
    )
    return t, pos


def copy_heads(dest: torch.Tensor, layer: int, first_block: int, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Copy one frame's heads into a peer shard (`dest`) and wait until they are there.

    Each part is (first head within the shard, `[count, 2, block_size, heads, head_dim]`):
    a head slice is a strided copy on the device, no packing needed (heads.py)."""
    devices = {dest.device}
    for offset, t in parts:
        n, heads = t.shape[0], t.shape[3]
        dest[layer, first_block : first_block + n, :, :, offset : offset + heads].copy_(t, non_blocking=True)
        devices.add(t.device)
    for d in devices:  # a copy into host memory is done when copy_ returns; between GPUs, wait on both ends
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()


class DeviceCopy:
    """A stream's layer payloads as device copies into the receiver's mapped shards (`import_shards`).

    The sender's side of `frame.PAYLOAD_DEVICE_COPY`: the blocks are in place
    before the layer frame leaves, and the frame carries no payload.
    """

    checksum_kind = CHECKSUM_NONE  # nothing crosses the connection to check

    def __init__(self, dest: list[torch.Tensor]) -> None:
        self._dest = dest

    def place(
        self, layer: int, first_block: int, rank: int, parts: Sequence[tuple[int, torch.Tensor]]
    ) -> list[torch.Tensor]:
        copy_heads(self._dest[rank], layer, first_block, parts)
        return []
