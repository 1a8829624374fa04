"""The GGUF block formats splitserve computes in place (engine/kernels/quant.*): each one's GGML
type number, elements and bytes a block. Every format's block is 32 elements, or a super-block
of 256 (the K-quants) made of eight 32-element sub-blocks, so that one loop over blocks of 32
serves them all. Plain data, no torch: the planner counts weight bytes with it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    name: str  # llama.cpp's: "Q4_K"
    ggml_type: int  # GGMLQuantizationType's value, as GGUF files write it
    block_elems: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` elements (`k` a multiple of the block)."""
        return k // self.block_elems * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems


FORMATS: dict[int, BlockFormat] = {
    f.ggml_type: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q5_0", 6, 32, 22),
        BlockFormat("Q5_1", 7, 32, 24),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, 256, 144),
        BlockFormat("Q5_K", 13, 256, 176),
        BlockFormat("Q6_K", 14, 256, 210),
    )
}
BY_NAME: dict[str, BlockFormat] = {f.name: f for f in FORMATS.values()}
