"""measure/hw.py's machine description, which every benchmark's header prints: the CPU flags the
kernels choose their paths by, the load average, the machine and the code's version."""

from __future__ import annotations

import pytest
import torch

from splitserve.measure import hw


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ({"sse2", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}, "avx2 avx512f avx512_bf16 avx512_vnni"),
        ({"avx2", "amx_bf16", "amx_tile"}, "avx2 amx_bf16 amx_tile"),
        ({"sse2"}, "none of " + " ".join(hw.KERNEL_FLAGS)),
        (set(), "unknown"),
    ],
)
def test_cpu_flags_name_the_kernel_paths_flags_in_a_fixed_order(monkeypatch, flags: set[str], line: str) -> None:
    monkeypatch.setattr(hw, "cpu_flag_set", lambda: frozenset(flags))
    assert hw.cpu_flags() == line


def test_this_machine_is_described() -> None:
    assert len(hw.load_average().split()) == 3
    assert hw.machine(torch.device("cpu")).endswith(" CPUs")
    assert hw.code_version()  # a commit, or "-" outside a checkout


def test_a_stated_commit_that_is_not_this_checkout_is_marked(monkeypatch) -> None:
    monkeypatch.setenv("SPLITSERVE_COMMIT", "0000000deadbeef")
    assert hw.code_version() == "0000000deadbeef (stated, not checked)"
