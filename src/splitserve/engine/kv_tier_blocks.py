"""The two tiers behind the prefix cache that a worker's flags ask for (`configured_tiers`), each a
`KVTier` (engine/kv_tier.py): `HostTier` (RAM) and `DiskTier` (one checksummed file per block,
written by a thread of its own), each LRU and bounded in bytes, each with its counts (`TierStats`).
What goes into them and what comes out, checked, is engine/kv_tiers.py's.

A disk file is a header (magic, the block's hash, the CRC-32 of the payload, the payload's length)
and the block's bytes (KVCache.export_block's layout).
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_tier import PROBE_LOADS, Held, KVTier, Spill, TierStats

_MAGIC = b"SSKV"
_HEADER = struct.Struct("<4s16sIQ")  # magic, block hash, crc32 of the payload, payload length
# Disk writes that may wait for the writer thread at once. The blocks waiting are the host tier's
# spills (already in RAM, moved not copied), so the bound caps how far the disk may fall behind, not
# a new buffer: a context of 1.5K tokens is 96 blocks of 16.
DISK_WRITES_PENDING = 256
# Disk blocks read ahead at once (`DiskTier.prefetch`), about two 1.5K-token contexts: a read ahead
# that no load takes (the request was aborted) waits until its block leaves the tier.
DISK_READS_AHEAD = 192


def crc32(data: torch.Tensor) -> int:
    return zlib.crc32(data.numpy().data)


class HostTier(KVTier):
    """Blocks in RAM, LRU, bounded in bytes. `pinned` (on CUDA): kept in pinned memory, so that a load
    to the device can be asynchronous (engine/kv_tiers.py's `CudaLoads`)."""

    name = "host"

    def __init__(self, capacity_bytes: int, pinned: bool = False) -> None:
        self.capacity = capacity_bytes
        self.pinned = pinned
        self.blocks: OrderedDict[BlockHash, Held] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.blocks

    def refresh(self, h: BlockHash) -> bool:
        if h not in self.blocks:
            return False
        self.blocks.move_to_end(h)
        return True

    def put(self, h: BlockHash, held: Held, pass_on: bool) -> tuple[bool, list[Spill]]:
        """Store a block (the bytes it lets go of are in RAM already: `pass_on` costs nothing)."""
        if self.refresh(h):
            return True, []
        if held.data.numel() > self.capacity:
            return False, [Spill(h, held)]
        out = []
        while self.stats.bytes + held.data.numel() > self.capacity:
            old, gone = self.blocks.popitem(last=False)
            self.stats.bytes -= gone.data.numel()
            out.append(Spill(old, gone))
        self.blocks[h] = Held(held.data.pin_memory(), held.crc) if self.pinned else held
        self.stats.bytes += held.data.numel()
        self.stats.stored += 1
        self.stats.blocks = len(self.blocks)
        return True, out

    def get(self, h: BlockHash) -> Held | None:
        held = self.blocks.get(h)
        if held is None:
            return None
        self.blocks.move_to_end(h)
        return held

    def drop(self, h: BlockHash) -> None:
        held = self.blocks.pop(h, None)
        if held is not None:
            self.stats.bytes -= held.data.numel()
            self.stats.blocks = len(self.blocks)

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self.blocks)

    def probe(self, data: torch.Tensor, load: Callable[[torch.Tensor], None]) -> float:
        """A load from RAM: the copy into the pool and the checksum."""
        t0 = time.perf_counter()
        for _ in range(PROBE_LOADS):
            load(data.clone())
            crc32(data)
        return time.perf_counter() - t0


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


def read_file(path: Path) -> bytes:
    """A tier file's bytes; empty when it cannot be read (gone): `DiskTier.get` refuses it, counted."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


class DiskTier(KVTier):
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
        self.pending: dict[BlockHash, tuple[Held, int]] = {}
        self._tickets = itertools.count()
        self.max_pending = max_pending
        self.lost_writes: list[BlockHash] = []  # blocks whose write failed since the last `lost`
        self.stats = TierStats()
        # (block, its bytes and checksum to write, or None to delete its file; the write's ticket)
        self._jobs: queue.SimpleQueue[tuple[BlockHash, Held | None, int] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[BlockHash, int, bool]] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        # reads ahead of a load: a prompt's disk blocks are read while it waits for its allocation
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-reader")
        self.read_ahead: dict[BlockHash, Future[bytes]] = {}

    def path(self, h: BlockHash) -> Path:
        return self.dir / f"{h.hex()}.kv"

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.files

    def refresh(self, h: BlockHash) -> bool:
        self.settle()
        if h not in self.files:
            return False
        self.files.move_to_end(h)
        return True

    def put(self, h: BlockHash, held: Held, pass_on: bool) -> tuple[bool, list[Spill]]:
        """Book a block and queue its write. Not taken: too large for the tier (handed back), or
        `max_pending` writes already waiting (dropped, counted in `write_dropped`). `pass_on`: the
        files it evicts are read back for the next tier first (on this thread: a tier after the disk
        is one the evictions may wait for)."""
        if self.refresh(h):
            return True, []
        size = _HEADER.size + held.data.numel()
        if size > self.capacity:
            return False, [Spill(h, held)]
        if len(self.pending) >= self.max_pending:
            self.stats.write_dropped += 1
            return False, []
        evicted = []
        while self.stats.bytes + size > self.capacity:
            old, old_size = self.files.popitem(last=False)
            evicted.append(Spill(old, self._read(old) if pass_on else None))
            self._remove(old, old_size)
        ticket = next(self._tickets)
        self.pending[h] = (held, ticket)
        self._jobs.put((h, held, ticket))  # serialized on the writer thread, not here
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
                self.lost_writes.append(h)

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

    def prefetch(self, hashes: Iterable[BlockHash]) -> None:
        """Start reading these blocks' files on the reader thread (at most `DISK_READS_AHEAD` at once), so
        that their load (`get`, at the prompt's allocation) finds the bytes read. Checked at `get`, as
        any read: a read ahead is only early, never trusted."""
        for h in hashes:
            if len(self.read_ahead) >= DISK_READS_AHEAD:
                return
            if h in self.files and h not in self.pending and h not in self.read_ahead:
                self.read_ahead[h] = self._reader.submit(read_file, self.path(h))

    def close(self) -> None:
        """Finish the queued writes and stop the writer and reader threads."""
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._jobs.put(None)
        self._writer.join(timeout=30.0)
        self.settle()

    def lost(self) -> list[BlockHash]:
        """The blocks whose write failed since last asked (the writes finished so far taken in)."""
        self.settle()
        lost, self.lost_writes = self.lost_writes, []
        return lost

    def get(self, h: BlockHash) -> Held | None:
        """None (and the entry dropped, counted) when the file is gone, short, or not this block's."""
        self.settle()
        if h not in self.files:
            return None
        held = self._read(h)
        if held is None:
            self.stats.checksum_failures += 1
            self.drop(h)
            return None
        self.files.move_to_end(h)
        return held

    def _read(self, h: BlockHash) -> Held | None:
        """A booked block's bytes and stored checksum: the ones its write was queued with while it
        waits, else its file's (read ahead, or now); None when the file does not hold this block."""
        if h in self.pending:
            return self.pending[h][0]
        ahead = self.read_ahead.pop(h, None)
        raw = ahead.result() if ahead is not None else read_file(self.path(h))
        if len(raw) < _HEADER.size:
            return None
        magic, fh, crc, n = _HEADER.unpack_from(raw)
        if magic != _MAGIC or fh != h or len(raw) != _HEADER.size + n:
            return None
        return Held(torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.uint8), crc)

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self.files)

    def probe(self, data: torch.Tensor, load: Callable[[torch.Tensor], None]) -> float | None:
        """A load from a file: its read, the checksum and the copy into the pool; None when the
        directory cannot be written."""
        crc = crc32(data)
        probe = self.dir / "probe.tmp"
        try:
            DiskTier._write(probe, data.numpy().tobytes())
            t0 = time.perf_counter()
            for _ in range(PROBE_LOADS):
                raw = torch.frombuffer(bytearray(probe.read_bytes()), dtype=torch.uint8)
                zlib.crc32(raw.numpy().data) == crc  # noqa: B015  # the checksum is part of a load's cost
                load(raw)
            return time.perf_counter() - t0
        except OSError:
            return None
        finally:
            probe.unlink(missing_ok=True)

    def drop(self, h: BlockHash) -> None:
        size = self.files.pop(h, None)
        if size is not None:
            self._remove(h, size)

    def _remove(self, h: BlockHash, size: int) -> None:
        self.stats.bytes -= size
        self.stats.blocks = len(self.files)
        self.pending.pop(h, None)
        self.read_ahead.pop(h, None)  # a read under way may see the file go: the next read is afresh
        self._jobs.put((h, None, -1))


def configured_tiers(cfg: EngineConfig) -> list[KVTier]:
    """The tiers `cfg` asks for, fastest first: host RAM, then disk (under `kv_disk_tier_dir`, or a
    fresh temporary directory); a size of 0 leaves a tier out. On CUDA the host tier's blocks are
    pinned, so that their loads can be asynchronous."""
    tiers: list[KVTier] = []
    if cfg.kv_host_tier_bytes > 0:
        tiers.append(
            HostTier(cfg.kv_host_tier_bytes, pinned=cfg.torch_device.type == "cuda" and torch.cuda.is_available())
        )
    if cfg.kv_disk_tier_bytes > 0:
        directory = cfg.kv_disk_tier_dir or tempfile.mkdtemp(prefix="splitserve-kv-")
        tiers.append(DiskTier(cfg.kv_disk_tier_bytes, directory))
    return tiers
