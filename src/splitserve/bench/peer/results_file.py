"""A peer run's results file (bench/results/peer-*.txt), written by the run itself:
a header line saying what ran where (the exact command, the commit, the date, the
CPU and its flags, the load average at the start), then everything the run prints.
These machines differ (AVX2 only, AVX-512 with bf16 dot products, AMX), and a figure
means little without the arithmetic it was measured on."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

# the flags that decide which kernels and dtypes are fast here
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def header_line(argv: list[str]) -> str:
    from splitserve.engine.tuned import cpu_flags
    from splitserve.measure.hw import cpu_name

    flags = cpu_flags()
    have = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    cores = len(os.sched_getaffinity(0))
    return (
        f"$ {shlex.join(argv)}   # at {_commit()}, {when}, {cores} CPU cores ({cpu_name()}; flags {have}), "
        f"load average {load} at start"
    )


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno", "--", "src"], capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    commit = out.stdout.strip() or "unknown commit"
    return commit + (" + uncommitted src/ changes" if dirty.stdout.strip() else "")


class _Tee:
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


@contextmanager
def tee_results(path: str) -> Iterator[None]:
    """Within: stdout goes to the terminal and to `path` too, after the header line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(header_line(["splitserve", *sys.argv[1:]]) + "\n")
        f.flush()
        saved = sys.stdout
        sys.stdout = _Tee(saved, f)
        try:
            yield
        finally:
            sys.stdout = saved
