"""`Problem`: one reason not to start, typed by the check that found it.

Every preflight returns these (engine/preflight.py: the model against the flags;
engine/kernels/prebuild.py: the C++ kernels; cluster/preflight.py and placement.py:
the pools against the machine), so that a caller tells them apart without reading
their text; the command decides how to say them. Imports nothing, so that any
floor's check can return one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Check(StrEnum):
    """Which check found a problem."""

    MODEL = "model"  # the model file is missing, unreadable or of a kind the engine does not run
    TENSOR_PARALLEL = "tensor_parallel"  # a tensor-parallel size the model's shapes do not split by
    PLACEMENT = "placement"  # workers the machine (or the Ray cluster's node types) cannot hold
    KV_TIERS = "kv_tiers"  # a disk tier whose directory cannot be made or written
    KERNELS = "kernels"  # a C++ kernel that cannot be built here (engine/kernels/prebuild.py)
    MEMORY = "memory"  # workers whose weights, KV pool and runtime exceed the machine's memory (engine/memory.py)


class Problem(NamedTuple):
    """One reason not to start, said so that the operator can act on it."""

    check: Check
    what: str  # what is wrong, with the numbers
    fix: str  # what to change, naming the flag

    def line(self) -> str:
        return f"{self.what}: {self.fix}"
