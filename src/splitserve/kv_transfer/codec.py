"""KV wire codecs: how a layer frame's K and V travel, whatever dtype either cache stores.

Codec ids (the layer header's `value`, frame.py):

- `CODEC_RAW` (0): the cache's own bytes, as before codecs existed; zero-copy on both ends.
- `CODEC_INT8` (1): symmetric int8 with one float32 scale per (block, K or V, token, head).
  The payload is block after block (the frame's `[blocks, 2, block_size, heads, head_dim]`),
  each block its int8 values `[2, block_size, heads, head_dim]` (bytes `[0, V)`), then its
  scales `[2, block_size, heads]` as little-endian float32 (bytes `[V, V + 4S)`): the same
  bytes as one block of an int8 KV pool (engine/kv_cache.py's quantized block). A value
  decodes as `q * scale`, with `scale = max|x| / 127` over its head_dim values and `q`
  rounded half to even, so each decoded value is within half a step (`scale / 2`) of the
  value sent, before the receiver rounds it to its own dtype. Bytes per element:
  `1 + 4 / head_dim`, 0.53x bfloat16 at head_dim 64, 0.52x at 128.

No lossless stage, measured on real KV (`splitserve bench transfer --codec --lossless`,
bench/results/transfer-lossless.txt: SmolLM2's bfloat16 KV of a 2K-token prefill, one core):
the best, zstd at level 1 on byte-shuffled values, keeps 0.68x the bytes at 233 MB/s in and
2.4 GB/s out, so it would take 0.68x raw's time on a link of 1 Gb/s or slower and cost more
than it saves from 10 Gb/s on (lz4 keeps 0.99x); int8 takes 0.53x on the same links, and
zstd after int8 only 0.48x against its 0.53x. It would pay only for a sender that must stay
exact (`raw`) on a slow link; not built (a compressed frame's length varies, which the
receiver's length check against the reservation does not allow yet, and zstd is not a
dependency).

Which codec a stream uses: the sender offers what it may use in its handshake, the
receiver's ack picks one it can decode into its cache (an old peer that knows no codecs
sends and answers 0: raw). The sender's offer comes from `choose`, a pure function of the
link's bandwidth (configured, or measured on earlier streams to that receiver), the
codec's encode and decode throughput (measured at start by `measure_speed`, or given) and
the bytes it saves: encoding that costs more time than the bytes it saves (loopback, the
same host, CUDA IPC, which moves no bytes on the connection) stays off.
"""

from __future__ import annotations

import math
import time
from typing import Literal, NamedTuple

import torch

CODEC_RAW, CODEC_INT8 = 0, 1
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_INT8: "int8"}
CODEC_IDS = {v: k for k, v in CODEC_NAMES.items()}
WireCodecMode = Literal["auto", "raw", "int8"]
WIRE_CODEC_MODES: tuple[WireCodecMode, ...] = ("auto", "raw", "int8")

# Offer bits in a handshake (bit i: codec i); raw is always acceptable and never offered.
OFFER_INT8 = 1 << CODEC_INT8

# Storage dtypes the int8 codec decodes into (the receiver's cache): the float ones by
# `decode_into`; an int8 pool takes the frame's bytes as they are (its own block format);
# an fp8 pool through engine/kv_cache.py's `quantize_into` (re-quantized from the decoded values).
DECODES_INTO = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")
# Storage dtypes a sender can put on the wire as int8: the float ones are encoded, an int8
# pool's blocks already are int8 frames. An fp8 pool's are not, and there is no transcoder.
ENCODES_FROM = ("float32", "bfloat16", "float16", "int8")

_SCALE_BYTES = 4
_QMAX = 127.0


def wire_bytes(codec: int, elements: int, head_dim: int, element_size: int) -> int:
    """Payload bytes of a frame of `elements` KV elements under `codec`."""
    if codec == CODEC_RAW:
        return elements * element_size
    if codec == CODEC_INT8:
        if elements % head_dim:
            raise ValueError(f"{elements} elements are not whole heads of dim {head_dim}")
        return elements + (elements // head_dim) * _SCALE_BYTES
    raise ValueError(f"unknown codec {codec}")


def ratio(codec: int, head_dim: int, element_size: int) -> float:
    """Wire bytes over raw bytes for one element."""
    return wire_bytes(codec, head_dim, head_dim, element_size) / (head_dim * element_size)


class Int8Encoder:
    """Encodes frames into one staging buffer, kept and reused (one per stream: the stream's
    thread sends a frame before it encodes the next)."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[blocks, 2, block_size, heads, head_dim]` (any float dtype) -> the int8 payload
        as flat uint8 (a view of the staging buffer, valid until the next call)."""
        total = wire_bytes(CODEC_INT8, x.numel(), x.shape[-1], 1)
        s = self._staging
        if s is None or s.numel() < total or s.device != x.device:
            s = self._staging = torch.empty(total, dtype=torch.uint8, device=x.device)
        out = s[:total]
        encode_into(x, out)
        return out


def _regions(payload: torch.Tensor, blocks: int, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload's int8 values `[blocks, rows, head_dim]` and fp32 scales `[blocks, rows]`, views."""
    per_block = payload.view(blocks, -1)
    v = rows * head_dim
    return per_block[:, :v].view(torch.int8).view(blocks, rows, head_dim), per_block[:, v:].view(torch.float32)


def encode_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Write `x`'s int8 payload (`x` `[blocks, ..., head_dim]`) into `out` (flat uint8 of
    `wire_bytes(CODEC_INT8, ...)` bytes)."""
    blocks, hd = x.shape[0], x.shape[-1]
    rows = x.numel() // (blocks * hd)
    xf = x.reshape(blocks, rows, hd).to(torch.float32, copy=True)  # a copy even from float32: divided in place
    values, scales = _regions(out, blocks, rows, hd)
    s = xf.abs().amax(dim=2).div_(_QMAX)
    scales.copy_(s)
    q = xf.div_(s.masked_fill_(s == 0, 1.0).unsqueeze(2)).round_().clamp_(-_QMAX, _QMAX)
    values.copy_(q)


def decode_into(payload: torch.Tensor, dst: torch.Tensor) -> None:
    """Decode an int8 payload (flat uint8) into `dst` (`[blocks, ..., head_dim]` in the
    receiver's dtype: its blocks)."""
    blocks, hd = dst.shape[0], dst.shape[-1]
    n = dst.numel()
    if payload.numel() != wire_bytes(CODEC_INT8, n, hd, 1):
        raise ValueError(f"int8 payload of {payload.numel()} bytes for {n} elements")
    if payload.device != dst.device:  # a CUDA cache: the payload arrived in host memory
        payload = payload.to(dst.device)
    rows = n // (blocks * hd)
    values, scales = _regions(payload, blocks, rows, hd)
    dst.view(blocks, rows, hd).copy_(values * scales.unsqueeze(2))


def check_aligned(head_dim: int) -> str | None:
    """Why the int8 codec cannot carry this head dim, or None (the scales follow the values
    and must sit on a 4-byte boundary)."""
    return None if head_dim % 4 == 0 else f"head dim {head_dim} is not a multiple of 4"


class CodecSpeed(NamedTuple):
    """The int8 codec's throughput in raw (cache) bytes per second, one core."""

    encode_bps: float
    decode_bps: float


def measure_speed(
    dtype: torch.dtype, head_dim: int, nbytes: int = 4 << 20, repeats: int = 5, device: str | torch.device = "cpu"
) -> CodecSpeed:
    """Encode and decode throughput on this machine, on `device` (the cache's: where the
    sender encodes; best of `repeats` after one untimed pass, which pays the buffers' page
    faults and any lazy start-up; a few ms each)."""
    elements = max(head_dim, nbytes // torch.tensor([], dtype=dtype).element_size() // head_dim * head_dim)
    x = torch.randn(elements // (32 * head_dim) or 1, 32, head_dim).to(dtype).to(device)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)  # blocks of 32 rows
    enc = Int8Encoder()
    dst = torch.empty_like(x)
    decode_into(enc.encode(x), dst)  # warm-up
    best_e = best_d = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        payload = enc.encode(x)
        sync()
        t1 = time.perf_counter()
        decode_into(payload, dst)
        sync()
        t2 = time.perf_counter()
        best_e, best_d = min(best_e, t1 - t0), min(best_d, t2 - t1)
    raw = x.numel() * x.element_size()
    return CodecSpeed(raw / max(best_e, 1e-9), raw / max(best_d, 1e-9))


class Choice(NamedTuple):
    codec: int
    why: str


# Turn the codec on only if the model says a frame arrives in at most this fraction of the
# raw time: the measured figures move with load, and a near tie is not worth the error.
MARGIN = 0.8


def choose(
    bandwidth_bps: float | None,
    speed: CodecSpeed | None,
    wire_ratio: float,
    margin: float = MARGIN,
    same_host: bool = False,
) -> Choice:
    """The codec for a link, from its bandwidth (payload bytes per second; None: not known
    yet), the codec's speed, wire bytes over raw bytes, and whether the receiver is on this
    host (loopback, or one of its own addresses: memory moves the bytes, faster than either
    end encodes them, so raw without measuring).

    Per raw byte, raw costs `1 / bandwidth`; int8 costs the slowest of its three stages,
    which overlap (the sender encodes the next frame while the socket drains the last, the
    receiver decodes one while the next arrives): `max(1 / encode, ratio / bandwidth,
    1 / decode)`. On when that is under `margin` of raw's.
    """
    if same_host:
        return Choice(CODEC_RAW, "the receiver is on this host")
    if speed is None:
        return Choice(CODEC_RAW, "codec speed unknown")
    if bandwidth_bps is None:
        return Choice(CODEC_RAW, "link bandwidth not measured yet")
    raw_s = 1.0 / bandwidth_bps
    int8_s = max(1.0 / speed.encode_bps, wire_ratio / bandwidth_bps, 1.0 / speed.decode_bps)
    gbps = bandwidth_bps * 8 / 1e9
    if int8_s <= margin * raw_s:
        return Choice(CODEC_INT8, f"link {gbps:.2f} Gb/s: int8 {int8_s / raw_s:.2f}x raw's time per byte")
    return Choice(CODEC_RAW, f"link {gbps:.2f} Gb/s: int8 would take {int8_s / raw_s:.2f}x raw's time")
