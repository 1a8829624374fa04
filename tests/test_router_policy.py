"""Routing terms, each on its own, with exact numbers (the RNG is seeded and passed in)."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any

import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.router.config import Deadlines, Limits, Listeners, Retries, RouterConfig, RoutingConfig
from splitserve.router.policy import (
    DecodeCandidate,
    KvAwareChooser,
    RoundRobinChooser,
    WorkerLoad,
    choose_prefill_mode,
    choose_prefill_worker,
    decode_chooser,
    decode_cost,
    decode_stall_tokens,
    kv_shortfall_tokens,
    pick,
    queued_and_running_tokens,
    round_robin,
    route,
    ttft_saved_tokens,
    uncached_prefill_tokens,
)
from splitserve.router.prefix_index import PrefixIndex

IDLE = WorkerLoad(queued_tokens=0, running_tokens=0, free_blocks=100, total_blocks=100)
ROUTING = RoutingConfig(prefill_weight=1.0)  # a prefill token worth one token of load: plain sums below


def cand(worker: str, uncached: int, load: WorkerLoad = IDLE, overlap: int = 0) -> DecodeCandidate:
    return DecodeCandidate(worker, overlap, uncached, load)


# ---- uncached_prefill_tokens


def test_uncached_tokens_are_the_context_past_the_cached_blocks() -> None:
    assert uncached_prefill_tokens(100, 3, 16) == 52
    assert uncached_prefill_tokens(100, 0, 16) == 100
    assert uncached_prefill_tokens(64, 4, 16) == 0  # every block cached


# ---- queued_and_running_tokens


def test_load_is_queued_plus_running_tokens() -> None:
    assert queued_and_running_tokens(WorkerLoad(300, 200, 0, 100)) == 500


# ---- kv_shortfall_tokens


def test_no_shortfall_while_the_worker_has_room() -> None:
    assert kv_shortfall_tokens(160, free_blocks=10, block_size=16) == 0


def test_shortfall_grows_block_by_block_as_free_blocks_run_out() -> None:
    assert kv_shortfall_tokens(160, free_blocks=9, block_size=16) == 16
    assert kv_shortfall_tokens(160, free_blocks=4, block_size=16) == 96
    assert kv_shortfall_tokens(160, free_blocks=0, block_size=16) == 160


def test_a_partial_block_needs_a_whole_one() -> None:
    assert kv_shortfall_tokens(17, free_blocks=1, block_size=16) == 16
    assert kv_shortfall_tokens(0, free_blocks=0, block_size=16) == 0


# ---- decode_cost


def test_decode_cost_adds_weighted_prefill_tokens_to_load_and_shortfall() -> None:
    assert decode_cost(prefill_tokens=100, work_tokens=50, shortfall_tokens=16, prefill_weight=2.0) == 266.0
    assert decode_cost(prefill_tokens=100, work_tokens=0, shortfall_tokens=0, prefill_weight=1.0) == 100.0


# ---- pick


def test_pick_takes_the_cheapest() -> None:
    assert pick([3.0, 1.0, 2.0], 0.0, random.Random(0)) == 1


def test_ties_are_broken_by_the_rng_exactly() -> None:
    picks = [pick([5.0, 5.0, 5.0, 5.0], 0.0, random.Random(seed)) for seed in range(6)]
    assert picks == [random.Random(seed).randrange(4) for seed in range(6)]
    assert len(set(picks)) > 1


def test_softmax_temperature_samples_by_exp_of_minus_cost_over_t() -> None:
    rng = random.Random(7)
    picks = [pick([0.0, 16.0], 16.0, rng) for _ in range(2000)]  # 16 tokens apart at T = 16 tokens
    # p(first) = e / (e + 1) = 0.731
    assert abs(picks.count(0) / len(picks) - 0.731) < 0.03
    rng2 = random.Random(7)  # and exactly reproducible
    assert picks == [pick([0.0, 16.0], 16.0, rng2) for _ in range(2000)]


# ---- KvAwareChooser


def test_the_worker_with_the_prefix_wins_at_equal_load() -> None:
    choice = KvAwareChooser(ROUTING).choose([cand("a", 64), cand("b", 16, overlap=3)], random.Random(0))
    assert (choice.worker, choice.overlap_blocks, choice.uncached_tokens, choice.cost) == ("b", 3, 16, 16.0)


def test_load_beats_a_smaller_prefill() -> None:
    busy = WorkerLoad(100, 0, 100, 100)
    choice = KvAwareChooser(ROUTING).choose([cand("a", 16, busy, overlap=3), cand("b", 64)], random.Random(0))
    assert (choice.worker, choice.cost) == ("b", 64.0)  # a: 16 + 100 = 116


def test_the_prefill_weight_trades_cached_tokens_against_load() -> None:
    busy = WorkerLoad(100, 0, 100, 100)
    cands = [cand("a", 16, busy, overlap=3), cand("b", 64)]
    choice = KvAwareChooser(RoutingConfig(prefill_weight=4.0)).choose(cands, random.Random(0))
    assert (choice.worker, choice.cost) == ("a", 164.0)  # b: 4 * 64 = 256


def test_by_default_a_cache_hit_outweighs_the_load_of_the_request_that_cached_it() -> None:
    # the router counts a routed request's tokens until the worker's next stats poll, finished or not
    lagging = WorkerLoad(59, 0, 100, 100)
    choice = KvAwareChooser(RoutingConfig()).choose(
        [cand("a", 18, lagging, overlap=3), cand("b", 66)], random.Random(0)
    )
    assert (choice.worker, choice.cost) == ("a", 4 * 18 + 59)


def test_a_worker_out_of_free_blocks_pays_for_the_shortfall() -> None:
    full = WorkerLoad(0, 0, 1, 100)
    choice = KvAwareChooser(ROUTING).choose([cand("a", 48, full), cand("b", 60)], random.Random(0))
    assert (choice.worker, choice.cost) == ("b", 60.0)  # a: 48 + 16 * (3 - 1) = 80


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        KvAwareChooser(ROUTING).choose([], random.Random(0))
    with pytest.raises(ValueError):
        RoundRobinChooser().choose([], random.Random(0))


def test_the_decision_logs_its_formula_with_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="splitserve.router.policy")
    chooser = KvAwareChooser(RoutingConfig(prefill_weight=2.0))
    chooser.choose([cand("w1", 40, WorkerLoad(100, 30, 2, 100), overlap=2)], random.Random(0))
    assert (
        "decode w1: cost = 2*uncached(40) + load(100 queued + 30 running) "
        "+ shortfall(16*max(0, 3 blocks - 2 free)) = 226"
    ) in caplog.text


# ---- RoundRobinChooser


def test_round_robin_takes_workers_in_address_order() -> None:
    workers = ["b:1", "a:1", "c:1"]
    assert [round_robin(workers, t) for t in range(5)] == ["a:1", "b:1", "c:1", "a:1", "b:1"]


def test_the_round_robin_chooser_counts_its_turns_whatever_the_caches() -> None:
    chooser = RoundRobinChooser()
    cands = [cand("b:1", 0, overlap=9), cand("a:1", 100)]
    picks = [chooser.choose(cands, random.Random(0)) for _ in range(3)]
    assert [(c.worker, c.uncached_tokens) for c in picks] == [("a:1", 100), ("b:1", 0), ("a:1", 100)]


def test_the_chooser_is_the_one_the_config_names() -> None:
    assert isinstance(decode_chooser(RoutingConfig(decode_policy="round_robin")), RoundRobinChooser)
    assert isinstance(decode_chooser(RoutingConfig(decode_policy="kv_aware")), KvAwareChooser)


# ---- choose_prefill_mode


def test_short_uncached_suffix_prefills_locally() -> None:
    r = RoutingConfig(local_prefill_max_tokens=256)
    assert choose_prefill_mode(256, 0, 0, r) == "local"
    assert choose_prefill_mode(257, 0, 0, r) == "remote"


def test_a_prompt_the_backed_up_pool_cannot_start_soon_prefills_on_the_decode_worker() -> None:
    r = RoutingConfig(local_prefill_max_tokens=0, prefill_backlog_tokens=1000)
    assert choose_prefill_mode(600, 1000, 0, r) == "local"  # done here before the pool could start it
    assert choose_prefill_mode(600, 1000, 400, r) == "local"  # 400 + 600 <= 1000: still no later
    assert choose_prefill_mode(600, 1000, 401, r) == "remote"  # the decode worker's own queue is longer
    assert choose_prefill_mode(1001, 1000, 0, r) == "remote"  # this prompt alone outlasts the pool's wait
    assert choose_prefill_mode(600, 999, 0, r) == "remote"  # the pool is not backed up


def test_forced_modes() -> None:
    assert choose_prefill_mode(1, 0, 0, RoutingConfig(mode="disaggregated")) == "remote"
    assert choose_prefill_mode(10**6, 0, 10**6, RoutingConfig(mode="colocated")) == "local"


def test_the_mode_decision_logs_its_numbers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="splitserve.router.policy")
    choose_prefill_mode(300, 9000, 100, ROUTING, decode_running=2)
    assert (
        "prefill mode local: uncached 300 <= 256 is False; prefill queue 9000 >= 700 and decode queue "
        "100 + 300 <= it and TTFT saved 8900 >= stall 1 x 300 x 2 running is True" in caplog.text
    )


def test_a_backed_up_prompt_stays_remote_when_its_stall_of_the_running_streams_outweighs_the_ttft_saved() -> None:
    # the burst load: a 1,100-token prompt behind another on the prefill worker, four steady streams
    r = RoutingConfig(local_prefill_max_tokens=0, prefill_backlog_tokens=700)
    assert choose_prefill_mode(1100, 1100, 0, r, decode_running=0) == "local"  # nobody to stall
    assert choose_prefill_mode(1100, 1100, 0, r, decode_running=4) == "remote"  # saves 1100, stalls 4 x 1100
    assert choose_prefill_mode(1100, 1100, 0, replace(r, decode_stall_weight=0.25), decode_running=4) == "local"
    assert choose_prefill_mode(1100, 1100, 0, replace(r, decode_stall_weight=0.0), decode_running=40) == "local"
    assert ttft_saved_tokens(1100, 300) == 800 and decode_stall_tokens(1100, 4) == 4400


def test_route_weighs_the_chosen_decode_workers_running_streams() -> None:
    cfg = RoutingConfig(local_prefill_max_tokens=0, prefill_backlog_tokens=100)
    quiet = WorkerLoad(0, 0, 100, 100, running_requests=0)
    streaming = WorkerLoad(0, 1200, 100, 100, running_requests=4)
    assert route([], 300, PrefixIndex(), {"d:1": quiet}, {"p:1": 400}, cfg, random.Random(0)).mode == "local"
    assert route([], 300, PrefixIndex(), {"d:1": streaming}, {"p:1": 400}, cfg, random.Random(0)).mode == "remote"


def test_route_reads_the_chosen_decode_workers_own_prefill_queue() -> None:
    cfg = RoutingConfig(local_prefill_max_tokens=0, prefill_backlog_tokens=100)
    idle, busy = WorkerLoad(0, 0, 100, 100), WorkerLoad(5000, 0, 100, 100)
    assert route([], 300, PrefixIndex(), {"d:1": idle}, {"p:1": 400}, cfg, random.Random(0)).mode == "local"
    assert route([], 300, PrefixIndex(), {"d:1": busy}, {"p:1": 400}, cfg, random.Random(0)).mode == "remote"


# ---- choose_prefill_worker


def test_least_queued_prefill_worker() -> None:
    assert choose_prefill_worker({"p1": 500, "p2": 100, "p3": 300}, random.Random(0)) == "p2"


def test_prefill_ties_are_broken_by_the_rng() -> None:
    q = {"p1": 0, "p2": 0, "p3": 5}
    assert choose_prefill_worker(q, random.Random(1)) == ["p1", "p2"][random.Random(1).randrange(2)]


# ---- route: the terms together


def test_route_picks_the_prefix_holder_and_prefills_its_short_suffix_locally() -> None:
    cfg = RoutingConfig(block_size=4, local_prefill_max_tokens=8)
    prompt = list(range(40))
    hashes = block_hashes(prompt, 4)
    idx = PrefixIndex()
    idx.stored("a", hashes[:8])
    loads = {"a": IDLE, "b": IDLE}
    r = route(hashes, len(prompt), idx, loads, {"p": 0}, cfg, random.Random(0))
    assert (r.worker, r.overlap_blocks, r.uncached_tokens, r.mode) == ("a", 8, 8, "local")
    idx.removed("a", hashes[4:])
    r = route(hashes, len(prompt), idx, loads, {"p": 0}, cfg, random.Random(0))
    assert (r.worker, r.uncached_tokens, r.mode) == ("a", 24, "remote")


def test_the_mode_sees_the_chosen_workers_uncached_tokens() -> None:
    # b holds the prefix but is busy; a wins and must prefill all 40 tokens, so remote
    cfg = RoutingConfig(block_size=4, local_prefill_max_tokens=8)
    prompt = list(range(40))
    hashes = block_hashes(prompt, 4)
    idx = PrefixIndex()
    idx.stored("b", hashes)
    loads = {"a": IDLE, "b": WorkerLoad(1000, 0, 100, 100)}
    r = route(hashes, len(prompt), idx, loads, {"p": 0}, cfg, random.Random(0))
    assert (r.worker, r.overlap_blocks, r.uncached_tokens, r.mode) == ("a", 0, 40, "remote")


def test_route_without_prefill_workers_is_local() -> None:
    r = route([], 5000, PrefixIndex(), {"a": IDLE}, {}, RoutingConfig(), random.Random(0))
    assert r.mode == "local"


def test_route_keeps_the_round_robin_turn_in_the_chooser_it_is_given() -> None:
    cfg = RoutingConfig(decode_policy="round_robin")
    chooser = decode_chooser(cfg)
    loads = {"b": IDLE, "a": IDLE}
    picks = [route([], 10, PrefixIndex(), loads, {}, cfg, random.Random(0), chooser).worker for _ in range(3)]
    assert picks == ["a", "b", "a"]


# ---- the routing section of the config


def test_routing_config_rejects_what_it_cannot_route_with() -> None:
    # values of any type (a flag or a file may hold anything): the point is what __post_init__ lets through
    bad: list[tuple[str, Any]] = [
        ("block_size", 0),
        ("prefill_weight", -1.0),
        ("temperature", float("nan")),
        ("local_prefill_max_tokens", -1),
        ("mode", "sometimes"),
        ("decode_policy", "random"),
    ]
    for field, value in bad:
        with pytest.raises(ValueError, match=field):
            replace(ROUTING, **{field: value})


def test_each_section_of_the_router_config_checks_its_own_numbers() -> None:
    cfg = RouterConfig(routing=RoutingConfig(mode="colocated", block_size=32))
    assert (cfg.routing.mode, cfg.routing.block_size) == ("colocated", 32)
    with pytest.raises(ValueError, match="Limits.max_prompt_tokens"):
        Limits(max_model_len=512, max_prompt_tokens=512)
    with pytest.raises(ValueError, match="Limits.default_max_tokens"):
        Limits(max_tokens_cap=8, default_max_tokens=16)
    with pytest.raises(ValueError, match="Deadlines.admit_timeout_s"):
        Deadlines(admit_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="Retries.max_request_faults"):
        Retries(max_request_faults=0)
    with pytest.raises(ValueError, match="Listeners.grpc_port"):
        Listeners(grpc_port=-1)
    assert Listeners(cluster_token="t").auth_metadata == (("x-splitserve-token", "t"),)
    assert Listeners().auth_metadata == ()
