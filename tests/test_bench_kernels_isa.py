"""`splitserve bench kernels-isa` on shrunken shapes: every path the CPU has is timed, for the
linear kernel at each batch and for attention over each KV dtype at each context; and
linear_on, the kernel on one chosen path, agrees with the product and refuses what it cannot run."""

from __future__ import annotations

import re

import pytest
import torch

from splitserve import cli
from splitserve.bench import kernels_isa
from splitserve.engine.kernels import decode as kd
from splitserve.engine.kernels import linear as kl

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def linear_kernel() -> None:
    if kl.best_isa() == 0:
        pytest.skip("the linear kernel is not available here")


def test_every_path_is_timed_side_by_side(monkeypatch, capsys, linear_kernel, cpu_decode_kernels) -> None:
    monkeypatch.setattr(kernels_isa, "LAYERS", 2)
    monkeypatch.setattr(kernels_isa, "LM_HEAD", (256, 576))
    rc = cli.main(["bench", "kernels-isa", "--batches", "1,3", "--contexts", "20,40", "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"machine: .*; CPU flags: .*; torch ", out)
    linear = [kl.ISA_NAMES[i] for i in range(1, kl.best_isa() + 1)]
    for batch in (1, 3):
        line = next(x for x in out.splitlines() if x.startswith(f"  batch  {batch}:"))
        assert all(f"{name} " in line for name in linear), line
    attention = [kd.ISA_NAMES[i] for i in range(1, cpu_decode_kernels.best_isa + 1)]
    for ctx in (20, 40):
        for kind in kernels_isa.KV_DTYPES:
            line = next(x for x in out.splitlines() if re.match(rf"  context +{ctx} {kind} +KV:", x))
            assert all(f"{name} " in line for name in attention), line
            assert len(re.findall(r"[0-9.]+ ms \([0-9.]+x\)", line)) == len(attention)


def test_linear_on_each_path_is_the_product(linear_kernel) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w = torch.randn(40, 64, generator=gen).bfloat16()
    want = x.float() @ w.float().T
    for isa in range(1, kl.best_isa() + 1):
        torch.testing.assert_close(kl.linear_on(x, w, isa).float(), want, rtol=2e-2, atol=5e-2)
    with pytest.raises(ValueError, match="not available"):
        kl.linear_on(x, w, kl.best_isa() + 1)
    with pytest.raises(ValueError, match="bf16 w"):
        kl.linear_on(x, w.float(), 1)  # fp32 w needs fp32 x
    with pytest.raises(ValueError, match="contiguous"):
        kl.linear_on(x.T.contiguous().T, w, 1)
