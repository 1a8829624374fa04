"""One tier behind the prefix cache, as the store (engine/kv_tiers.py) walks them: a named, bounded
store of checksummed blocks. The store keeps its tiers in a list, fastest first: a block the pool
evicts goes into the first, a block tier i evicts goes on to tier i+1, and one the last evicts is
gone; a lookup takes a block from the first tier that holds it. Nothing in the serving path outside
a tier's own file names it: the stats, the metrics' labels, the block events, the worker's reported
speeds and the router's pricing carry its `name` as data (the benchmarks of the host and disk tiers
name theirs). The host (RAM) and disk tiers are engine/kv_tier_blocks.py's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from splitserve.engine.block_hash import BlockHash

# Loads of one block a tier's probe times at start (`KVTier.probe`): its first bandwidth figure.
PROBE_LOADS = 4


@dataclass
class TierStats:
    """Per tier, since start."""

    blocks: int = 0  # held now
    bytes: int = 0  # held now
    stored: int = 0  # blocks written into it
    hits: int = 0  # blocks loaded from it into the pool
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    recomputed_instead: int = 0  # hits that were recomputed because loading would be slower
    checksum_failures: int = 0  # loads refused: bad checksum, wrong hash, short or missing file
    write_failures: int = 0  # writes that failed (a full disk): the block dropped
    write_dropped: int = 0  # blocks not written because the disk writer's queue was full


@dataclass
class Held:
    data: torch.Tensor  # uint8, KVCache.export_block's layout
    crc: int  # CRC-32 of `data` when it left the pool


class Spill(NamedTuple):
    """A block a tier let go of to make room (or could not take): the next tier's to keep."""

    hash: BlockHash
    held: Held | None  # its bytes; None where not asked for (no next tier) or no longer readable


class KVTier(ABC):
    """A bounded LRU store of blocks. Called on the engine thread only; a tier that works on a thread
    of its own (the disk's writer) reports what it lost there through `lost`."""

    name: str  # as stats, block events, metrics and the router know it
    capacity: int  # bytes
    stats: TierStats

    @abstractmethod
    def __contains__(self, h: BlockHash) -> bool: ...

    @abstractmethod
    def refresh(self, h: BlockHash) -> bool:
        """Whether the tier holds `h`; if it does, `h` becomes its most recently used block."""

    @abstractmethod
    def put(self, h: BlockHash, held: Held, pass_on: bool) -> tuple[bool, list[Spill]]:
        """Keep a block: (whether it holds `h` now, the blocks it let go of, oldest first). `h` itself is
        among them when it is too large for the tier. `pass_on`: a next tier takes them, so their bytes
        are wanted (else their `held` may be None)."""

    @abstractmethod
    def get(self, h: BlockHash) -> Held | None:
        """The block's bytes and stored checksum, checked by the store; None (dropped, counted by the
        tier) when the tier can no longer read them."""

    @abstractmethod
    def drop(self, h: BlockHash) -> None:
        """Forget a block (its bytes failed the store's check)."""

    @abstractmethod
    def hashes(self) -> tuple[BlockHash, ...]:
        """Every block held now (a snapshot for a new block-event subscriber)."""

    @abstractmethod
    def probe(self, data: torch.Tensor, load: Callable[[torch.Tensor], None]) -> float | None:
        """Seconds of `PROBE_LOADS` loads of `data` (one block) from this tier through `load` (into the
        pool), checksums included: the seed of the tier's measured bandwidth. None: not measurable."""

    def prefetch(self, hashes: Iterable[BlockHash]) -> None:
        """Start reading these blocks, which a load will soon ask for (a tier that reads slowly)."""
        return None  # by default: nothing to do

    def lost(self) -> list[BlockHash]:
        """Blocks dropped since last asked outside a `put` or a `get` (a write that failed later)."""
        return []

    def flush(self) -> None:
        """Wait until the tier's writes in flight are done (tests; the engine never waits)."""
        return None  # by default: nothing to do

    def close(self) -> None:
        """Finish the writes in flight and stop the tier's threads, if any."""
        return None  # by default: nothing to do
