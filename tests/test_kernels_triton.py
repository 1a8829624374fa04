"""The Triton decode kernels (engine/kernels/triton_decode.py) against the torch
code they replace, run on CPU tensors by Triton's interpreter: RMSNorm with the
residual add, RoPE and the KV write, SiLU * up (bf16 bit for bit but for rare
1-ulp differences, fp32 within ulps), paged decode attention (within the
output's rounding of an fp32 reference) over GQA ratios, head and block sizes,
contexts across block boundaries, padded and column-sliced block tables, batch
1..4, in one split and split-K (empty splits included); and a tiny model
decoding on them: logits close to the torch path's, greedy tokens equal in
fp32. What the interpreter cannot show (speed, tile sizes and warps on a GPU,
capture in a CUDA graph) is for tests/test_cuda.py, on a GPU, where this module
is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

if torch.cuda.is_available():
    # TRITON_INTERPRET holds for the whole process (triton reads it when imported and when it
    # decorates kernels), so here it would hand tests/test_cuda.py's kernels to the interpreter too
    pytest.skip("a GPU runs these kernels natively, in tests/test_cuda.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import numpy as np
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import splitserve.engine.kernels.triton_decode as td  # noqa: E402
from splitserve.engine.attention import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    write_kv,
)
from splitserve.engine.kv_cache import quantized_views  # noqa: E402
from splitserve.engine.layers import apply_rope, rms_norm  # noqa: E402
from splitserve.engine.model import DecoderModel  # noqa: E402
from splitserve.engine.random_model import random_weights, tiny_model_config  # noqa: E402
from tests.kernel_helpers.decode_cases import (  # noqa: E402
    decode_batch,
    decode_logits,
    fp32_attention,
    make_step,
    quantized_batch,
    rope_rows,
)

pytestmark = pytest.mark.timeout(120)

BF16, F32 = torch.bfloat16, torch.float32
DTYPES = [BF16, F32]


# Three faults of Triton 3.6's interpreter that a GPU does not have, mended for these tests
# only (the kernels are untouched): it truncates fp32 to bf16 where the GPU's cvt rounds to
# nearest even; its tl.dot multiplies bf16 operands as their raw uint16 bit patterns; and its
# scalars (1-element arrays) have an __index__ that NumPy 2.4 refuses, which breaks any loop
# bounded by a value loaded or passed at run time.
_convert_float = interpreter._convert_float
_patch_lang_tensor = interpreter._patch_lang_tensor
_create_dot = interpreter.InterpreterBuilder.create_dot


def _rounding_convert_float(data, src, dst, rounding_mode):
    if src == tl.float32 and dst == tl.bfloat16:
        f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return f32.to(BF16).view(torch.int16).numpy().view(np.uint16)
    return _convert_float(data, src, dst, rounding_mode)


def _as_f32(x):
    if x.dtype != tl.bfloat16:
        return x
    return interpreter.TensorHandle(_convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)


def _dot_on_values(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _create_dot(self, _as_f32(a), _as_f32(b), d, input_precision, max_num_imprecise_acc)


def _patch_with_index(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


@pytest.fixture(scope="module", autouse=True)
def faithful_interpreter():
    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_convert_float", _rounding_convert_float)
    mp.setattr(interpreter, "_patch_lang_tensor", _patch_with_index)
    mp.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_on_values)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def kernels() -> td.TritonDecodeKernels:
    if td.kernels_disabled():
        pytest.skip(f"{td.DISABLE_ENV} is set")
    k = td.triton_decode_kernels()
    assert k is not None  # triton imported above
    return k


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_like_torch(out: torch.Tensor, ref: torch.Tensor, fp32_rtol: float = 1e-6) -> None:
    """bf16: bit for bit but for rare 1-ulp differences (sums in another order); fp32: within ulps."""
    assert out.dtype is ref.dtype and out.shape == ref.shape
    if out.dtype is BF16:
        assert int(ulps_apart(out, ref).max()) <= 1
        assert (out == ref).float().mean() >= 0.99
    else:
        torch.testing.assert_close(out, ref, rtol=fp32_rtol, atol=1e-30)


# ---------------------------------------------------------- RMSNorm, SiLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (4, 37)])
def test_norm_with_residual_matches_torch(kernels, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    h0 = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    y = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    cache, meta, _ = decode_batch(gen, dtype, [1] * rows, 2, 1, 8, 4)
    h = h0.clone()
    step = make_step(kernels, h, cache, meta, heads=2)
    assert_like_torch(step.norm(w), rms_norm(h0, w, 1e-5))
    assert torch.equal(h, h0)  # no residual: h untouched
    x = step.norm(w, residual=y)
    assert torch.equal(h, h0 + y)  # the residual add, in place, exactly as torch adds
    assert_like_torch(x, rms_norm(h0 + y, w, 1e-5))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-100), on purpose
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 40), (3, 3)])
def test_silu_mul_matches_torch(kernels, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)[:inter]  # exp's overflow and underflow ends
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    cache, meta, _ = decode_batch(gen, dtype, [1] * rows, 2, 1, 8, 4)
    step = make_step(kernels, torch.zeros(rows, 8, dtype=dtype), cache, meta, heads=2, intermediate=inter)
    assert_like_torch(step.silu_mul(gate_up), ref, fp32_rtol=3e-6)


# --------------------------------------------- matrix products (gemv_kernel)


def assert_product_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within one rounding of the exact product: bf16 at most 1 ulp from the fp32 sum rounded once
    (the kernel sums in fp32 and rounds once, cuBLAS likewise), fp32 within a few ulps of fp64."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert out.dtype is x.dtype and out.shape == exact.shape
    if out.dtype is BF16:
        assert int(ulps_apart(out, exact.to(BF16)).max()) <= 1
    else:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])  # 5: past GEMV_MAX_ROWS, F.linear
@pytest.mark.parametrize("n,k,with_bias", [(7, 37, True), (64, 576, False), (9, 1100, True)])
def test_linear_matches_the_exact_product(kernels, dtype, rows, n, k, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    cache, meta, _ = decode_batch(gen, dtype, [1] * rows, 2, 1, 8, 4)
    step = make_step(kernels, torch.zeros(rows, 8, dtype=dtype), cache, meta, heads=2)
    assert_product_close(step.linear(x, w, bias), x, w, bias)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter,out", [(1, 1536, 16), (3, 40, 9), (5, 24, 8)])  # 5 rows: two calls
def test_silu_mul_linear_reads_the_activation_as_silu_mul_rounds_it(kernels, dtype, rows, inter, out):
    gen = torch.Generator().manual_seed(rows + inter + out)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :2] = torch.tensor([-100.0, 100.0]).to(dtype)
    w = (torch.randn(out, inter, generator=gen) / inter**0.5).to(dtype)
    cache, meta, _ = decode_batch(gen, dtype, [1] * rows, 2, 1, 8, 4)
    step = make_step(kernels, torch.zeros(rows, 8, dtype=dtype), cache, meta, heads=2, intermediate=inter)
    act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(dtype)  # the rounded activation, as torch has it
    assert_product_close(step.silu_mul_linear(gate_up, w), act, w, None)


# ------------------------------------------------- RoPE and the cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (3, 1, 6)])
def test_rope_and_kv_write_match_torch(kernels, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    ctx = [5, 16, 17, 40]
    cache0, meta, qkv0 = decode_batch(gen, dtype, ctx, heads, kv_heads, head_dim, block_size=8)
    cos, sin = rope_rows([n - 1 for n in ctx], head_dim, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    t = len(ctx)
    q = apply_rope(qkv0[:, :q_size].view(t, heads, head_dim), cos, sin)
    k_rot = apply_rope(qkv0[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim), cos, sin)
    v = qkv0[:, q_size + kv_size :].view(t, kv_heads, head_dim)
    expected = cache0.clone()
    write_kv(expected[1], k_rot, v, meta)
    cache, qkv = cache0.clone(), qkv0.clone()
    make_step(kernels, torch.zeros(t, 8, dtype=dtype), cache, meta, heads, cos, sin).write_kv(1, qkv)
    # each product rounded as torch rounds it: the same bits (the interpreter does not fuse
    # multiply-adds; a GPU may, a few fp32 ulps)
    assert torch.equal(qkv[:, :q_size], q.reshape(t, -1))  # q and k rotated in place
    assert torch.equal(qkv[:, q_size : q_size + kv_size], k_rot.reshape(t, -1))
    assert torch.equal(qkv[:, q_size + kv_size :], qkv0[:, q_size + kv_size :])  # v untouched
    assert torch.equal(cache, expected)  # this layer's slots and nothing else


# --------------------------------------------------------- decode attention

ATTENTION_SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2
    (4, 4, 32, 4),  # no GQA
    (8, 1, 16, 16),  # one kv head for eight query heads
    (6, 2, 48, 8),  # a head size that is not a power of two
    (4, 2, 16, 1),  # one token per block
]
CONTEXTS = [[1], [70], [16, 17], [1, 15, 16, 33]]


def split_everything(monkeypatch) -> None:
    """Split-K at every context longer than one attention tile (on a GPU: long contexts only)."""
    monkeypatch.setattr(td, "SPLIT_MIN_TOKENS", 1)
    monkeypatch.setattr(td, "SPLIT_TARGET_PROGRAMS", 10**6)


@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", ATTENTION_SHAPES)
def test_decode_attention_matches_an_fp32_reference(
    kernels, monkeypatch, dtype, heads, kv_heads, head_dim, block_size, split
):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim * 10 + block_size)
    if split:
        split_everything(monkeypatch)
    for i, ctx in enumerate(CONTEXTS):
        cache0, meta, qkv = decode_batch(gen, dtype, ctx, heads, kv_heads, head_dim, block_size, slack=i % 2 * 3)
        scale = head_dim**-0.5
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        t = len(ctx)
        after_write = cache0.clone()
        write_kv(
            after_write[0],
            qkv[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim),
            qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim),
            meta,
        )
        ref = fp32_attention(qkv[:, :q_size].view(t, heads, head_dim), after_write[0], meta, scale).reshape(t, -1)
        cache = cache0.clone()
        step = make_step(kernels, torch.zeros(t, 8, dtype=dtype), cache, meta, heads)
        # with split-K, some splits past a short sequence's context stay empty
        assert (step._splits > 1) == (split and meta.block_tables.shape[1] * block_size > td.ATTENTION_BLOCK_N)
        out = step.attention(0, qkv)
        assert torch.equal(cache, after_write), ctx
        assert out.dtype is dtype and out.shape == (t, q_size)
        # fp32 arithmetic throughout, then one rounding to the output dtype
        tol = 2e-6 + 2e-6 * ref.abs() if dtype is F32 else 1e-5 + ref.abs() * 2.0**-8
        err = (out.float() - ref).abs()
        assert bool((err <= tol).all()), (ctx, float(err.max()))


@pytest.mark.parametrize(
    "batch,kv_heads,max_context", [(1, 8, 8192), (1, 8, 128), (32, 8, 4096), (3, 2, 1000), (1, 1, 300)]
)
def test_context_splits_cover_the_context_in_whole_tiles(batch, kv_heads, max_context):
    splits, per_split = td.context_splits(batch, kv_heads, max_context)
    assert 1 <= splits <= td.MAX_SPLITS
    assert (splits - 1) * per_split < max_context <= splits * per_split  # all covered, no split wholly past
    if splits > 1:
        assert per_split % td.ATTENTION_BLOCK_N == 0 and per_split >= td.SPLIT_MIN_TOKENS
        assert batch * kv_heads * splits <= td.SPLIT_TARGET_PROGRAMS


def test_split_k_fills_the_gpu_at_batch_1_and_leaves_short_or_wide_batches_alone():
    assert td.context_splits(1, 8, 8192)[0] >= 16  # Llama-3-8B, batch 1, 8k context: 8 programs become >= 128
    assert td.context_splits(1, 8, 128)[0] == 1  # too short to pay for the combine
    assert td.context_splits(64, 8, 8192)[0] == 1  # 512 programs already


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs", "ctx", "split"),
    [
        (9, 3, 64, 16, [5, 20, 33], False),
        (8, 2, 32, 4, [7, 13, 2, 30], False),
        (6, 2, 48, 16, [17], False),
        (4, 2, 32, 16, [70, 3], True),
    ],
)
def test_quantized_decode_matches_the_torch_path(
    kernels, monkeypatch, kind, dtype, heads, kv_heads, dim, bs, ctx, split
):
    """An int8 or e4m3 cache (engine/kv_cache.py's format): the step's write gives the torch
    write's bytes, and its attention, reading values and scales in place, the torch path's
    (which dequantizes the gathered blocks to fp32), one split or several."""
    if split:
        split_everything(monkeypatch)
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    cache, meta = quantized_batch(gen, kind, dtype, ctx, kv_heads, dim, bs)
    ref_cache = cache.clone()
    b, q_size, kv_size = len(ctx), heads * dim, kv_heads * dim
    qkv = torch.randn(b, q_size + 2 * kv_size, generator=gen).to(dtype)
    kn = qkv[:, q_size : q_size + kv_size].reshape(b, kv_heads, dim)
    vn = qkv[:, q_size + kv_size :].reshape(b, kv_heads, dim)
    write_kv(ref_cache[1], kn, vn, meta)
    ref = paged_attention(qkv[:, :q_size].reshape(b, heads, dim), kn, vn, ref_cache[1], meta, dim**-0.5)
    ones, zeros = torch.ones(b, dim, dtype=dtype), torch.zeros(b, dim, dtype=dtype)  # RoPE as the identity
    step = kernels.step(
        torch.zeros(b, 8, dtype=dtype),
        cache,
        meta,
        ones,
        zeros,
        num_heads=heads,
        scale=dim**-0.5,
        eps=1e-5,
        intermediate_size=8,
        kv_heads=kv_heads,
    )
    assert (step._splits > 1) == split
    out = step.attention(1, qkv.clone())
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    tol = 2e-2 if dtype is BF16 else 1e-5
    torch.testing.assert_close(out.float(), ref.reshape(b, -1).float(), rtol=tol, atol=tol)


def test_every_e4m3_code_is_read_exactly(kernels):
    """Attention over one token's V is that V: each of the 254 finite e4m3 codes (scale 1), one
    head of 254 values, comes back as torch's own conversion gives it."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7f and 0xff are NaN
    dim = codes.numel()
    cache, meta = quantized_batch(torch.Generator().manual_seed(0), "fp8_e4m3", F32, [1], 1, dim, 4)
    qkv = torch.zeros(1, 3 * dim)
    step = kernels.step(
        torch.zeros(1, 8),
        cache,
        meta,
        torch.ones(1, dim),
        torch.zeros(1, dim),
        num_heads=1,
        scale=dim**-0.5,
        eps=1e-5,
        intermediate_size=8,
        kv_heads=1,
    )
    step.write_kv(1, qkv)
    values, scales = quantized_views(cache[1], 1, dim)  # then the token's V replaced by the codes, scale 1
    blk, off = int(meta.slot_blocks[0]), int(meta.slot_offsets[0])
    values.view(torch.uint8)[blk, 1, off, 0] = codes
    scales[blk, 1, off, 0] = 1.0
    out = step.attention(1, qkv, write=False)[0]
    assert torch.equal(out, codes.view(torch.float8_e4m3fn).float())


def test_attention_after_write_kv_reads_what_it_wrote(kernels):
    """The layer-hook path: write_kv, then attention(write=False), is attention(write=True)."""
    gen = torch.Generator().manual_seed(11)
    cache0, meta, qkv0 = decode_batch(gen, F32, [3, 20], 4, 2, 16, 8)
    cos, sin = rope_rows([2, 19], 16, F32)
    one_call, two_calls = cache0.clone(), cache0.clone()
    a = make_step(kernels, torch.zeros(2, 8), one_call, meta, 4, cos, sin).attention(1, qkv0.clone()).clone()
    step = make_step(kernels, torch.zeros(2, 8), two_calls, meta, 4, cos, sin)
    qkv = qkv0.clone()
    step.write_kv(1, qkv)
    assert torch.equal(step.attention(1, qkv, write=False), a)
    assert torch.equal(one_call, two_calls)


def test_wrong_tensors_are_refused(kernels):
    gen = torch.Generator().manual_seed(1)
    cache, meta, qkv = decode_batch(gen, F32, [3, 5], 4, 2, 16, 4)
    step = make_step(kernels, torch.zeros(2, 8), cache, meta, 4)
    with pytest.raises(ValueError, match="qkv"):
        step.attention(0, qkv.to(BF16))
    with pytest.raises(IndexError):
        step.attention(2, qkv)
    with pytest.raises(ValueError, match="gate_up"):
        step.silu_mul(torch.zeros(2, 15))
    with pytest.raises(ValueError, match="residual"):
        step.norm(torch.ones(8), residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="int64"):
        make_step(
            kernels,
            torch.zeros(2, 8),
            cache,
            AttentionMetadata(
                meta.slot_blocks.int(), meta.slot_offsets, meta.block_tables, meta.context_lens, [1, 1], [3, 5], True
            ),
            4,
        )
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        make_step(kernels, torch.zeros(2, 8, dtype=torch.float64), cache.double(), meta, 4)


# ------------------------------------------------------------------ model

TINY = tiny_model_config(
    num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=256, max_position=128
)


@pytest.fixture(scope="module")
def tiny():
    weights = random_weights(TINY, seed=3, dtype=BF16)
    tokens = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    return weights, tokens


def on_triton(monkeypatch, kernels: td.TritonDecodeKernels) -> list[int]:
    """CPU decode steps on the Triton kernels (the interpreter); returns a list that counts steps."""
    steps: list[int] = []

    def pick(self, kv_cache, meta):
        if not meta.is_decode:
            return None
        steps.append(1)
        return kernels

    monkeypatch.setattr(DecoderModel, "_decode_kernels", pick)
    return steps


def on_torch(monkeypatch) -> None:
    monkeypatch.setattr(DecoderModel, "_decode_kernels", lambda self, kv_cache, meta: None)


@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split-k"])
def test_fp32_decode_logits_match_torch_and_greedy_tokens_are_equal(kernels, tiny, monkeypatch, split):
    weights, tokens = tiny
    cpu = torch.device("cpu")
    if split:
        split_everything(monkeypatch)  # a 48-token table: two splits
    steps = on_triton(monkeypatch, kernels)
    ours = decode_logits(DecoderModel(TINY, weights, cpu, F32), tokens, 12)
    assert len(steps) == 12  # every decode step ran on the kernels, the prefill not
    on_torch(monkeypatch)
    theirs = decode_logits(DecoderModel(TINY, weights, cpu, F32), tokens, 12)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=5e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_bf16_decode_logits_as_close_to_fp32_as_torchs(kernels, tiny, monkeypatch):
    weights, tokens = tiny
    cpu = torch.device("cpu")
    on_torch(monkeypatch)
    ref = decode_logits(DecoderModel(TINY, weights, cpu, F32), tokens, 12)  # the same bf16 weights, fp32 math
    theirs = decode_logits(DecoderModel(TINY, weights, cpu, BF16), tokens, 12)
    on_triton(monkeypatch, kernels)
    ours = decode_logits(DecoderModel(TINY, weights, cpu, BF16), tokens, 12)
    err_ours, err_theirs = (ours - ref).abs(), (theirs - ref).abs()
    assert err_ours.mean() <= 1.1 * err_theirs.mean()
    assert err_ours.max() <= 1.5 * err_theirs.max()
    torch.testing.assert_close(ours, theirs, rtol=2**-6, atol=8 * float(err_theirs.mean()) + 0.05)


def test_cuda_decode_steps_are_offered_the_triton_kernels(kernels, tiny, monkeypatch):
    """Which kernels a step gets, by device: a model on `meta` stands in for one on CUDA (the
    choice reads only the model's device and the cache's dtype and device)."""
    import splitserve.engine.model as model_mod

    weights, _ = tiny
    monkeypatch.setattr(model_mod, "triton_decode_kernels", lambda: kernels)
    meta = AttentionMetadata(
        torch.tensor([1]), torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]), [1], [1], True
    )
    prefill = AttentionMetadata(
        meta.slot_blocks, meta.slot_offsets, meta.block_tables, meta.context_lens, [1], [1], False
    )
    cuda = torch.device("cuda")

    def cache(dtype: torch.dtype, device: torch.device, rows: int = TINY.num_layers) -> torch.Tensor:
        # what _decode_kernels reads of a cache: no real tensor on this machine is on CUDA
        shape = (rows,)
        return SimpleNamespace(dtype=dtype, device=device, is_cpu=device.type == "cpu", shape=shape)  # type: ignore[return-value]

    model = DecoderModel(TINY, weights, torch.device("meta"), BF16)
    model.device = cuda
    assert model._decode_kernels(cache(BF16, cuda), meta) is kernels
    assert model._decode_kernels(cache(BF16, cuda), prefill) is None
    assert model._decode_kernels(cache(F32, cuda), meta) is None  # a cache of another dtype
    assert model._decode_kernels(cache(BF16, cuda, rows=1), meta) is None  # a cache of pages (engine/kv_groups.py)
    for quantized in (torch.int8, torch.float8_e4m3fn):  # read in place by the kernels
        assert model._decode_kernels(cache(quantized, cuda), meta) is kernels
    cpu = DecoderModel(TINY, weights, torch.device("cpu"), BF16)
    assert cpu._decode_kernels(cache(BF16, torch.device("cpu")), meta) is not kernels  # C++ kernels or torch
    monkeypatch.setattr(model_mod, "triton_decode_kernels", lambda: None)  # no triton: torch
    assert model._decode_kernels(cache(BF16, cuda), meta) is None


def test_no_kernels_env_gives_none(monkeypatch):
    monkeypatch.setattr(td._KERNELS, "done", False)
    monkeypatch.setattr(td._KERNELS, "value", None)
    monkeypatch.setenv(td.DISABLE_ENV, "1")
    assert td.triton_decode_kernels() is None


def test_without_triton_the_engine_imports_and_gets_none():
    """A machine without triton (CI, the CPU torch pin): nothing fails, CUDA decode runs on torch."""
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if not installed: importing it raises ImportError
        import splitserve.engine.model
        from splitserve.engine.kernels.triton_decode import triton_decode_kernels
        assert triton_decode_kernels() is None
        print("torch")
    """)
    env = {k: v for k, v in os.environ.items() if k != td.DISABLE_ENV}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr


def test_the_load_time_self_test_passes_on_the_kernels_and_catches_a_wrong_one(kernels):
    # On a GPU, _load runs this before the kernels compute anything real (Triton compiles
    # there for the first time); here it runs through the interpreter on the CPU.
    assert td._self_test(kernels, torch.device("cpu"))

    class WrongSilu:
        def __init__(self, real: td.TritonDecodeKernels) -> None:
            self.real = real

        def step(self, *args, **kwargs):
            s = self.real.step(*args, **kwargs)
            # the wrong kernel the self-test must catch, patched onto the real step
            s.silu_mul = lambda gate_up: torch.zeros(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)  # type: ignore[method-assign]
            return s

    assert not td._self_test(WrongSilu(kernels), torch.device("cpu"))  # type: ignore[arg-type]  # it calls only step


def test_the_quantized_read_has_a_self_test_of_its_own(kernels, monkeypatch):
    """On a GPU the quantized read is checked apart at load: if it fails there, int8 and fp8 pools
    decode on the torch path while pools of the model's dtype keep the kernels."""
    import splitserve.engine.model as model_mod

    assert td._self_test_quantized(kernels, torch.device("cpu"))
    assert td._quantized_self_test_passes(kernels, torch.device("cpu"))

    class WrongScales:
        def step(self, *args, **kwargs):
            s = kernels.step(*args, **kwargs)
            real = s.attention
            s.attention = lambda layer, qkv, write=True: real(layer, qkv, write) * 1.01
            return s

    assert not td._quantized_self_test_passes(WrongScales(), torch.device("cpu"))  # type: ignore[arg-type]

    monkeypatch.setattr(model_mod, "triton_decode_kernels", lambda: kernels)
    monkeypatch.setattr(kernels, "reads_quantized", False)
    weights = random_weights(TINY, seed=3, dtype=BF16)
    model = DecoderModel(TINY, weights, torch.device("meta"), BF16)
    model.device = torch.device("cuda")
    meta = AttentionMetadata(
        torch.tensor([1]), torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]), [1], [1], True
    )
    cuda = torch.device("cuda")
    rows = (TINY.num_layers,)
    int8 = SimpleNamespace(dtype=torch.int8, device=cuda, is_cpu=False, shape=rows)
    bf16 = SimpleNamespace(dtype=BF16, device=cuda, is_cpu=False, shape=rows)
    assert model._decode_kernels(int8, meta) is None  # type: ignore[arg-type]
    assert model._decode_kernels(bf16, meta) is kernels  # type: ignore[arg-type]
