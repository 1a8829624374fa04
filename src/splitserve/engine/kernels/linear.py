"""`linear(x, w, bias)`: F.linear, with a CPU kernel for decode (bf16 or fp32 weights).

At batch 1..a few rows, a decode step on a CPU is bound by reading weights,
and torch's F.linear streams them at a fraction of memory bandwidth (bf16 and
fp32 alike). The kernel in linear.cpp streams each weight once at close to it.
This front takes the kernel when the call fits it (CPU; bf16 W with bf16 or
fp32 x, or fp32 W with fp32 x; contiguous, few rows, no autograd) and F.linear
otherwise, so callers never need to know which ran.

SPLITSERVE_NO_KERNELS=1 forces F.linear everywhere (read once, when the
process first calls linear; the check per call would cost more than a small
matrix's worth of bandwidth).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from splitserve.engine.kernels.build import load_extension, passes_self_test
from splitserve.engine.kernels.once import Once
from splitserve.engine.tuned import cpu_flags

log = logging.getLogger(__name__)

# Rows of x up to which the kernel beats F.linear on the SmolLM2 shapes (see
# bench_linear.py; at 32 they are level, both bound by bf16 arithmetic). Past
# this, prefill territory, oneDNN's blocked GEMM is the better tool.
MAX_ROWS = 32
# The same for fp32 W with fp32 x. Set from bench_linear.py measurements.
MAX_ROWS_F32 = 32

DISABLE_ENV = "SPLITSERVE_NO_KERNELS"

_BF16 = torch.bfloat16
_F32 = torch.float32


class PackedWeight(Protocol):
    """A weight kept in a format of its own (engine/quant/'s QuantizedWeight: GGUF blocks) that
    computes x @ W.T on its own kernel; `linear` hands it over."""

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor: ...


# bf16 products in hardware (AVX512-BF16 or AMX); read once per process. Unknown (no
# /proc/cpuinfo) counts as absent: the fp32 path is always right, at worst slower.
_NATIVE_BF16: Once[bool] = Once(lambda: bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}))


def native_bf16() -> bool:
    """The CPU multiplies bf16 natively, so oneDNN's bf16 GEMM beats fp32 (else it is ~8x slower)."""
    return bool(_NATIVE_BF16.value if _NATIVE_BF16.done else _NATIVE_BF16.get())


def kernels_disabled() -> bool:
    """SPLITSERVE_NO_KERNELS set to anything but "" or "0". Read once, at the first call of linear."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def _run(ext: ModuleType, x: Tensor, w: Tensor, bias: Tensor | None, isa: int = 0) -> Tensor:
    """The kernel on checked arguments: x [B, K] and w [N, K] contiguous CPU, w bf16 with x bf16
    or fp32, or w fp32 with x fp32; bias None or [N] contiguous CPU bf16/fp32, K > 0. The module
    trusts its pointers, so whatever reaches this function must satisfy all of that."""
    b, n = x.shape[0], w.shape[0]
    y = x.new_empty(b, n)  # the cheapest of torch's allocating calls (~1 us)
    bias_kind = 0 if bias is None else (1 if bias.dtype is _BF16 else 2)
    ext.linear(
        y.data_ptr(),
        x.data_ptr(),
        w.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        b,
        n,
        x.shape[1],
        x.dtype is _F32,
        bias_kind,
        torch.get_num_threads(),
        isa,
        w.dtype is _F32,
    )
    return y


def _self_test(ext: ModuleType) -> bool:
    """A freshly built binary must agree with torch before it computes anything real."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 77, generator=gen).to(torch.bfloat16)
    w = torch.randn(45, 77, generator=gen).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    got = _run(ext, x, w, None).float()
    if not torch.allclose(got, ref, rtol=2e-2, atol=5e-2):
        return False
    xf, wf = x.float() + 0.001, w.float() - 0.001  # fp32 W path: not representable in bf16
    ref = (xf.double() @ wf.double().T).float()
    return bool(torch.allclose(_run(ext, xf, wf, None), ref, rtol=1e-4, atol=1e-4))


def _load() -> ModuleType | None:
    if kernels_disabled():
        log.info("%s is set: linear runs on torch's F.linear", DISABLE_ENV)
        return None
    ext = load_extension("splitserve_linear", "linear.cpp")
    if ext is not None and ext.isa() == 0:
        log.warning("CPU has neither AVX2+FMA nor AVX-512; using torch's F.linear")
        return None
    if ext is None:
        return None
    return ext if passes_self_test("linear kernel", lambda: _self_test(ext), "torch's F.linear") else None


_EXT: Once[ModuleType | None] = Once(_load)  # the built kernel, or None: disabled, unbuildable or failed


def _extension() -> ModuleType | None:
    return _EXT.get()


# The kernel's paths, by the `isa` argument (linear.cpp picks the widest the CPU has for 0).
ISA_NAMES = {1: "avx2", 2: "avx512", 3: "avx512_bf16"}


def best_isa() -> int:
    """The path `linear` takes on this CPU: 1 AVX2+FMA, 2 AVX-512F, 3 AVX-512 BF16 (0: no kernel here)."""
    ext = _extension()
    return 0 if ext is None else int(ext.isa())


def linear_on(x: Tensor, w: Tensor, isa: int) -> Tensor:
    """x @ w.T on one path of the kernel (1 .. best_isa()), to compare the paths side by side: x [B, K]
    and w [N, K] contiguous CPU tensors, bf16 w with bf16 or fp32 x, or fp32 both (ValueError else)."""
    ext = _extension()
    if ext is None or not 1 <= isa <= int(ext.isa()):
        raise ValueError(f"linear kernel path {isa} is not available here (paths 1..{best_isa()})")
    pair = (w.dtype is _BF16 and x.dtype in (_BF16, _F32)) or (w.dtype is _F32 and x.dtype is _F32)
    if not (pair and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] > 0):
        raise ValueError("linear_on takes x [B, K] and w [N, K]: bf16 w with bf16 or fp32 x, or fp32 both")
    if not (x.is_cpu and w.is_cpu and x.is_contiguous() and w.is_contiguous()):
        raise ValueError("linear_on takes contiguous CPU tensors")
    return _run(ext, x, w, None, isa)


def linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows of x that `linear` computes on the kernel for a dense weight of `dtype`, each row
    alone (past them, F.linear)."""
    return MAX_ROWS if dtype is _BF16 else MAX_ROWS_F32


def kernel_available() -> bool:
    """True when linear() will use the kernel for calls that fit it (building it now if not yet built)."""
    return _extension() is not None


def linear(x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ w.T (+ bias), in x's dtype. w is [N, K] (a PackedWeight, GGUF blocks, runs its own
    kernel); x is [..., K], bf16 or fp32. fp32 w with fp32 x runs the kernel's fp32 path: one fixed
    reduction order per row, whatever the thread count or the other rows of x.

    Unlike F.linear, a bf16 w may meet fp32 x (the product is then exact fp32 arithmetic on the
    widened weights) and bias may be bf16 or fp32; the F.linear fallback casts w and bias to x's
    dtype to give the same contract.
    """
    if not isinstance(w, Tensor):
        return w.linear(x, bias)
    ext = _EXT.value if _EXT.done else _EXT.get()
    # Checked in order of cost: this runs ~120 times per decode step, where
    # one small matrix takes ~30 us, so the front must stay around 1-2 us.
    # Every property the kernel relies on is checked here: it takes raw pointers.
    wd = w.dtype
    if (
        ext is not None
        and ((wd is _BF16 and (x.dtype is _BF16 or x.dtype is _F32)) or (wd is _F32 and x.dtype is _F32))
        and x.is_cpu
        and w.is_cpu
        and w.dim() == 2
        and x.dim() > 0
        and x.is_contiguous()
        and w.is_contiguous()
        and x.shape[-1] == w.shape[1]
        and w.shape[1] > 0
        and (
            bias is None
            or (
                bias.dim() == 1
                and bias.is_cpu
                and bias.is_contiguous()
                and (bias.dtype is _BF16 or bias.dtype is _F32)
                and bias.shape[0] == w.shape[0]
            )
        )
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad))
        )
    ):
        max_rows = linear_max_rows(wd)
        if x.dim() == 2:
            if x.shape[0] <= max_rows:
                return _run(ext, x, w, bias)
        elif x.numel() <= max_rows * x.shape[-1]:
            y = _run(ext, x.reshape(-1, x.shape[-1]), w, bias)
            return y.reshape(*x.shape[:-1], w.shape[0])
    if x.dtype is _BF16 and x.is_cpu and not native_bf16():
        # Without bf16 arithmetic in the CPU (AVX2, AVX-512 without BF16), oneDNN's bf16 GEMM runs
        # at ~9 GFLOP/s against ~70 in fp32: a prefill in bf16 took 6x as long as in fp32. Widening
        # costs one pass over the weight (~1 ms for the largest SmolLM2 matrix, against ~27 ms of
        # arithmetic at 512 rows), and the result is rounded to bf16 as F.linear's would be.
        return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(_BF16)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, w, bias)
