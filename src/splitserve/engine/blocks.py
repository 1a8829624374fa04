"""Block arithmetic every side shares: how many blocks hold a number of
tokens, and which blocks of a context a remote prefill fills. Torch-free, so
the router and the benchmarks' command lines can import it cheaply."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that hold `a` tokens, a grid's tiles."""
    return -(-a // b)


def blocks_to_fill(context_len: int, num_cached_tokens: int, block_size: int) -> range:
    """The block-table indices a remote prefill fills for a context whose first
    `num_cached_tokens` (whole blocks) the decode worker has cached: both ends of a
    reservation derive its geometry here."""
    return range(num_cached_tokens // block_size, cdiv(context_len, block_size))
