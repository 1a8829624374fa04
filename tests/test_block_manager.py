"""Block accounting: reference counts, prefix reuse, LRU eviction, and no leaks
after any mix of finished, aborted and preempted requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_prefix_blocks_are_shared_and_survive_free_until_evicted():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    hashes = block_hashes(prompt, 4)
    table, cached = bm.allocate(len(prompt), hashes)
    assert cached == 0 and len(table) == 3 and bm.num_free_blocks == 5
    bm.cache_full_blocks(table, prompt, len(prompt))
    assert [e.kind for e in bm.drain_events()] == ["stored"]

    table2, cached2 = bm.allocate(len(prompt), hashes)
    assert cached2 == 8 and table2[:2] == table[:2] and table2[2] != table[2]
    assert bm.ref_counts[table[0]] == 2

    shared = table2[:2]
    bm.free_blocks(table)  # free_blocks empties the table it is given
    bm.free_blocks(table2)
    assert bm.num_free_blocks == 8 and table == table2 == []
    # freed but still cached: a third request gets the same blocks back
    table3, cached3 = bm.allocate(len(prompt), hashes)
    assert cached3 == 8 and table3[:2] == shared
    bm.free_blocks(table3)


def test_lru_eviction_reports_removed_hashes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5]
    ta, _ = bm.allocate(len(a), block_hashes(a, 2))
    bm.cache_full_blocks(ta, a, len(a))
    bm.free_blocks(ta)
    bm.drain_events()
    b = [9, 9, 9, 9, 9, 9, 9]  # needs all four blocks: evicts both cached ones
    tb, cached = bm.allocate(len(b), block_hashes(b, 2))
    assert cached == 0
    removed = [h for e in bm.drain_events() if e.kind == "removed" for h in e.hashes]
    assert sorted(removed) == sorted(block_hashes(a, 2))
    assert bm.cached_prefix(block_hashes(a, 2), len(a)) == []
    bm.free_blocks(tb)


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    t, _ = bm.allocate(8, block_hashes(prompt, 4))
    bm.cache_full_blocks(t, prompt, 8)
    assert len(bm.cached_prefix(block_hashes(prompt, 4), 8)) == 1


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    p = [1, 2, 3, 4, 5]
    t, _ = bm.allocate(5, block_hashes(p, 2))
    bm.cache_full_blocks(t, p, 5)
    bm.free_blocks(t)
    cached = bm.cached_prefix(block_hashes(p, 2), 5)
    assert len(cached) == 2
    assert bm.can_allocate(5, cached)
    assert not bm.can_allocate(7, cached)


# ---- property: any mix of finishes, aborts and preemptions frees every block ----


def run_aborting(engine: Engine, aborts: dict[str, int], max_steps: int) -> None:
    """Step `engine` until it is idle, aborting each request of `aborts` at its step."""
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        for rid, at in list(aborts.items()):
            if steps >= at:
                engine.abort(rid)
                del aborts[rid]
        assert steps < max_steps


CFG = tiny_model_config(num_layers=1, vocab_size=64)
WEIGHTS = random_weights(CFG, seed=1)

request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(0, 3),  # which shared prefix (0 = none)
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # abort after this many steps (6 = never)
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=10), st.integers(0, 2**16))
def test_free_blocks_return_to_start_after_any_mix(reqs, seed):
    # few blocks, so that preemption and eviction both happen
    engine = Engine(CFG, WEIGHTS, EngineConfig(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=4))
    start = engine.blocks.num_free_blocks
    g = torch.Generator().manual_seed(seed)
    prefixes = {k: torch.randint(0, 64, (12,), generator=g).tolist() for k in (1, 2, 3)}
    aborts: dict[str, int] = {}
    for i, (n, prefix, max_tokens, abort_at) in enumerate(reqs):
        prompt = (prefixes.get(prefix, []) + torch.randint(0, 64, (n,), generator=g).tolist())[:40]
        rid = f"r{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i))
        if abort_at < 6:
            aborts[rid] = abort_at
    run_aborting(engine, aborts, 1000)
    assert engine.blocks.num_free_blocks == start
    assert all(rc == 0 for rc in engine.blocks.ref_counts)
