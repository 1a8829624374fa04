"""A cache of pages for models of windowed and global layers (engine/kv_groups.py): where each
layer lives, windowed pages given back once every holder has passed them, prefix hits only where
the next token's window is whole, nothing leaked after any mix of requests, and the tokens the
same as a cache of one row per layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_groups import OWN_PAGE, CacheGroups
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from tests.family_helpers.logits import chunked_logits
from tests.test_block_manager import run_aborting

pytestmark = pytest.mark.timeout(300)


def test_layers_are_placed_by_kind():
    g = CacheGroups.of((4, 4, 0, 4, 4, 0, 4))  # Gemma 3's pattern, shorter: 2 global, 5 windowed
    assert g is not None and (g.rows, g.window, g.window_pages, g.pages_per_block) == (2, 4, 3, 4)
    assert g.layer_rows == ((0, 0), (1, 0), (0, OWN_PAGE), (0, 1), (1, 1), (1, OWN_PAGE), (0, 2))
    assert CacheGroups.of((0, 0)) is None  # every layer global: one row per layer
    assert CacheGroups.of((4, 4)) is None  # every layer windowed alike
    assert CacheGroups.of((4, 8, 0)) is None  # two window sizes: not grouped


def manager(pages: int = 40, window: int = 8) -> BlockManager:
    groups = CacheGroups.of((window, 0, window))  # one global layer: a page per layer kind
    assert groups is not None and groups.window_pages == 2
    return BlockManager(pages, 4, groups=groups, window_pages=[None] * pages)


def test_window_pages_go_back_once_the_context_passes_them():
    bm = manager()
    table, _ = bm.allocate(16, [])  # 4 blocks, each with 2 window pages
    assert bm.num_free_blocks == (40 - 12) // 3 and all(bm.window_pages[b] for b in table)
    held = bm.release_behind(table, 0, 16)  # the next token (position 16) sees 9..16: blocks 2, 3
    assert held == 2 and [bm.window_pages[b] is None for b in table] == [True, True, False, False]
    assert len(bm.free) == 40 - 4 - 4  # the first two blocks' four window pages are free again
    bm.free_blocks(table, held)
    assert bm.num_free_blocks == 40 // 3 and all(r == 0 for r in bm.ref_counts)


def test_a_forked_block_keeps_its_window_until_every_holder_passes_it():
    bm = manager()
    parent, _ = bm.allocate(8, [])
    child = bm.share(parent, 0)
    assert bm.release_behind(parent, 0, 16) == 2
    assert all(bm.window_pages[b] for b in parent)  # the child still reads them
    assert bm.release_behind(child, 0, 16) == 2
    assert not any(bm.window_pages[b] for b in parent)
    bm.free_blocks(parent, 2)
    bm.free_blocks(child, 2)
    assert bm.num_free_blocks == 40 // 3


def test_a_prefix_hit_needs_the_window_of_its_next_token():
    bm = manager(window=4)
    prompt = list(range(17))
    hashes = block_hashes(prompt, 4)
    table, _ = bm.allocate(17, hashes)
    bm.cache_full_blocks(table, prompt, 17)
    assert len(bm.cached_prefix(hashes, 17)) == 4  # whole: every block still has its window pages
    held = bm.release_behind(table, 0, 17)  # position 17 sees 14..17: blocks 3, 4
    assert held == 3
    # a hit of 4 blocks continues at position 16, whose window (13..16) reads block 3: still there
    assert len(bm.cached_prefix(hashes, 17)) == 4
    bm.release_behind(table, held, 21)  # now block 3's window pages are gone too
    # 4 blocks: block 3 lacks them; 3 blocks: position 12 sees 9..12, blocks 2 and 3; 2 blocks:
    # position 8 sees 5..8, blocks 1 and 2, both gone; 1 block: position 4 sees 1..4, block 0, gone
    assert bm.cached_prefix(hashes, 17) == []
    bm.free_blocks(table, 4)


def test_cached_blocks_keep_their_window_pages_and_evicting_frees_them():
    bm = manager(pages=12)  # four blocks' worth
    prompt = list(range(8))
    table, _ = bm.allocate(8, block_hashes(prompt, 4))
    bm.cache_full_blocks(table, prompt, 8)
    bm.free_blocks(table, 0)
    assert bm.parked == 4 and bm.num_free_blocks == 4  # cached, whole, and all of it evictable
    other, _ = bm.allocate(16, [])  # the whole pool: the cached blocks are evicted
    assert bm.parked == 0 and len(other) == 4 and bm.num_free_blocks == 0
    bm.free_blocks(other, 0)
    assert bm.num_free_blocks == 4


def test_a_prompt_takes_its_window_pages_as_its_prefill_reaches_them():
    bm = manager()
    table, _ = bm.allocate(32, [], window_blocks=2)  # 8 blocks, the first chunk's 2 with windows
    assert [bm.window_pages[b] is not None for b in table] == [True] * 2 + [False] * 6
    assert len(bm.free) == 40 - 8 - 4
    assert bm.hold_windows(table, 2, 5) and [bm.window_pages[b] is not None for b in table].count(True) == 5
    small = manager(pages=14)
    other, _ = small.allocate(32, [], window_blocks=2)  # 12 of its 14 pages
    assert not small.hold_windows(other, 2, 4)  # 4 more pages: nothing changes
    assert [small.window_pages[b] is not None for b in other].count(True) == 2 and len(small.free) == 2
    held = bm.release_behind(table, 0, 20)  # position 20 sees 13..20: blocks 3 on
    assert held == 3
    bm.free_blocks(table, held, 5)
    assert bm.num_free_blocks == 40 // 3 and all(r == 0 for r in bm.window_refs)


# ---- the engine: the same tokens as a cache of one row per layer, and nothing leaked ----

HYBRID = tiny_model_config(
    num_layers=3,
    vocab_size=64,
    sliding_window=6,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
)
WEIGHTS = random_weights(HYBRID, seed=3)


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return out


def test_paged_cache_tokens_equal_the_one_row_per_layer_cache():
    """Greedy tokens through the engine's cache of pages, prompts and outputs well past the window,
    equal the argmax of the model's own forward over a cache of one row per layer."""
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    for n in (5, 23, 40):
        prompt = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine = Engine(HYBRID, WEIGHTS, cfg)
        assert engine.kv_cache.groups is not None and engine.kv_cache.tensor.shape[0] == 1
        tokens = greedy(engine, [prompt], 24)["r0"]
        logits = chunked_logits(engine.model, prompt + tokens[:-1], n, chunk=16, block_size=4)
        assert logits[n - 1 :].argmax(-1).tolist() == tokens, f"prompt of {n}"
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_long_prompts_in_a_tight_pool_finish_without_preemption():
    """Two long prompts, chunked, in a pool that holds their blocks but not both prefills' window
    pages at their most: admission counts a prefill's pages at their most, so neither is preempted."""
    # 36 pages: a prompt of 10 blocks takes 14 at admission and 20 at its prefill's most, so the
    # second fits beside the first's admission (14 + 20) but not beside its prefill (20 + 20)
    cfg = EngineConfig(num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine = Engine(HYBRID, WEIGHTS, cfg)
    assert engine.blocks.num_pages == 36
    prompts = [torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in (1, 2)]
    out = greedy(engine, prompts, 8)
    assert sorted(out) == ["r0", "r1"] and engine.scheduler.num_preemptions == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(0, 3),  # which shared prefix (0 = none)
    st.integers(1, 16),  # max_tokens
    st.integers(0, 8),  # abort after this many steps (8 = never)
    st.integers(1, 2),  # n
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=8), st.integers(0, 2**16))
def test_every_page_comes_back_after_any_mix(reqs, seed):
    cfg = EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    engine = Engine(HYBRID, WEIGHTS, cfg)
    start = engine.blocks.num_free_blocks
    g = torch.Generator().manual_seed(seed)
    prefixes = {k: torch.randint(0, 64, (12,), generator=g).tolist() for k in (1, 2, 3)}
    aborts: dict[str, int] = {}
    for i, (n, prefix, max_tokens, abort_at, samples) in enumerate(reqs):
        prompt = (prefixes.get(prefix, []) + torch.randint(0, 64, (n,), generator=g).tolist())[:40]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, n=samples)
        engine.add_request(f"r{i}", prompt, params)
        if abort_at < 8:
            aborts[f"r{i}"] = abort_at
    run_aborting(engine, aborts, 2000)
    bm = engine.blocks
    assert bm.num_free_blocks == start and all(rc == 0 for rc in bm.ref_counts)
    assert all(r == 0 for r in bm.window_refs)
    attached = sum(len(p or ()) for p in bm.window_pages)
    assert len(bm.free) + attached == bm.num_pages and bm.parked == attached
