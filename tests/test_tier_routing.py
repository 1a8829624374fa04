"""The router's view of the KV tiers: block events carry the tier (proto and back), the prefix index
learns where each block is on each worker, and routing prices a worker by the seconds until the
context is in its pool (engine/tier_cost.py), with the local-or-remote decision on the same
numbers; a tier-blind router counts the tiers' blocks as uncached."""

from __future__ import annotations

import dataclasses
import random

import pytest

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.scheduler import SchedulerStats
from splitserve.engine.tier_cost import TierSpeed, TierSpeeds, prefix_cost
from splitserve.proto import convert
from splitserve.router.config import RoutingConfig
from splitserve.router.policy import WorkerLoad, decode_candidates, route
from splitserve.router.prefix_index import PrefixIndex, WorkerId

BS = 16
HASHES = [bytes([i]) * 16 for i in range(1, 101)]  # a 1,600-token context
# a 1 MiB block: host 1 ms (1 GB/s), disk 5 ms (200 MB/s); prefill 1,600 tokens/s: 10 ms a block
SPEEDS = TierSpeeds(1600.0, 1 << 20, (TierSpeed("host", 1e9), TierSpeed("disk", 2e8)))
SLOW_DISK = SPEEDS._replace(tiers=(TierSpeed("host", 1e9), TierSpeed("disk", 1e7)))  # 100 ms a block
ORDER: dict[WorkerId, tuple[str, ...]] = {"a": SPEEDS.order}


def test_block_events_carry_their_tier_through_the_proto():
    events = [
        BlockEvent("stored", (HASHES[0],)),
        BlockEvent("removed", (HASHES[0],)),
        BlockEvent("stored", (HASHES[0],), "host"),
        BlockEvent("stored", (HASHES[1],), "disk"),
        BlockEvent("removed", (HASHES[1],), "remote"),  # a name is data: a tier the router never heard of
    ]
    batch = convert.block_events_to_proto(events)
    assert [convert.tier_name(e.tier) for e in batch.events] == ["pool", "pool", "host", "disk", "remote"]
    assert batch.events[0].tier == ""  # the pool: the field's default


def test_worker_stats_carry_the_measured_speeds():
    s = SchedulerStats(0, 0, 10, 10, 0, 0, 0, 0, 0)
    m = convert.stats_to_proto("w", s, BS, SPEEDS)
    assert [(t.name, t.bytes_per_s) for t in m.tiers] == [("host", 1e9), ("disk", 2e8)]
    assert convert.speeds_from_proto(m) == SPEEDS
    assert convert.speeds_from_proto(convert.stats_to_proto("w", s, BS)) == TierSpeeds()


def test_the_index_learns_each_blocks_tier_and_forgets_it():
    idx = PrefixIndex()
    idx.stored("a", HASHES[:4])
    idx.removed("a", HASHES[2:4])  # evicted from the pool ...
    idx.stored("a", HASHES[2:4], "host")  # ... into the host tier
    idx.stored("a", HASHES[4:6], "disk")
    assert idx.overlap(HASHES) == {"a": 2}  # pooled blocks only, as before
    assert idx.overlap_tiers(HASHES, ORDER) == {"a": ["pool", "pool", "host", "host", "disk", "disk"]}
    idx.stored("a", HASHES[3:4], "disk")  # in both: the tier the worker looks in first counts
    assert idx.overlap_tiers(HASHES, ORDER)["a"][3] == "host"
    assert idx.overlap_tiers(HASHES, {"a": ("disk", "host")})["a"][3] == "disk"
    idx.removed("a", HASHES[3:4], "host")
    assert idx.overlap_tiers(HASHES, ORDER)["a"][3] == "disk"
    idx.removed("a", HASHES[4:5], "disk")  # a hole: the run stops there
    assert idx.overlap_tiers(HASHES, ORDER) == {"a": ["pool", "pool", "host", "disk"]}
    idx.cleared("a")
    assert idx.overlap_tiers(HASHES, ORDER) == {} and len(idx) == 0


def test_prefix_cost_loads_what_is_faster_than_recomputing():
    host = prefix_cost(["pool"] * 10 + ["host"] * 90, 1600, BS, SPEEDS)
    assert (host.pool_blocks, host.loaded_blocks, host.compute_tokens) == (10, 90, 0)
    assert host.load_seconds == pytest.approx(90 * (1 << 20) / 1e9)
    assert host.seconds(SPEEDS.prefill_tokens_per_s) == pytest.approx(0.094, rel=0.01)
    disk = prefix_cost(["disk"] * 100, 1600, BS, SLOW_DISK)  # 100 ms a block against 10 ms to recompute it
    assert (disk.loaded_blocks, disk.compute_tokens) == (0, 1600)
    assert prefix_cost(["host"] * 100, 1600, BS, TierSpeeds()).compute_tokens == 1600  # nothing measured


def loads(**speeds: TierSpeeds) -> dict[str, WorkerLoad]:
    return {w: WorkerLoad(0, 0, 1000, 1000, s) for w, s in speeds.items()}


def test_routing_prefers_a_host_hit_and_keeps_its_prefill_local():
    idx = PrefixIndex()
    idx.stored("a", HASHES, "host")  # a's whole context is in its host tier
    idx.stored("b", HASHES[:20])  # b holds a fifth of it in its pool
    cfg = RoutingConfig(block_size=BS, mode="auto", local_prefill_max_tokens=64)
    r = route(HASHES, 1600, idx, loads(a=SPEEDS, b=SPEEDS), {"p": 0}, cfg, random.Random(0))
    assert r.worker == "a"
    assert (r.overlap_blocks, r.uncached_tokens) == (0, 0)  # everything loads: nothing to prefill
    assert r.mode == "local"  # no prefill to move: a remote prefill would only add a hop
    blind = route(HASHES, 1600, idx, loads(a=SPEEDS, b=SPEEDS), {"p": 0}, cfg, random.Random(0), tier_aware=False)
    assert blind.worker == "b" and blind.mode == "remote"  # tier-blind: a counts as empty
    blind_cfg = dataclasses.replace(cfg, tier_aware=False)  # what --tier-blind-routing sets
    assert route(HASHES, 1600, idx, loads(a=SPEEDS, b=SPEEDS), {"p": 0}, blind_cfg, random.Random(0)).worker == "b"


def test_a_disk_hit_slower_than_recompute_is_priced_as_a_recompute():
    idx = PrefixIndex()
    idx.stored("a", HASHES, "disk")
    (c,) = decode_candidates(HASHES, 1600, idx, loads(a=SLOW_DISK), BS)
    assert (c.loaded_blocks, c.uncached_tokens, c.prefill_tokens) == (0, 1600, None)
    (fast,) = decode_candidates(HASHES, 1600, idx, loads(a=SPEEDS), BS)
    assert fast.loaded_blocks == 100 and fast.prefill_tokens == pytest.approx(100 * (1 << 20) / 2e8 * 1600)


def test_the_tier_blind_flag_reaches_the_routing_config():
    import argparse

    from splitserve.router.flags import add_router_arguments, router_config_from_args

    p = argparse.ArgumentParser()
    add_router_arguments(p)
    p.add_argument("--block-size", type=int, default=16)
    assert router_config_from_args(p.parse_args([]), None).routing.tier_aware
    assert not router_config_from_args(p.parse_args(["--tier-blind-routing"]), None).routing.tier_aware


def test_a_third_tier_is_priced_at_the_bandwidth_its_worker_reports_in_the_order_it_reports():
    """A tier the router has no name for (a remote store after the disk): its blocks are where the
    worker's order puts them, and cost what its measured bandwidth says."""
    remote = TierSpeeds(1600.0, 1 << 20, (*SPEEDS.tiers, TierSpeed("remote", 5e8)))  # 2 ms a block
    idx = PrefixIndex()
    idx.stored("a", HASHES[:50], "disk")
    idx.stored("a", HASHES, "remote")
    (c,) = decode_candidates(HASHES, 1600, idx, loads(a=remote), BS)
    assert c.loaded_blocks == 100  # 50 from disk at 5 ms, 50 from remote at 2 ms: each beats 10 ms
    assert c.prefill_tokens == pytest.approx((50 * (1 << 20) / 2e8 + 50 * (1 << 20) / 5e8) * 1600)
    assert idx.overlap_tiers(HASHES, {"a": remote.order})["a"] == ["disk"] * 50 + ["remote"] * 50
    slow = remote._replace(tiers=(*SPEEDS.tiers, TierSpeed("remote", 5e7)))  # 20 ms a block: recomputed
    (c,) = decode_candidates(HASHES, 1600, idx, loads(a=slow), BS)
    assert (c.loaded_blocks, c.uncached_tokens) == (50, 800)
