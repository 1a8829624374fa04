"""The KV plane's wire format: one fixed binary header, then raw bytes.

Every message on a KV connection is a frame. Nothing on this plane is
pickled or otherwise turned into objects: the header is parsed with `struct`,
checked field by field, and the payload is raw tensor bytes that the receiver
reads straight into its cache memory. Bytes that do not parse are rejected
with a `FrameError` and the connection is dropped.

Header, little-endian, `HEADER_SIZE` = 136 bytes:

| offset | size | field            | meaning                                                   |
| ------ | ---- | ---------------- | --------------------------------------------------------- |
| 0      | 4    | magic            | b"SSKV"                                                   |
| 4      | 1    | version          | 2, or 3 for a layer frame with an encoded payload (below) |
| 5      | 1    | kind             | 1 handshake, 2 layer, 3 done, 4 ack, 5 error              |
| 6      | 1    | checksum kind    | 0 none, 1 crc32 (zlib), 2 lane-sum crc32 (see below)      |
| 7      | 1    | dtype code       | 0 none, 1 float32, 2 bfloat16, 3 float16, 4 int8, 5 fp8   |
|        |      |                  | (the sender's cache; an encoded frame's values came from) |
| 8      | 16   | ticket           | the reservation's 128-bit random ticket                   |
| 24     | 64   | request id       | utf-8, NUL-padded; at most 64 bytes                       |
| 88     | 4    | layer            | layer index (layer frames)                                |
| 92     | 4    | first block      | the receiver's block id of the first block (layer frames) |
| 96     | 4    | block count      | consecutive receiver block ids from first block; a        |
|        |      |                  | handshake's: the codecs offered; its ack's: the codec     |
|        |      |                  | chosen (see "Wire codecs")                                |
| 100    | 4    | payload checksum | of the payload, by checksum kind                          |
| 104    | 8    | element count    | tensor elements in the payload (layer frames)             |
| 112    | 8    | payload length   | bytes that follow the header                              |
| 120    | 8    | value            | done: the first token; handshake and its ack: see below;  |
|        |      |                  | layer: the payload's codec id (0 raw, 1 int8: codec.py)   |
| 128    | 2    | first head       | the model's KV head the payload starts at (layer frames)   |
| 130    | 2    | head count       | KV heads in the payload; 0: every head (layer frames)     |
| 132    | 4    | header crc32     | zlib.crc32 of bytes 0..131                                |

Payloads by kind: handshake, the sender's `KVLayout` as `<IIIIBII` (layers,
KV heads of the whole model, head dim, block size, dtype code, the sender's
tensor-parallel size, and the receiver's as the sender read it from the
reservation: the size its frames are cut for), then its manifest as `<16sH` and
`<I` each (the model's fingerprint, zeros for none; the count of layers' windows,
0 where every layer is global; each layer's window in tokens, 0 for a global one:
a receiver refuses KV of another model or of other layer kinds before any layer
frame is read); ack and error, utf-8 text (an
error's reason), except a handshake's ack that grants device copies, whose
payload is the CUDA IPC mapping of the receiver's cache shards; layer, the K
and V of `block count` blocks of one layer for the heads `first head ..
first head + head count - 1`, which are exactly one receiver shard's heads,
as they lie in that shard (`[count, 2, block_size, head count, head_dim]`;
heads.py says how the sender cuts them), or nothing when the stream moves
payloads by device copies; done, nothing. Control payloads are at most
`MAX_CONTROL_PAYLOAD` bytes. A head count of 0 (every head, one frame per run)
is what a hand-written frame at tensor-parallel size 1 may say.

A handshake's value says how the sender asks the stream's layer payloads to
travel, and its ack's value what it got: `PAYLOAD_ON_CONNECTION` (0), as bytes
after each layer header; `PAYLOAD_DEVICE_COPY` (1), copied by the sender into
the receiver's cache through the mapping (CUDA IPC, same GPU) before it sends
the layer header, which then carries no payload and no checksum.

Wire codecs (codec.py). A handshake's block count is a bit set of the codecs the sender
offers (bit i: codec i; raw, 0, is always acceptable and not offered); its ack's block
count is the codec the receiver chose, one of those offered or 0. A peer from before
codecs writes 0 in both (the field was unused and zero in those kinds) and reads neither,
so against it a stream is raw. A layer frame whose payload is encoded is version 3 and
names its codec in `value`; raw layer frames and every other kind stay version 2 (what
such a peer reads), and a version 2 layer frame must say codec 0. Element count is still
the elements of the K and V the frame carries; payload length and the checksum are of
the bytes on the wire, and the receiver checks the length against the codec's size for
that many elements (`codec.wire_bytes`).

Why a lane-sum checksum: zlib.crc32 runs at about 2.7 GB/s per core here,
slower than loopback TCP, so checking it on both ends would cost about half
the bandwidth on a two-core machine. Kind 2 sums the payload's 64-bit words
per 4 KiB lane (wrapping) with vectorised numpy code (about 20 GB/s on one
core) and takes the crc32 of those sums: any flipped bit, zeroed or shifted
lane, or misplaced run still fails it; what it misses, words swapped within
one 4 KiB lane, is not how transports fail. Kind 1 (full crc32) is there for
anyone who wants it; the receiver checks whichever the sender chose.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from splitserve.engine.blocks import cdiv
from splitserve.engine.kv_cache import KVLayout
from splitserve.kv_transfer.codec import CODEC_NAMES, CODEC_RAW

MAGIC = b"SSKV"
VERSION = 2  # 2: head ranges in layer frames, tensor-parallel sizes in the handshake
VERSION_CODEC = 3  # 3: a layer frame whose payload is encoded, its codec id in `value` (codec.py)

HANDSHAKE, LAYER, DONE, ACK, ERROR = 1, 2, 3, 4, 5
KIND_NAMES = {HANDSHAKE: "handshake", LAYER: "layer", DONE: "done", ACK: "ack", ERROR: "error"}

CHECKSUM_NONE, CHECKSUM_CRC32, CHECKSUM_LANESUM = 0, 1, 2
CHECKSUM_KINDS = {"none": CHECKSUM_NONE, "crc32": CHECKSUM_CRC32, "lanesum": CHECKSUM_LANESUM}

# 4, 5: quantized pools (engine/kv_cache.py: a block is its one-byte values, then its fp32 scales)
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "int8": 4, "fp8_e4m3": 5}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

PAYLOAD_ON_CONNECTION, PAYLOAD_DEVICE_COPY = 0, 1  # a handshake's and its ack's value

REQUEST_ID_BYTES = 64
MAX_CONTROL_PAYLOAD = 4096
# A done frame's payload is the request's handoff record (the workers' serialized Handoff: the
# prompt's token ids and each sample's first token), opaque to this package.
MAX_HANDOFF_PAYLOAD = 16 << 20
# Far above any one layer frame (a whole layer of a 128k-token request in bf16
# at 8 KV heads x 128 is 0.5 GiB) and far below what would exhaust memory.
MAX_PAYLOAD = 1 << 31

_BODY = struct.Struct("<4sBBBB16s64sIIIIQQqHH")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
_LAYOUT = struct.Struct("<IIIIBII")
_MANIFEST = struct.Struct("<16sH")  # the model fingerprint (zeros: none), then the count of windows
_WINDOW = struct.Struct("<I")

LANE_BYTES = 4096


class FrameError(Exception):
    """Bytes that are not a valid frame; the connection that sent them is dropped."""


class Header(NamedTuple):
    kind: int
    ticket: bytes
    request_id: str
    layer: int = 0
    first_block: int = 0
    block_count: int = 0
    dtype_code: int = 0
    element_count: int = 0
    payload_length: int = 0
    checksum_kind: int = CHECKSUM_NONE
    checksum: int = 0
    value: int = 0
    first_head: int = 0
    head_count: int = 0  # 0: every head


def encode_header(h: Header) -> bytes:
    rid = h.request_id.encode()
    if len(rid) > REQUEST_ID_BYTES:
        raise ValueError(f"request id longer than {REQUEST_ID_BYTES} bytes")
    if len(h.ticket) != 16:
        raise ValueError("ticket must be 16 bytes")
    version = VERSION_CODEC if h.kind == LAYER and h.value != CODEC_RAW else VERSION
    body = _BODY.pack(
        MAGIC,
        version,
        h.kind,
        h.checksum_kind,
        h.dtype_code,
        h.ticket,
        rid,
        h.layer,
        h.first_block,
        h.block_count,
        h.checksum,
        h.element_count,
        h.payload_length,
        h.value,
        h.first_head,
        h.head_count,
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse and check one header; raises FrameError on anything malformed."""
    if len(buf) != HEADER_SIZE:
        raise FrameError(f"header is {len(buf)} bytes, expected {HEADER_SIZE}")
    body = bytes(buf[: _BODY.size])
    (
        magic,
        version,
        kind,
        ck_kind,
        dtype_code,
        ticket,
        rid,
        layer,
        first,
        count,
        checksum,
        elements,
        length,
        value,
        first_head,
        head_count,
    ) = _BODY.unpack(body)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version not in (VERSION, VERSION_CODEC):
        raise FrameError(f"unsupported frame version {version}")
    if _CRC.unpack(bytes(buf[_BODY.size :]))[0] != zlib.crc32(body):
        raise FrameError("header checksum mismatch")
    _check_fields(version, kind, ck_kind, dtype_code, length, value)
    try:
        request_id = rid.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise FrameError("request id is not utf-8") from None
    return Header(
        kind,
        ticket,
        request_id,
        layer,
        first,
        count,
        dtype_code,
        elements,
        length,
        ck_kind,
        checksum,
        value,
        first_head,
        head_count,
    )


def _check_fields(version: int, kind: int, ck_kind: int, dtype_code: int, length: int, value: int) -> None:
    """A checksummed header's fields against the format: FrameError naming the first that is wrong."""
    if kind not in KIND_NAMES:
        raise FrameError(f"unknown frame kind {kind}")
    if kind == LAYER and (version == VERSION_CODEC) != (value != CODEC_RAW):
        raise FrameError(f"layer frame of version {version} names codec {value}")
    if version == VERSION_CODEC and kind != LAYER:
        raise FrameError(f"a {KIND_NAMES[kind]} frame of version {version}")
    if kind == LAYER and value not in CODEC_NAMES:
        raise FrameError(f"unknown codec {value}")
    if ck_kind not in CHECKSUM_KINDS.values():
        raise FrameError(f"unknown checksum kind {ck_kind}")
    if dtype_code != 0 and dtype_code not in DTYPE_NAMES:
        raise FrameError(f"unknown dtype code {dtype_code}")
    if length > MAX_PAYLOAD:
        raise FrameError(f"payload length {length} over the limit {MAX_PAYLOAD}")
    limit = MAX_HANDOFF_PAYLOAD if kind == DONE else MAX_CONTROL_PAYLOAD
    if kind != LAYER and length > limit:
        raise FrameError(f"{KIND_NAMES[kind]} payload of {length} bytes over {limit}")


def control(kind: int, ticket: bytes, request_id: str, text: str = "") -> list[bytes]:
    """An ack or error frame carrying `text` (cut to `MAX_CONTROL_PAYLOAD` bytes), as buffers for `send`."""
    body = text.encode()[:MAX_CONTROL_PAYLOAD]
    return [encode_header(Header(kind, ticket, request_id, payload_length=len(body))), body]


def encode_layout(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    tp_size: int = 1,
    receiver_tp_size: int = 1,
    windows: tuple[int, ...] = (),
    model_fingerprint: bytes = b"",
) -> bytes:
    """The handshake's payload: the sender's layout (`tp_size` its own), the receiver's
    tensor-parallel size that its frames are cut for, then the manifest: the model's
    fingerprint (16 bytes, zeros for none), the count of per-layer windows (0: every layer
    global) and each window in tokens."""
    fixed = _LAYOUT.pack(num_layers, num_kv_heads, head_dim, block_size, DTYPE_CODES[dtype], tp_size, receiver_tp_size)
    manifest = _MANIFEST.pack(model_fingerprint.ljust(16, b"\0"), len(windows))
    return fixed + manifest + b"".join(_WINDOW.pack(w) for w in windows)


def decode_layout(payload: bytes) -> tuple[KVLayout, int]:
    """The sender's layout and the receiver's tensor-parallel size it cut its frames for."""
    head = _LAYOUT.size + _MANIFEST.size
    if len(payload) < head:
        raise FrameError(f"handshake layout is {len(payload)} bytes, expected at least {head}")
    layers, heads, head_dim, block_size, code, tp_size, receiver_tp_size = _LAYOUT.unpack_from(payload)
    fingerprint, count = _MANIFEST.unpack_from(payload, _LAYOUT.size)
    if len(payload) != head + count * _WINDOW.size:
        raise FrameError(f"handshake layout is {len(payload)} bytes, {count} windows make it {head + count * 4}")
    windows = tuple(w for (w,) in _WINDOW.iter_unpack(payload[head:]))
    if code not in DTYPE_NAMES:
        raise FrameError(f"unknown dtype code {code} in handshake")
    try:
        fp = b"" if fingerprint == bytes(16) else fingerprint
        layout = KVLayout(layers, heads, head_dim, block_size, DTYPE_NAMES[code], tp_size, windows, fp)
    except ValueError as e:
        raise FrameError(f"handshake layout: {e}") from None
    if receiver_tp_size < 1:
        raise FrameError("handshake names a receiver tensor-parallel size below 1")
    return layout, receiver_tp_size


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view of the same memory (no copy)."""
    if not t.is_contiguous():
        raise ValueError("payload tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class PayloadChecksum:
    """A payload's checksum, fed piece by piece as the bytes arrive.

    Every piece but the last must be a whole number of lanes (`LANE_BYTES`), so
    a receiver can check each piece right after reading it, while it is still
    in cache and while the sender keeps filling the socket buffer.
    """

    def __init__(self, kind: int) -> None:
        if kind not in CHECKSUM_KINDS.values():
            raise ValueError(f"unknown checksum kind {kind}")
        self.kind = kind
        self.value = 0

    def update(self, piece: torch.Tensor) -> None:
        if self.kind == CHECKSUM_CRC32:
            self.value = zlib.crc32(_host_memoryview(piece), self.value)
        elif self.kind == CHECKSUM_LANESUM:
            self.value = zlib.crc32(_lane_sums(piece), self.value)


def checksum(kind: int, pieces: Sequence[torch.Tensor]) -> int:
    """Checksum of the concatenation of contiguous byte tensors (`as_bytes`).

    Pieces that are not whole lanes are first joined into one buffer (a copy,
    only for odd layouts).
    """
    if kind == CHECKSUM_LANESUM and len(pieces) > 1 and any(p.numel() % LANE_BYTES for p in pieces[:-1]):
        pieces = [torch.cat(list(pieces))]
    c = PayloadChecksum(kind)
    for p in pieces:
        c.update(p)
    return c.value


def _lane_sums(p: torch.Tensor) -> memoryview:
    n = p.numel()
    full = n - n % LANE_BYTES
    # ndarray.data is memoryview(ndarray), and typed so (numpy's stubs give arrays the
    # buffer protocol only from Python 3.12 on)
    if p.device.type == "cpu":  # numpy: single-threaded SIMD, no thread-pool wakeups for small frames
        a = p.numpy()
        sums = [a[:full].view(np.int64).reshape(-1, LANE_BYTES // 8).sum(axis=1)] if full else []
        if n > full:
            tail = np.zeros(cdiv(n - full, 8) * 8, dtype=np.uint8)
            tail[: n - full] = a[full:]
            sums.append(tail.view(np.int64).sum().reshape(1))
        return (np.concatenate(sums) if len(sums) > 1 else sums[0]).data.cast("B")
    parts = []
    if full:
        main = p[:full]
        if main.data_ptr() % 8:
            main = main.clone()
        parts.append(main.view(torch.int64).view(-1, LANE_BYTES // 8).sum(dim=1))
    if n > full:
        padded = torch.zeros(cdiv(n - full, 8) * 8, dtype=torch.uint8, device=p.device)
        padded[: n - full] = p[full:]
        parts.append(padded.view(torch.int64).sum().reshape(1))
    return torch.cat(parts).cpu().numpy().data.cast("B")


def _host_memoryview(p: torch.Tensor) -> memoryview:
    return p.cpu().numpy().data.cast("B")
