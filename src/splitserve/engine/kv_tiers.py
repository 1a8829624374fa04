"""Tiers behind the prefix cache: a bounded host (RAM) tier and a bounded disk tier.

A cached block evicted from the pool (its chained hash known, engine/block_hash.py)
is copied to the host tier; a block the full host tier evicts goes on to the disk
tier (one file per block under the cache directory), and one the full disk tier
evicts is gone. At allocation the scheduler asks how many of a prompt's blocks after
its pooled prefix continue in a tier (`TierStore.lookup`), decides in seconds whether
loading them beats recomputing them (`plan_load`, a pure function of the tier
bandwidths and the prefill speed this worker measured), reads and checks the chosen
ones (`TierStore.fetch`) and writes them into freshly allocated pool blocks
(`TierStore.install`). The tiers themselves, as stores of blocks, are
engine/kv_tier_blocks.py's; the disk tier writes on a thread of its own. On CUDA the
host tier's blocks are pinned and a load runs on a stream of its own (`CudaLoads`).

Every stored block carries a CRC-32 of its bytes, and a disk file also its hash and
its length; a block that fails any check, a file that is gone or short, is not
loaded: the load stops there and the rest of the prompt is recomputed, and the
failure is counted. A write that fails (a full disk) drops the block, counted.
Nothing here can produce wrong KV: the worst case is a recompute.

Every change of a block's tier is a `BlockEvent` (stored at a tier, removed from
one), so the router's prefix index learns which worker holds which prefix where.
"""

from __future__ import annotations

import logging
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_tier_blocks import DiskTier, HostTier, TierStats
from splitserve.engine.kv_tier_blocks import crc32 as _crc
from splitserve.engine.tier_cost import TierSpeeds, plan_load

log = logging.getLogger(__name__)

TIERS = ("host", "disk")


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

    @staticmethod
    def pin(data: torch.Tensor) -> torch.Tensor:
        return data.pin_memory()

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
    """The host and disk tiers of one engine's pool: what the block manager evicts goes in, what the
    scheduler chooses to load comes out, checked."""

    def __init__(self, kv_cache: KVCache, host_bytes: int, disk_bytes: int = 0, disk_dir: str | None = None) -> None:
        self.kv_cache = kv_cache
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk: DiskTier | None = None
        if disk_bytes > 0:
            self.disk = DiskTier(disk_bytes, disk_dir or tempfile.mkdtemp(prefix="splitserve-kv-"))
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
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats
        if self.disk is not None:
            out["disk"] = self.disk.stats
        return out

    def _probe(self) -> None:
        """Seed the bandwidths: one block's bytes through each tier, a few times."""
        data = torch.randint(0, 256, (self.block_bytes,), dtype=torch.uint8)
        crc = _crc(data)
        if self.host is not None:
            t0 = time.perf_counter()
            for _ in range(4):
                self.kv_cache.import_block(self.kv_cache.num_blocks - 1, data.clone())
                _crc(data)
            self.bandwidth.observe("host", 4 * self.block_bytes, time.perf_counter() - t0)
        if self.disk is not None:
            probe = self.disk.dir / "probe.tmp"
            try:
                DiskTier._write(probe, data.numpy().tobytes())
                t0 = time.perf_counter()
                for _ in range(4):
                    raw = torch.frombuffer(bytearray(probe.read_bytes()), dtype=torch.uint8)
                    zlib.crc32(raw.numpy().data) == crc  # noqa: B015  # the checksum is part of a load's cost
                    self.kv_cache.import_block(self.kv_cache.num_blocks - 1, raw)
                self.bandwidth.observe("disk", 4 * self.block_bytes, time.perf_counter() - t0)
            except OSError:
                pass
            finally:
                probe.unlink(missing_ok=True)
        self.kv_cache.reset_blocks([self.kv_cache.num_blocks - 1])

    # ---- in: the pool evicted a cached block ----

    def evicted(self, block_id: int, h: BlockHash) -> None:
        """The block manager is about to reuse `block_id`, which held `h`: keep a copy (of a whole
        block only: one whose windowed pages went back to the pool cannot be loaded again)."""
        if not self.kv_cache.whole(block_id):
            return
        if self.host is None:
            if self.disk is not None:
                data = self.kv_cache.export_block(block_id)
                self._to_disk(h, data, _crc(data))
            return
        if h in self.host:
            self.host.put(h, self.host.blocks[h].data, self.host.blocks[h].crc)  # refresh
            self.events.append(BlockEvent("stored", (h,), "host"))
            return
        data = self.kv_cache.export_block(block_id)
        if self.cuda is not None:  # loads from pinned memory can be asynchronous
            data = self.cuda.pin(data)
        crc = _crc(data)
        spilled = self.host.put(h, data, crc)
        if h in self.host:
            self.events.append(BlockEvent("stored", (h,), "host"))
        for old, d, c in spilled:
            if old != h:
                self.events.append(BlockEvent("removed", (old,), "host"))
            if self.disk is not None:
                self._to_disk(old, d, c)

    def _to_disk(self, h: BlockHash, data: torch.Tensor, crc: int) -> None:
        assert self.disk is not None
        written, evicted = self.disk.put(h, data, crc)
        for old in evicted:
            self.events.append(BlockEvent("removed", (old,), "disk"))
        if written:
            self.events.append(BlockEvent("stored", (h,), "disk"))

    # ---- out: a prompt continues in a tier ----

    def lookup(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The tier of each leading block of `hashes` that some tier holds (stops at the first miss)."""
        out: list[str] = []
        for h in hashes:
            if self.host is not None and h in self.host:
                out.append("host")
            elif self.disk is not None and h in self.disk:
                out.append("disk")
            else:
                break
        return out

    def loadable(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` a load would take from the tiers now (nothing counted).
        Asked when a prompt is admitted, so the disk blocks among them start being read now (the
        reader thread): their load at the prompt's allocation, after its wait for a seat or for the
        step in progress, finds them read."""
        tiers, bw = self.lookup(hashes), self.bandwidth.values
        n = plan_load(tiers, self.block_bytes, self.layout.block_size, bw, self.prefill_tokens_per_s)
        if self.disk is not None:
            self.disk.prefetch(h for h, t in zip(hashes[:n], tiers[:n], strict=True) if t == "disk")
        return n

    def plan(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` to load (the rest recompute), the skipped hits counted."""
        tiers = self.lookup(hashes)
        n = plan_load(tiers, self.block_bytes, self.layout.block_size, self.bandwidth.values, self.prefill_tokens_per_s)
        for tier in tiers[n:]:
            self.stats[tier].recomputed_instead += 1
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
        tier_name, got = "", None
        if self.host is not None and h in self.host:
            tier_name, got = "host", self.host.get(h)
        elif self.disk is not None and h in self.disk:
            tier_name, got = "disk", self.disk.get(h)
        if not tier_name:
            return None
        tier = self.host if tier_name == "host" else self.disk
        assert tier is not None
        if got is None:  # the disk tier counted it
            self.events.append(BlockEvent("removed", (h,), tier_name))
            return None
        data, crc = got
        if data.numel() != self.block_bytes or _crc(data) != crc:
            tier.stats.checksum_failures += 1
            tier.drop(h)
            self.events.append(BlockEvent("removed", (h,), tier_name))
            return None
        return Fetched(h, tier_name, data, time.perf_counter() - t0)

    def install(self, fetched: Fetched, block_id: int) -> None:
        """Write a fetched block into pool block `block_id`; its tier counts the hit."""
        stats = self.stats[fetched.tier]
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
            self.stats[tier].load_seconds += seconds
            self.bandwidth.observe(tier, nbytes, seconds)

    def note_prefix(self, prompt_tokens: int, pooled_tokens: int, loaded: Sequence[Fetched]) -> None:
        """Log where an admitted prompt's prefix came from: the one per-request record of it (the
        conversation benchmark splits its TTFTs by it; an operator reads how often a tier served)."""
        bs = self.layout.block_size
        host = sum(bs for f in loaded if f.tier == "host")
        disk = len(loaded) * bs - host
        log.info(
            "prefix: prompt %d tokens, pool %d, host %d, disk %d, computed %d",
            prompt_tokens,
            pooled_tokens,
            host,
            disk,
            prompt_tokens - pooled_tokens - host - disk,
        )

    def speeds(self) -> TierSpeeds:
        """What this worker measured, for the router (WorkerStats)."""
        if self.cuda is not None:
            self._harvest_cuda()
        bw = self.bandwidth.values
        return TierSpeeds(self.prefill_tokens_per_s or 0.0, bw.get("host", 0.0), bw.get("disk", 0.0), self.block_bytes)

    def observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.2) -> None:
        """A step that prefilled `tokens` tokens in `seconds`: the prefill speed's running average."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - alpha) * old + alpha * rate

    def drain_events(self) -> list[BlockEvent]:
        if self.disk is not None:  # disk writes that failed since: the router must not count on them
            self.disk.settle()
            self.events += [BlockEvent("removed", (h,), "disk") for h in self.disk.drain_lost()]
        events, self.events = self.events, []
        return events

    def flush(self) -> None:
        """Wait for the disk tier's queued writes (tests; the engine never waits on the disk)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Stop the disk tier's writer thread once its queued writes are done."""
        if self.disk is not None:
            self.disk.close()

    def held(self) -> list[tuple[str, tuple[BlockHash, ...]]]:
        """Every block each tier holds (a snapshot for a new block-event subscriber)."""
        out = []
        if self.host is not None and self.host.blocks:
            out.append(("host", tuple(self.host.blocks)))
        if self.disk is not None and self.disk.files:
            out.append(("disk", tuple(self.disk.files)))
        return out
