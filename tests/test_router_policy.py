"""Routing terms, each on its own, with exact numbers (the RNG is seeded and passed in)."""

from __future__ import annotations

import logging
import random

import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.router.config import RouterConfig
from splitserve.router.policy import (
    DecodeCandidate,
    WorkerLoad,
    choose_decode_worker,
    choose_prefill_mode,
    choose_prefill_worker,
    decode_cost,
    load_score,
    overlap_score,
    route,
)
from splitserve.router.prefix_index import PrefixIndex

IDLE = WorkerLoad(queued_tokens=0, running_tokens=0, free_blocks=100, total_blocks=100)


def cfg(**kw: object) -> RouterConfig:
    return RouterConfig(**kw)  # type: ignore[arg-type]


# ---- overlap_score


def test_overlap_score_is_the_cached_fraction() -> None:
    assert overlap_score(3, 4) == 0.75
    assert overlap_score(0, 4) == 0.0
    assert overlap_score(4, 4) == 1.0


def test_overlap_score_of_a_prompt_without_full_blocks_is_zero() -> None:
    assert overlap_score(0, 0) == 0.0


# ---- load_score


def test_load_score_counts_queued_and_running_tokens_over_the_scale() -> None:
    c = cfg(load_token_scale=1000.0, block_load_weight=0.0)
    assert load_score(WorkerLoad(300, 200, 100, 100), c) == 0.5


def test_load_score_counts_the_used_block_fraction() -> None:
    c = cfg(token_load_weight=0.0, block_load_weight=2.0)
    assert load_score(WorkerLoad(0, 0, 25, 100), c) == 1.5


def test_load_score_of_a_worker_without_blocks_is_full() -> None:
    assert load_score(WorkerLoad(0, 0, 0, 0), cfg(token_load_weight=0.0)) == 1.0


# ---- decode_cost


def test_decode_cost_weighs_load_against_overlap() -> None:
    assert decode_cost(overlap=0.5, load=0.25, cfg=cfg(overlap_weight=2.0, load_weight=4.0)) == 0.0
    assert decode_cost(overlap=1.0, load=0.0, cfg=cfg()) == -1.0


# ---- choose_decode_worker


def test_the_worker_with_the_prefix_wins_at_equal_load() -> None:
    cands = [DecodeCandidate("a", 0, IDLE), DecodeCandidate("b", 3, IDLE)]
    assert choose_decode_worker(cands, 4, cfg(), random.Random(0)).worker == "b"


def test_load_beats_a_small_overlap() -> None:
    busy = WorkerLoad(16384, 0, 0, 100)  # load 1 + 1 = 2
    cands = [DecodeCandidate("a", 1, busy), DecodeCandidate("b", 0, IDLE)]
    choice = choose_decode_worker(cands, 4, cfg(), random.Random(0))
    assert choice.worker == "b" and choice.cost == 0.0


def test_ties_are_broken_by_the_rng_exactly() -> None:
    cands = [DecodeCandidate(w, 0, IDLE) for w in "abcd"]
    picks = [choose_decode_worker(cands, 4, cfg(), random.Random(seed)).worker for seed in range(6)]
    expected = ["abcd"[random.Random(seed).randrange(4)] for seed in range(6)]
    assert picks == expected
    assert len(set(picks)) > 1


def test_softmax_temperature_samples_by_exp_of_minus_cost() -> None:
    cands = [DecodeCandidate("a", 4, IDLE), DecodeCandidate("b", 0, IDLE)]  # costs -1 and 0
    c = cfg(temperature=1.0)
    rng = random.Random(7)
    picks = [choose_decode_worker(cands, 4, c, rng).worker for _ in range(2000)]
    share_a = picks.count("a") / len(picks)
    # p(a) = e / (e + 1) = 0.731
    assert abs(share_a - 0.731) < 0.03
    # and exactly reproducible
    rng2 = random.Random(7)
    assert picks == [choose_decode_worker(cands, 4, c, rng2).worker for _ in range(2000)]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_decode_worker([], 4, cfg(), random.Random(0))


def test_the_decision_logs_its_formula_with_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="splitserve.router.policy")
    choose_decode_worker([DecodeCandidate("w1", 2, WorkerLoad(100, 0, 50, 100))], 4, cfg(), random.Random(0))
    text = caplog.text
    assert "decode w1: cost = 1*load(1*100/16384 + 1*(1 - 50/100) = 0.5061) - 1*overlap(2/4 = 0.5000) = 0.0061" in text


# ---- choose_prefill_mode


def test_short_uncached_suffix_prefills_locally() -> None:
    c = cfg(local_prefill_max_tokens=256)
    assert choose_prefill_mode(256, 0, False, c) == "local"
    assert choose_prefill_mode(257, 0, False, c) == "remote"


def test_backed_up_prefill_pool_with_an_idle_decode_worker_prefills_locally() -> None:
    c = cfg(local_prefill_max_tokens=0, prefill_backlog_tokens=1000)
    assert choose_prefill_mode(5000, 1000, True, c) == "local"
    assert choose_prefill_mode(5000, 1000, False, c) == "remote"  # decode worker busy
    assert choose_prefill_mode(5000, 999, True, c) == "remote"  # pool not backed up


def test_forced_modes() -> None:
    assert choose_prefill_mode(1, 0, True, cfg(mode="disaggregated")) == "remote"
    assert choose_prefill_mode(10**6, 0, False, cfg(mode="colocated")) == "local"


def test_the_mode_decision_logs_its_numbers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="splitserve.router.policy")
    choose_prefill_mode(300, 9000, True, cfg())
    assert "prefill mode local: uncached 300 <= 256 is False; prefill queue 9000 >= 8192 and decode idle True is True" in caplog.text


# ---- choose_prefill_worker


def test_least_queued_prefill_worker() -> None:
    assert choose_prefill_worker({"p1": 500, "p2": 100, "p3": 300}, random.Random(0)) == "p2"


def test_prefill_ties_are_broken_by_the_rng() -> None:
    q = {"p1": 0, "p2": 0, "p3": 5}
    assert choose_prefill_worker(q, random.Random(1)) == ["p1", "p2"][random.Random(1).randrange(2)]


# ---- route: the terms together


def test_route_picks_the_prefix_holder_and_prefills_its_short_suffix_locally() -> None:
    c = cfg(block_size=4, local_prefill_max_tokens=8)
    prompt = list(range(40))
    hashes = block_hashes(prompt, 4)
    idx = PrefixIndex()
    idx.stored("a", hashes[:8])
    loads = {"a": IDLE, "b": IDLE}
    r = route(hashes, len(prompt), idx, loads, {"p": 0}, c, random.Random(0))
    assert (r.worker, r.overlap_blocks, r.uncached_tokens, r.mode) == ("a", 8, 8, "local")
    idx.removed("a", hashes[4:])
    r = route(hashes, len(prompt), idx, loads, {"p": 0}, c, random.Random(0))
    assert (r.worker, r.uncached_tokens, r.mode) == ("a", 24, "remote")


def test_route_without_prefill_workers_is_local() -> None:
    r = route([], 5000, PrefixIndex(), {"a": IDLE}, {}, cfg(), random.Random(0))
    assert r.mode == "local"


def test_round_robin_takes_workers_in_turn_whatever_their_caches():
    from splitserve.router.policy import round_robin

    workers = ["b:1", "a:1", "c:1"]
    assert [round_robin(workers, t) for t in range(5)] == ["a:1", "b:1", "c:1", "a:1", "b:1"]
