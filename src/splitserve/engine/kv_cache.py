"""The paged KV cache tensor and its layout.

One tensor holds every layer: `[num_layers, num_blocks, 2, block_size,
num_kv_heads, head_dim]` (the 2 is K then V). The layout is layer-major and
then block-major on purpose: one layer's K and V for a run of consecutive block
ids is a single contiguous slice, so the KV transfer can send or receive a
layer of a reservation as a few contiguous pieces, straight from and into
cache memory, with no staging copy.

With tensor parallelism (`KVLayout.tp_size` > 1) each rank holds the KV heads
of its own attention heads: rank r has heads `r * per_rank .. (r+1) * per_rank
- 1` in a tensor of the same layout with `kv_heads_per_rank` heads, a shard.
The worker's rank 0 holds every rank's shard (`KVCache.shards`, shared memory
on a CPU, each rank's own device on CUDA, handed to the ranks when they start),
so the scheduler, the block manager and the KV transfer see one cache and only
block ids cross its interface; `tensor` is rank 0's shard.

Quantized KV (`KVLayout.dtype` "int8" or "fp8_e4m3", `--kv-cache-dtype int8|fp8`): each
block carries its own scales, so that a block stays one contiguous run of bytes (copied,
sent and received as it is) and can be written token by token. The tensor is `[num_layers,
num_blocks, block_bytes]` of one-byte elements (torch.int8, or torch.float8_e4m3fn for
fp8), and one layer's block (one rank's shard: `kv_heads` = `kv_heads_per_rank`) is:

    bytes [0, V)        values [2, block_size, kv_heads, head_dim], one byte each
                        (K then V; int8 two's complement, or float8 e4m3fn bits)
    bytes [V, V + 4S)   scales [2, block_size, kv_heads] fp32, little-endian
    V = 2 * block_size * kv_heads * head_dim,  S = 2 * block_size * kv_heads,
    block_bytes = V + 4S = 2 * block_size * kv_heads * (head_dim + 4)

One scale per (layer, block, K|V, token, kv head): x[d] = value[d] * scale. A row x (one
token's head_dim elements of one head, K after RoPE) is quantized as `quantize_rows` does:
scale = max|x| / Q with Q = 127 (int8) or 448 (e4m3's largest finite value), in fp32;
value = round-half-even(x / scale) clamped to [-127, 127] (int8), or x / scale clamped to
[-448, 448] and rounded to e4m3fn (fp8); an all-zero row has scale 0 and values 0. The
attention kernels (the CPU C++ decode kernel and the torch path in engine/attention.py)
read the values and scales in place; `quantize_into` writes a layer of bf16/fp32 K and V
into blocks of any layout (what a receiver of another dtype calls) and `dequantize_blocks`
reads them back.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

from splitserve.engine.config import QUANTIZED_KV_DTYPES, kv_dtype_name
from splitserve.engine.kv_groups import CacheGroups

# The storage dtype of each quantized KV format's values, and the largest magnitude it holds.
QUANTIZED_TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_BYTES = 4  # one fp32 scale per token and KV head


@dataclass(frozen=True)
class KVLayout:
    """What both ends of a KV transfer must agree on, field by field."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # storage dtype, canonical: "float32" | "bfloat16" | "float16" | "int8" | "fp8_e4m3"
    tp_size: int = 1  # ranks the heads are split over; num_kv_heads is the model's, all ranks together
    # The manifest beside the shapes: each layer's kind (its sliding window in tokens, 0 for a
    # layer that attends to the whole context; () where every layer does), and the model's
    # fingerprint (engine/fingerprint.py: its family, shapes and a sample of every weight; b""
    # where unknown). KV of one model is never read as another's, nor a windowed layer's as a
    # global one's: the handshake refuses the mismatch, naming the field, before any byte moves.
    windows: tuple[int, ...] = ()
    model_fingerprint: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", kv_dtype_name(self.dtype, "float32"))
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVLayout.{f} must be positive")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"KVLayout: {self.num_kv_heads} KV heads do not split evenly over tensor-parallel size {self.tp_size}"
            )
        if self.windows and (len(self.windows) != self.num_layers or min(self.windows) < 0):
            raise ValueError(f"KVLayout: {len(self.windows)} windows for {self.num_layers} layers (each >= 0)")
        if self.model_fingerprint and len(self.model_fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"KVLayout: a model fingerprint is {FINGERPRINT_BYTES} bytes")

    @property
    def kv_heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    def rank_heads(self, rank: int) -> range:
        """The model's KV heads that rank `rank` holds."""
        if not 0 <= rank < self.tp_size:
            raise IndexError(f"rank {rank} outside 0..{self.tp_size - 1}")
        n = self.kv_heads_per_rank
        return range(rank * n, (rank + 1) * n)

    @property
    def quantized(self) -> bool:
        """int8 or fp8 values with their scales in each block (the module doc's format)."""
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        """The cache tensor's element type (a quantized cache's values' type)."""
        if self.quantized:
            return QUANTIZED_TORCH_DTYPES[self.dtype]
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def elements_per_block(self) -> int:
        """K and V values of one layer for one block, every rank's heads (scales not counted)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one layer's K and V for one block, every rank's heads (with their scales)."""
        if self.quantized:
            return 2 * self.block_size * self.num_kv_heads * (self.head_dim + SCALE_BYTES)
        return self.elements_per_block * torch.tensor([], dtype=self.torch_dtype).element_size()

    def shard_shape(self, num_blocks: int, rows: int = 0) -> tuple[int, ...]:
        """One rank's cache tensor: `[layers, blocks, 2, block_size, kv_heads_per_rank, head_dim]`,
        or `[layers, blocks, block_bytes]` when quantized (`rows` layers instead: a grouped
        cache's pages, engine/kv_groups.py)."""
        rows = rows or self.num_layers
        if self.quantized:
            return (rows, num_blocks, self.shard_bytes_per_block)
        return (rows, num_blocks, 2, self.block_size, self.kv_heads_per_rank, self.head_dim)

    @property
    def shard_bytes_per_block(self) -> int:
        """Bytes of one layer's K and V for one block in one rank's shard."""
        return self.bytes_per_block // self.tp_size

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field on which two layouts differ, as a message, or None. The
        tensor-parallel size is not among them: the KV transfer maps heads between sizes."""
        for f in LAYOUT_FIELDS:
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                if f == "dtype":
                    return f"KV layout mismatch on dtype: {a} KV here, {b} KV at the peer"
                return f"KV layout mismatch on {f}: {describe_field(a)} here, {describe_field(b)} at the peer"
        return None


# What two ends of a transfer must agree on (KVLayout.mismatch), whatever their tensor-parallel split.
LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "windows", "model_fingerprint")
FINGERPRINT_BYTES = 16


def describe_field(value: object) -> str:
    """A layout field's value as an error message shows it."""
    if isinstance(value, bytes):  # the model fingerprint
        return value.hex()[:12] if value else "none"
    if isinstance(value, tuple):  # the windows
        return "windows " + ",".join(str(w) for w in value) if value else "every layer global"
    return str(value)


def pool_blocks(layout: KVLayout, pool_bytes: int) -> int:
    """Blocks of `layout` (every layer, every rank) that fit in `pool_bytes` (ValueError if none)."""
    n = pool_bytes // (layout.num_layers * layout.bytes_per_block)
    if n < 1:
        raise ValueError(
            f"a KV pool of {pool_bytes} bytes holds no block of {layout.num_layers * layout.bytes_per_block} bytes "
            f"({layout.dtype} KV)"
        )
    return n


SHM_DIR = "/dev/shm"


def check_shared_memory(nbytes: int, directory: str = SHM_DIR) -> None:
    """ValueError unless `directory` (the tmpfs behind torch's CPU shared memory) has room for
    `nbytes`: past its size a page fault kills the process (SIGBUS) long after the allocation,
    and containers start with small ones (Docker: 64 MiB)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return  # no such tmpfs here: torch finds its shared memory elsewhere
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(
            f"the KV cache needs {nbytes / 2**20:.0f} MiB of shared memory for its tensor-parallel shards; "
            f"{directory} has {free / 2**20:.0f} MiB free: lower --num-blocks, or give the container more "
            "(docker run --shm-size, a Kubernetes emptyDir with medium Memory on /dev/shm)"
        )


class KVCache:
    """Owns the cache tensor. Only block ids cross its interface.

    A grouped cache (`groups`, engine/kv_groups.py: a model of windowed and global layers) is
    `[rows, num_blocks, ...]` pages: block b is page b, and its windowed layers live in the pages
    `window_pages[b]` while it holds them. The block manager writes `window_pages`; every reader
    here translates a windowed layer's block ids to those pages."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        shard_devices: list[torch.device | str] | None = None,
        shared: bool = False,
        groups: CacheGroups | None = None,
    ) -> None:
        """`shard_devices`: each rank's device (default: `device` for every rank); `shared`: CPU
        shards in shared memory, for rank processes to map (torch.multiprocessing passes them)."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.groups = groups
        self.rows = groups.rows if groups is not None else layout.num_layers
        # a block's windowed layers' pages (grouped only): None where it holds none (released, or free)
        self.window_pages: list[tuple[int, ...] | None] = [None] * num_blocks if groups is not None else []
        devices = shard_devices if shard_devices is not None else [device] * layout.tp_size
        if len(devices) != layout.tp_size:
            raise ValueError(f"{len(devices)} shard devices for tensor-parallel size {layout.tp_size}")
        shape = layout.shard_shape(num_blocks, self.rows)
        if shared:
            check_shared_memory(num_blocks * self.rows * layout.bytes_per_block)
        self.shards = [
            untouched_zeros(shape, layout.torch_dtype)
            if not shared and torch.device(d).type == "cpu"
            else torch.zeros(shape, dtype=layout.torch_dtype, device=d)
            for d in devices
        ]
        if shared:
            for t in self.shards:
                t.share_memory_()
        self.tensor = self.shards[0]  # rank 0's (with tp_size 1, the whole cache)

    def shard(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s `[num_layers, num_blocks, 2, block_size, kv_heads_per_rank, head_dim]`."""
        return self.shards[rank]

    def layer(self, layer: int) -> torch.Tensor:
        """`[num_blocks, 2, block_size, kv_heads, head_dim]` view of one layer (quantized:
        `[num_blocks, block_bytes]`, which `quantized_views` splits); of a grouped cache, the
        layer's row, indexed by pages."""
        return self.tensor[self.row(layer)]

    def row(self, layer: int) -> int:
        """The tensor's row that holds `layer`."""
        return layer if self.groups is None else self.groups.layer_rows[layer][0]

    def pages(self, layer: int, block_ids: list[int]) -> list[int]:
        """Where `layer`'s K/V of these blocks is: the block ids themselves, but for a grouped
        cache's windowed layer, the pages each block holds (KeyError: one holds none)."""
        if self.groups is None or not self.groups.is_windowed(layer):
            return block_ids
        g = self.groups.layer_rows[layer][1]
        out = []
        for b in block_ids:
            held = self.window_pages[b]
            if held is None:
                raise KeyError(f"block {b} holds no pages for the windowed layer {layer}")
            out.append(held[g])
        return out

    def blocks(self, layer: int, first_block: int, count: int, rank: int = 0) -> torch.Tensor:
        """Contiguous view of one layer's K and V for blocks `first_block .. first_block+count-1`
        in rank `rank`'s shard (the whole cache's heads with tp_size 1). A grouped cache's
        windowed layer: as far as the blocks' pages are consecutive (one block always is)."""
        if first_block < 0 or count < 0 or first_block + count > self.num_blocks:
            raise IndexError(f"blocks {first_block}..{first_block + count - 1} outside 0..{self.num_blocks - 1}")
        pages = self.pages(layer, list(range(first_block, first_block + count)))
        if pages and pages != list(range(pages[0], pages[0] + count)):
            raise IndexError(f"the pages of layer {layer}'s blocks {first_block}..+{count} are not consecutive")
        first = pages[0] if pages else first_block
        return self.shards[rank][self.row(layer), first : first + count]

    def block_pages(self, block_id: int) -> list[int]:
        """The pages that hold a block's KV: its own, and its windowed layers' while it holds them.
        The last block, scratch (CUDA graphs' padding rows, the tiers' probe), is all its own pages."""
        if self.groups is None:
            return [block_id]
        if block_id == self.num_blocks - 1:
            return [block_id] * self.groups.pages_per_block
        return [block_id, *(self.window_pages[block_id] or ())]

    def whole(self, block_id: int) -> bool:
        """Whether the block holds every layer's KV (a grouped cache's block past every window does not)."""
        return len(self.block_pages(block_id)) == (self.groups.pages_per_block if self.groups is not None else 1)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer, every rank's shard."""
        pairs = [p for s, d in pairs for p in zip(self.block_pages(s), self.block_pages(d), strict=False)]
        src = torch.as_tensor([s for s, _ in pairs], device=self.tensor.device)
        dst = torch.as_tensor([d for _, d in pairs], device=self.tensor.device)
        for shard in self.shards:
            raw = shard.view(torch.uint8) if self.layout.quantized else shard
            raw[:, dst.to(shard.device)] = raw[:, src.to(shard.device)]

    def reset_blocks(self, block_ids: list[int]) -> None:
        """Zero the given blocks in every layer (after a failed or partial transfer)."""
        block_ids = [p for b in block_ids for p in self.block_pages(b)]
        if block_ids:
            for t in self.shards:
                raw = t.view(torch.uint8) if self.layout.quantized else t
                raw[:, torch.as_tensor(block_ids, dtype=torch.long, device=t.device)] = 0

    def block_nbytes(self) -> int:
        """Bytes of one block's KV, every layer, every rank's shard (what `export_block` returns)."""
        pages = self.groups.pages_per_block if self.groups is not None else 1
        return pages * sum(t[:, 0].numel() * t.element_size() for t in self.shards)

    def export_block(self, block_id: int) -> torch.Tensor:
        """One whole block's KV, every layer and shard, as a flat uint8 CPU tensor of its own (a tier's copy)."""
        if not self.whole(block_id):
            raise ValueError(f"block {block_id} no longer holds its windowed layers' KV")
        pages = torch.as_tensor(self.block_pages(block_id), dtype=torch.long)
        parts = [t[:, pages.to(t.device)].contiguous().cpu().view(torch.uint8).reshape(-1) for t in self.shards]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def import_block(self, block_id: int, data: torch.Tensor) -> None:
        """Write what `export_block` returned into block `block_id` (which holds every layer's pages)."""
        if not self.whole(block_id):
            raise ValueError(f"block {block_id} holds no pages for its windowed layers")
        pages = self.block_pages(block_id)
        start = 0
        for t in self.shards:
            index = torch.as_tensor(pages, dtype=torch.long, device=t.device)
            shape = t[:, index].shape
            n = shape.numel() * t.element_size()
            t[:, index] = data[start : start + n].to(t.device).view(t.dtype).reshape(shape)
            start += n

    @property
    def nbytes(self) -> int:
        """Every rank's shard together."""
        return sum(t.numel() * t.element_size() for t in self.shards)


# ------------------------------------------------------------------ quantized KV


def quantized_kind(t: torch.Tensor) -> str | None:
    """ "int8" or "fp8_e4m3" for a quantized cache tensor (or one layer of it), None otherwise."""
    for name, dtype in QUANTIZED_TORCH_DTYPES.items():
        if t.dtype == dtype:
            return name
    return None


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) as (values [..., head_dim] of the kind's torch dtype,
    scales [...] fp32): the module doc's rounding, which the C++ decode kernel reproduces."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QUANT_MAX[kind]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / safe[..., None]
    if kind == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_rows' inverse: values [..., head_dim] * scales [...], in `dtype`."""
    return (values.float() * scales[..., None].float()).to(dtype)


def quantized_block_size(layer_cache: torch.Tensor, kv_heads: int, head_dim: int) -> int:
    """Tokens per block of one quantized layer `[num_blocks, block_bytes]`."""
    per_token = 2 * kv_heads * (head_dim + SCALE_BYTES)
    if layer_cache.shape[-1] % per_token:
        raise ValueError(f"a quantized block of {layer_cache.shape[-1]} bytes is no whole number of tokens")
    return int(layer_cache.shape[-1]) // per_token


def quantized_views(layer_cache: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One quantized layer `[num_blocks, block_bytes]` as (values `[num_blocks, 2, block_size,
    kv_heads, head_dim]` in the cache's dtype, scales `[num_blocks, 2, block_size, kv_heads]`
    fp32), both views of the same memory."""
    blocks = layer_cache.shape[0]
    bs = quantized_block_size(layer_cache, kv_heads, head_dim)
    nvals = 2 * bs * kv_heads * head_dim
    values = layer_cache[:, :nvals].view(blocks, 2, bs, kv_heads, head_dim)
    scales = layer_cache[:, nvals:].view(torch.uint8).view(torch.float32).view(blocks, 2, bs, kv_heads)
    return values, scales


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor as int8 (so that indexing works whatever its dtype: torch lacks
    index_put and gather for float8 on some devices)."""
    return t.view(torch.int8)


def write_quantized(
    layer_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """New tokens' K and V ([T, kv_heads, head_dim]) quantized into their slots of one layer."""
    kind = quantized_kind(layer_cache)
    if kind is None:
        raise ValueError(f"{layer_cache.dtype} is not a quantized KV cache")
    values, scales = quantized_views(layer_cache, k.shape[1], k.shape[2])
    raw = _as_int(values)
    for i, x in enumerate((k, v)):
        qv, sc = quantize_rows(x, kind)
        raw[slot_blocks, i, slot_offsets] = _as_int(qv)
        scales[slot_blocks, i, slot_offsets] = sc


def gather_dequantized(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks `block_ids` (any shape S) of one quantized layer, dequantized:
    `[*S, 2, block_size, kv_heads, head_dim]` in `dtype`."""
    kind = quantized_kind(layer_cache)
    if kind is None:
        raise ValueError(f"{layer_cache.dtype} is not a quantized KV cache")
    values, scales = quantized_views(layer_cache, kv_heads, head_dim)
    qv = _as_int(values)[block_ids].view(QUANTIZED_TORCH_DTYPES[kind])
    return dequantize_rows(qv, scales[block_ids], dtype)


def quantize_into(
    cache: KVCache, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, rank: int = 0
) -> None:
    """Write one layer's K and V of whole blocks, `[len(block_ids), block_size, kv_heads_per_rank,
    head_dim]` each in any float dtype (bf16 or fp32 off the wire), into blocks `block_ids` of
    rank `rank`'s shard, in the cache's own storage dtype: quantized with fresh per-token, per-head
    scales for an int8 or fp8 cache (exactly as the engine's own writes), cast otherwise."""
    lay = cache.layout
    shape = (len(block_ids), lay.block_size, lay.kv_heads_per_rank, lay.head_dim)
    if tuple(k.shape) != shape or tuple(v.shape) != shape:
        raise ValueError(f"quantize_into takes K and V of shape {list(shape)}, got {list(k.shape)}, {list(v.shape)}")
    if not block_ids:
        return
    if not 0 <= min(block_ids) <= max(block_ids) < cache.num_blocks:
        raise IndexError(f"block ids outside 0..{cache.num_blocks - 1}")
    shard = cache.shard(rank)[layer]
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=shard.device)
    k, v = k.to(shard.device), v.to(shard.device)
    if not lay.quantized:
        shard[ids, 0] = k.to(shard.dtype)
        shard[ids, 1] = v.to(shard.dtype)
        return
    values, scales = quantized_views(shard, lay.kv_heads_per_rank, lay.head_dim)
    raw = _as_int(values)
    for i, x in enumerate((k, v)):
        qv, sc = quantize_rows(x, lay.dtype)
        raw[ids, i] = _as_int(qv)
        scales[ids, i] = sc


def dequantize_blocks(
    cache: KVCache, layer: int, block_ids: list[int], dtype: torch.dtype, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_into's inverse: (K, V) of blocks `block_ids` of one layer of rank `rank`'s shard,
    each `[len(block_ids), block_size, kv_heads_per_rank, head_dim]` in `dtype`."""
    lay = cache.layout
    shard = cache.shard(rank)[layer]
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=shard.device)
    if lay.quantized:
        kv = gather_dequantized(shard, ids, lay.kv_heads_per_rank, lay.head_dim, dtype)
    else:
        kv = shard[ids].to(dtype)
    return kv[:, 0], kv[:, 1]


def untouched_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of zeros on an anonymous mapping: the kernel gives each page zeroed at its first
    write, so a KV pool holds memory only where blocks have been written. A worker's RSS is its
    weights and the blocks it has used, not the whole pool: a standby worker holds its warm-up's
    few blocks, and a start does not wait for the pool to be cleared (torch.zeros writes every
    byte at once). The tensor keeps the mapping alive (torch.frombuffer holds a reference)."""
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
