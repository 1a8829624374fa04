"""CUDA IPC: same-GPU peers copy KV device to device, with no host round trip.

CUDA IPC is a way for a stream's layer payloads to travel, settled at its
handshake (links.py decides; see frame.py for the handshake's value): the
frames themselves go over a TCP connection like any other stream's. The decode
side exports its cache tensor's CUDA IPC handle in the handshake's ack (plain
bytes and integers, never pickled: the fields of torch's own `reduce_tensor`
for CUDA tensors, packed with `struct`). The prefill side maps it once per
receiver and, for each layer frame, `DeviceCopy` copies its blocks straight
into the reserved blocks and waits for the copy; the stream then sends the
layer frame with no payload, so the receiver can count it.

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

from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer.frame import CHECKSUM_NONE, FrameError

# device, num_blocks, storage size, storage offset, tensor offset, refcount offset, event sync, gpu uuid,
# exporting process id, key of the export in that process
_FIXED = struct.Struct("<iQQQqQB16sq16s")

# This process's exported caches by key, for a sender in the same process (see the top).
_EXPORTED: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()


def can_map(cache: KVCache) -> bool:
    """Whether `cache` can take part in CUDA IPC (it lives on a CUDA device)."""
    return cache.tensor.is_cuda


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
    from torch.multiprocessing.reductions import reduce_tensor

    t = cache.tensor
    _, args = reduce_tensor(t)
    (_, _, _, tensor_offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event_handle, event_sync) = args  # fmt: skip
    blobs = [bytes(handle), bytes(ref_handle), bytes(event_handle or b"")]
    key = next((k for k, v in list(_EXPORTED.items()) if v is t), None)  # one key per cache, however many handshakes
    if key is None:
        key = os.urandom(16)
        _EXPORTED[key] = t
    fixed = _FIXED.pack(
        device,
        cache.num_blocks,
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
    """The peer's cache tensor, mapped into this process (shape from our own layout)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(blob) < _FIXED.size:
        raise FrameError("CUDA IPC mapping too short")
    (device, num_blocks, size_bytes, offset_bytes, tensor_offset, ref_offset, event_sync, gpu, pid,
     key) = _FIXED.unpack_from(blob)  # fmt: skip
    if pid == os.getpid():
        own = _EXPORTED.get(key)
        if own is None:
            raise FrameError("CUDA IPC mapping from this process names no live cache")
        return own
    pos, blobs = _FIXED.size, []
    for _ in range(3):
        (n,) = struct.unpack_from("<H", blob, pos)
        blobs.append(blob[pos + 2 : pos + 2 + n])
        pos += 2 + n
    handle, ref_handle, event_handle = blobs
    if gpu != _uuid(device):
        raise FrameError("CUDA IPC peer is on another GPU")
    lay = local.layout
    shape = (lay.num_layers, num_blocks, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
    stride = torch.empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), stride, tensor_offset, torch.storage.TypedStorage, lay.torch_dtype,
        device, handle, size_bytes, offset_bytes, False, ref_handle, ref_offset, event_handle or None, bool(event_sync),
    )  # fmt: skip


def copy_blocks(dest: torch.Tensor, layer: int, first_block: int, pieces: Sequence[torch.Tensor]) -> None:
    """Copy one frame's blocks into the peer's cache and wait until they are there."""
    offset = first_block
    for p in pieces:
        dest[layer, offset : offset + p.shape[0]].copy_(p, non_blocking=True)
        offset += p.shape[0]
    if dest.is_cuda:  # a copy into host memory is done when copy_ returns
        torch.cuda.current_stream(dest.device).synchronize()


class DeviceCopy:
    """A stream's layer payloads as device copies into the receiver's mapped cache (`import_cache`).

    The sender's side of `frame.PAYLOAD_DEVICE_COPY`: the blocks are in place
    before the layer frame leaves, and the frame carries no payload.
    """

    checksum_kind = CHECKSUM_NONE  # nothing crosses the connection to check

    def __init__(self, dest: torch.Tensor) -> None:
        self._dest = dest

    def place(self, layer: int, first_block: int, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        copy_blocks(self._dest, layer, first_block, pieces)
        return []
