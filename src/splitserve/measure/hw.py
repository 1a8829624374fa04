"""Hardware-limit probes for the engine benchmark: what the machine can do,
measured in the same run as the figures divided by it.

- memory-read bandwidth: on a CPU a `torch.sum` over an fp32 buffer far larger
  than the last-level cache (a plain read, the batch-1 decode floor); on a GPU
  a device-to-device copy, counted as bytes read plus bytes written (the HBM
  figure that gpt-fast and the issue's roofline use);
- the model's own matrix products: one pass of `F.linear` over a full set of
  weight tensors of the model's shapes (every layer its own tensors, so the
  weights stream from memory as they do in a decode step) at a given batch.
  At batch 32 that is the matmul rate the decode step is held against; at
  batch 1 it is what torch's matrix-vector product alone makes of the
  bandwidth; at prompt length it is the prefill ceiling.

The probes use plain torch on purpose: they say what the library and the
machine give, whatever kernel the engine itself happens to use.

Every benchmark's header states the machine it ran on with the functions below
(`cpu_flags`, `machine`, `code_version`, `load_average`): these machines differ,
and a figure belongs to the CPU paths and the code that produced it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from splitserve.engine.config import ModelConfig
from splitserve.engine.tuned import cpu_flags as cpu_flag_set

# The flags the kernels choose their paths by (engine/kernels: AVX2, AVX-512, AVX-512 bf16 dot
# products; VNNI and AMX where present), as a benchmark's header states them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> str:
    """This CPU's KERNEL_FLAGS, space-separated ("none of ..." if it has none, "unknown" without /proc)."""
    flags = cpu_flag_set()
    if not flags:
        return "unknown"
    return " ".join(f for f in KERNEL_FLAGS if f in flags) or "none of " + " ".join(KERNEL_FLAGS)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages ("?" where the platform has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


class CpuTimes(NamedTuple):
    busy: int  # jiffies the CPUs spent on anything but idle and iowait, since boot
    total: int


def process_cpu_seconds(pid: int | str = "self") -> float | None:
    """A process's user plus system CPU seconds so far (/proc/PID/stat's utime and stime; None where
    it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times(path: str = "/proc/stat") -> CpuTimes | None:
    """The machine's CPU time so far (None where /proc/stat is not there to read)."""
    try:
        with open(path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = sum(fields[3:5])  # idle, iowait
    return CpuTimes(sum(fields) - idle, sum(fields))


def busy_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the machine's CPU time that was busy between two readings."""
    total = after.total - before.total
    return (after.busy - before.busy) / total if total > 0 else 0.0


def wait_until_quiet(
    threshold: float = 0.1,
    window_s: float = 2.0,
    limit_s: float = 120.0,
    read: Callable[[], CpuTimes | None] = cpu_times,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[float, float]:
    """Wait until the machine's CPUs were busy under `threshold` of a `window_s` window (a system
    just stopped may still be exiting and giving back memory), at most `limit_s`. Returns the
    seconds waited and the last window's busy share (0.0 where the CPU time cannot be read)."""
    waited = 0.0
    before = read()
    while before is not None:
        sleep(window_s)
        waited += window_s
        after = read()
        if after is None:
            break
        busy = busy_fraction(before, after)
        if busy < threshold or waited >= limit_s:
            return waited, busy
        before = after
    return waited, 0.0


def machine(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and how many CPUs this process sees."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {os.cpu_count()} CPUs"


def code_version(scope: str = "engine") -> str:
    """The commit the code comes from, marked when `scope` (a folder of src/splitserve, "." for all of
    it) has uncommitted changes: a figure belongs to a version."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/splitserve

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    stated = os.environ.get("SPLITSERVE_COMMIT")
    # a GPU machine's copy has no .git, or a stale one (its HEAD is not the tree that was sent):
    # the commit as the caller states it wins there
    if stated and not (commit and stated.startswith(commit)):
        return f"{stated} (stated, not checked)"
    if not commit:
        return "-"
    dirty = git("status", "--porcelain", "-uno", "--", scope)
    where = "src/splitserve/" if scope == "." else f"{scope}/"
    return commit + (f" + uncommitted {where} changes" if dirty else "")


def machine_line(device: torch.device | None = None) -> str:
    """A benchmark header's second line: the machine, its CPU flags, torch and its threads, the code, the load."""
    return (
        f"machine: {machine(device or torch.device('cpu'))}; CPU flags: {cpu_flags()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; code {code_version()}; load average {load_average()}"
    )


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """The buffer `read_bandwidth` reads: fp32 noise on CPU (pages touched), zeros on a GPU."""
    n = nbytes // 4
    if device.type == "cuda":
        return torch.zeros(2, n, dtype=torch.float32, device=device)  # source and destination of the copy
    return torch.rand(n, dtype=torch.float32)


def read_bandwidth(buf: torch.Tensor) -> float:
    """One sample, GB/s. CPU: bytes summed per second. CUDA: (read + written) bytes copied per second."""
    device = buf.device
    sync(device)
    t = time.perf_counter()
    if device.type == "cuda":
        buf[1].copy_(buf[0])
        moved = 2 * buf[0].numel() * 4
    else:
        buf.sum()
        moved = buf.numel() * 4
    sync(device)
    return moved / (time.perf_counter() - t) / 1e9


class LinearGroup(NamedTuple):
    name: str
    out_features: int
    in_features: int
    weights: list[torch.Tensor]  # one per layer (lm_head: one)


def linear_shapes(cfg: ModelConfig, lm_head: bool = True) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count) of a step's matrix products, as the engine fuses them."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = [
        ("qkv", q + 2 * kv, h, cfg.num_layers),
        ("o", h, q, cfg.num_layers),
        ("gate_up", 2 * i, h, cfg.num_layers),
        ("down", h, i, cfg.num_layers),
    ]
    if lm_head:
        shapes.append(("lm_head", cfg.vocab_size, h, 1))
    return shapes


class LinearProbe:
    """A full set of the model's weight shapes (random values) and a timed pass of F.linear over them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, lm_head: bool = True) -> None:
        self.device = device
        self.dtype = dtype
        self.groups = [
            LinearGroup(name, n, k, [torch.randn(n, k, device=device).mul_(k**-0.5).to(dtype) for _ in range(count)])
            for name, n, k, count in linear_shapes(cfg, lm_head)
        ]
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for g in self.groups for w in g.weights)

    def flops(self, batch: int, skip: tuple[str, ...] = ()) -> int:
        return sum(self.group_flops(g, batch) for g in self.groups if g.name not in skip)

    def group_flops(self, group: LinearGroup, batch: int) -> int:
        return 2 * batch * group.out_features * group.in_features * len(group.weights)

    def _x(self, batch: int, k: int) -> torch.Tensor:
        key = (batch, k)
        if key not in self._inputs:
            self._inputs[key] = torch.randn(batch, k, device=self.device).to(self.dtype)
        return self._inputs[key]

    def pass_times(self, batch: int, skip: tuple[str, ...] = ()) -> dict[str, float]:
        """Seconds per group for one pass over every weight at this batch (device synchronised per group)."""
        out: dict[str, float] = {}
        with torch.inference_mode():
            for g in self.groups:
                if g.name in skip:
                    continue
                x = self._x(batch, g.in_features)
                sync(self.device)
                t = time.perf_counter()
                for w in g.weights:
                    F.linear(x, w)
                sync(self.device)
                out[g.name] = time.perf_counter() - t
        return out

    def free_inputs(self) -> None:
        self._inputs.clear()


class CpuShare:
    """Cores kept busy by other processes (and the hypervisor's steal) while a figure was measured.

    Read from /proc: the machine's busy time minus this process's own CPU time,
    over the wall time. On a shared 2-core machine this says how much of the
    noise in a figure is someone else's work. NaN where /proc is missing.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError, IndexError):
            return None
        own = process_cpu_seconds()
        if own is None:
            return None
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        return busy / os.sysconf("SC_CLK_TCK"), own, time.perf_counter()

    def others(self) -> float:
        """Other processes' cores, averaged since construction."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return float("nan")
        busy, own, wall = (e - s for e, s in zip(end, self._start, strict=True))
        return max(0.0, (busy - own) / wall)
