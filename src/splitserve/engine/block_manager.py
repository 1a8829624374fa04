"""The KV block allocator: free list, reference counts, and the prefix cache.

A full block is cached under the chained hash of its tokens (engine/block_hash).
When its last reference goes, it joins the free list but keeps its hash, so a
later request with the same prefix can take it back; the free list is ordered
least recently freed first, and allocation evicts from that end (LRU).

Allocation is a check and then a commit: `can_allocate` never changes state,
`allocate` assumes the check passed. Every change to the set of cached hashes
is recorded as a `BlockEvent` for the router's prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.engine.block_hash import ROOT_HASH, BlockHash, hash_block
from splitserve.engine.blocks import cdiv


class BlockEvent(NamedTuple):
    kind: str  # "stored" | "removed" | "cleared"
    hashes: tuple[BlockHash, ...]
    tier: str = "pool"  # where: "pool" (this cache), "host" or "disk" (engine/kv_tiers.py)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        # Unreferenced blocks, least recently freed first. Cached ones keep their hash until evicted.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: list[BlockEvent] = []
        self.stats = PrefixCacheStats()
        # told (block id, hash) just before a cached block is evicted, while its KV is intact
        # (engine/kv_tiers.py keeps a copy)
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # ---- queries (never change state) ----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def cached_prefix(self, hashes: list[BlockHash], num_tokens: int) -> list[int]:
        """Block ids holding the longest cached prefix of `hashes`.

        At least one token is always left to compute: the last prompt token's
        logits give the first output token.
        """
        if not self.enable_prefix_caching:
            return []
        usable = min(len(hashes), (num_tokens - 1) // self.block_size)
        out: list[int] = []
        for h in hashes[:usable]:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def can_allocate(self, num_tokens: int, cached: list[int]) -> bool:
        """Whether `num_tokens` fit, reusing the `cached` prefix blocks."""
        # A cached block with no references sits on the free list: taking it uses up a free slot.
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return self.blocks_needed(num_tokens) - len(cached) + revived <= len(self.free)

    # ---- commits ----

    def allocate(self, num_tokens: int, hashes: list[BlockHash]) -> tuple[list[int], int]:
        """Block table for `num_tokens` tokens, the cached prefix reused.

        Returns (block_table, number of tokens already in the cache).
        The caller has checked `can_allocate` with the same arguments.
        """
        cached = self.cached_prefix(hashes, num_tokens)
        if self.enable_prefix_caching:
            self.stats.queries += min(len(hashes), (num_tokens - 1) // self.block_size)
            self.stats.hits += len(cached)
        table: list[int] = []
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
            table.append(b)
        for _ in range(self.blocks_needed(num_tokens) - len(cached)):
            table.append(self._take_free())
        return table, len(cached) * self.block_size

    def append_slot(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` so it holds `num_tokens`; False (nothing changed) if no block is free."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            block_table.append(self._take_free())
        return True

    def share(self, block_table: list[int]) -> list[int]:
        """One more reference to each of these (held) blocks: a forked sequence's copy of them."""
        for b in block_table:
            self.ref_counts[b] += 1
        return list(block_table)

    def take(self, count: int) -> list[int]:
        """`count` free blocks (the caller checked there are as many)."""
        return [self._take_free() for _ in range(count)]

    def cache_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Register every full, computed block of a sequence in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        stored: list[BlockHash] = []
        parent = ROOT_HASH
        for i in range(num_computed // self.block_size):
            b = block_table[i]
            h = self.block_hash[b]
            if h is None:
                h = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
                if h not in self.hash_to_block:  # an equal block computed elsewhere keeps the entry
                    self.block_hash[b] = h
                    self.hash_to_block[h] = b
                    stored.append(h)
            parent = h
        if stored:
            self.events.append(BlockEvent("stored", tuple(stored)))

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop one reference to each block; the tail goes to the free list first so that
        a prefix's head, shared most widely, is evicted last."""
        for b in reversed(block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            if self.ref_counts[b] == 0:
                self.free[b] = None
        block_table.clear()

    def adopt(self, block_id: int, h: BlockHash) -> None:
        """Register a held block whose KV was loaded from a tier as the cached block `h`."""
        self.block_hash[block_id] = h
        self.hash_to_block[h] = block_id
        self.events.append(BlockEvent("stored", (h,)))

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)  # least recently freed: evict it
        h = self.block_hash[b]
        if h is not None:
            if self.on_evict is not None:
                self.on_evict(b, h)
            self.block_hash[b] = None
            del self.hash_to_block[h]
            self.events.append(BlockEvent("removed", (h,)))
        self.ref_counts[b] = 1
        return b
