"""Tiers behind the prefix cache: a bounded host (RAM) tier and a bounded disk tier.

A cached block evicted from the pool (its chained hash known, engine/block_hash.py)
is copied to the host tier; a block the full host tier evicts goes on to the disk
tier (one file per block under the cache directory), and one the full disk tier
evicts is gone. At allocation the scheduler asks how many of a prompt's blocks after
its pooled prefix continue in a tier (`TierStore.lookup`), decides in seconds whether
loading them beats recomputing them (`plan_load`, a pure function of the tier
bandwidths and the prefill speed this worker measured), and loads the chosen ones
into freshly allocated pool blocks (`TierStore.load`).

Every stored block carries a CRC-32 of its bytes, and a disk file also its hash and
its length; a block that fails any check, a file that is gone or short, is not
loaded: the load stops there and the rest of the prompt is recomputed, and the
failure is counted. A write that fails (a full disk) drops the block, counted.
Nothing here can produce wrong KV: the worst case is a recompute.

Every change of a block's tier is a `BlockEvent` (stored at a tier, removed from
one), so the router's prefix index learns which worker holds which prefix where.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.tier_cost import TierSpeeds, plan_load

log = logging.getLogger(__name__)

TIERS = ("host", "disk")
_MAGIC = b"SSKV"
_HEADER = struct.Struct("<4s16sIQ")  # magic, block hash, crc32 of the payload, payload length
# Disk writes that may wait for the writer thread at once. The blocks waiting are the host tier's
# spills (already in RAM, moved not copied), so the bound caps how far the disk may fall behind, not
# a new buffer: a context of 1.5K tokens is 96 blocks of 16.
DISK_WRITES_PENDING = 256


@dataclass
class TierStats:
    """Per tier, since start."""

    blocks: int = 0  # held now
    bytes: int = 0  # held now
    stored: int = 0  # blocks written into it
    hits: int = 0  # blocks loaded from it into the pool
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    recomputed_instead: int = 0  # hits that were recomputed because loading would be slower
    checksum_failures: int = 0  # loads refused: bad checksum, wrong hash, short or missing file
    write_failures: int = 0  # writes that failed (a full disk): the block dropped
    write_dropped: int = 0  # blocks not written because the disk writer's queue was full


class Fetched(NamedTuple):
    """A block read from a tier and checked, not yet in the pool."""

    hash: BlockHash
    tier: str
    data: torch.Tensor  # uint8, KVCache.export_block's layout
    seconds: float  # the read and the check


@dataclass
class _Held:
    data: torch.Tensor  # uint8
    crc: int


def _crc(data: torch.Tensor) -> int:
    return zlib.crc32(data.numpy().data)


class HostTier:
    """Blocks in RAM, LRU, bounded in bytes."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.blocks: OrderedDict[BlockHash, _Held] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.blocks

    def put(self, h: BlockHash, data: torch.Tensor, crc: int) -> list[tuple[BlockHash, torch.Tensor, int]]:
        """Store a block; returns the blocks evicted to make room (oldest first)."""
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return []
        if data.numel() > self.capacity:
            return [(h, data, crc)]
        out = []
        while self.stats.bytes + data.numel() > self.capacity:
            old, held = self.blocks.popitem(last=False)
            self.stats.bytes -= held.data.numel()
            out.append((old, held.data, held.crc))
        self.blocks[h] = _Held(data, crc)
        self.stats.bytes += data.numel()
        self.stats.stored += 1
        self.stats.blocks = len(self.blocks)
        return out

    def get(self, h: BlockHash) -> tuple[torch.Tensor, int] | None:
        held = self.blocks.get(h)
        if held is None:
            return None
        self.blocks.move_to_end(h)
        return held.data, held.crc

    def drop(self, h: BlockHash) -> None:
        held = self.blocks.pop(h, None)
        if held is not None:
            self.stats.bytes -= held.data.numel()
            self.stats.blocks = len(self.blocks)


_DISK_TIERS = itertools.count()


def _alive(pid: str) -> bool:
    """Whether a process with this id runs on this host (a folder name that is no pid: not)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's
        return True
    return True


class DiskTier:
    """One file per block, LRU, bounded in bytes (headers included), under a folder of its own inside
    `directory` (`pid-<pid>-<n>`, n counting this process's tiers): the workers of one host may share
    the directory. At start the folders of processes that are gone are deleted (their index went
    with them).

    Files are written and deleted by a writer thread of its own, never on the engine thread: `put`
    books the block into the index and queues its write, and until the write is done the block is
    read from the bytes it queued (still in RAM). At most `max_pending` writes wait at once; a block
    that would be one more is dropped, counted (`write_dropped`): a disk slower than the evictions
    costs recomputes, never a stalled step. The index is only touched on the engine thread; the
    writer reports each write's outcome through a queue that `settle` drains."""

    name = "disk"

    def __init__(self, capacity_bytes: int, directory: str, max_pending: int = DISK_WRITES_PENDING) -> None:
        self.capacity = capacity_bytes
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("pid-*"):
            if stale.is_dir() and not _alive(stale.name.split("-")[1]):
                shutil.rmtree(stale, ignore_errors=True)
        self.dir = root / f"pid-{os.getpid()}-{next(_DISK_TIERS)}"
        shutil.rmtree(self.dir, ignore_errors=True)  # a reused pid's leftovers
        self.dir.mkdir()
        self.files: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size (pending writes too)
        # queued or being written, with the write's ticket: read from here meanwhile
        self.pending: dict[BlockHash, tuple[_Held, int]] = {}
        self._tickets = itertools.count()
        self.max_pending = max_pending
        self.lost: list[BlockHash] = []  # blocks whose write failed since the last `drain_lost`
        self.stats = TierStats()
        # (block, its bytes and checksum to write, or None to delete its file; the write's ticket)
        self._jobs: queue.SimpleQueue[tuple[BlockHash, _Held | None, int] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[BlockHash, int, bool]] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, h: BlockHash) -> Path:
        return self.dir / f"{h.hex()}.kv"

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.files

    def put(self, h: BlockHash, data: torch.Tensor, crc: int) -> tuple[bool, list[BlockHash]]:
        """Book a block and queue its write; (taken, hashes evicted to make room). Not taken: too
        large for the tier, or `max_pending` writes already waiting (counted in `write_dropped`)."""
        self.settle()
        if h in self.files:
            self.files.move_to_end(h)
            return True, []
        size = _HEADER.size + data.numel()
        if size > self.capacity:
            return False, []
        if len(self.pending) >= self.max_pending:
            self.stats.write_dropped += 1
            return False, []
        evicted = []
        while self.stats.bytes + size > self.capacity:
            old, old_size = self.files.popitem(last=False)
            self._remove(old, old_size)
            evicted.append(old)
        ticket = next(self._tickets)
        self.pending[h] = (_Held(data, crc), ticket)
        self._jobs.put((h, self.pending[h][0], ticket))  # serialized on the writer thread, not here
        self.files[h] = size
        self.stats.bytes += size
        self.stats.stored += 1
        self.stats.blocks = len(self.files)
        return True, evicted

    @staticmethod
    def _write(path: Path, payload: bytes) -> None:
        with open(path, "wb") as f:
            f.write(payload)

    def _write_loop(self) -> None:
        """The writer thread: the jobs in order (a block's delete never overtakes its write)."""
        while (job := self._jobs.get()) is not None:
            h, held, ticket = job
            path = self.path(h)
            if held is None:
                path.unlink(missing_ok=True)
                continue
            try:
                payload = _HEADER.pack(_MAGIC, h, held.crc, held.data.numel()) + held.data.numpy().tobytes()
                DiskTier._write(path, payload)  # looked up at each write: a test may replace it
                self._done.put((h, ticket, True))
            except OSError:
                path.unlink(missing_ok=True)
                self._done.put((h, ticket, False))

    def settle(self) -> None:
        """Take in the writes the writer finished: a written block is read from its file from now on; a
        failed one (a full disk) leaves the index, counted, and is reported in `lost`."""
        while True:
            try:
                h, ticket, ok = self._done.get_nowait()
            except queue.Empty:
                return
            if self.pending.get(h, (None, -1))[1] != ticket:  # evicted while it was being written
                continue
            del self.pending[h]
            if not ok:
                self.stats.write_failures += 1
                size = self.files.pop(h)
                self.stats.bytes -= size
                self.stats.blocks = len(self.files)
                self.lost.append(h)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is done and settled (tests, and a clean stop)."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            try:
                done = self._done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self._done.put(done)
            self.settle()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        self._jobs.put(None)
        self._writer.join(timeout=30.0)
        self.settle()

    def drain_lost(self) -> list[BlockHash]:
        lost, self.lost = self.lost, []
        return lost

    def get(self, h: BlockHash) -> tuple[torch.Tensor, int] | None:
        """The block's bytes and stored checksum; None (and the entry dropped, counted) when the file is
        gone, short, or not this block's."""
        self.settle()
        if h not in self.files:
            return None
        if h in self.pending:  # its write still queued: the bytes it was queued with
            held = self.pending[h][0]
            self.files.move_to_end(h)
            return held.data, held.crc
        try:
            raw = self.path(h).read_bytes()
        except OSError:
            raw = b""
        ok = len(raw) >= _HEADER.size
        if ok:
            magic, fh, crc, n = _HEADER.unpack_from(raw)
            ok = magic == _MAGIC and fh == h and len(raw) == _HEADER.size + n
        if not ok:
            self.stats.checksum_failures += 1
            self.drop(h)
            return None
        self.files.move_to_end(h)
        return torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.uint8), crc

    def drop(self, h: BlockHash) -> None:
        size = self.files.pop(h, None)
        if size is not None:
            self._remove(h, size)

    def _remove(self, h: BlockHash, size: int) -> None:
        self.stats.bytes -= size
        self.stats.blocks = len(self.files)
        self.pending.pop(h, None)
        self._jobs.put((h, None, -1))


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
        """The block manager is about to reuse `block_id`, which held `h`: keep a copy."""
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
        """How many leading blocks of `hashes` a load would take from the tiers now (nothing counted)."""
        tiers, bw = self.lookup(hashes), self.bandwidth.values
        return plan_load(tiers, self.block_bytes, self.layout.block_size, bw, self.prefill_tokens_per_s)

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
        t0 = time.perf_counter()
        self.kv_cache.import_block(block_id, fetched.data)
        dt = fetched.seconds + time.perf_counter() - t0
        stats = self.stats[fetched.tier]
        stats.hits += 1
        stats.bytes_loaded += fetched.data.numel()
        stats.load_seconds += dt
        self.bandwidth.observe(fetched.tier, fetched.data.numel(), dt)

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
