"""The linear kernel: agreement with an fp32 reference on every code path
(AVX512-BF16, AVX-512 and AVX2 fp32-FMA) over odd shapes, batch 1..8 and 32,
with and without bias, for bf16 weights and for fp32 weights (against an fp64
reference and against F.linear); identical results whatever the thread count
and whatever else is in the batch; and the F.linear fallback for calls that do
not fit, for SPLITSERVE_NO_KERNELS and for a kernel that does not compile."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import splitserve.engine.kernels.linear as kl
from splitserve.engine.kernels.build import load_extension

pytestmark = pytest.mark.timeout(300)

ISA_NAMES = {1: "avx2", 2: "avx512", 3: "avx512bf16"}

# [N, K]: N odd and not a multiple of the 4-row tile; K below, at and past the
# vector widths (8, 16, 32 lanes) and not a multiple of any; the SmolLM2 shapes.
SHAPES = [
    (1, 1),
    (3, 15),
    (7, 16),
    (17, 17),
    (5, 31),
    (64, 32),
    (33, 33),
    (257, 100),
    (130, 1537),
    (960, 576),
    (576, 1536),
]
BATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 13, 32]


@pytest.fixture(scope="module")
def ext():
    if kl.kernels_disabled():
        pytest.skip(f"{kl.DISABLE_ENV} is set")
    ext = kl._extension()
    if ext is None:
        pytest.skip("the linear kernel could not be built here (see the warning in the log)")
    return ext


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x @ w.T + bias, and the scale of its rounding error: sum_k |x_k w_k|."""
    ref = x.float() @ w.float().T
    if bias is not None:
        ref = ref + bias.float()
    return ref, x.float().abs() @ w.float().abs().T


def _assert_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    assert y.shape == ref.shape
    # fp32 accumulation in any order, then (bf16 output) one rounding of the result
    tol = 1e-5 * scale + 1e-6
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.float() - ref).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), f"err {err.flatten()[worst]} > tol {tol.flatten()[worst]}"


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert y.dtype == x.dtype
    _assert_close(y, *_reference(x, w, bias))


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_fp32_reference_on_every_isa(ext, n, k):
    gen = torch.Generator().manual_seed(n * 10007 + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for b in BATCHES if n * k < 100_000 else BATCHES[::3]:
        x = torch.randn(b, k, generator=gen).to(torch.bfloat16)
        for bi in (None, bias):
            ref, scale = _reference(x, w, bi)
            for isa in range(1, ext.isa() + 1):
                for xin in (x, x.float()):  # fp32 x: the FMA paths, whatever the ISA
                    for bin_ in (None,) if bi is None else (bi, bi.float()):
                        y = kl._run(ext, xin, w, bin_, isa)
                        assert y.dtype == xin.dtype, (isa, b)
                        _assert_close(y, ref, scale)


def test_every_isa_this_cpu_has_is_exercised(ext):
    # The paths above are chosen by `isa`; on a CPU with AVX512-BF16 all three run.
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512_bf16" in flags and " avx512bw" in flags:
        assert ext.isa() == 3
    assert ext.isa() >= 1


def test_bf16_output_no_worse_than_f_linear(ext):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 576, generator=gen).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    ours = (kl.linear(x, w).float() - ref).abs().max()
    theirs = (F.linear(x, w).float() - ref).abs().max()
    assert ours <= theirs * 1.01 + 1e-6


def test_front_uses_kernel_for_leading_dims_and_1d_x(ext):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(37, 70, generator=gen).to(torch.bfloat16)
    x3 = torch.randn(2, 3, 70, generator=gen).to(torch.bfloat16)
    y3 = kl.linear(x3, w)
    assert y3.shape == (2, 3, 37)
    _check(y3.reshape(6, 37), x3.reshape(6, 70), w, None)
    x1 = x3[0, 0]
    y1 = kl.linear(x1, w)
    assert y1.shape == (37,)
    _check(y1[None], x1[None], w, None)


@pytest.mark.parametrize("n", [2053, 701])  # 2.4 MB and 0.8 MB: cut into different chunks per thread count
def test_same_bits_for_any_thread_count(ext, n):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(n, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kl.linear(x, w)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        many = kl.linear(x, w)
    finally:
        torch.set_num_threads(before)
    # each row's dot product is computed the same way whichever thread or chunk takes it
    assert torch.equal(one, many)


def test_concurrent_callers_get_their_own_results(ext):
    gen = torch.Generator().manual_seed(4)
    ws = [torch.randn(700, 576, generator=gen).to(torch.bfloat16) for _ in range(4)]
    xs = [torch.randn(2, 576, generator=gen).to(torch.bfloat16) for _ in range(4)]
    expected = [kl.linear(x, w) for x, w in zip(xs, ws, strict=True)]

    def run(i: int) -> bool:
        return all(torch.equal(kl.linear(xs[i], ws[i]), expected[i]) for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(4)))


def test_empty_and_k0_inputs(ext):
    w = torch.randn(5, 8).to(torch.bfloat16)
    assert kl.linear(torch.empty(0, 8, dtype=torch.bfloat16), w).shape == (0, 5)
    bias = torch.arange(5.0).to(torch.bfloat16)
    y = kl.linear(torch.empty(2, 0, dtype=torch.bfloat16), torch.empty(5, 0, dtype=torch.bfloat16), bias)
    assert torch.equal(y, bias.expand(2, 5))


def test_mismatched_shapes_raise_as_f_linear_does(ext):
    # the kernel takes raw pointers: a mismatch must never reach it
    w = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        kl.linear(torch.randn(2, 9).to(torch.bfloat16), w)
    with pytest.raises(RuntimeError):
        kl.linear(torch.randn(2, 8).to(torch.bfloat16), w, torch.randn(5).to(torch.bfloat16))


def test_isa_beyond_the_cpu_is_refused(ext):
    w = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="not available"):
        kl._run(ext, torch.randn(1, 8).to(torch.bfloat16), w, None, ext.isa() + 1)


# ------------------------------------------------------------ fp32 weights


def _fp32_isas(ext) -> list[int]:
    # fp32 W runs AVX-512F (levels 2 and 3) or AVX2: asking for level 3 must work too
    return list(range(1, ext.isa() + 1))


def _reference64(x, w, bias):
    """fp64 x @ w.T + bias, and sum_k |x_k w_k| (the scale of any fp32 summation's error)."""
    ref = x.double() @ w.double().T
    if bias is not None:
        ref = ref + bias.double()
    return ref, x.double().abs() @ w.double().abs().T


@pytest.mark.parametrize("n,k", SHAPES)
def test_fp32_weights_match_reference_and_f_linear_on_every_isa(ext, n, k):
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in BATCHES if n * k < 100_000 else BATCHES[::3]:
        x = torch.randn(b, k, generator=gen)
        for bi in (None, bias, bias.to(torch.bfloat16)):
            ref, scale = _reference64(x, w, bi)
            # fp32 FMA with K/lanes terms per lane: err <= ~(K/8 + 8) * 2^-24 * scale
            tol = (k / 8 + 8) * 2.0**-24 * scale + 1e-7
            theirs = F.linear(x, w, None if bi is None else bi.float())
            for isa in _fp32_isas(ext):
                y = kl._run(ext, x, w, bi, isa)
                assert y.dtype == torch.float32 and y.shape == (b, n)
                err = (y.double() - ref).abs()
                assert bool((err <= tol).all()), (isa, b, float((err - tol).max()))
                # and as close to F.linear as two fp32 summation orders can be
                assert bool(((y - theirs).abs().double() <= 2 * tol).all()), (isa, b)


def test_fp32_weights_no_less_accurate_than_f_linear(ext):
    gen = torch.Generator().manual_seed(11)
    for n, k in [(3072, 576), (576, 1536)]:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(4, k, generator=gen)
        ref = x.double() @ w.double().T
        ours = (kl.linear(x, w).double() - ref).abs().mean()
        theirs = (F.linear(x, w).double() - ref).abs().mean()
        assert ours <= theirs * 1.25, (n, k, float(ours), float(theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_results_do_not_depend_on_the_rest_of_the_batch(ext, dtype):
    # batching must be invisible: a row alone, or among 1..31 others in any
    # position, gives the same bits, on every ISA path
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(301, 583, generator=gen).to(dtype)  # odd N (tile leftovers), odd K (masked tail)
    bias = torch.randn(301, generator=gen)
    xs = torch.randn(32, 583, generator=gen).to(dtype)
    isas = _fp32_isas(ext) if dtype is torch.float32 else list(range(1, ext.isa() + 1))
    for isa in isas:
        alone = torch.cat([kl._run(ext, xs[i : i + 1], w, bias, isa) for i in range(32)])
        for b in (2, 3, 5, 6, 7, 8, 13, 32):
            for start in (0, 32 - b):
                got = kl._run(ext, xs[start : start + b].contiguous(), w, bias, isa)
                assert torch.equal(got, alone[start : start + b]), (isa, b, start)
        perm = torch.randperm(32, generator=gen)
        assert torch.equal(kl._run(ext, xs[perm].contiguous(), w, bias, isa), alone[perm]), isa


@pytest.mark.parametrize("n", [2053, 701, 6007])  # fp32: 4.7, 1.6 and 13.8 MB, cut differently per thread count
def test_fp32_same_bits_for_any_thread_count(ext, n):
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(n, 576, generator=gen)
    x = torch.randn(3, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kl.linear(x, w)
        results = []
        for threads in (2, 3, max(4, os.cpu_count() or 4)):
            torch.set_num_threads(threads)
            results.append(kl.linear(x, w))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, r) for r in results)


def test_front_takes_fp32_weights_with_leading_dims_and_1d_x(ext):
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(37, 70, generator=gen)
    bias = torch.randn(37, generator=gen)
    x3 = torch.randn(2, 3, 70, generator=gen)
    y3 = kl.linear(x3, w, bias)
    assert y3.shape == (2, 3, 37) and y3.dtype == torch.float32
    assert torch.equal(y3.reshape(6, 37), kl._run(ext, x3.reshape(6, 70), w, bias))
    y1 = kl.linear(x3[0, 0], w)
    assert y1.shape == (37,)
    assert torch.equal(y1, kl._run(ext, x3[0, 0][None], w, None)[0])


def test_fp32_weights_with_bf16_x_are_refused_by_the_module(ext):
    # the front never sends these (they go to F.linear); the module must not misread them
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="fp32 w takes fp32 x"):
        kl._run(ext, torch.randn(1, 8).to(torch.bfloat16), w, None)


@pytest.fixture
def recording_ext(monkeypatch):
    """A built kernel stand-in: records the calls that reach it, answers with the reference."""
    calls: list[tuple[int, ...]] = []

    def run(ext, x, w, bias, isa=0):
        calls.append(tuple(x.shape))
        y = x.float() @ w.float().T + (0 if bias is None else bias.float())
        return y.to(x.dtype)

    monkeypatch.setattr(kl._EXT, "value", object())
    monkeypatch.setattr(kl._EXT, "done", True)
    monkeypatch.setattr(kl, "_run", run)
    _pin_native_bf16(monkeypatch, True)  # the fallback is then plain F.linear, whatever this CPU has
    return calls


def _pin_native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(kl._NATIVE_BF16, "value", native)
    monkeypatch.setattr(kl._NATIVE_BF16, "done", True)


def test_calls_that_do_not_fit_go_to_f_linear(recording_ext):
    w = torch.randn(16, 32).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    kl.linear(x, w)
    assert recording_ext == [(2, 32)]  # this one fits
    not_fitting = [
        (torch.randn(32, 2).to(torch.bfloat16).T, w, None),  # x not contiguous
        (x, torch.randn(32, 16).to(torch.bfloat16).T, None),  # w not contiguous
        (x.half(), w.half(), None),  # fp16 weights
        (torch.randn(kl.MAX_ROWS + 1, 32).to(torch.bfloat16), w, None),  # too many rows: GEMM territory
        (x, w, torch.randn(16).half()),  # fp16 bias
    ]
    for xi, wi, bi in not_fitting:
        y = kl.linear(xi, wi, bi)
        expected = F.linear(xi, wi.to(xi.dtype), None if bi is None else bi.to(xi.dtype))
        assert torch.equal(y, expected)
    x_grad = x.clone().requires_grad_()
    y = kl.linear(x_grad, w)
    assert y.requires_grad  # autograd path: F.linear, so backward works
    assert recording_ext == [(2, 32)]


def test_fp32_calls_that_fit_and_that_do_not(recording_ext):
    w = torch.randn(16, 32)
    x = torch.randn(2, 32)
    kl.linear(x, w, torch.randn(16))
    kl.linear(torch.randn(kl.MAX_ROWS_F32, 32), w)
    assert recording_ext == [(2, 32), (kl.MAX_ROWS_F32, 32)]  # fp32 W with fp32 x fits
    not_fitting = [
        (x.to(torch.bfloat16), w, None),  # bf16 x with fp32 W: F.linear in bf16
        (torch.randn(kl.MAX_ROWS_F32 + 1, 32), w, None),  # too many rows
        (x.double(), w.double(), None),  # fp64
        (x, w, torch.randn(16).half()),  # fp16 bias
    ]
    for xi, wi, bi in not_fitting:
        y = kl.linear(xi, wi, bi)
        expected = F.linear(xi, wi.to(xi.dtype), None if bi is None else bi.to(xi.dtype))
        assert torch.equal(y, expected)
    assert len(recording_ext) == 2


def test_without_a_kernel_linear_is_f_linear(monkeypatch):
    monkeypatch.setattr(kl._EXT, "value", None)
    monkeypatch.setattr(kl._EXT, "done", True)
    _pin_native_bf16(monkeypatch, True)
    assert not kl.kernel_available()
    w = torch.randn(9, 20).to(torch.bfloat16)
    x = torch.randn(3, 20).to(torch.bfloat16)
    b = torch.randn(9).to(torch.bfloat16)
    assert torch.equal(kl.linear(x, w, b), F.linear(x, w, b))
    # the contract beyond F.linear holds on the fallback too: fp32 x with bf16 w
    assert torch.equal(kl.linear(x.float(), w, b), F.linear(x.float(), w.float(), b.float()))


def test_bf16_gemm_runs_in_fp32_where_the_cpu_lacks_bf16_arithmetic(monkeypatch):
    """Past the kernel's rows, a bf16 product on a CPU without AVX512-BF16/AMX is widened to fp32
    (oneDNN's emulated bf16 GEMM ran 8x slower than fp32 on an AVX2 host): the result is the
    fp32 product rounded once to bf16, so no less accurate than F.linear's."""
    _pin_native_bf16(monkeypatch, False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(kl.MAX_ROWS + 7, 96, generator=gen).to(torch.bfloat16)
    w = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, generator=gen).to(torch.bfloat16)
    y = kl.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (kl.MAX_ROWS + 7, 40)
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
    ref = x.double() @ w.double().T + b.double()
    err = (y.double() - ref).abs().max()
    assert err <= (F.linear(x, w, b).double() - ref).abs().max()
    _pin_native_bf16(monkeypatch, True)  # with bf16 arithmetic in hardware, oneDNN's bf16 GEMM
    assert torch.equal(kl.linear(x, w, b), F.linear(x, w, b))


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(kl, "cpu_flags", lambda: {"avx2", "fma"})
    assert not kl._NATIVE_BF16._make()
    monkeypatch.setattr(kl, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert kl._NATIVE_BF16._make()


def test_env_var_forces_f_linear_without_building():
    code = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        import splitserve.engine.kernels.linear as kl
        w = torch.randn(8, 16).to(torch.bfloat16); x = torch.randn(2, 16).to(torch.bfloat16)
        assert torch.equal(kl.linear(x, w), F.linear(x, w))
        assert not kl.kernel_available() and kl._EXT.value is None
        print("ok")
        """
    )
    env = {**os.environ, kl.DISABLE_ENV: "1", "TORCH_EXTENSIONS_DIR": "/nonexistent/never-built"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_compile_failure_is_one_warning_and_none(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.kernels.build"):
        assert load_extension("splitserve_broken_for_test", broken) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not build kernel splitserve_broken_for_test" in warnings[0].getMessage()
