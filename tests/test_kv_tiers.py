"""The host and disk tiers behind the prefix cache (engine/kv_tiers.py), on the tiny model: an evicted
prefix comes back from a tier and gives the tokens and log-probabilities of a run without tiers; a
corrupt host block, a corrupt, truncated or deleted disk file and a full disk each degrade to a
recompute, counted, with the same tokens; the load-or-recompute decision in seconds; the tiers' block
events; a decode worker whose cached prefix continues in a tier reserves fewer blocks to fill; a third
tier, defined in this file only (`RemoteTier`), after the disk."""

from __future__ import annotations

import errno
import random
import threading
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch

from splitserve.engine.block_hash import BlockHash, block_hashes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_tier import PROBE_LOADS, Held, KVTier, Spill, TierStats
from splitserve.engine.kv_tier_blocks import DiskTier, HostTier
from splitserve.engine.kv_tiers import TierStore
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.tier_cost import expected_seconds, plan_load
from tests.worker_helpers import EnginePair, assert_engine_empty

pytestmark = pytest.mark.timeout(120)

BS = 4
MODEL = tiny_model_config(tie_embeddings=False)  # an untied head: varied greedy tokens
WEIGHTS = random_weights(MODEL)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
_rng = random.Random(7)
CONTEXT = [_rng.randrange(1, 512) for _ in range(41)]  # ten full blocks and a token
OTHER = [_rng.randrange(1, 512) for _ in range(84)]  # fills the pool: CONTEXT's blocks are evicted
TURN2 = CONTEXT + [5, 9, 17, 33, 65, 129, 257]


def engine(num_blocks: int = 24, **tiers: object) -> Engine:
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64, **tiers)  # type: ignore[arg-type]
    return Engine(MODEL, WEIGHTS, cfg)


def tiers_of(e: Engine) -> TierStore:
    assert e.tiers is not None
    return e.tiers


def disk_of(e: Engine) -> DiskTier:
    disk = tiers_of(e).tier("disk")
    assert isinstance(disk, DiskTier)
    return disk


def host_of(e: Engine) -> HostTier:
    host = tiers_of(e).tier("host")
    assert isinstance(host, HostTier)
    return host


def run(e: Engine, rid: str, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Tokens, their logprobs, and the prompt tokens that came from the cache (pool or tier)."""
    e.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    lps: list[float] = []
    cached = -1
    while e.has_work:
        for out in e.step():
            tokens.append(out.token_id)
            lps.append(out.logprob.logprob if out.logprob else 0.0)
            cached = out.num_cached_tokens
    if e.tiers is not None:  # the disk tier writes on a thread of its own: its files as of now
        e.tiers.flush()
    return tokens, lps, cached


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[float]]:
    """The second turn with its context still in a pool large enough (no tiers): a loaded block's KV is
    the computed one byte for byte, so the log-probabilities are equal too, not only the tokens."""
    plain, _, cached = run(engine(enable_prefix_caching=False), "ref", TURN2)
    assert cached == 0 and len(set(plain)) > 2  # a varied greedy run, so that equality means something
    big = engine(num_blocks=64)
    run(big, "turn1", CONTEXT)
    tokens, lps, cached = run(big, "turn2", TURN2)
    assert cached == 40 and tokens == plain
    return tokens, lps


def same_tokens(tokens: list[int], lps: list[float], reference: tuple[list[int], list[float]]) -> None:
    """A recomputed prefix: the same tokens; its log-probabilities to float rounding (the chunks differ)."""
    assert tokens == reference[0]
    assert lps == pytest.approx(reference[1], abs=1e-4)


def evict_context(e: Engine) -> None:
    run(e, "turn1", CONTEXT)
    run(e, "other", OTHER)
    assert not e.blocks.cached_prefix(block_hashes(TURN2, BS), len(TURN2))  # gone from the pool
    # no prefill speed measured: every hit loads (the timing-dependent decision has tests of its own)
    tiers_of(e).prefill_tokens_per_s = None


def test_a_host_tier_hit_loads_the_evicted_prefix_and_gives_the_same_tokens(reference):
    e = engine(kv_host_tier_bytes=1 << 20)
    evict_context(e)
    assert e.scheduler.cached_prefix_tokens(TURN2) == 40  # what a request's usage reports: the tier's too
    tokens, lps, cached = run(e, "turn2", TURN2)
    assert (tokens, lps) == reference
    assert cached == 40  # ten blocks loaded, not recomputed
    host = tiers_of(e).stats["host"]
    assert host.hits == 10 and host.bytes_loaded == 10 * tiers_of(e).block_bytes and host.load_seconds > 0
    assert host.checksum_failures == 0 and host.blocks > 0
    assert_engine_empty(e)


def test_the_host_tier_spills_to_disk_and_a_disk_hit_gives_the_same_tokens(reference, tmp_path):
    block = engine().kv_cache.block_nbytes()
    e = engine(kv_host_tier_bytes=2 * block, kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    evict_context(e)
    on_disk = tiers_of(e).stats["disk"].blocks
    assert on_disk >= 8 and len(list(tmp_path.glob("pid-*/*.kv"))) == on_disk
    tokens, lps, cached = run(e, "turn2", TURN2)
    assert (tokens, lps) == reference
    assert cached == 40
    assert tiers_of(e).stats["disk"].hits >= 8


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_disk_file_is_recomputed_counted_with_the_same_tokens(reference, tmp_path, damage):
    e = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    evict_context(e)
    disk = disk_of(e)
    fourth = block_hashes(TURN2, BS)[3]
    assert fourth in disk
    path = disk.path(fourth)
    raw = bytearray(path.read_bytes())
    if damage == "corrupt":
        raw[-7] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        path.unlink()
    tokens, lps, cached = run(e, "turn2", TURN2)
    same_tokens(tokens, lps, reference)
    assert cached == 12  # three blocks loaded; the damaged one and the rest recomputed
    assert tiers_of(e).stats["disk"].checksum_failures == 1
    assert fourth not in disk


def test_a_corrupt_host_block_is_recomputed_counted(reference):
    e = engine(kv_host_tier_bytes=1 << 20)
    evict_context(e)
    host = host_of(e)
    first = block_hashes(TURN2, BS)[0]
    host.blocks[first].data[100] ^= 0x40
    tokens, lps, cached = run(e, "turn2", TURN2)
    same_tokens(tokens, lps, reference)
    assert cached == 0 and tiers_of(e).stats["host"].checksum_failures == 1


def test_a_full_disk_drops_the_blocks_counted_and_recomputes(reference, tmp_path, monkeypatch):
    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    e = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
    evict_context(e)
    assert tiers_of(e).stats["disk"].write_failures >= 10 and tiers_of(e).stats["disk"].blocks == 0
    tokens, lps, cached = run(e, "turn2", TURN2)
    same_tokens(tokens, lps, reference)
    assert cached == 0 and not list(tmp_path.glob("pid-*/*.kv"))


def test_a_hit_that_would_load_slower_than_it_recomputes_is_recomputed_counted(reference):
    e = engine(kv_host_tier_bytes=1 << 20)
    evict_context(e)
    tiers_of(e).bandwidth.values["host"] = 1.0  # one byte a second
    tiers_of(e).prefill_tokens_per_s = 1000.0
    tokens, lps, cached = run(e, "turn2", TURN2)
    same_tokens(tokens, lps, reference)
    assert cached == 0 and tiers_of(e).stats["host"].recomputed_instead == 10 and tiers_of(e).stats["host"].hits == 0


def test_plan_load_picks_the_prefix_that_saves_the_most_seconds():
    bw = {"host": 1e9, "disk": 1e6}
    # a 1 MB block: host 1 ms, disk 1 s; recomputing 16 tokens at 160 tok/s takes 0.1 s
    assert plan_load(["host"] * 3, 10**6, 16, bw, 160.0) == 3
    assert plan_load(["disk"] * 3, 10**6, 16, bw, 160.0) == 0
    assert plan_load(["host", "host", "disk", "host"], 10**6, 16, bw, 160.0) == 2
    # one slow block between fast ones is worth loading when the ones after it save more than it costs
    assert plan_load(["host", "disk", *["host"] * 20], 10**6, 16, bw, 160.0) == 22
    assert plan_load(["disk"] * 3, 10**6, 16, bw, None) == 3  # no prefill measured yet: load
    assert plan_load([], 10**6, 16, bw, 160.0) == 0
    assert expected_seconds(["pool", "host", "disk"], 10**6, 16, bw, 160.0) == pytest.approx(0.001 + 0.1)


def test_tier_moves_are_block_events():
    e = engine(kv_host_tier_bytes=1 << 20)
    evict_context(e)
    events = e.drain_block_events()
    host_stored = {h for ev in events if ev.kind == "stored" and ev.tier == "host" for h in ev.hashes}
    pool_removed = {h for ev in events if ev.kind == "removed" and ev.tier == "pool" for h in ev.hashes}
    assert len(host_stored) >= 10 and host_stored <= pool_removed
    run(e, "turn2", TURN2)
    loaded = {h for ev in e.drain_block_events() if ev.kind == "stored" and ev.tier == "pool" for h in ev.hashes}
    assert len(loaded & host_stored) == 10


def test_a_decode_worker_loads_its_prefix_from_a_tier_and_a_remote_prefill_fills_the_rest(reference):
    """Disaggregated: the decode worker's reservation loads the evicted context from its host tier, the
    prefill worker computes only the blocks after it (its own cache holds nothing), and the tokens are
    the ones of a run without tiers."""
    decode = engine(kv_host_tier_bytes=1 << 20)
    evict_context(decode)
    pair = EnginePair.of(
        Engine(MODEL, WEIGHTS, EngineConfig(num_blocks=64, block_size=BS, max_num_batched_tokens=8)), decode
    )
    try:
        remote = pair.reserve("r", TURN2, GREEDY)
        assert remote.num_cached_tokens == 40 and tiers_of(decode).stats["host"].hits == 10
        pair.start_prefill("r", TURN2, GREEDY, remote)
        first = pair.prefill_until_done("r")
        pair.poll_prefill()
        pair.poll_decode()
        assert [first, *pair.decode_to_end("r")] == reference[0]
    finally:
        pair.close()
    assert_engine_empty(decode)


def test_the_tier_metrics_export_each_tier_with_its_counts(tmp_path):
    from prometheus_client import generate_latest

    from splitserve.workers.common.metrics import WorkerMetrics

    e = engine(kv_host_tier_bytes=1 << 20, kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    evict_context(e)
    run(e, "turn2", TURN2)
    m = WorkerMetrics("tiny", "decode", "w0")
    m.watch_tiers(tiers_of(e).stats)
    text = generate_latest(m.registry).decode()

    def series(name: str, tier: str) -> str:
        return f'splitserve:kv_tier_{name}{{model_name="tiny",role="decode",tier="{tier}",worker_id="w0"}}'

    assert series("hits_total", "host") + " 10.0" in text
    assert series("blocks", "disk") in text
    for name in ("loaded_bytes_total", "load_seconds_total", "recomputed_instead_total", "checksum_failures_total"):
        assert series(name, "host") in text


def test_the_tier_flags_reach_the_engine_config_and_serve_help():
    import argparse

    from splitserve.cluster.serve import add_arguments
    from splitserve.engine.flags import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    a = p.parse_args(["--kv-host-tier-mib", "64", "--kv-disk-tier-mib", "1024", "--kv-disk-tier-dir", "/x"])
    cfg = engine_config_from_args(a)
    assert (cfg.kv_host_tier_bytes, cfg.kv_disk_tier_bytes, cfg.kv_disk_tier_dir) == (64 << 20, 1 << 30, "/x")
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    help_text = serve.format_help()
    assert all(f in help_text for f in ("--kv-host-tier-mib", "--kv-disk-tier-mib", "--kv-disk-tier-dir"))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_pools_blocks_go_through_a_tier_with_their_scales(kv_dtype):
    """A quantized block is one run of bytes, values and scales (engine/kv_cache.py): loaded back from a
    tier it gives the tokens and log-probabilities of the same pool that kept it."""
    big = engine(num_blocks=64, kv_cache_dtype=kv_dtype)
    run(big, "turn1", CONTEXT)
    want = run(big, "turn2", TURN2)
    e = engine(kv_cache_dtype=kv_dtype, kv_host_tier_bytes=1 << 20)
    evict_context(e)
    assert run(e, "turn2", TURN2) == want
    assert tiers_of(e).stats["host"].hits == 10


def test_workers_sharing_a_disk_directory_keep_to_their_own_folders(tmp_path):
    gone = tmp_path / "pid-999999999-0"  # a process that is no more: its files go at the next start
    gone.mkdir()
    (gone / "x.kv").write_bytes(b"old")
    a = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    evict_context(a)
    held = sorted(tmp_path.glob("pid-*/*.kv"))
    assert held and not gone.exists()
    b = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    assert disk_of(a).dir != disk_of(b).dir
    assert sorted(tmp_path.glob("pid-*/*.kv")) == held  # the other's files stay


def test_a_soak_of_damaged_files_and_a_full_disk_gives_no_wrong_token(tmp_path, monkeypatch):
    """Conversations that outgrow the pool, their contexts going to a small host tier and on to disk,
    while files are corrupted, truncated and deleted at random and the disk fills now and then: every
    turn's greedy tokens equal a run without tiers, and every fallback is counted."""
    rng = random.Random(11)
    sessions = [[rng.randrange(1, 512) for _ in range(24)] for _ in range(4)]
    plain = engine(num_blocks=24, enable_prefix_caching=False)
    block = plain.kv_cache.block_nbytes()
    e = engine(kv_host_tier_bytes=6 * block, kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    real_write = DiskTier._write
    full = {"on": False}

    def write(path, payload):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, payload)

    monkeypatch.setattr(DiskTier, "_write", staticmethod(write))
    damaged = 0
    for turn in range(24):
        s = turn % len(sessions)
        prompt = sessions[s] + [rng.randrange(1, 512) for _ in range(4)]
        tiers_of(e).prefill_tokens_per_s = None  # every hit loads
        got = run(e, f"t{turn}", prompt)[0]
        assert got == run(plain, f"p{turn}", prompt)[0], f"turn {turn}"
        sessions[s] = prompt + got[:4]
        full["on"] = rng.random() < 0.2
        files = sorted(tmp_path.glob("pid-*/*.kv"))
        for f in rng.sample(files, min(2, len(files))):
            damage = rng.choice(["corrupt", "truncate", "delete"])
            raw = bytearray(f.read_bytes())
            if damage == "corrupt":
                raw[rng.randrange(40, len(raw))] ^= 0x10  # past the header: the checksum must catch it
                f.write_bytes(bytes(raw))
            elif damage == "truncate":
                f.write_bytes(bytes(raw[: rng.randrange(len(raw))]))
            else:
                f.unlink()
            damaged += 1
    disk = tiers_of(e).stats["disk"]
    assert damaged > 10 and disk.hits > 0 and disk.checksum_failures > 0 and disk.write_failures > 0


def test_disk_writes_run_on_the_writer_thread_not_the_engine_thread(reference, tmp_path, monkeypatch):
    real_write = DiskTier._write
    writers: set[str] = set()

    def write(path, payload):
        writers.add(threading.current_thread().name)
        real_write(path, payload)

    e = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    monkeypatch.setattr(DiskTier, "_write", staticmethod(write))
    evict_context(e)
    assert writers == {"kv-disk-writer"}
    tokens, lps, cached = run(e, "turn2", TURN2)
    assert (tokens, lps) == reference and cached == 40


def test_a_block_queued_for_disk_is_served_from_memory_and_a_full_queue_drops_counted(reference, tmp_path, monkeypatch):
    """The disk stalls: the first blocks wait in the writer's queue (a hit reads them from there), the
    ones past its bound are dropped and counted, and nothing waits for the disk."""
    real_write = DiskTier._write
    stalled = threading.Event()

    def slow(path, payload):
        stalled.wait(timeout=60)
        real_write(path, payload)

    cfg = EngineConfig(
        num_blocks=24,
        block_size=BS,
        max_num_batched_tokens=64,
        kv_disk_tier_bytes=1 << 20,
        kv_disk_tier_dir=str(tmp_path),
    )
    e = Engine(MODEL, WEIGHTS, cfg)
    disk = disk_of(e)
    disk.max_pending = 6
    monkeypatch.setattr(DiskTier, "_write", staticmethod(slow))  # after the start's probe, which writes too
    e.add_request("turn1", CONTEXT, GREEDY)
    while e.has_work:
        e.step()
    e.add_request("other", OTHER, GREEDY)
    while e.has_work:
        e.step()
    assert disk.stats.write_dropped > 0 and len(disk.pending) == 6 and not list(tmp_path.glob("pid-*/*.kv"))
    tiers_of(e).prefill_tokens_per_s = None
    e.add_request("turn2", TURN2, GREEDY)
    tokens: list[int] = []
    while e.has_work:
        tokens += [o.token_id for o in e.step()]
    assert tokens == reference[0]
    stalled.set()
    tiers_of(e).flush()
    assert not disk.pending and disk.stats.write_failures == 0
    assert len(list(tmp_path.glob("pid-*/*.kv"))) == disk.stats.blocks
    tiers_of(e).close()


def test_a_prompts_disk_blocks_are_read_ahead_at_admission_and_loaded_from_those_reads(reference, tmp_path):
    """Asking what a prompt would load (at admission: `cached_prefix_tokens`) starts reading its disk
    blocks on the reader thread; the load at its allocation takes those reads, checked: with the files
    deleted in between, the blocks still load, and give the reference tokens."""
    e = engine(kv_disk_tier_bytes=1 << 20, kv_disk_tier_dir=str(tmp_path))
    evict_context(e)
    disk = disk_of(e)
    assert not disk.read_ahead
    assert e.scheduler.cached_prefix_tokens(TURN2) == 40
    assert len(disk.read_ahead) == 10
    for read in disk.read_ahead.values():
        read.result(timeout=30)
    for f in tmp_path.glob("pid-*/*.kv"):
        f.unlink()
    tokens, lps, cached = run(e, "turn2", TURN2)
    assert (tokens, lps) == reference and cached == 40
    assert tiers_of(e).stats["disk"].hits == 10 and not disk.read_ahead


class RemoteTier(KVTier):
    """A third tier, after the disk, defined here only: a dict of serialized blocks standing in for a
    remote store, LRU and bounded in bytes, whose link moves `bytes_per_s` (what its probe reports).
    Nothing else in the package names it: the store walks it, and its name travels as data."""

    name = "remote"

    def __init__(self, capacity_bytes: int, bytes_per_s: float) -> None:
        self.capacity = capacity_bytes
        self.bytes_per_s = bytes_per_s
        self.store: OrderedDict[BlockHash, tuple[bytes, int]] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.store

    def refresh(self, h: BlockHash) -> bool:
        if h in self.store:
            self.store.move_to_end(h)
        return h in self.store

    def put(self, h: BlockHash, held: Held, pass_on: bool) -> tuple[bool, list[Spill]]:
        if self.refresh(h):
            return True, []
        gone = []
        while self.stats.bytes + held.data.numel() > self.capacity and self.store:
            old, (raw, _) = self.store.popitem(last=False)
            self.stats.bytes -= len(raw)
            gone.append(Spill(old, None))
        self.store[h] = (held.data.numpy().tobytes(), held.crc)
        self.stats.bytes += held.data.numel()
        self.stats.stored += 1
        self.stats.blocks = len(self.store)
        return True, gone

    def get(self, h: BlockHash) -> Held | None:
        raw, crc = self.store[h]
        return Held(torch.frombuffer(bytearray(raw), dtype=torch.uint8), crc)

    def drop(self, h: BlockHash) -> None:
        raw, _ = self.store.pop(h)
        self.stats.bytes -= len(raw)
        self.stats.blocks = len(self.store)

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self.store)

    def probe(self, data: torch.Tensor, load: Callable[[torch.Tensor], None]) -> float:
        return PROBE_LOADS * data.numel() / self.bytes_per_s  # the link's time, not this machine's


def test_a_third_tier_after_the_disk_takes_its_spills_and_serves_a_prefix_hit(reference, tmp_path):
    """Host -> disk -> remote, the remote tier a test double: the evicted context goes through all
    three, comes back into the pool by a prefix hit with the tokens of a run without tiers, and the
    remote tier's name travels as data to the stats, the metrics, the worker's reported speeds and
    the router's index and pricing, which prices its blocks at its own bandwidth."""
    from prometheus_client import generate_latest

    from splitserve.engine.scheduler import SchedulerStats
    from splitserve.engine.tier_cost import prefix_cost
    from splitserve.proto import convert
    from splitserve.router.prefix_index import PrefixIndex
    from splitserve.workers.common.metrics import WorkerMetrics

    block = engine().kv_cache.block_nbytes()
    cfg = EngineConfig(num_blocks=24, block_size=BS, max_num_batched_tokens=64)
    remote = RemoteTier(1 << 20, bytes_per_s=5e7)
    tiers: list[KVTier] = [HostTier(2 * block), DiskTier(3 * (block + 64), str(tmp_path)), remote]
    e = Engine(MODEL, WEIGHTS, cfg, kv_tiers=tiers)
    assert tiers_of(e).bandwidth.values["remote"] == pytest.approx(5e7)  # its probe, as the store took it
    evict_context(e)
    events = e.drain_block_events()
    hashes = block_hashes(TURN2, BS)[:10]
    where = tiers_of(e).lookup(hashes)
    assert set(where) == {"host", "disk", "remote"}  # spilled on down the list, each tier full
    assert {h for ev in events if ev.kind == "removed" and ev.tier == "disk" for h in ev.hashes} & set(remote.store)

    index = PrefixIndex()  # the router's view, fed through the proto as a worker's stream would be
    for ev in convert.block_events_to_proto(events).events:
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            index.stored("w", ev.stored.block_hashes, convert.tier_name(ev.tier))
        elif kind == "removed":
            index.removed("w", ev.removed.block_hashes, convert.tier_name(ev.tier))
    # a block recomputes in 40 us and loads in 4 us from host, 20 from disk, 82 from remote (its probe)
    tiers_of(e).prefill_tokens_per_s = 1e5
    tiers_of(e).bandwidth.values.update(host=1e9, disk=2e8)
    stats = convert.stats_to_proto("w", SchedulerStats(0, 0, 10, 10, 0, 0, 0, 0, 0), BS, tiers_of(e).speeds())
    speeds = convert.speeds_from_proto(stats)
    assert speeds.order == ("host", "disk", "remote") and speeds.bandwidth["remote"] == pytest.approx(5e7)
    seen = index.overlap_tiers(hashes, {"w": speeds.order})["w"]
    assert seen == where
    cost = prefix_cost(seen, 40, BS, speeds)
    loaded = where.index("remote")  # the router loads the host and disk blocks, and recomputes the remote run
    assert (cost.loaded_blocks, cost.compute_tokens) == (loaded, 40 - BS * loaded)
    assert prefix_cost(seen, 40, BS, speeds._replace(prefill_tokens_per_s=1e4)).loaded_blocks == 10  # slower: all
    assert tiers_of(e).plan(hashes) == loaded  # and the worker decides as the router priced it

    tiers_of(e).prefill_tokens_per_s = None  # every hit loads
    tokens, lps, cached = run(e, "turn2", TURN2)
    assert (tokens, lps) == reference and cached == 40
    hits = {name: s.hits for name, s in tiers_of(e).stats.items()}
    assert hits == {name: where.count(name) for name in ("host", "disk", "remote")}
    assert len(e.blocks.cached_prefix(hashes, len(CONTEXT))) == 10  # the context back in the pool
    m = WorkerMetrics("tiny", "decode", "w0")
    m.watch_tiers(tiers_of(e).stats)
    text = generate_latest(m.registry).decode()
    labels = 'model_name="tiny",role="decode",tier="remote",worker_id="w0"'
    assert f"splitserve:kv_tier_hits_total{{{labels}}} {float(hits['remote'])}" in text
    tiers_of(e).close()
