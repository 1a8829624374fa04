"""The configuration a user gets without flags: what the benchmarks found best for the
machine, chosen by `tuned_defaults`, a pure function of what `detect_machine` saw.

Issue 22: the figures in BENCHMARKS.md needed flags that were not the defaults
(`--dtype bfloat16`, `--long-prefill-token-threshold 256`, `--prefill-backlog-tokens
700`), so `splitserve serve` as a user starts it did not give them. Each choice here
names the measurement behind it; a flag still overrides it, and the commands print
`Tuned.line()` at start so that nobody has to guess what ran.

Each choice is the default of the flag of its name (`prefill_backlog_tokens` of
`--prefill-backlog-tokens`), whose parser default is None: `fill_tuned` sets the
choices no flag gave, so that what the start line says is what runs (issue 33:
five of the ten printed choices were argparse defaults written out again elsewhere).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

# CPU flags whose bfloat16 arithmetic makes a bf16 matmul faster than float32's (dot products
# in bf16 with float32 accumulation); without them torch converts, and float32 is faster.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

# The two thresholds the peer sweeps of issue 10 chose, the same on every machine: a long prefill
# yields to prompts of this many tokens or fewer, and the router prefills locally past a prefill
# pool backlog of this many tokens. The library's own dataclasses (router/config.py's
# RoutingConfig, plan/sim/simulate.py's ClusterSpec) default to them too, so a caller without
# flags runs what `serve` runs.
LONG_PREFILL_TOKEN_THRESHOLD = 256
PREFILL_BACKLOG_TOKENS = 700


@dataclass(frozen=True)
class Machine:
    """What the defaults are chosen from."""

    device: str  # "cpu" or "cuda[:N]"
    cores: int  # the cores this process may run on
    cpu_flags: frozenset[str]  # /proc/cpuinfo's flags

    @property
    def bf16_arithmetic(self) -> bool:
        return bool(self.cpu_flags & BF16_CPU_FLAGS)

    @property
    def block_kernel(self) -> str:
        """The path engine/kernels/quant.cpp takes for a file's blocks here, as its own detection
        picks it from the same flags (a GPU dequantizes them onto the device instead)."""
        if self.device != "cpu":
            return "dequantized onto the GPU"
        f = self.cpu_flags
        if {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= f:
            return "AVX-512 BF16 tiles" if {"avx512_bf16", "avx512dq"} <= f else "AVX-512 VNNI"
        return "AVX2" if {"avx2", "fma", "f16c"} <= f else "scalar"


@dataclass(frozen=True)
class Tuned:
    """The defaults for one machine; every field is the default of the flag of its name."""

    dtype: str  # weights and KV (--kv-cache-dtype auto follows the weights)
    quantization: str  # auto: a GGUF file's matrices computed on their blocks, never inflated
    block_kernel: str  # which kernels compute them (Machine.block_kernel): said, not a flag
    prefill_workers: int
    decode_workers: int
    threads: int  # each worker's own share of the cores (0: torch's own count)
    core_lease: bool  # a prefill borrows the idle cores of the other workers (engine/core_lease.py)
    decode_borrows: bool  # so does a decode step (--decode-borrows)
    long_prefill_token_threshold: int
    prefill_backlog_tokens: int
    mode: str
    prefill_order: str  # which waiting prompt starts first (engine/prefill_order.py)

    def line(self) -> str:
        lend = "no core lending"
        if self.core_lease:
            lend = (
                "prefill and decode steps borrow idle cores" if self.decode_borrows else "a prefill borrows idle cores"
            )
        threads = f"{self.threads} thread(s)" if self.threads else "torch's own threads"
        return (
            f"--dtype {self.dtype}, --quantization {self.quantization} ({self.block_kernel} kernels on a file's "
            f"blocks), {self.prefill_workers} prefill + {self.decode_workers} decode worker(s) x "
            f"{threads} ({lend}), --mode {self.mode}, --long-prefill-token-threshold "
            f"{self.long_prefill_token_threshold}, --prefill-backlog-tokens {self.prefill_backlog_tokens}, "
            f"--prefill-order {self.prefill_order}"
        )

    def flag_values(self) -> dict[str, str | int]:
        """Each choice as its flag gives it, by the flag's argparse dest. The core lease is not among
        them: `serve` makes its file, one per cluster, where `core_lease` says to."""
        said = ("core_lease", "block_kernel")
        values: dict[str, str | int] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in said}
        values["decode_borrows"] = "on" if self.decode_borrows else "off"
        return values


def tuned_defaults(machine: Machine) -> Tuned:
    """The tuned configuration of `machine`. On a CPU: bfloat16 where the CPU has bf16 arithmetic
    (the engine bench: bf16 decode and prefill beat float32 there, and float32 beats bf16 without
    it); one prefill and one decode worker, each owning half the cores and the prefill borrowing
    the decode worker's while it idles (issue 22: the mode auto pair kept the steady streams' ITL
    flat through bursts, and a lone prompt gets every core), and decode steps borrowing the prefill
    worker's while it idles (a batch-4 SmolLM2 step 16.9 ms on 1 thread, 12.3 on 2; ShareGPT at
    concurrency 4 through the serving path: 1.18 against 1.08 req/s, ITL p50 20.3 against 23.2 ms);
    a long prefill yielding to prompts of 256 tokens or fewer and the router prefilling locally past
    a 700-token backlog (the peer sweeps of issue 10); waiting prompts shortest first, aged, to
    bound the short ones' TTFT; a GGUF file's matrices kept in their blocks (issue 45: inflating
    an 8B Q4_0 file to bfloat16 exhausted a 24 GB machine, and on AVX-512 BF16 the blocks compute
    each row to the dense bf16 kernel's bits, at 1.38x its speed at batch 1: BENCHMARKS.md).
    On a GPU: bfloat16, one worker per role, torch's own threads, nothing lent, the blocks
    dequantized onto the device."""
    on_cpu = machine.device == "cpu"
    dtype = "bfloat16" if (not on_cpu or machine.bf16_arithmetic) else "float32"
    threads = max(1, machine.cores // 2) if on_cpu else 0
    return Tuned(
        dtype=dtype,
        quantization="auto",
        block_kernel=machine.block_kernel,
        prefill_workers=1,
        decode_workers=1,
        threads=threads,
        core_lease=on_cpu and machine.cores > 1,
        decode_borrows=on_cpu and machine.cores > 1,
        long_prefill_token_threshold=LONG_PREFILL_TOKEN_THRESHOLD,
        prefill_backlog_tokens=PREFILL_BACKLOG_TOKENS,
        mode="auto",
        prefill_order="shortest",
    )


def tuned_for(device: str) -> Tuned:
    """This machine's tuned choices for an engine on `device` (--device: cpu, cuda[:N])."""
    return tuned_defaults(detect_machine("cpu" if device == "cpu" else "cuda"))


# The choices that divide this machine between a cluster's workers. Only `serve`, which starts
# them all, applies them; a process started alone (`splitserve worker`, `generate --local`) keeps
# its flags' own meaning: torch's own thread count, no core lease.
MACHINE_SHARES = frozenset({"prefill_workers", "decode_workers", "threads", "core_lease"})


def fill_tuned(a: argparse.Namespace, tuned: Tuned, *, whole_cluster: bool = False) -> argparse.Namespace:
    """A copy of the flags `a` with each tuned choice that no flag gave (None) set to `tuned`'s: the
    machine's shares only for a command that starts the whole cluster. A flag the command does not
    have stays absent; the core lease is `serve`'s to fill (cluster/serve.py `with_tuned`)."""
    filled = argparse.Namespace(**vars(a))
    for dest, value in tuned.flag_values().items():
        if getattr(a, dest, "") is None and (whole_cluster or dest not in MACHINE_SHARES):
            setattr(filled, dest, value)
    return filled


# Tokens per engine step (--max-num-batched-tokens), by role. A prefill worker has no decodes to
# interleave, so its steps are as large as a long prompt: a 1,320-token prompt through the serving
# path computed in 1.20 s in one step against 1.33 s in three steps of 512 (each step streams its
# layers' KV and pays its per-layer overhead again). A decode worker's steps carry its streams'
# tokens beside a local prefill's chunk, whose size is what they stall for.
PREFILL_WORKER_CHUNK_TOKENS = 2048
CHUNK_TOKENS = 512


def chunk_tokens(role: str | None) -> int:
    """The default tokens per step of a worker of `role` ("prefill", "decode"; None: any engine)."""
    return PREFILL_WORKER_CHUNK_TOKENS if role == "prefill" else CHUNK_TOKENS


def detect_machine(device: str = "cpu") -> Machine:
    """This process's machine: the cores it may run on and the CPU's flags."""
    return Machine(device=device, cores=len(os.sched_getaffinity(0)), cpu_flags=cpu_flags())


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's flags (empty where /proc/cpuinfo is not there to read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
