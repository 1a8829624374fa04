"""Which decode worker holds which prefix: a pure data structure fed by the
workers' block events (stored, removed, cleared).

A block hash is chained (engine/block_hash.py), so it names a whole prefix.
`overlap` walks a prompt's hashes in order and stops, for each worker, at its
first miss: a worker that evicted block i cannot reuse block i+1 either.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

WorkerId = Hashable


class PrefixIndex:
    def __init__(self) -> None:
        self._workers_by_hash: dict[bytes, set[WorkerId]] = {}
        self._hashes_by_worker: dict[WorkerId, set[bytes]] = {}

    def stored(self, worker: WorkerId, hashes: Iterable[bytes]) -> None:
        mine = self._hashes_by_worker.setdefault(worker, set())
        for h in hashes:
            if h not in mine:
                mine.add(h)
                self._workers_by_hash.setdefault(h, set()).add(worker)

    def removed(self, worker: WorkerId, hashes: Iterable[bytes]) -> None:
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

    def num_blocks(self, worker: WorkerId) -> int:
        return len(self._hashes_by_worker.get(worker, ()))

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._workers_by_hash)
