"""The machines a plan runs on: accelerators and the network between them.

The GPU figures are datasheet peaks (NVIDIA's spec sheets, SXM parts, dense bf16
without sparsity); no kernel reaches them, which is why the roofline takes its
efficiency factors as parameters. `cpu-here` is this machine's CPU as measured:
from a calibration profile when one is given, else from a quick measurement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    # one direction of the intra-node link (NVLink is quoted as both directions added up;
    # a ring all-reduce sends and receives at once, so one direction is what bounds it)
    interconnect_bytes_per_s: float

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "hbm_bytes_per_s", "bf16_flops", "interconnect_bytes_per_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Accelerator.{f} must be positive")


# Datasheet peaks. Memory: the 80 GB parts hold 80 GiB; H200's 141 GB and B200's 180 GB are decimal.
GPUS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a100-80gb", 80 * GIB, 2.039e12, 312e12, 300e9),  # NVLink 3: 600 GB/s both ways
        Accelerator("h100-sxm", 80 * GIB, 3.35e12, 989e12, 450e9),  # NVLink 4: 900 GB/s
        Accelerator("h200", 141e9, 4.8e12, 989e12, 450e9),  # NVLink 4: 900 GB/s
        Accelerator("b200", 180e9, 8.0e12, 2.25e15, 900e9),  # NVLink 5: 1.8 TB/s
    )
}

CPU_HERE = "cpu-here"


def cpu_from_profile(profile: Mapping[str, Any], memory_bytes: float | None = None) -> Accelerator:
    """This machine's CPU from measured figures: `memory_bytes_per_s` (streaming read bandwidth)
    and `matmul_flops` (the engine's dtype, one process). Memory is the machine's RAM unless given."""
    try:
        bandwidth, flops = float(profile["memory_bytes_per_s"]), float(profile["matmul_flops"])
    except KeyError as e:
        raise ValueError(f"a CPU profile needs {e.args[0]!r} (measured)") from None
    ram = memory_bytes if memory_bytes is not None else float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    # one CPU, no peer: "interconnect" is a memory copy, so the all-reduce term costs what a copy does
    return Accelerator(CPU_HERE, ram, bandwidth, flops, bandwidth)


def measure_cpu(seconds: float = 0.3) -> dict[str, float]:
    """A quick measurement of this CPU: fp32 matmul FLOP/s and the bandwidth of a large array sum."""
    import numpy as np

    a = np.ones((512, 512), dtype=np.float32)
    big = np.ones(64 * 2**20 // 4, dtype=np.float32)  # 64 MiB: past the caches

    def rate(work: float, step: Any) -> float:
        step()  # warm
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            step()
            n += 1
        return work * n / (time.perf_counter() - start)

    return {
        "matmul_flops": rate(2.0 * 512**3, lambda: a @ a),
        "memory_bytes_per_s": rate(float(big.nbytes), big.sum),
    }


def accelerator(name: str, profile: Mapping[str, Any] | None = None) -> Accelerator:
    """A GPU from the table, or `cpu-here` (from `profile`, else measured now)."""
    if name == CPU_HERE:
        return cpu_from_profile(profile if profile is not None else measure_cpu())
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown accelerator {name!r}; expected one of {', '.join([*GPUS, CPU_HERE])}") from None


@dataclass(frozen=True)
class Network:
    """The link between a prefill and a decode worker."""

    gbps: float  # line rate, Gb/s
    rdma: bool  # RDMA (GPUDirect, no host copy) or TCP through the host
    latency_s: float  # per message (one message per layer when pipelined)
    # the share of line rate a KV stream reaches: an assumption, not a measurement. TCP copies
    # GPU -> host -> kernel and back on the far side; RDMA writes straight into the far GPU.
    efficiency: float

    def __post_init__(self) -> None:
        if self.gbps <= 0:
            raise ValueError("Network.gbps must be positive")
        if not 0 < self.efficiency <= 1:
            raise ValueError("Network.efficiency must be in (0, 1]")
        if self.latency_s < 0:
            raise ValueError("Network.latency_s must be >= 0")

    @property
    def line_bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8

    @property
    def bytes_per_s(self) -> float:
        return self.line_bytes_per_s * self.efficiency

    @staticmethod
    def of(gbps: float, rdma: bool, efficiency: float | None = None, latency_s: float | None = None) -> Network:
        """Defaults: RDMA reaches 90% of line rate with 5 us per message, TCP 50% with 50 us."""
        return Network(
            gbps=gbps,
            rdma=rdma,
            latency_s=latency_s if latency_s is not None else (5e-6 if rdma else 50e-6),
            efficiency=efficiency if efficiency is not None else (0.9 if rdma else 0.5),
        )
