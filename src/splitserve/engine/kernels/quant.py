"""The front of quant.cpp: x @ W.T and W's rows dequantized, W in a GGUF block format.

`quant_linear` is what a linear layer on a quantized weight runs on a CPU: for decode-sized
batches (up to MAX_ROWS rows) the kernel over the packed blocks (`exact`: the blocks dequantized
in registers against x as it is, what the engine runs; else llama.cpp's int8 vec_dot, kept for
comparison: quant.cpp's header has the figures); past that, a prefill, the weight dequantized
into a float matrix for oneDNN's GEMM, where arithmetic and not the weight's bytes bound the
step. Each call checks every tensor it hands over as a pointer: the module trusts them.

Paths (quant.cpp): 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512 VNNI; `best_path()` is the CPU's widest,
and `on_path` runs any of them so that tests and benchmarks compare each with the others.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import Tensor

from splitserve.engine.gguf_formats import FORMATS, BlockFormat
from splitserve.engine.kernels.build import load_extension, passes_self_test
from splitserve.engine.kernels.linear import linear, native_bf16
from splitserve.engine.kernels.once import Once

log = logging.getLogger(__name__)


# Rows of x up to which the kernel runs on fp32 x: each weight block is unpacked once and dotted
# with every row, so its cost grows with the rows while the dequantized GEMM's per-row cost falls.
# Measured on a Q4_1 576x1536 matrix, one thread (AVX-512 VNNI, bf16 x): 565 against 884 us at 8
# rows, 919 against 877 at 16, 2,655 against 1,067 at 48 (`splitserve bench quant`'s crossover
# section measures it on each run).
MAX_ROWS = 16
# The same for bf16 x where the CPU multiplies bf16 (quant.cpp's path_bf16: a chunk of W unpacked
# once into scratch, then linear.cpp's register tiles). SmolLM2's matrices in Q4_1, 6 layers, 2
# threads (AMD EPYC), against the dense bf16 weights: 0.94x at 128 rows, 0.87x at 256, 0.84x at 512,
# 0.81x at 1,024, where dequantizing the whole matrix into oneDNN's GEMM gives 0.86x, 0.86x, 0.94x
# and 1.01x. Up to here a row's bits are the decode kernel's, whatever else shares the step, so the
# line is a decode worker's whole chunk (tuned.CHUNK_TOKENS): at 256, a resumed request's prompt
# tail prefilled beside a long prompt's chunk took the GEMM and its seeded text parted; a prefill
# worker's 2,048-token chunks take the GEMM.
TILE_MAX_ROWS = 512

PATH_NAMES = {0: "scalar", 1: "avx2", 2: "avx512_vnni"}

_F32, _BF16 = torch.float32, torch.bfloat16


def _self_test(ext: ModuleType) -> bool:
    """Every format's kernel against its own dequantized rows and a float matmul."""
    gen = torch.Generator().manual_seed(0)
    for fmt in FORMATS.values():
        k = 2 * fmt.block_elems
        w = random_blocks(fmt, 5, k, gen)
        x = torch.randn(3, k, generator=gen)
        ref = x.double() @ _dequantize(ext, fmt, w, k, _F32).double().T
        for exact in (False, True):
            got = _linear(ext, x, (fmt.ggml_type, w.data_ptr(), w.shape[0]), 5, k, int(ext.isa()), exact)
            if not torch.allclose(got.double(), ref, rtol=0.05, atol=0.05 * float(ref.abs().max()) + 1e-3):
                return False
    return True


def random_blocks(fmt: BlockFormat, n: int, k: int, gen: torch.Generator) -> Tensor:
    """n rows of k elements of valid `fmt` blocks: random bytes with every fp16 scale in the
    range a checkpoint's are (a random scale's bits could be a NaN). For tests and self-tests."""
    blocks = k // fmt.block_elems
    data = torch.randint(0, 256, (n, blocks, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    scale_at = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    for at in scale_at.get(fmt.name, (0,)):
        half = (torch.rand(n, blocks, generator=gen) * 0.02 + 0.001).to(torch.float16)
        data[:, :, at : at + 2] = half.view(torch.uint8).reshape(n, blocks, 2)
    if fmt.name == "Q6_K":  # int8 scales: keep them moderate
        data[:, :, 192:208] = (data[:, :, 192:208] % 64).to(torch.uint8)
    return data.reshape(n, blocks * fmt.block_bytes).contiguous()


def _load() -> ModuleType | None:
    ext = load_extension("splitserve_quant", "quant.cpp", fallback="dequantized weights")
    if ext is None:
        return None
    return ext if passes_self_test("quantized linear kernel", lambda: _self_test(ext), "dequantized weights") else None


_EXT: Once[ModuleType | None] = Once(_load)


def available() -> bool:
    """Whether quantized weights can be computed in place here (building the kernel if not yet built)."""
    return _EXT.get() is not None


def best_path() -> int:
    ext = _EXT.get()
    return -1 if ext is None else int(ext.isa())


def max_rows() -> int:
    """The most rows of x the kernel takes (past them, the dequantized GEMM): TILE_MAX_ROWS on a SIMD
    path (past 12 rows of fp32 x, or 8 of bf16 x on AVX-512 BF16, a chunk of W is unpacked once into
    scratch for register tiles), else MAX_ROWS. 0 where the kernel is not built."""
    ext = _EXT.value if _EXT.done else None
    if ext is None:
        return 0
    return TILE_MAX_ROWS if int(ext.isa()) >= 1 else MAX_ROWS


def _ext() -> ModuleType:
    ext = _EXT.value if _EXT.done else _EXT.get()
    if ext is None:
        raise RuntimeError("the quantized linear kernel is not available on this machine")
    return ext


def _check(fmt: BlockFormat, w: Tensor, k: int) -> None:
    if not (w.dtype is torch.uint8 and w.dim() == 2 and w.is_cpu and w.is_contiguous()):
        raise ValueError("quantized blocks must be a contiguous CPU uint8 tensor [rows, row_bytes]")
    if k % fmt.block_elems or w.shape[1] != fmt.row_bytes(k):
        raise ValueError(f"{fmt.name}: rows of {w.shape[1]} bytes do not hold {k} elements")


def _linear(ext: ModuleType, x: Tensor, parts: Parts, n: int, k: int, path: int, exact: bool = False) -> Tensor:
    """x [B, k] (fp32 or bf16, contiguous) @ W.T, W's rows the checked `parts` (n in all); `exact`:
    x as it is against the blocks dequantized in fp32, else x rounded to int8 blocks."""
    b = x.shape[0]
    y = x.new_empty(b, n)
    ext.linear(y.data_ptr(), x.data_ptr(), parts, k, b, n, x.dtype is _BF16, torch.get_num_threads(), path, exact)
    return y


def _dequantize(
    ext: ModuleType,
    fmt: BlockFormat,
    w: Tensor,
    k: int,
    dtype: torch.dtype,
    rows: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    count = w.shape[0] if rows is None else rows.numel()
    if out is not None and (out.shape != (count, k) or not out.is_contiguous() or out.dtype is not dtype):
        raise ValueError(
            f"dequantize: out must be a contiguous [{count}, {k}] {dtype} tensor, got {tuple(out.shape)} {out.dtype}"
        )
    into = _BF16 if dtype is _BF16 else _F32  # what the kernel writes; any other dtype is converted
    buf = out if out is not None and out.dtype is into else torch.empty(count, k, dtype=into)
    idx = 0 if rows is None else rows.data_ptr()
    ext.dequantize(buf.data_ptr(), w.data_ptr(), fmt.ggml_type, idx, count, k, dtype is _BF16, torch.get_num_threads())
    if out is None:
        return buf if buf.dtype is dtype else buf.to(dtype)
    if buf is not out:
        out.copy_(buf)
    return out


def dequantize(
    fmt: BlockFormat,
    w: Tensor,
    k: int,
    dtype: torch.dtype = _F32,
    rows: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """W's rows as floats: all of them, or those in `rows` (int64 indices: an embedding's lookup);
    written into `out` where it is given (a slice of a fused slot's matrix, in `dtype`)."""
    _check(fmt, w, k)
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= w.shape[0]):
            raise IndexError(f"row index out of range for a weight of {w.shape[0]} rows")
    return _dequantize(_ext(), fmt, w, k, dtype, rows, out)


def _fits(x: Tensor, k: int) -> bool:
    return x.dtype in (_F32, _BF16) and x.is_cpu and x.dim() == 2 and x.shape[1] == k and x.is_contiguous()


def quant_linear(x: Tensor, fmt: BlockFormat, w: Tensor, k: int, exact: bool = False) -> Tensor:
    """x [B, k] @ W.T on the blocks: the kernel up to `max_rows()` rows, else W dequantized for a
    float GEMM."""
    parts = check_blocks(fmt, w, k)
    if not _fits(x, k):
        raise ValueError(f"x must be a contiguous CPU fp32 or bf16 [rows, {k}] tensor, got {tuple(x.shape)} {x.dtype}")
    ext = _ext()
    if x.shape[0] <= (max_rows() if exact else MAX_ROWS):  # the int8 mode has no scratch tiles
        return _linear(ext, x, parts, w.shape[0], k, int(ext.isa()), exact)
    return linear(x, _dequantize(ext, fmt, w, k, gemm_dtype(x)))


def gemm_dtype(x: Tensor) -> torch.dtype:
    """What a prefill's matrix is dequantized into for linear.py's `linear`: x's dtype, but fp32 for
    bf16 x on a CPU without bf16 arithmetic (which `linear` widens to fp32 anyway)."""
    return x.dtype if x.dtype is _F32 or native_bf16() else _F32


# A weight's parts as the kernel takes them: (GGML type, address of the blocks, rows) one after the
# other in one flat tuple, checked once by `check_blocks` when the weight is made, so that a decode
# step's ~120 calls check only x.
Parts = tuple[int, ...]


def check_blocks(fmt: BlockFormat, w: Tensor, k: int) -> tuple[int, int, int]:
    """`w`'s blocks checked as every call would check them, and its entry in a weight's Parts
    (the caller keeps `w` alive as long as the entry)."""
    _check(fmt, w, k)
    return fmt.ggml_type, w.data_ptr(), w.shape[0]


def decode_linear(
    x: Tensor, parts: Parts, n: int, k: int, rows: int | None = None, exact: bool = False
) -> Tensor | None:
    """x @ W.T on the kernel for W's checked `parts` ([n, k] in all), or None where x does not take
    it (more than `rows` rows, max_rows() where None; another dtype or layout; not built)."""
    ext = _EXT.value if _EXT.done else None
    if ext is None or not (x.dim() == 2 and x.shape[0] <= (max_rows() if rows is None else rows) and _fits(x, k)):
        return None
    return _linear(ext, x, parts, n, k, int(ext.isa()), exact)


def on_path(x: Tensor, fmt: BlockFormat, w: Tensor, k: int, path: int, exact: bool = False) -> Tensor:
    """x @ W.T on one path of the kernel (0 .. best_path()), whatever the rows: to compare paths."""
    if not _fits(x, k):
        raise ValueError("on_path takes a contiguous CPU fp32 or bf16 x [rows, k]")
    ext = _ext()
    if not 0 <= path <= int(ext.isa()):
        raise ValueError(f"quantized kernel path {path} is not available here (paths 0..{int(ext.isa())})")
    return _linear(ext, x, check_blocks(fmt, w, k), w.shape[0], k, path, exact)
