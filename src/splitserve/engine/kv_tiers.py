"""Tiers behind the prefix cache: an ordered list of bounded stores of blocks, fastest first
(engine/kv_tier.py; the host RAM and disk tiers that the flags ask for are engine/kv_tier_blocks.py's).

A cached block evicted from the pool (its chained hash known, engine/block_hash.py)
is copied to the first tier; a block a full tier evicts goes on to the next (from the
host tier to the disk tier, one file per block under the cache directory), and one
the last tier evicts is gone. At allocation the scheduler asks how many of a prompt's
blocks after its pooled prefix continue in a tier (`TierStore.lookup`: each from the
first tier that holds it), decides in seconds whether loading them beats recomputing
them (`plan_load`, a pure function of the tier bandwidths and the prefill speed this
worker measured), reads and checks the chosen ones (`TierStore.fetch`) and writes
them into freshly allocated pool blocks (`TierStore.install`): a hit goes back to the
pool, and from there, evicted again, to the first tier. The disk tier writes on a
thread of its own. On CUDA the host tier's blocks are pinned and a load runs on a
stream of its own (`CudaLoads`).

Every stored block carries a CRC-32 of its bytes, and a disk file also its hash and
its length; a block that fails any check, a file that is gone or short, is not
loaded: the load stops there and the rest of the prompt is recomputed, and the
failure is counted. A write that fails (a full disk) drops the block, counted.
Nothing here can produce wrong KV: the worst case is a recompute.

Every change of a block's tier is a `BlockEvent` (stored at a tier, removed from
one, the tier by its name), so the router's prefix index learns which worker holds
which prefix where.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_tier import PROBE_LOADS, Held, KVTier, TierStats
from splitserve.engine.kv_tier_blocks import crc32 as _crc
from splitserve.engine.tier_cost import TierSpeed, TierSpeeds, plan_load

log = logging.getLogger(__name__)


class Fetched(NamedTuple):
    """A block read from a tier and checked, not yet in the pool."""

    hash: BlockHash
    tier: str
    data: torch.Tensor  # uint8, KVCache.export_block's layout
    seconds: float  # the read and the check


class CudaLoads:
    """On CUDA: the host tier keeps its blocks in pinned memory, and a load runs on a stream of its own
    (host to device from the pinned bytes, then into the pool), so that the engine thread only queues
    it: the compute stream waits for the load on the device, not the host. A load's seconds come from
    CUDA events once they have completed (`harvest`): timed on the host, an asynchronous copy would
    look free, and the load-or-recompute plan would price it so."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # per load queued: its tier, bytes, seconds on the host (read and check), and its CUDA events
        self.timing: list[tuple[str, int, float, torch.cuda.Event, torch.cuda.Event]] = []

    def load(self, kv_cache: KVCache, block_id: int, data: torch.Tensor, tier: str, read_s: float) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            on_device = data.to(self.device, non_blocking=True)  # asynchronous from pinned memory
            kv_cache.import_block(block_id, on_device)  # device to device, on this stream
            end.record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)  # the next step sees the block
        self.timing.append((tier, data.numel(), read_s, start, end))

    def harvest(self) -> list[tuple[str, int, float]]:
        """The loads that have completed since the last harvest: (tier, bytes, seconds on host and device)."""
        finished = [t[4].query() for t in self.timing]
        done = [t for t, f in zip(self.timing, finished, strict=True) if f]
        self.timing = [t for t, f in zip(self.timing, finished, strict=True) if not f]
        return [(tier, n, read_s + start.elapsed_time(end) / 1e3) for tier, n, read_s, start, end in done]


@dataclass
class Bandwidths:
    """Measured bytes/s of a tier's load (a running average, seeded by a probe at start)."""

    values: dict[str, float] = field(default_factory=dict)
    alpha: float = 0.2

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        bw = nbytes / seconds
        old = self.values.get(tier)
        self.values[tier] = bw if old is None else (1 - self.alpha) * old + self.alpha * bw


class TierStore:
    """The tiers behind one engine's pool, fastest first (engine/kv_tier.py): what the block manager
    evicts goes in, what the scheduler chooses to load comes out, checked."""

    def __init__(self, kv_cache: KVCache, tiers: Sequence[KVTier]) -> None:
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"two tiers of one name: {[t.name for t in tiers]}")
        self.kv_cache = kv_cache
        self.tiers = list(tiers)
        self._by_name = {t.name: t for t in self.tiers}  # the list never changes: looked up per block
        self.events: list[BlockEvent] = []
        self.bandwidth = Bandwidths()
        self.prefill_tokens_per_s: float | None = None  # the engine's measured prefill speed
        self.layout = kv_cache.layout
        self.block_bytes = kv_cache.block_nbytes()
        device = kv_cache.shards[0].device
        self.cuda = CudaLoads(device) if device.type == "cuda" and torch.cuda.is_available() else None
        self._probe()

    @property
    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats for t in self.tiers}

    def tier(self, name: str) -> KVTier:
        """The tier of this name (KeyError: none)."""
        return self._by_name[name]

    def _probe(self) -> None:
        """Seed the bandwidths: one block's bytes through each tier into the pool's scratch block."""
        data = torch.randint(0, 256, (self.block_bytes,), dtype=torch.uint8)
        scratch = self.kv_cache.num_blocks - 1

        def load(d: torch.Tensor) -> None:
            self.kv_cache.import_block(scratch, d)

        for tier in self.tiers:
            seconds = tier.probe(data, load)
            if seconds is not None:
                self.bandwidth.observe(tier.name, PROBE_LOADS * self.block_bytes, seconds)
        self.kv_cache.reset_blocks([scratch])

    # ---- in: the pool evicted a cached block ----

    def evicted(self, block_id: int, h: BlockHash) -> None:
        """The block manager is about to reuse `block_id`, which held `h`: keep a copy (of a whole
        block only: one whose windowed pages went back to the pool cannot be loaded again)."""
        if not self.kv_cache.whole(block_id) or not self.tiers:
            return
        if self.tiers[0].refresh(h):
            self.events.append(BlockEvent("stored", (h,), self.tiers[0].name))
            return
        data = self.kv_cache.export_block(block_id)
        self._put(0, h, Held(data, _crc(data)))

    def _put(self, i: int, h: BlockHash, held: Held) -> None:
        """Into tier i; what it lets go of goes on to tier i + 1 (from the last: gone)."""
        tier, last = self.tiers[i], i + 1 == len(self.tiers)
        taken, spilled = tier.put(h, held, pass_on=not last)
        if taken:
            self.events.append(BlockEvent("stored", (h,), tier.name))
        for old in spilled:
            if old.hash != h:
                self.events.append(BlockEvent("removed", (old.hash,), tier.name))
            if not last and old.held is not None:
                self._put(i + 1, old.hash, old.held)

    # ---- out: a prompt continues in a tier ----

    def _holder(self, h: BlockHash) -> KVTier | None:
        """The fastest tier holding `h`: the one a load takes it from."""
        return next((t for t in self.tiers if h in t), None)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The tier of each leading block of `hashes` that some tier holds (stops at the first miss)."""
        out: list[str] = []
        for h in hashes:
            tier = self._holder(h)
            if tier is None:
                break
            out.append(tier.name)
        return out

    def loadable(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` a load would take from the tiers now (nothing counted).
        Asked when a prompt is admitted, so the slow tiers start reading theirs now (the disk's reader
        thread): their load at the prompt's allocation, after its wait for a seat or for the step in
        progress, finds them read."""
        tiers, bw = self.lookup(hashes), self.bandwidth.values
        n = plan_load(tiers, self.block_bytes, self.layout.block_size, bw, self.prefill_tokens_per_s)
        for tier in self.tiers:
            tier.prefetch(h for h, t in zip(hashes[:n], tiers[:n], strict=True) if t == tier.name)
        return n

    def plan(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` to load (the rest recompute), the skipped hits counted."""
        tiers = self.lookup(hashes)
        n = plan_load(tiers, self.block_bytes, self.layout.block_size, self.bandwidth.values, self.prefill_tokens_per_s)
        for tier in tiers[n:]:
            self.tier(tier).stats.recomputed_instead += 1
        return n

    def fetch(self, hashes: Sequence[BlockHash]) -> list[Fetched]:
        """The checked bytes of the leading blocks of `hashes` worth loading (`plan`), read before the
        pool makes room for them (its evictions could push them further down otherwise); stops at the
        first block that fails a check (counted, dropped from its tier): it and the rest are recomputed."""
        out: list[Fetched] = []
        for h in hashes[: self.plan(hashes)]:
            got = self._read(h)
            if got is None:
                break
            out.append(got)
        return out

    def _read(self, h: BlockHash) -> Fetched | None:
        t0 = time.perf_counter()
        tier = self._holder(h)
        if tier is None:
            return None
        got = tier.get(h)
        if got is None:  # the tier counted it
            self.events.append(BlockEvent("removed", (h,), tier.name))
            return None
        if got.data.numel() != self.block_bytes or _crc(got.data) != got.crc:
            tier.stats.checksum_failures += 1
            tier.drop(h)
            self.events.append(BlockEvent("removed", (h,), tier.name))
            return None
        return Fetched(h, tier.name, got.data, time.perf_counter() - t0)

    def install(self, fetched: Fetched, block_id: int) -> None:
        """Write a fetched block into pool block `block_id`; its tier counts the hit."""
        stats = self.tier(fetched.tier).stats
        stats.hits += 1
        stats.bytes_loaded += fetched.data.numel()
        if self.cuda is not None:  # queued on the load stream; timed when it has completed
            self.cuda.load(self.kv_cache, block_id, fetched.data, fetched.tier, fetched.seconds)
            self._harvest_cuda()
            return
        t0 = time.perf_counter()
        self.kv_cache.import_block(block_id, fetched.data)
        dt = fetched.seconds + time.perf_counter() - t0
        stats.load_seconds += dt
        self.bandwidth.observe(fetched.tier, fetched.data.numel(), dt)

    def _harvest_cuda(self) -> None:
        """Count the seconds of the CUDA loads that have completed (their read and check included)."""
        assert self.cuda is not None
        for tier, nbytes, seconds in self.cuda.harvest():
            self.tier(tier).stats.load_seconds += seconds
            self.bandwidth.observe(tier, nbytes, seconds)

    def note_prefix(self, prompt_tokens: int, pooled_tokens: int, loaded: Sequence[Fetched]) -> None:
        """Log where an admitted prompt's prefix came from: the one per-request record of it (the
        conversation benchmark splits its TTFTs by it; an operator reads how often a tier served).
        Each tier is named, in the store's order, with the tokens loaded from it."""
        bs = self.layout.block_size
        by_tier = "".join(f", {t.name} {bs * sum(f.tier == t.name for f in loaded)}" for t in self.tiers)
        computed = prompt_tokens - pooled_tokens - bs * len(loaded)
        log.info("prefix: prompt %d tokens, pool %d%s, computed %d", prompt_tokens, pooled_tokens, by_tier, computed)

    def speeds(self) -> TierSpeeds:
        """What this worker measured, for the router (WorkerStats): each tier's bandwidth in its order."""
        if self.cuda is not None:
            self._harvest_cuda()
        bw = self.bandwidth.values
        tiers = tuple(TierSpeed(t.name, bw.get(t.name, 0.0)) for t in self.tiers)
        return TierSpeeds(self.prefill_tokens_per_s or 0.0, self.block_bytes, tiers)

    def observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.2) -> None:
        """A step that prefilled `tokens` tokens in `seconds`: the prefill speed's running average."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - alpha) * old + alpha * rate

    def drain_events(self) -> list[BlockEvent]:
        for tier in self.tiers:  # blocks a tier lost since (a disk write that failed): not to count on
            self.events += [BlockEvent("removed", (h,), tier.name) for h in tier.lost()]
        events, self.events = self.events, []
        return events

    def flush(self) -> None:
        """Wait for the tiers' writes in flight (tests; the engine never waits on the disk)."""
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Stop the tiers' threads (the disk's writer) once their writes in flight are done."""
        for tier in self.tiers:
            tier.close()

    def held(self) -> list[tuple[str, tuple[BlockHash, ...]]]:
        """Every block each tier holds (a snapshot for a new block-event subscriber)."""
        return [(t.name, held) for t in self.tiers if (held := t.hashes())]
