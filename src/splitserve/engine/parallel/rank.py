"""A tensor-parallel rank other than 0: a process that holds its shard of the
weights and of the KV cache and runs every step rank 0 sends, until told to stop
or until rank 0 is gone.

It waits for the next step on its pipe and on its parent's sentinel at once, so an
idle rank needs no timeout and still exits as soon as the worker does, however
the worker ended. Inside a step the collectives carry the group's timeout.
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from splitserve.engine.config import ModelConfig, parse_dtype
from splitserve.engine.model import DecoderModel
from splitserve.engine.parallel.process_group import join_group, join_store, leave_group
from splitserve.engine.parallel.step import StepInputs, run_step
from splitserve.engine.quant.weight import Weight

log = logging.getLogger(__name__)

# Pipe messages besides steps (a step is a whole number of int64s, 8n bytes; these are not).
LOADED = b"loaded"  # rank to rank 0: weights in place, joining the group
STOP = b"stop"  # rank 0 to rank: leave the group and exit
FAILED = b"failed: "  # rank to rank 0, then the traceback's text


@dataclass(frozen=True)
class RankSpec:
    """What a rank starts from. torch.multiprocessing passes its tensors by reference:
    shared memory on a CPU, a CUDA IPC handle on a GPU; nothing is copied."""

    rank: int
    size: int
    store_port: int
    device: str
    dtype: str
    model_cfg: ModelConfig  # the rank's shapes (shard.rank_config)
    weights: dict[str, Weight]  # the rank's shard (shard.shard_weights): floats and quantized blocks
    kv_cache: torch.Tensor  # the rank's KV shard, held by rank 0 too
    threads: int  # torch threads of this process
    timeout_s: float  # every collective's, and the group's start


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """The process's entry point (torch.multiprocessing, spawn context)."""
    # Ctrl-C reaches the whole process group; rank 0 alone handles it, and stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = DecoderModel(spec.model_cfg, spec.weights, device, parse_dtype(spec.dtype), reduce=_all_reduce)
        # The process object keeps its arguments for life: let go of the tensors the model
        # copied (column slices made contiguous, anything moved to a GPU).
        spec.weights.clear()
        conn.send_bytes(LOADED)
        join_group(join_store(spec.store_port, spec.size, spec.timeout_s), spec.rank, spec.size, device, spec.timeout_s)
        _serve(model, spec.kv_cache, conn)
    except BaseException:
        text = traceback.format_exc()
        log.error("tensor-parallel rank %d failed:\n%s", spec.rank, text)
        try:
            conn.send_bytes(FAILED + text.encode())
        except OSError:
            pass  # rank 0 is gone too
        raise SystemExit(1) from None
    finally:
        leave_group()


def _serve(model: DecoderModel, kv_cache: torch.Tensor, conn: Connection) -> None:
    parent = parent_process()
    if parent is None:
        raise RuntimeError("a tensor-parallel rank must be started by rank 0")
    while True:
        if conn not in wait([conn, parent.sentinel]):
            return  # rank 0 exited without a word: nobody will send another step
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg == STOP:
            return
        run_step(model, kv_cache, StepInputs.decode(msg))


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)
