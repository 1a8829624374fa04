"""The prefix index: fed by stored/removed/cleared events, asked for leading overlap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.block_hash import block_hashes
from splitserve.router.prefix_index import PrefixIndex

BS = 4
SYSTEM = list(range(100, 116))  # 4 blocks


def test_empty_index_overlaps_nothing() -> None:
    assert PrefixIndex().overlap(block_hashes(SYSTEM, BS)) == {}
    assert PrefixIndex().overlap([]) == {}


def test_overlap_counts_leading_blocks_per_worker() -> None:
    idx = PrefixIndex()
    full = block_hashes(SYSTEM + [1, 2, 3, 4], BS)  # 5 blocks
    idx.stored("a", full)
    idx.stored("b", full[:2])
    assert idx.overlap(full) == {"a": 5, "b": 2}
    other = block_hashes(SYSTEM + [9, 9, 9, 9], BS)
    assert idx.overlap(other) == {"a": 4, "b": 2}


def test_walk_stops_at_first_miss_even_if_later_blocks_are_held() -> None:
    idx = PrefixIndex()
    h = block_hashes(SYSTEM, BS)
    idx.stored("a", h)
    idx.removed("a", [h[1]])
    assert idx.overlap(h) == {"a": 1}


def test_removed_and_cleared() -> None:
    idx = PrefixIndex()
    h = block_hashes(SYSTEM, BS)
    idx.stored("a", h)
    idx.stored("b", h)
    idx.removed("a", h[2:])
    assert idx.overlap(h) == {"a": 2, "b": 4}
    idx.cleared("b")
    assert idx.overlap(h) == {"a": 2}
    assert idx.num_blocks("b") == 0
    idx.cleared("a")
    assert len(idx) == 0  # no hash is kept for nobody


def test_events_for_unknown_workers_and_hashes_are_harmless() -> None:
    idx = PrefixIndex()
    idx.removed("ghost", [b"x" * 16])
    idx.cleared("ghost")
    idx.stored("a", [b"y" * 16])
    idx.removed("a", [b"x" * 16])
    assert idx.overlap([b"y" * 16]) == {"a": 1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 7), st.booleans()), max_size=40))
def test_matches_a_naive_model(ops: list[tuple[str, int, bool]]) -> None:
    """Random stored/removed sequences agree with counting leading held blocks by brute force."""
    chain = block_hashes(list(range(32)), BS)  # 8 blocks
    idx = PrefixIndex()
    held: dict[str, set[bytes]] = {w: set() for w in "abc"}
    for worker, i, store in ops:
        if store:
            idx.stored(worker, [chain[i]])
            held[worker].add(chain[i])
        else:
            idx.removed(worker, [chain[i]])
            held[worker].discard(chain[i])
    expected = {}
    for w, hs in held.items():
        n = 0
        while n < len(chain) and chain[n] in hs:
            n += 1
        if n:
            expected[w] = n
    assert idx.overlap(chain) == expected
