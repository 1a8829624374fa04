"""The quantized-weight kernels (engine/kernels/quant.cpp) on every GGUF block format and every
path this CPU has: dequantization bit-exact against the gguf package's, x @ W.T against a float
matmul on those weights, and a row's result the same alone or in a batch and at 1 or 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from splitserve.engine.gguf_formats import BY_NAME, FORMATS
from splitserve.engine.kernels import quant as qk
from splitserve.engine.quant.weight import QuantizedWeight, cat_rows

pytestmark = pytest.mark.skipif(not qk.available(), reason="the quantized kernel does not build on this platform")

NAMES = sorted(BY_NAME)


def _weights(name: str, n: int = 24, blocks: int = 3, seed: int = 0) -> tuple[torch.Tensor, int]:
    fmt = BY_NAME[name]
    k = blocks * fmt.block_elems
    return qk.random_blocks(fmt, n, k, torch.Generator().manual_seed(seed)), k


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_is_the_gguf_packages_bit_for_bit(name):
    w, k = _weights(name)
    ref = gguf_dequantize(w.numpy(), GGMLQuantizationType[name]).reshape(w.shape[0], k)
    got = qk.dequantize(BY_NAME[name], w, k)
    want = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: a -0.0 stays -0.0
    rows = torch.tensor([5, 0, 5, 23])
    assert torch.equal(qk.dequantize(BY_NAME[name], w, k, rows=rows), got[rows])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_every_path_matches_a_float_matmul(name, rows):
    w, k = _weights(name, seed=rows)
    fmt = BY_NAME[name]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ qk.dequantize(fmt, w, k).double().T
    outs = [qk.on_path(x, fmt, w, k, path).double() for path in range(qk.best_path() + 1)]
    for path, y in enumerate(outs):
        # x rounded to int8 per block of 32 (the int8 mode, llama.cpp's vec_dot): ~0.5% of the norm
        rel = float((y - exact).norm() / exact.norm())
        assert rel < 0.02, (qk.PATH_NAMES[path], rel)
    for y in outs[1:]:  # the SIMD paths compute the scalar reference's integers
        assert torch.allclose(y, outs[0], rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
    for path in range(qk.best_path() + 1):  # the exact mode: the float matmul, to fp32 rounding
        y = qk.on_path(x, fmt, w, k, path, exact=True).double()
        assert float((y - exact).norm() / exact.norm()) < 1e-5, qk.PATH_NAMES[path]


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_result_is_the_same_alone_in_a_batch_and_at_any_thread_count(name):
    w, k = _weights(name, n=200)
    fmt = BY_NAME[name]
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    for exact in (False, True):
        try:
            torch.set_num_threads(1)
            alone = qk.quant_linear(x[3:4].contiguous(), fmt, w, k, exact)
            torch.set_num_threads(2)
            batch = qk.quant_linear(x, fmt, w, k, exact)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(alone[0], batch[3])


def test_bf16_activations_give_bf16_results_close_to_fp32():
    w, k = _weights("Q4_0")
    fmt = BY_NAME["Q4_0"]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    y32 = qk.quant_linear(x, fmt, w, k)
    y16 = qk.quant_linear(x.to(torch.bfloat16), fmt, w, k)
    assert y16.dtype is torch.bfloat16
    assert torch.allclose(y16.float(), y32, rtol=0.05, atol=0.05 * float(y32.abs().max()))
    # the exact mode on bf16 x: the dense bf16 model's products (vdpbf16ps where the CPU has it)
    xb = x.to(torch.bfloat16)
    dense = (xb.float() @ qk.dequantize(fmt, w, k, torch.bfloat16).float().T).to(torch.bfloat16)
    for path in range(qk.best_path() + 1):
        got = qk.on_path(xb, fmt, w, k, path, exact=True)
        assert got.dtype is torch.bfloat16
        assert torch.allclose(got.float(), dense.float(), rtol=2e-2, atol=2e-2 * float(dense.float().abs().max()))


@pytest.mark.skipif(not (qk.available() and qk._ext().bf16()), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("name", NAMES)
def test_bf16_rows_get_the_dense_bf16_kernels_bits_whatever_shares_the_call(name):
    """On AVX-512 BF16 a row's bf16 result is the same bits in registers (a few rows) and through the
    unpacked scratch (more), up to a prefill chunk of TILE_MAX_ROWS, and equal to linear.cpp's dense
    kernel on the dequantized bf16 weights: the blocks are the dense model, batch-invariant."""
    from splitserve.engine.kernels.linear import linear

    w, k = _weights(name, n=37)  # 37: nine tiles of four rows of W, and one row alone
    fmt = BY_NAME[name]
    x = torch.randn(qk.TILE_MAX_ROWS, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    alone = torch.stack([qk.quant_linear(x[i : i + 1].contiguous(), fmt, w, k, exact=True)[0] for i in (0, 7, 200)])
    for rows in (1, 2, 8, 9, 16, 33, qk.TILE_MAX_ROWS):
        y = qk.quant_linear(x[:rows].contiguous(), fmt, w, k, exact=True)
        for j, i in enumerate((0, 7, 200)):
            if i < rows:
                assert torch.equal(y[i].view(torch.int16), alone[j].view(torch.int16)), (rows, i)
    dense = qk.dequantize(fmt, w, k, torch.bfloat16)
    for rows in (3, 20):
        got = qk.quant_linear(x[:rows].contiguous(), fmt, w, k, exact=True)
        assert torch.equal(got.view(torch.int16), linear(x[:rows].contiguous(), dense).view(torch.int16))


def test_prefill_sized_batches_take_the_scratch_tiles_then_the_dequantized_gemm_and_agree():
    w, k = _weights("Q5_1")
    fmt = BY_NAME["Q5_1"]
    for rows in (qk.MAX_ROWS + 5, qk.TILE_MAX_ROWS + 1):  # fp32 x through scratch, then the GEMM
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
        exact = x @ qk.dequantize(fmt, w, k).T
        for path in range(1, qk.best_path() + 1):
            if rows <= qk.TILE_MAX_ROWS:
                got = qk.on_path(x, fmt, w, k, path, exact=True)
                assert torch.allclose(got, exact, rtol=1e-4, atol=1e-4), qk.PATH_NAMES[path]
        assert torch.allclose(qk.quant_linear(x, fmt, w, k, exact=True), exact, rtol=1e-4, atol=1e-4)
        assert torch.allclose(qk.quant_linear(x, fmt, w, k), exact, rtol=1e-4, atol=1e-4)  # int8 mode: the GEMM
    xb = torch.randn(qk.TILE_MAX_ROWS + 1, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dense = xb.float() @ qk.dequantize(fmt, w, k, torch.bfloat16).float().T
    got = qk.quant_linear(xb, fmt, w, k).float()  # past the tiles' rows: the GEMM on bf16 weights
    assert torch.allclose(got, dense, rtol=2e-2, atol=2e-2 * float(dense.abs().max()))


def test_bad_arguments_are_refused_before_any_pointer_is_handed_over():
    w, k = _weights("Q8_0")
    fmt = BY_NAME["Q8_0"]
    with pytest.raises(ValueError, match="do not hold"):
        qk.quant_linear(torch.randn(1, k + 32), fmt, w, k + 32)
    with pytest.raises(ValueError, match="contiguous CPU fp32 or bf16"):
        qk.quant_linear(torch.randn(k, 2).T, fmt, w, k)
    with pytest.raises(ValueError, match="not available"):
        qk.on_path(torch.randn(1, k), fmt, w, k, qk.best_path() + 1)
    with pytest.raises(IndexError):
        qk.dequantize(fmt, w, k, rows=torch.tensor([w.shape[0]]))


def test_a_quantized_weights_rows_and_columns():
    """What the loaders, the model and tensor parallelism do with a weight, on its blocks."""
    q4, k = _weights("Q4_0", n=6, blocks=4)
    q8, _ = _weights("Q8_0", n=4, blocks=4)
    a = QuantizedWeight.of(BY_NAME["Q4_0"], q4, k)
    b = QuantizedWeight.of(BY_NAME["Q8_0"], q8, k)
    fused = cat_rows([a, b, a])
    assert isinstance(fused, QuantizedWeight) and fused.shape == (16, k)
    assert fused.format_names == ("Q4_0", "Q8_0") and fused.nbytes == 2 * q4.numel() + q8.numel()
    dense = fused.dequantize()
    assert torch.equal(dense, torch.cat([a.dequantize(), b.dequantize(), a.dequantize()]))
    # a dtype the kernel does not write (a GPU's float16 copy): each part converted into its rows
    assert torch.equal(fused.dequantize(torch.float16), dense.half())
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(fused.linear(x), x @ dense.T, rtol=0.02, atol=0.02 * float((x @ dense.T).abs().max()))
    idx = torch.tensor([15, 2, 7, 7, 0])
    assert torch.equal(fused.take_rows(idx).dequantize(), dense[idx])
    assert torch.equal(fused.rows(slice(4, 9)).dequantize(), dense[4:9])
    assert torch.equal(fused.cols(slice(32, 96)).dequantize(), dense[:, 32:96])
    with pytest.raises(ValueError, match="blocks"):
        fused.cols(slice(0, 48))
    ids = torch.tensor([[1, 14], [9, 0]])
    assert torch.equal(fused.embedding(ids, torch.float32), dense[ids])
    assert torch.equal(fused.sample(7, 50), dense.reshape(-1)[::7][:50])
    mixed = cat_rows([a, torch.ones(2, k)])  # a float part: the slot is floats
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed[:6], a.dequantize())


def test_a_weight_in_another_row_order_is_a_view_whose_products_are_gathered():
    """llama.cpp's q/k rows stay where the file holds them: every operation sees HF's order."""
    q4, k = _weights("Q4_0", n=6, blocks=4)
    q8, _ = _weights("Q8_0", n=4, blocks=4)
    a = QuantizedWeight.of(BY_NAME["Q4_0"], q4, k)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    p = a.in_row_order(perm)
    assert p.parts[0].data.data_ptr() == a.parts[0].data.data_ptr() and p.nbytes == a.nbytes  # nothing copied
    fused = cat_rows([p, QuantizedWeight.of(BY_NAME["Q8_0"], q8, k), p])
    assert isinstance(fused, QuantizedWeight)
    dense = torch.cat(
        [a.dequantize()[perm], QuantizedWeight.of(BY_NAME["Q8_0"], q8, k).dequantize(), a.dequantize()[perm]]
    )
    assert torch.equal(fused.dequantize(), dense)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    ref = x @ dense.T
    for w in (fused, fused.invariant()):
        assert torch.allclose(w.linear(x), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
    prefill = torch.randn(qk.MAX_ROWS + 3, k, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(fused.linear(prefill), prefill @ dense.T, rtol=1e-4, atol=1e-4)
    idx = torch.tensor([15, 2, 7, 7, 0])
    assert torch.equal(fused.take_rows(idx).dequantize(), dense[idx])
    again = torch.randperm(16, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fused.in_row_order(again).dequantize(), dense[again])
    assert torch.equal(fused.rows(slice(4, 9)).dequantize(), dense[4:9])
    assert torch.equal(fused.cols(slice(32, 96)).dequantize(), dense[:, 32:96])
    ids = torch.tensor([[1, 14], [9, 0]])
    assert torch.equal(p.embedding(ids % 6, torch.float32), a.dequantize()[perm][ids % 6])
    assert torch.equal(fused.embedding(ids, torch.float32), dense[ids])
    assert torch.equal(fused.sample(7, 50), dense.reshape(-1)[::7][:50])
    with pytest.raises(ValueError, match="row order"):
        QuantizedWeight(a.parts, k, order=torch.arange(5))


def test_the_format_table_is_ggmls():
    for fmt in FORMATS.values():
        t = GGMLQuantizationType(fmt.ggml_type)
        assert t.name == fmt.name
        from gguf.constants import GGML_QUANT_SIZES

        assert GGML_QUANT_SIZES[t] == (fmt.block_elems, fmt.block_bytes)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_quantizing_floats_at_load_reads_back_through_the_gguf_packages_dequantize(name):
    from splitserve.engine.quant.quantize import quantize_q4_k, quantize_q8_0

    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(7)) * 0.05
    blocks = (quantize_q8_0 if name == "Q8_0" else quantize_q4_k)(w)
    assert blocks.shape == (6, BY_NAME[name].row_bytes(512))
    back = torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType[name]).reshape(6, 512).copy())
    rel = float((back - w).norm() / w.norm())
    assert rel < (0.01 if name == "Q8_0" else 0.12), rel  # 8 bits, or 4 bits with 6-bit scales and mins
    assert torch.equal(qk.dequantize(BY_NAME[name], blocks, 512), back)
