"""Which decode worker holds which prefix: a pure data structure fed by the
workers' block events (stored, removed, cleared).

A block hash is chained (engine/block_hash.py), so it names a whole prefix.
`overlap` walks a prompt's hashes in order and stops, for each worker, at its
first miss: a worker that evicted block i cannot reuse block i+1 either.

A block a worker evicted from its pool into a tier behind it (engine/kv_tiers.py:
host RAM, disk, ...) comes as an event with that tier's name; `overlap` counts
pooled blocks only, `overlap_tiers` says where each leading block is on each
worker: in the first of its tiers, in the order it looks in them, that holds it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

WorkerId = Hashable


class PrefixIndex:
    def __init__(self) -> None:
        self._workers_by_hash: dict[bytes, set[WorkerId]] = {}
        self._hashes_by_worker: dict[WorkerId, set[bytes]] = {}
        # blocks behind the pools: worker -> hash -> the tiers holding it; hash -> the workers
        self._tiers_by_worker: dict[WorkerId, dict[bytes, set[str]]] = {}
        self._tier_workers_by_hash: dict[bytes, set[WorkerId]] = {}

    def stored(self, worker: WorkerId, hashes: Iterable[bytes], tier: str = "pool") -> None:
        if tier != "pool":
            held = self._tiers_by_worker.setdefault(worker, {})
            for h in hashes:
                held.setdefault(h, set()).add(tier)
                self._tier_workers_by_hash.setdefault(h, set()).add(worker)
            return
        mine = self._hashes_by_worker.setdefault(worker, set())
        for h in hashes:
            if h not in mine:
                mine.add(h)
                self._workers_by_hash.setdefault(h, set()).add(worker)

    def removed(self, worker: WorkerId, hashes: Iterable[bytes], tier: str = "pool") -> None:
        if tier != "pool":
            held = self._tiers_by_worker.get(worker, {})
            for h in hashes:
                where = held.get(h)
                if where is not None:
                    where.discard(tier)
                    if not where:
                        del held[h]
                        self._drop_tiered(h, worker)
            return
        mine = self._hashes_by_worker.get(worker)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._drop(h, worker)

    def cleared(self, worker: WorkerId) -> None:
        """The worker dropped its whole cache (or left, or its event stream broke)."""
        for h in self._hashes_by_worker.pop(worker, ()):
            self._drop(h, worker)
        for h in self._tiers_by_worker.pop(worker, {}):
            self._drop_tiered(h, worker)

    def _drop_tiered(self, h: bytes, worker: WorkerId) -> None:
        holders = self._tier_workers_by_hash[h]
        holders.discard(worker)
        if not holders:
            del self._tier_workers_by_hash[h]

    def _drop(self, h: bytes, worker: WorkerId) -> None:
        holders = self._workers_by_hash[h]
        holders.discard(worker)
        if not holders:
            del self._workers_by_hash[h]

    def overlap(self, hashes: Sequence[bytes]) -> dict[WorkerId, int]:
        """Worker -> number of leading blocks of `hashes` it holds (workers with none are absent)."""
        if not hashes:
            return {}
        first = self._workers_by_hash.get(hashes[0])
        if not first:
            return {}
        active = set(first)
        result: dict[WorkerId, int] = {}
        depth = 1  # blocks every worker in `active` holds so far
        for h in hashes[1:]:
            holders = self._workers_by_hash.get(h)
            if holders is None:
                break
            if not active <= holders:
                for w in active - holders:
                    result[w] = depth
                active &= holders
                if not active:
                    return result
            depth += 1
        for w in active:
            result[w] = depth
        return result

    def overlap_tiers(
        self, hashes: Sequence[bytes], order: Mapping[WorkerId, Sequence[str]] | None = None
    ) -> dict[WorkerId, list[str]]:
        """Worker -> where each leading block of `hashes` is on it, up to its first block held nowhere
        (workers holding none are absent): "pool", else the first tier in `order[worker]` (the order
        the worker looks in, fastest first) that holds it; tiers the order does not name come after,
        by name."""
        if not hashes:
            return {}
        order = order or {}
        workers = self._workers_by_hash.get(hashes[0], set()) | self._tier_workers_by_hash.get(hashes[0], set())
        result: dict[WorkerId, list[str]] = {}
        for w in workers:
            pooled = self._hashes_by_worker.get(w, set())
            tiered = self._tiers_by_worker.get(w, {})
            where: list[str] = []
            for h in hashes:
                if h in pooled:
                    where.append("pool")
                elif h in tiered:
                    where.append(_first(tiered[h], order.get(w, ())))
                else:
                    break
            result[w] = where
        return result

    def num_blocks(self, worker: WorkerId) -> int:
        return len(self._hashes_by_worker.get(worker, ()))

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._workers_by_hash)


def _first(tiers: set[str], order: Sequence[str]) -> str:
    """The tier of `tiers` that a worker looking in `order` finds a block in first."""
    return min(tiers, key=lambda t: (order.index(t) if t in order else len(order), t))
