"""Cores lent between the workers of one machine, step by step.

A lone long prompt on one core waits twice as long as it must when the core
next to it is idle (issue 22: 3.2 s against vLLM's 2.4 s for ~1,100 tokens,
vLLM spreading the prompt over both cores). So a step that prefills takes the
cores no other worker of the machine claims now, and a worker that has work
claims its own cores back: the borrower sees the claim at its next step
boundary and shrinks to what is left (never below its own share).

The workers share a small file in /dev/shm (each node has its own, so workers
of a multi-node cluster lend only within their machine): one slot per worker
process, its pid and the cores its current step claims (0 while idle). A
worker writes only its own slot, and sizes a step under the file's lock, so two
workers starting a step at once do not both take every free core. A slot whose
process is gone counts for nothing, so a crashed worker lends its cores back.

`step_threads` is the policy, pure; `CoreLease` is the file.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

SLOTS = 64  # worker processes per machine that can share one lease file
_SLOT = struct.Struct("<ii")  # pid, cores claimed
_SIZE = SLOTS * _SLOT.size


def step_threads(total_cores: int, own_cores: int, others_claimed: int, borrows: bool) -> int:
    """The threads a worker's next step runs on. A step that may borrow (one that prefills) takes
    every core the other workers do not claim, and at least its own share; any other step runs on
    its own share, since a decode step at a few sequences gains little from a second thread."""
    if not borrows:
        return own_cores
    return max(own_cores, total_cores - others_claimed)


class CoreLease:
    """This worker's slot in the machine's lease file; `acquire` at each step, `release` when idle."""

    def __init__(self, path: str, total_cores: int, own_cores: int, pid: int | None = None) -> None:
        if total_cores < 1 or own_cores < 1:
            raise ValueError(f"core lease: total_cores ({total_cores}) and own_cores ({own_cores}) must be >= 1")
        if own_cores > total_cores:
            raise ValueError(f"core lease: own_cores ({own_cores}) is more than the {total_cores} cores shared")
        self.path = path
        self.total_cores = total_cores
        self.own_cores = own_cores
        self.pid = os.getpid() if pid is None else pid
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with _locked(self._fd):
            if os.fstat(self._fd).st_size < _SIZE:
                os.ftruncate(self._fd, _SIZE)
            self._map = mmap.mmap(self._fd, _SIZE)
            self._slot = self._take_slot()
        self.claimed = 0

    def acquire(self, borrows: bool) -> int:
        """Claim the cores of the next step and return how many threads it runs on."""
        with _locked(self._fd):
            threads = step_threads(self.total_cores, self.own_cores, self._others_claimed(), borrows)
            self._write(self._slot, self.pid, threads)
        self.claimed = threads
        return threads

    def release(self) -> None:
        """Idle: claim nothing, so that a neighbour's next prefill step may take these cores."""
        if self.claimed:
            self._write(self._slot, self.pid, 0)  # one aligned word: a reader sees the old or the new
            self.claimed = 0

    def close(self) -> None:
        if self._fd < 0:
            return
        with _locked(self._fd):
            self._write(self._slot, 0, 0)
            if not any(pid and _alive(pid) for pid, _ in _SLOT.iter_unpack(self._map)):
                _unlink(self.path)  # the last worker of the machine gone: leave nothing in /dev/shm
        self._map.close()
        os.close(self._fd)
        self._fd = -1

    def _take_slot(self) -> int:
        free = None
        for i in range(SLOTS):
            pid, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == self.pid:
                return i
            if free is None and (pid == 0 or not _alive(pid)):
                free = i
        if free is None:
            raise RuntimeError(f"core lease {self.path}: all {SLOTS} slots are held by live processes")
        self._write(free, self.pid, 0)
        return free

    def _others_claimed(self) -> int:
        total = 0
        for i in range(SLOTS):
            if i == self._slot:
                continue
            pid, cores = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and cores and _alive(pid):
                total += cores
        return total

    def _write(self, slot: int, pid: int, cores: int) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, pid, cores)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@contextmanager
def _locked(fd: int) -> Iterator[None]:
    """The lease file's exclusive lock, held for a few microseconds per step."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
