"""The paged KV cache tensor and its layout.

One tensor holds every layer: `[num_layers, num_blocks, 2, block_size,
num_kv_heads, head_dim]` (the 2 is K then V). The layout is layer-major and
then block-major on purpose: one layer's K and V for a run of consecutive block
ids is a single contiguous slice, so the KV transfer can send or receive a
layer of a reservation as a few contiguous pieces, straight from and into
cache memory, with no staging copy.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(parse_dtype(self.dtype)))
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVLayout.{f} must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def elements_per_block(self) -> int:
        """Elements of one layer's K and V for one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one layer's K and V for one block."""
        return self.elements_per_block * torch.tensor([], dtype=self.torch_dtype).element_size()

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field on which two layouts differ, as a message, or None."""
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"KV layout mismatch on {f}: {a} here, {b} at the peer"
        return None


class KVCache:
    """Owns the cache tensor. Only block ids cross its interface."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            (layout.num_layers, num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.torch_dtype,
            device=device,
        )

    def layer(self, layer: int) -> torch.Tensor:
        """`[num_blocks, 2, block_size, kv_heads, head_dim]` view of one layer."""
        return self.tensor[layer]

    def blocks(self, layer: int, first_block: int, count: int) -> torch.Tensor:
        """Contiguous view of one layer's K and V for blocks `first_block .. first_block+count-1`."""
        if first_block < 0 or count < 0 or first_block + count > self.num_blocks:
            raise IndexError(f"blocks {first_block}..{first_block + count - 1} outside 0..{self.num_blocks - 1}")
        return self.tensor[layer, first_block : first_block + count]

    def reset_blocks(self, block_ids: list[int]) -> None:
        """Zero the given blocks in every layer (after a failed or partial transfer)."""
        if block_ids:
            self.tensor[:, torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)] = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
