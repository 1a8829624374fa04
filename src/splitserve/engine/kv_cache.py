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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve.engine.config import dtype_name, parse_dtype


@dataclass(frozen=True)
class KVLayout:
    """What both ends of a KV transfer must agree on, field by field."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # canonical name: "float32" | "bfloat16" | "float16"
    tp_size: int = 1  # ranks the heads are split over; num_kv_heads is the model's, all ranks together

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(parse_dtype(self.dtype)))
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVLayout.{f} must be positive")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"KVLayout: {self.num_kv_heads} KV heads do not split evenly over tensor-parallel size {self.tp_size}"
            )

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
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def elements_per_block(self) -> int:
        """Elements of one layer's K and V for one block, every rank's heads."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one layer's K and V for one block, every rank's heads."""
        return self.elements_per_block * torch.tensor([], dtype=self.torch_dtype).element_size()

    @property
    def shard_bytes_per_block(self) -> int:
        """Bytes of one layer's K and V for one block in one rank's shard."""
        return self.bytes_per_block // self.tp_size

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field on which two layouts differ, as a message, or None. The
        tensor-parallel size is not among them: the KV transfer maps heads between sizes."""
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"KV layout mismatch on {f}: {a} here, {b} at the peer"
        return None


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
    """Owns the cache tensor. Only block ids cross its interface."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        shard_devices: list[torch.device | str] | None = None,
        shared: bool = False,
    ) -> None:
        """`shard_devices`: each rank's device (default: `device` for every rank); `shared`: CPU
        shards in shared memory, for rank processes to map (torch.multiprocessing passes them)."""
        self.layout = layout
        self.num_blocks = num_blocks
        devices = shard_devices if shard_devices is not None else [device] * layout.tp_size
        if len(devices) != layout.tp_size:
            raise ValueError(f"{len(devices)} shard devices for tensor-parallel size {layout.tp_size}")
        shape = (layout.num_layers, num_blocks, 2, layout.block_size, layout.kv_heads_per_rank, layout.head_dim)
        if shared:
            check_shared_memory(num_blocks * layout.num_layers * layout.bytes_per_block)
        self.shards = [torch.zeros(shape, dtype=layout.torch_dtype, device=d) for d in devices]
        if shared:
            for t in self.shards:
                t.share_memory_()
        self.tensor = self.shards[0]  # rank 0's (with tp_size 1, the whole cache)

    def shard(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s `[num_layers, num_blocks, 2, block_size, kv_heads_per_rank, head_dim]`."""
        return self.shards[rank]

    def layer(self, layer: int) -> torch.Tensor:
        """`[num_blocks, 2, block_size, kv_heads, head_dim]` view of one layer."""
        return self.tensor[layer]

    def blocks(self, layer: int, first_block: int, count: int, rank: int = 0) -> torch.Tensor:
        """Contiguous view of one layer's K and V for blocks `first_block .. first_block+count-1`
        in rank `rank`'s shard (the whole cache's heads with tp_size 1)."""
        if first_block < 0 or count < 0 or first_block + count > self.num_blocks:
            raise IndexError(f"blocks {first_block}..{first_block + count - 1} outside 0..{self.num_blocks - 1}")
        return self.shards[rank][layer, first_block : first_block + count]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer, every rank's shard."""
        src = torch.as_tensor([s for s, _ in pairs], device=self.tensor.device)
        dst = torch.as_tensor([d for _, d in pairs], device=self.tensor.device)
        for shard in self.shards:
            shard[:, dst.to(shard.device)] = shard[:, src.to(shard.device)]

    def reset_blocks(self, block_ids: list[int]) -> None:
        """Zero the given blocks in every layer (after a failed or partial transfer)."""
        if block_ids:
            for t in self.shards:
                t[:, torch.as_tensor(block_ids, dtype=torch.long, device=t.device)] = 0

    def block_nbytes(self) -> int:
        """Bytes of one block's KV, every layer, every rank's shard (what `export_block` returns)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.shards)

    def export_block(self, block_id: int) -> torch.Tensor:
        """One block's KV, every layer and shard, as a flat uint8 CPU tensor of its own (a tier's copy)."""
        parts = [t[:, block_id].contiguous().cpu().view(torch.uint8).reshape(-1) for t in self.shards]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def import_block(self, block_id: int, data: torch.Tensor) -> None:
        """Write what `export_block` returned into block `block_id`."""
        start = 0
        for t in self.shards:
            view = t[:, block_id]
            n = view.numel() * t.element_size()
            src = data[start : start + n].view(t.dtype).reshape(view.shape)
            view.copy_(src, non_blocking=False)
            start += n

    @property
    def nbytes(self) -> int:
        """Every rank's shard together."""
        return sum(t.numel() * t.element_size() for t in self.shards)
