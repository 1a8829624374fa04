"""Rank 0's side of tensor parallelism: start the other ranks, send each step's
inputs to them, sum over them, stop them.

Rank 0 is the worker's own process. It hands each rank its shard of the weights
and its KV shard when it spawns it (torch.multiprocessing: shared memory on a
CPU, CUDA IPC on a GPU), waits until every rank has its weights in place, then
joins the process group with them. A rank that dies or fails makes rank 0's
next send or collective raise a RuntimeError naming the rank and how it ended;
the group is unusable from then on (the engine has lost part of every layer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import KVCache, check_shared_memory
from splitserve.engine.parallel.process_group import host_store, join_group, leave_group
from splitserve.engine.parallel.rank import FAILED, LOADED, STOP, RankSpec, rank_main
from splitserve.engine.parallel.shard import rank_config, shard_weights
from splitserve.engine.parallel.step import StepInputs
from splitserve.engine.quant.weight import QuantizedWeight, Weight, owns_storage

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a step's all-reduce waits this long at most for the slowest rank
START_TIMEOUT_S = 300.0  # a rank's start: a fresh interpreter, torch's import, its weights
STOP_TIMEOUT_S = 10.0  # a rank told to stop that has not exited by then is killed


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection  # rank 0's end of the pipe
    failure: str = ""  # the rank's own account of its failure, once read

    def note(self, msg: bytes) -> None:
        """Keep a message's account of the rank's failure: its traceback's last line."""
        if msg.startswith(FAILED):
            lines = msg[len(FAILED) :].decode(errors="replace").strip().splitlines()
            self.failure = lines[-1] if lines else "failed"

    def status(self) -> str:
        """Running, or how it ended, with its own account where it sent one."""
        if self.process.is_alive():
            return f"rank {self.rank} (pid {self.process.pid}) running"
        try:
            while not self.failure and self.conn.poll(0):
                self.note(self.conn.recv_bytes())
        except (EOFError, OSError):
            pass  # nothing more from it
        why = f": {self.failure}" if self.failure else ""
        return f"rank {self.rank} (pid {self.process.pid}) exited with code {self.process.exitcode}{why}"


@dataclass
class TensorParallelGroup:
    size: int
    store: dist.TCPStore  # rank 0 hosts it; it must outlive the group
    ranks: list[_Rank] = field(default_factory=list)
    broken: str = ""  # why the group can no longer run a step
    _joined: bool = False
    _threads_before: int = 0  # this process's torch threads before the group took its share

    @staticmethod
    def start(
        model_cfg: ModelConfig,
        weights: Mapping[str, Weight],
        cfg: EngineConfig,
        kv_cache: KVCache,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> TensorParallelGroup:
        """Spawn ranks 1..N-1 with their shards of `weights` and of `kv_cache`, and join the
        group with them as rank 0. Raises RuntimeError if a rank fails to start."""
        size = cfg.tensor_parallel_size
        group = TensorParallelGroup(size, host_store(size, start_timeout_s))
        ctx = mp.get_context("spawn")
        shapes = rank_config(model_cfg, size)
        # The ranks compute at the same time: each, this one too, takes its share of this
        # process's threads (with more threads than cores, the all-reduces wait on descheduled
        # ranks: on 2 cores a tiny model's TP 2 decode step took 42 ms so, 8 ms shared out).
        threads = max(1, torch.get_num_threads() // size)
        group._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rank_weights = {r: _for_rank(shard_weights(model_cfg, weights, r, size)) for r in range(1, size)}
            check_shared_memory(_bytes_to_share(rank_weights.values()))
            for r in range(1, size):
                spec = RankSpec(
                    rank=r,
                    size=size,
                    store_port=group.store.port,
                    device=str(kv_cache.shard(r).device),
                    dtype=cfg.dtype,
                    model_cfg=shapes,
                    weights=rank_weights.pop(r),
                    kv_cache=kv_cache.shard(r),
                    threads=threads,
                    timeout_s=timeout_s,
                )
                here, there = ctx.Pipe()
                process = ctx.Process(target=rank_main, args=(spec, there), name=f"splitserve-tp-rank-{r}", daemon=True)
                process.start()
                there.close()  # the rank's end lives in the rank: EOF here once it exits
                group.ranks.append(_Rank(r, process, here))
            group._await_loaded(start_timeout_s)
            join_group(group.store, 0, size, kv_cache.shard(0).device, timeout_s)
            group._joined = True
        except BaseException:
            group.close()
            raise
        log.info("tensor-parallel group of %d ranks up: %s", size, "; ".join(r.status() for r in group.ranks))
        return group

    def _await_loaded(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            ready = wait([r.conn, r.process.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"tensor-parallel rank {r.rank} did not load its weights within {timeout_s:.0f}s")
            msg = b""
            if r.conn in ready:
                try:
                    msg = r.conn.recv_bytes()
                except EOFError:
                    pass
            if msg != LOADED:
                r.note(msg)
                r.process.join(STOP_TIMEOUT_S)
                raise RuntimeError(f"tensor-parallel {r.status()} while starting")

    def broadcast(self, step: StepInputs) -> None:
        """Send a step to every other rank; rank 0 then runs its own shard of it."""
        self._check()
        data = step.encode()
        for r in self.ranks:
            try:
                r.conn.send_bytes(data)
            except OSError as e:
                self._fail(f"cannot send a step to rank {r.rank} ({e})")

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks in place (the model's o and down outputs)."""
        self._check()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:  # gloo's and NCCL's errors, a timeout among them
            self._fail(f"all-reduce failed ({e})")

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError(f"tensor-parallel group unusable: {self.broken}")

    def _fail(self, what: str) -> None:
        for r in self.ranks:  # a rank whose socket just closed may still be exiting
            r.process.join(0.2)
        self.broken = f"{what}; " + "; ".join(r.status() for r in self.ranks)
        raise RuntimeError(f"tensor-parallel step failed: {self.broken}")

    def close(self) -> None:
        """Stop every rank (killing one that does not stop in time) and leave the group. Idempotent."""
        for r in self.ranks:
            try:
                r.conn.send_bytes(STOP)
            except OSError:
                pass  # already gone
        for r in self.ranks:
            r.process.join(STOP_TIMEOUT_S)
            if r.process.is_alive():
                log.warning("tensor-parallel rank %d did not stop in %.0fs; killing it", r.rank, STOP_TIMEOUT_S)
                r.process.kill()
                r.process.join(STOP_TIMEOUT_S)
            r.conn.close()
        self.ranks.clear()
        if self._joined:
            leave_group()
            self._joined = False
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = 0
        self.broken = self.broken or "closed"


def _for_rank(shard: dict[str, Weight]) -> dict[str, Weight]:
    """A rank's weights as it will map them: a slice cloned (handing over a view would move the
    whole tensor, or the whole mapped file, into shared memory), a whole tensor as it is (one
    shared copy for every rank)."""
    out: dict[str, Weight] = {}
    for name, t in shard.items():
        if isinstance(t, QuantizedWeight):
            out[name] = t.own_parts()
        else:
            out[name] = t if owns_storage(t) else t.clone()
    return out


def _bytes_to_share(shards: Iterable[dict[str, Weight]]) -> int:
    """Bytes that handing these tensors to other processes moves into shared memory."""
    tensors = [
        p for shard in shards for w in shard.values() for p in (_tensors(w) if isinstance(w, QuantizedWeight) else [w])
    ]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cpu and not t.is_shared()
    }
    return sum(storages.values())


def _tensors(w: QuantizedWeight) -> list[torch.Tensor]:
    return [p.data for p in w.parts] + ([w.order] if w.order is not None else [])
