"""The KV block allocator: free list, reference counts, and the prefix cache.

A full block is cached under the chained hash of its tokens (engine/block_hash).
When its last reference goes, it joins the free list but keeps its hash, so a
later request with the same prefix can take it back; the free list is ordered
least recently freed first, and allocation evicts from that end (LRU).

Allocation is a check and then a commit: `can_allocate` never changes state,
`allocate` assumes the check passed. Every change to the set of cached hashes
is recorded as a `BlockEvent` for the router's prefix index.

A grouped cache (engine/kv_groups.py: a model of windowed and global layers) counts pages: a
block is a page, and while a sequence's window still covers it, it also holds `window_pages`
more pages (written to the cache's `window_pages` map) for its windowed layers. A sequence holds
the window of its blocks from `held_from` on (`window_start` of its context); `release_behind`
moves that on as the context grows, and a block whose every holder has moved past it gives its
window pages back to the pool. A cached block keeps them while it is whole; a prefix hit must
find them on the blocks its next token's window reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.engine.block_hash import ROOT_HASH, BlockHash, hash_block
from splitserve.engine.blocks import cdiv, window_start
from splitserve.engine.kv_groups import CacheGroups


class BlockEvent(NamedTuple):
    kind: str  # "stored" | "removed" | "cleared"
    hashes: tuple[BlockHash, ...]
    tier: str = "pool"  # where: "pool" (this cache) or the name of a tier behind it (engine/kv_tiers.py)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: CacheGroups | None = None,
        window_pages: list[tuple[int, ...] | None] | None = None,
    ) -> None:
        """`num_blocks`: of a grouped cache (`groups`), its pages; `window_pages`: its map of each
        block's windowed pages (KVCache.window_pages), which this manager writes."""
        self.groups = groups
        self.pages_per_block = groups.pages_per_block if groups is not None else 1
        own: list[tuple[int, ...] | None] = [None] * num_blocks
        self.window_pages = window_pages if groups is not None and window_pages is not None else own
        self.window_refs = [0] * num_blocks  # holders of a block whose window still covers it
        self.parked = 0  # window pages of cached blocks nobody holds: free, as their block is
        self.num_pages = num_blocks
        # the most blocks a prompt can take at once (each with its window pages)
        self.num_blocks = num_blocks // self.pages_per_block
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
        """Blocks (with their window pages) the free pages make."""
        return self._available() // self.pages_per_block

    def _available(self) -> int:
        """Pages free now or on eviction: the free list's, and the window pages its cached blocks keep."""
        return len(self.free) + self.parked

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def fits_alone(self, prompt_tokens: int, total_tokens: int) -> bool:
        """Whether one request could run in the whole pool: its prompt's blocks with their window
        pages at admission, then its whole context with the windowed pages of a window's worth."""
        if self.groups is None:
            return self.blocks_needed(total_tokens) <= self.num_pages
        window_blocks = cdiv(self.groups.window, self.block_size) + 1
        longest = self.blocks_needed(total_tokens) + window_blocks * self.groups.window_pages
        return self.blocks_needed(prompt_tokens) * self.pages_per_block <= self.num_pages and longest <= self.num_pages

    def held_from(self, num_tokens: int) -> int:
        """The first block whose window a sequence with `num_tokens` in the cache still holds (0
        without windowed pages)."""
        return window_start(num_tokens, self.groups.window, self.block_size) if self.groups is not None else 0

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
        # the windowed layers' KV must be there for the blocks the next token's window reads
        while self.groups is not None and out:
            if all(self.window_pages[b] is not None for b in out[self.held_from(len(out) * self.block_size) :]):
                break
            out.pop()
        return out

    def can_allocate(
        self, num_tokens: int, cached: list[int], window_blocks: int | None = None, spare: int = 0
    ) -> bool:
        """Whether `num_tokens` fit, reusing the `cached` prefix blocks (and giving the first
        `window_blocks` their window pages; None: all), with `spare` pages left over."""
        # A cached block with no references sits on the free list: taking it uses up a free slot.
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        need = self._pages_for(len(cached), self.blocks_needed(num_tokens), window_blocks) + revived
        return need + spare <= self._available()

    def window_span(self, chunk_tokens: int) -> int:
        """The most blocks whose window pages a prefill in chunks of `chunk_tokens` holds at once:
        the window behind a chunk, and the chunk (0 without windowed pages)."""
        return cdiv(self.groups.window + chunk_tokens, self.block_size) + 1 if self.groups is not None else 0

    def _pages_for(self, first: int, end: int, window_blocks: int | None) -> int:
        """Pages for new blocks `first .. end - 1`, those before `window_blocks` with their window pages."""
        if self.groups is None:
            return end - first
        windowed = max(0, min(end, end if window_blocks is None else window_blocks) - first)
        return end - first + windowed * self.groups.window_pages

    # ---- commits ----

    def allocate(
        self, num_tokens: int, hashes: list[BlockHash], window_blocks: int | None = None
    ) -> tuple[list[int], int]:
        """Block table for `num_tokens` tokens, the cached prefix reused; of a grouped cache, the
        new blocks before `window_blocks` (None: all) with their window pages (`hold_windows` gives
        the others theirs as the prefill reaches them).

        Returns (block_table, number of tokens already in the cache).
        The caller has checked `can_allocate` with the same arguments.
        """
        cached = self.cached_prefix(hashes, num_tokens)
        if self.enable_prefix_caching:
            self.stats.queries += min(len(hashes), (num_tokens - 1) // self.block_size)
            self.stats.hits += len(cached)
        table: list[int] = []
        held = self.held_from(len(cached) * self.block_size)
        for i, b in enumerate(cached):
            if self.ref_counts[b] == 0:
                del self.free[b]
                self.parked -= len(self.window_pages[b] or ())
            self.ref_counts[b] += 1
            if self.groups is not None and i >= held:
                self.window_refs[b] += 1
            elif self.groups is not None and self.window_refs[b] == 0:
                self._release_window(b)  # a cached block whose window nobody reads any more
            table.append(b)
        for i in range(len(cached), self.blocks_needed(num_tokens)):
            table.append(self._take_free(window=window_blocks is None or i < window_blocks))
        return table, len(cached) * self.block_size

    def hold_windows(self, block_table: list[int], held_to: int, upto: int) -> bool:
        """Give a sequence's blocks `held_to .. upto - 1` that have none their window pages (a
        prompt's, as its prefill reaches them); False (nothing changed) if the pages do not suffice."""
        if self.groups is None:
            return True
        bare = [b for b in block_table[held_to:upto] if self.window_pages[b] is None]
        if len(bare) * self.groups.window_pages > self._available():
            return False
        for b in bare:
            self._attach_window(b)
        return True

    def append_slot(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` so it holds `num_tokens`; False (nothing changed) if no block is free."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need * self.pages_per_block > self._available():
            return False
        for _ in range(need):
            block_table.append(self._take_free())
        return True

    def share(self, block_table: list[int], held_from: int = 0) -> list[int]:
        """One more reference to each of these (held) blocks: a forked sequence's copy of them,
        holding their windows from `held_from` on, as its parent does."""
        for i, b in enumerate(block_table):
            self.ref_counts[b] += 1
            if self.groups is not None and i >= held_from:
                self.window_refs[b] += 1
        return list(block_table)

    def take(self, count: int) -> list[int]:
        """`count` free blocks (the caller checked there are as many)."""
        return [self._take_free() for _ in range(count)]

    def release_behind(self, block_table: list[int], held_from: int, num_tokens: int) -> int:
        """A sequence with `num_tokens` in the cache no longer needs the windows of its blocks before
        `held_from(num_tokens)`: let go of those it held from `held_from` on; the new `held_from`."""
        upto = min(self.held_from(num_tokens), len(block_table))
        for b in block_table[held_from:upto]:
            self._drop_window(b)
        return max(held_from, upto)

    def cache_full_blocks(
        self, block_table: list[int], token_ids: list[int], num_computed: int, root: BlockHash = ROOT_HASH
    ) -> None:
        """Register every full, computed block of a sequence in the prefix cache (`root`: its first
        block's parent, an adapter's own: engine/lora/rows.py)."""
        if not self.enable_prefix_caching:
            return
        stored: list[BlockHash] = []
        parent = root
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

    def free_blocks(self, block_table: list[int], held_from: int = 0, held_to: int | None = None) -> None:
        """Drop one reference to each block (and its window hold, from `held_from` to `held_to`);
        the tail goes to the free list first so that a prefix's head, shared most widely, is
        evicted last. A freed block keeps its window pages while it is cached and whole."""
        held_to = len(block_table) if held_to is None else held_to
        for i in range(len(block_table) - 1, -1, -1):
            b = block_table[i]
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            if self.groups is not None and held_from <= i < held_to:
                self.window_refs[b] -= 1
                if self.window_refs[b] == 0 and (self.ref_counts[b] > 0 or self.block_hash[b] is None):
                    self._release_window(b)
            if self.ref_counts[b] == 0:
                self.free[b] = None
                self.parked += len(self.window_pages[b] or ())
        block_table.clear()

    def adopt(self, block_id: int, h: BlockHash) -> None:
        """Register a held block whose KV was loaded from a tier as the cached block `h`."""
        self.block_hash[block_id] = h
        self.hash_to_block[h] = block_id
        self.events.append(BlockEvent("stored", (h,)))

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def _take_free(self, window: bool = True) -> int:
        """A block for a sequence: one reference, and (`window`) its window pages, which it holds."""
        b = self._take_page()
        self.ref_counts[b] = 1
        if self.groups is not None and window:
            self._attach_window(b)
        return b

    def _attach_window(self, b: int) -> None:
        assert self.groups is not None
        self.window_pages[b] = tuple(self._take_page() for _ in range(self.groups.window_pages))
        self.window_refs[b] = 1

    def _take_page(self) -> int:
        b, _ = self.free.popitem(last=False)  # least recently freed: evict it
        h = self.block_hash[b]
        if h is not None:
            if self.on_evict is not None:
                self.on_evict(b, h)
            self.block_hash[b] = None
            del self.hash_to_block[h]
            self.events.append(BlockEvent("removed", (h,)))
        if self.groups is not None:  # an evicted cached block's window pages, if it kept them
            self.parked -= len(self.window_pages[b] or ())
            self._release_window(b)
        return b

    def _drop_window(self, b: int) -> None:
        self.window_refs[b] -= 1
        if self.window_refs[b] == 0:
            self._release_window(b)

    def _release_window(self, b: int) -> None:
        """`b`'s window pages back to the pool, first in line: they hold nothing anyone can find."""
        pages, self.window_pages[b] = self.window_pages[b], None
        if pages and self.ref_counts[b] == 0 and b in self.free:
            self.parked -= len(pages)
        for p in pages or ():
            self.free[p] = None
            self.free.move_to_end(p, last=False)
