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


def window_start(context_len: int, window: int, block_size: int) -> int:
    """The first block-table index a layer of this `window` (0: global) still reads once a context
    of `context_len` tokens is in the cache: the next token, at position context_len, sees the
    keys from context_len - window + 1 on, and every later token's window starts later still.
    Both ends of a remote prefill derive from it which blocks of a windowed layer travel."""
    if not window:
        return 0
    return max(0, context_len - window + 1) // block_size
