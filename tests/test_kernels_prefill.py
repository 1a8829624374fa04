"""The prefill attention kernel (engine/kernels/prefill.cpp): agreement with fp32 causal
attention over shapes that cross its tiles (16-key tiles, 4-row tiles at d = 64, 2 and 8 rows
at d = 128 and 32), chunks after a cached prefix, shuffled block tables and GQA groups; one
result whatever the thread count; its availability follows the CPU's flags; the attention
module's prefill path takes it and agrees with its own SDPA path; the calls it does not fit
return None; a bad block table is refused before memory is touched."""

from __future__ import annotations

import os

import pytest
import torch

import splitserve.engine.kernels.prefill as kp
from splitserve.engine import attention

pytestmark = pytest.mark.timeout(300)


def _cpu_has_bf16_dot() -> bool:
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    return "avx512_bf16" in flags and "avx512bw" in flags


@pytest.fixture(scope="module")
def ext():
    if kp.kernels_disabled():
        pytest.skip(f"{kp.DISABLE_ENV} is set")
    if not _cpu_has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16: prefill attention runs SDPA here (test_available_follows_flags)")
    ext = kp._EXT.get()
    assert ext is not None, "the CPU has AVX-512 BF16 but the kernel did not build or failed its self-test"
    return ext


def test_available_follows_flags():
    if kp.kernels_disabled():
        assert not kp.prefill_kernel_available()
    else:
        assert kp.prefill_kernel_available() == _cpu_has_bf16_dot()


def _case(gen, heads, kv_heads, dim, q_len, ctx_len, bs=16, spare=3):
    nb = -(-ctx_len // bs)
    blocks = nb + spare
    cache = torch.randn(blocks, 2, bs, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen)[:nb].to(torch.int64)
    q = torch.randn(q_len, heads, dim, generator=gen).to(torch.bfloat16)
    return q, cache, table


CASES = [
    # heads, kv_heads, dim, q_len, ctx_len
    (9, 3, 64, 1, 1),
    (9, 3, 64, 5, 5),
    (9, 3, 64, 16, 16),
    (9, 3, 64, 17, 17),
    (9, 3, 64, 100, 100),
    (9, 3, 64, 37, 300),  # a chunk after a cached prefix
    (9, 3, 64, 1, 129),  # one row (a decode row in a mixed step)
    (4, 4, 64, 33, 47),
    (8, 2, 128, 21, 70),
    (6, 1, 32, 19, 45),
]


@pytest.mark.parametrize("heads,kv_heads,dim,q_len,ctx_len", CASES)
def test_matches_fp32_causal_attention(ext, heads, kv_heads, dim, q_len, ctx_len):
    gen = torch.Generator().manual_seed(q_len * 1000 + ctx_len)
    q, cache, table = _case(gen, heads, kv_heads, dim, q_len, ctx_len)
    scale = dim**-0.5
    got = kp.prefill_attention(q, cache, table, ctx_len, scale)
    assert got is not None and got.dtype is torch.bfloat16 and got.shape == q.shape
    ref = kp.sdpa_reference(q, cache, table, ctx_len, scale)
    # bf16 products with fp32 sums, P rounded to bf16 for the second product, as SDPA in bf16
    err = (got.float() - ref).abs().max().item()
    assert err < 2e-2, err


def test_one_result_whatever_the_thread_count(ext):
    gen = torch.Generator().manual_seed(7)
    q, cache, table = _case(gen, 9, 3, 64, 203, 203)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kp.prefill_attention(q, cache, table, 203, 0.125)
        torch.set_num_threads(2)
        two = kp.prefill_attention(q, cache, table, 203, 0.125)
    finally:
        torch.set_num_threads(before)
    assert one is not None and two is not None
    assert torch.equal(one, two)


def test_a_row_does_not_depend_on_its_chunk(ext):
    # the last 40 rows computed as a chunk after a 160-token prefix equal the same rows of the whole
    gen = torch.Generator().manual_seed(8)
    q, cache, table = _case(gen, 9, 3, 64, 200, 200)
    whole = kp.prefill_attention(q, cache, table, 200, 0.125)
    tail = kp.prefill_attention(q[160:].clone(), cache, table, 200, 0.125)
    assert whole is not None and tail is not None
    assert torch.equal(whole[160:], tail)


def test_large_scores_stay_finite(ext):
    # scores far from zero exercise the running maximum's rescaling
    gen = torch.Generator().manual_seed(9)
    q, cache, table = _case(gen, 9, 3, 64, 64, 64)
    q = (q.float() * 30).to(torch.bfloat16)
    got = kp.prefill_attention(q, cache, table, 64, 0.125)
    ref = kp.sdpa_reference(q, cache, table, 64, 0.125)
    assert got is not None and torch.isfinite(got.float()).all()
    assert (got.float() - ref).abs().max().item() < 5e-2


def test_calls_it_does_not_fit_return_none(ext):
    gen = torch.Generator().manual_seed(10)
    q, cache, table = _case(gen, 9, 3, 64, 8, 8)
    assert kp.prefill_attention(q.float(), cache, table, 8, 0.125) is None  # fp32 q
    assert kp.prefill_attention(q, cache.float(), table, 8, 0.125) is None  # fp32 cache
    q48, cache48, table48 = _case(gen, 4, 2, 48, 8, 8)
    assert kp.prefill_attention(q48, cache48, table48, 8, 0.125) is None  # head size 48
    assert kp.prefill_attention(q, cache, table.to(torch.int32), 8, 0.125) is None
    assert kp.prefill_attention(q, cache, table[:0], 8, 0.125) is None  # table too short


def test_a_block_outside_the_cache_is_refused(ext):
    gen = torch.Generator().manual_seed(11)
    q, cache, table = _case(gen, 9, 3, 64, 8, 20)
    bad = table.clone()
    bad[1] = cache.shape[0]
    with pytest.raises(IndexError, match="out of range"):
        kp.prefill_attention(q, cache, bad, 20, 0.125)


def _meta(table: torch.Tensor, q_lens: list[int], ctx_lens: list[int]) -> attention.AttentionMetadata:
    t = sum(q_lens)
    zeros = torch.zeros(t, dtype=torch.int64)
    return attention.AttentionMetadata(
        slot_blocks=zeros,
        slot_offsets=zeros,
        block_tables=table,
        context_lens=torch.tensor(ctx_lens),
        query_lens=q_lens,
        context_lens_list=ctx_lens,
        is_decode=False,
    )


def test_attention_prefill_path_takes_the_kernel_and_agrees_with_sdpa(ext):
    # two sequences in one step: a first chunk (no prefix) and a chunk after a prefix
    gen = torch.Generator().manual_seed(12)
    cache = torch.randn(20, 2, 16, 3, 64, generator=gen).to(torch.bfloat16)
    table = torch.tensor([[0, 1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10, 11]], dtype=torch.int64)
    q_lens, ctx_lens = [70, 30], [70, 110]
    q = torch.randn(100, 9, 64, generator=gen).to(torch.bfloat16)
    k_new = torch.cat(
        [cache[table[0, :5], 0].reshape(80, 3, 64)[:70], cache[table[1, :7], 0].reshape(112, 3, 64)[80:110]]
    )
    v_new = torch.cat(
        [cache[table[0, :5], 1].reshape(80, 3, 64)[:70], cache[table[1, :7], 1].reshape(112, 3, 64)[80:110]]
    )
    meta = _meta(table, q_lens, ctx_lens)
    calls = []

    def counted(*args, **kwargs):
        got = kp.prefill_attention(*args, **kwargs)
        calls.append(got is not None)
        return got

    ours = attention.paged_attention(q, k_new, v_new, cache, meta, 0.125, counted)
    assert calls == [True, True]
    sdpa = attention.paged_attention(q, k_new, v_new, cache, meta, 0.125)  # no kernel: SDPA
    assert (ours.float() - sdpa.float()).abs().max().item() < 2e-2


def test_a_kernel_that_fails_its_self_test_is_not_used(ext, monkeypatch, caplog):
    gen = torch.Generator().manual_seed(14)
    q, cache, table = _case(gen, 9, 3, 64, 8, 8)

    def raises(_ext):
        raise TypeError("prefill_attention() takes 13 integer arguments")

    for broken in (lambda _ext: False, raises):
        monkeypatch.setattr(kp._EXT, "done", False)
        monkeypatch.setattr(kp._EXT, "value", None)
        monkeypatch.setattr(kp, "_self_test", broken)
        with caplog.at_level("WARNING"):
            assert kp.prefill_attention(q, cache, table, 8, 0.125) is None  # the caller runs SDPA
        assert "self-test" in caplog.text and "SDPA" in caplog.text
        caplog.clear()
        monkeypatch.undo()
    assert kp.prefill_attention(q, cache, table, 8, 0.125) is not None  # the real one again


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_rows_norm_and_silu_mul_match_torch(dtype):
    # the decode kernels' RMSNorm and SiLU * up over a prefill's rows (model.py's prefill path)
    from splitserve.engine.kernels.decode import decode_kernels
    from splitserve.engine.layers import rms_norm

    k = decode_kernels()
    if k is None:
        pytest.skip("the decode kernels did not build here (see the warning in the log)")
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    expected_h = h + residual
    expected = rms_norm(expected_h, w, 1e-5)
    mine = h.clone()
    got = k.rms_norm(mine, w, 1e-5, residual)
    assert torch.equal(mine, expected_h)  # the residual added in place, rounded as torch rounds it
    tol = 1e-2 if dtype is torch.bfloat16 else 1e-5
    assert (got.float() - expected.float()).abs().max().item() <= tol * expected.float().abs().max().item()
    gate_up = torch.randn(37, 2 * 1536, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    act = k.silu_mul(gate_up)
    ref = torch.nn.functional.silu(gate) * up
    assert act.shape == (37, 1536)
    assert (act.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
    with pytest.raises(ValueError, match="even"):
        k.silu_mul(gate_up[:, :-1].contiguous())
    with pytest.raises(ValueError, match="residual"):
        k.rms_norm(h.clone(), w, 1e-5, residual[:5].contiguous())
