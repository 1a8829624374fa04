"""The torch.distributed process group of one tensor-parallel engine: gloo on a
CPU, NCCL on CUDA, met over a TCP store on loopback (rank 0 hosts it on a port the
kernel picks, so no port is guessed and none can be taken in between).

Every collective waits at most the group's timeout: a rank that died or hung makes
the others fail with an error instead of waiting for ever (gloo raises; NCCL's
watchdog, by torch's default, tears the process down: loud either way).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Each rank's device: the engine's CPU for all of them, or one GPU each from the engine's on."""
    if device.type != "cuda":
        return [device] * size
    first = device.index if device.index is not None else torch.cuda.current_device()
    if first + size > torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel size {size} from {device} needs GPUs {first}..{first + size - 1}; "
            f"this machine has {torch.cuda.device_count()}"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a free loopback port (`.port`)."""
    return dist.TCPStore(
        LOOPBACK, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """A rank's connection to rank 0's store."""
    return dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))


def join_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
    """Join the process's default group (torch.distributed has one per process, so a process
    runs at most one tensor-parallel engine at a time). Blocks until every rank has joined."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed process group "
            "(another tensor-parallel engine still open?); close that one first"
        )
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,  # NCCL binds the rank to its GPU
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
