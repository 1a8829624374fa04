"""The one chained block-hash function, shared by the router, the prefill worker
and the decode worker.

A full block's hash covers its own tokens and, through the parent hash, every
token before it, so equal hashes mean equal prefixes. The digest is a keyed-free
BLAKE2b (16 bytes): Python's built-in `hash` is fast but trivially collidable,
and a collision would hand one user another user's KV cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes  # 16-byte digest

ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash one full block given the hash of the block before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Chained hashes of every *full* block of `tokens` (a trailing partial block has none)."""
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[BlockHash] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[start : start + block_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out
