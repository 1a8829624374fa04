"""A benchmark's results file (bench/results/*.txt), written by the run itself: a
header line saying what ran where (the exact command, the commit, the date, the CPU
and its flags, the load average at the start), then everything the run prints.
These machines differ (AVX2 only, AVX-512 with bf16 dot products, AMX), and a figure
means little without the arithmetic it was measured on.

`with_results` is what a bench's `run` calls; a bench that prints its own header
(bench transfer --codec --netns, --lossless) passes header=False."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from splitserve.measure.hw import code_version, cpu_flags, cpu_name, load_average


def header_line(argv: list[str]) -> str:
    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    cores = len(os.sched_getaffinity(0))
    return (
        f"$ {shlex.join(argv)}   # at {code_version('.')}, {when}, {cores} CPU cores ({cpu_name()}; "
        f"flags {cpu_flags()}), load average {load_average()} at start"
    )


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
def tee_results(path: str, header: bool = True) -> Iterator[None]:
    """Within: stdout goes to the terminal and to `path` too, after the header line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        if header:
            f.write(header_line(["splitserve", *sys.argv[1:]]) + "\n")
            f.flush()
        saved = sys.stdout
        sys.stdout = _Tee(saved, f)
        try:
            yield
        finally:
            sys.stdout = saved


def with_results(path: str | None, run: Callable[[], int], header: bool = True) -> int:
    """`run()`, its output also written to `path` when one is given."""
    if not path:
        return run()
    with tee_results(path, header):
        return run()
