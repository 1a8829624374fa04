"""KV cache dtypes (--kv-cache-dtype): the names and their resolution, the quantized block
format of engine/kv_cache.py (values, then a fp32 scale per token and KV head, inside each
block), quantize_into / dequantize_blocks (what a receiver of another dtype calls), the
torch path's write and dequantizing read (engine/attention.py), the C++ decode kernel's
quantized write and read on every ISA path this CPU has (the same cache bytes as the torch
write, attention within rounding of the torch read), and a tiny model end to end: the same
token's log-probability by prefill and by decode, step by step, with int8 and fp8 KV."""

from __future__ import annotations

import os

import pytest
import torch

import splitserve.engine.kernels.decode as kd
from splitserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import (
    KVCache,
    KVLayout,
    dequantize_blocks,
    pool_blocks,
    quantize_into,
    quantize_rows,
    quantized_views,
)
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from tests.kernel_helpers.decode_cases import quantized_batch

pytestmark = pytest.mark.timeout(300)

BF16, F32 = torch.bfloat16, torch.float32
KINDS = ["int8", "fp8_e4m3"]


@pytest.fixture(scope="module")
def kernels(cpu_decode_kernels: kd.DecodeKernels) -> kd.DecodeKernels:
    return cpu_decode_kernels  # tests/conftest.py's


# ------------------------------------------------------------ names and sizes


@pytest.mark.parametrize(
    ("flag", "model", "name"),
    [
        ("auto", "bfloat16", "bfloat16"),
        ("auto", "float32", "float32"),
        ("bfloat16", "float32", "bfloat16"),
        ("float32", "bfloat16", "float32"),
        ("int8", "bfloat16", "int8"),
        ("fp8", "float32", "fp8_e4m3"),
    ],
)
def test_kv_cache_dtype_resolves(flag: str, model: str, name: str) -> None:
    cfg = EngineConfig(dtype=model, kv_cache_dtype=flag)
    assert cfg.kv_dtype == name
    assert KVLayout(2, 2, 8, 4, cfg.kv_dtype).dtype == name


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes=-1)


def test_quantized_block_bytes_and_capacity() -> None:
    bf16 = KVLayout(30, 3, 64, 16, "bfloat16")
    int8 = KVLayout(30, 3, 64, 16, "int8", tp_size=1)
    assert int8.quantized and not bf16.quantized
    assert int8.bytes_per_block == 2 * 16 * 3 * (64 + 4)
    assert int8.shard_shape(5) == (30, 5, int8.bytes_per_block)
    pool = 64 * 2**20
    assert pool_blocks(int8, pool) / pool_blocks(bf16, pool) >= 1.8
    with pytest.raises(ValueError, match="holds no block"):
        pool_blocks(int8, 100)
    tp2 = KVLayout(2, 4, 32, 8, "fp8", tp_size=2)
    assert KVCache(tp2, 3).tensor.shape == (2, 3, tp2.shard_bytes_per_block)
    assert tp2.shard_bytes_per_block * 2 == tp2.bytes_per_block


def test_layout_mismatch_names_both_dtypes() -> None:
    a = KVLayout(2, 2, 8, 4, "int8")
    b = KVLayout(2, 2, 8, 4, "bfloat16")
    assert a.mismatch(b) == "KV layout mismatch on dtype: int8 KV here, bfloat16 KV at the peer"
    assert a.mismatch(KVLayout(2, 2, 8, 4, "int8")) is None


# --------------------------------------------------------------- the format


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_error_and_zero_rows(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 10
    x[5, 1] = 0
    q, s = quantize_rows(x, kind)
    assert s[5, 1] == 0 and torch.all(q[5, 1].float() == 0)
    back = q.float() * s[..., None]
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if kind == "int8":
        assert torch.all(err <= amax / 254 * 1.0001)  # half a step
    else:  # e4m3: 3 mantissa bits, 2^-4 relative, and subnormals below 2^-6 of 448 steps
        assert torch.all(err <= torch.maximum(x.abs() / 16, amax / 448 * 2**-9) * 1.0001)


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_token_by_token_is_quantize_into(kind: str) -> None:
    """The engine writes a block token by token; quantize_into writes it whole: same bytes."""
    gen = torch.Generator().manual_seed(1)
    lay = KVLayout(1, 2, 16, 4, kind)
    a, b = KVCache(lay, 4), KVCache(lay, 4)
    k = torch.randn(2, 4, 2, 16, generator=gen).to(BF16)
    v = torch.randn(2, 4, 2, 16, generator=gen).to(BF16)
    for t in range(4):
        meta = _slots([3, 1], [t, t])
        write_kv(a.layer(0), k[:, t], v[:, t], meta)
    quantize_into(b, 0, [3, 1], k, v)
    assert torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))
    values, scales = quantized_views(b.layer(0), 2, 16)
    assert values.shape == (4, 2, 4, 2, 16) and scales.shape == (4, 2, 4, 2) and scales.dtype is F32
    assert torch.all(values[[0, 2]].view(torch.int8) == 0)  # untouched blocks stay zero


@pytest.mark.parametrize("dtype", ["int8", "fp8", "bfloat16", "float32"])
def test_quantize_into_and_back(dtype: str) -> None:
    gen = torch.Generator().manual_seed(2)
    lay = KVLayout(3, 4, 32, 8, dtype, tp_size=2)
    cache = KVCache(lay, 6)
    k = torch.randn(2, 8, 2, 32, generator=gen)
    v = torch.randn(2, 8, 2, 32, generator=gen)
    quantize_into(cache, 2, [4, 0], k, v, rank=1)
    k2, v2 = dequantize_blocks(cache, 2, [4, 0], F32, rank=1)
    tol = {"int8": 0.02, "fp8": 0.13, "bfloat16": 0.02, "float32": 0.0}[dtype]
    assert (k2 - k).abs().max() <= tol and (v2 - v).abs().max() <= tol
    assert torch.all(cache.shard(0).float() == 0)  # rank 0's shard untouched
    with pytest.raises(ValueError, match="quantize_into takes K and V of shape"):
        quantize_into(cache, 0, [1], k, v)
    with pytest.raises(IndexError):
        quantize_into(cache, 0, [1, 6], k, v)


@pytest.mark.parametrize("kind", KINDS)
def test_copy_and_reset_blocks_carry_scales(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    lay = KVLayout(2, 2, 16, 4, kind)
    cache = KVCache(lay, 4)
    k, v = torch.randn(1, 4, 2, 16, generator=gen), torch.randn(1, 4, 2, 16, generator=gen)
    for layer in range(2):
        quantize_into(cache, layer, [1], k, v)
    cache.copy_blocks([(1, 2)])
    assert torch.equal(dequantize_blocks(cache, 1, [2], F32)[0], dequantize_blocks(cache, 1, [1], F32)[0])
    cache.reset_blocks([1])
    assert torch.all(cache.tensor[:, 1].view(torch.uint8) == 0)


# --------------------------------------------------- the attention kernels


def _slots(blocks: list[int], offsets: list[int]) -> AttentionMetadata:
    return AttentionMetadata(
        slot_blocks=torch.tensor(blocks),
        slot_offsets=torch.tensor(offsets),
        block_tables=torch.zeros(len(blocks), 1, dtype=torch.long),
        context_lens=torch.ones(len(blocks), dtype=torch.long),
        query_lens=[1] * len(blocks),
        context_lens_list=[1] * len(blocks),
        is_decode=True,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs", "ctx"),
    [(9, 3, 64, 16, [5, 20, 33]), (4, 4, 128, 8, [1, 9]), (8, 2, 32, 4, [7, 13, 2, 30]), (6, 2, 48, 16, [17])],
)
def test_cpp_quantized_decode_matches_torch(
    kernels: kd.DecodeKernels,
    kind: str,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
    ctx: list[int],
) -> None:
    """Every ISA path: the kernel's quantized write gives the torch write's bytes, and its
    attention over the quantized cache agrees with the torch path's (which dequantizes to the
    model's dtype before SDPA: within that rounding)."""
    for isa in range(1, kernels.best_isa + 1):
        k = kernels.with_isa(isa)
        gen = torch.Generator().manual_seed(isa * 100 + dim)
        cache, meta = quantized_batch(gen, kind, dtype, ctx, kv_heads, dim, bs)
        ref_cache = cache.clone()
        b = len(ctx)
        qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        q = qkv[:, : heads * dim].reshape(b, heads, dim)
        kn = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(b, kv_heads, dim)
        vn = qkv[:, (heads + kv_heads) * dim :].reshape(b, kv_heads, dim)
        write_kv(ref_cache[1], kn, vn, meta)
        ref = paged_attention(q, kn, vn, ref_cache[1], meta, dim**-0.5).reshape(b, -1)
        h = torch.randn(b, 16, generator=gen).to(dtype)
        ones, zeros = torch.ones(b, dim, dtype=dtype), torch.zeros(b, dim, dtype=dtype)  # RoPE as the identity
        step = k.step(
            h,
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
        out = step.attention(1, qkv.clone())
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)), f"isa {isa}: cache bytes differ"
        tol = 2e-2 if dtype is BF16 else 1e-5
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=f"isa {isa}")


def test_cpp_quantized_step_needs_kv_heads(kernels: kd.DecodeKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    cache, meta = quantized_batch(gen, "int8", BF16, [3], 2, 16, 4)
    h = torch.randn(1, 16, generator=gen).to(BF16)
    ones = torch.ones(1, 16, dtype=BF16)
    with pytest.raises(ValueError, match="kv_heads given"):
        kernels.step(h, cache, meta, ones, ones, num_heads=4, scale=0.25, eps=1e-5, intermediate_size=8)


# ------------------------------------------------------------------ the model


def _token_logprobs(kv: str, dtype: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability teacher-forced by one prefill, and step by step by decode."""
    cfg = tiny_model_config(max_position=512)
    weights = random_weights(cfg, seed=3)
    eng = Engine(cfg, weights, EngineConfig(dtype=dtype, kv_cache_dtype=kv, num_blocks=64, block_size=4))
    try:
        return _forced(eng, tokens, prefill=True), _forced(eng, tokens, prefill=False)
    finally:
        eng.close()


def _forced(eng: Engine, tokens: list[int], prefill: bool) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) for each i, through the engine's model and cache: one
    prefill of the whole text, or one decode step per token (the fused kernel on a CPU)."""
    model, cache = eng.model, eng.kv_cache.tensor
    bs = eng.cfg.block_size
    n = len(tokens)
    nb = (n + bs - 1) // bs
    table = torch.arange(1, nb + 1)[None]
    ids = torch.tensor(tokens)
    if prefill:
        pos = torch.arange(n)
        meta = AttentionMetadata(table[0, pos // bs], pos % bs, table, torch.tensor([n]), [n], [n], False)
        logits = model.forward(ids, pos, cache, meta, torch.arange(n))
    else:
        rows = []
        for i in range(n):
            p = torch.tensor([i])
            meta = AttentionMetadata(table[0, p // bs], p % bs, table, torch.tensor([i + 1]), [1], [i + 1], True)
            rows.append(model.forward(ids[i : i + 1], p, cache, meta, torch.zeros(1, dtype=torch.long)))
        logits = torch.cat(rows)
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(n - 1), ids[1:]]


@pytest.mark.parametrize("kv", ["int8", "fp8", "bfloat16"])
def test_prefill_and_decode_give_the_same_logprobs(kv: str, kernels: kd.DecodeKernels) -> None:
    """Teacher-forced (prefill, torch path) against step by step (decode, the C++ kernel) over
    the same quantized cache: the same tokens' log-probabilities within 0.05."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (40,), generator=gen).tolist()
    forced, stepped = _token_logprobs(kv, "float32", tokens)
    assert (forced - stepped).abs().max().item() <= 0.05


def test_engine_generates_with_quantized_kv_and_sizes_the_pool_in_bytes() -> None:
    cfg = tiny_model_config(max_position=512)
    weights = random_weights(cfg, seed=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    blocks = {}
    for kv in ("float32", "int8", "fp8"):
        eng = Engine(cfg, weights, EngineConfig(kv_cache_dtype=kv, kv_cache_bytes=2**20, block_size=4))
        try:
            outs[kv] = eng.generate(prompts, greedy)
            blocks[kv] = eng.cfg.num_blocks
            assert eng.layout.dtype == EngineConfig(kv_cache_dtype=kv).kv_dtype
        finally:
            eng.close()
    assert all(len(o) == 12 for out in outs.values() for o in out)
    assert outs["int8"][0][:4] == outs["float32"][0][:4]
    assert blocks["int8"] == blocks["fp8"] and blocks["int8"] / blocks["float32"] >= 3.0


def test_worker_and_serve_flags() -> None:
    import argparse

    from splitserve.cluster.serve import add_arguments as add_serve_arguments
    from splitserve.engine.flags import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    cfg = engine_config_from_args(p.parse_args(["--kv-cache-dtype", "fp8", "--kv-cache-bytes", "4096"]))
    assert (cfg.kv_dtype, cfg.kv_cache_bytes) == ("fp8_e4m3", 4096)
    assert engine_config_from_args(p.parse_args(["--dtype", "bfloat16"])).kv_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int4"])
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    assert "--kv-cache-dtype" in serve.format_help() and "--kv-cache-bytes" in serve.format_help()


def test_cpp_reads_every_e4m3_code_exactly(kernels: kd.DecodeKernels) -> None:
    """A context of one token: attention returns its V, dequantized. V holds every e4m3fn code
    but NaN's (subnormals, zeros of both signs, the largest), each scale 1: the kernel's
    widening (portable and AVX-512) gives torch's float8_e4m3fn values exactly."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[codes == 0x7F], codes[codes == 0xFF] = 0x7E, 0xFE  # NaN is never written
    lay = KVLayout(1, 2, 128, 4, "fp8")
    for isa in range(1, kernels.best_isa + 1):
        cache = KVCache(lay, 2).tensor
        values, scales = quantized_views(cache[0], 2, 128)
        values.view(torch.uint8)[1, 1, 0] = codes.view(2, 128).to(torch.uint8)
        scales[1, :, 0] = 1.0
        meta = AttentionMetadata(
            torch.tensor([1]), torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]), [1], [1], True
        )
        h = torch.zeros(1, 16)
        ones = torch.ones(1, 128)
        step = kernels.with_isa(isa).step(
            h, cache, meta, ones, ones * 0, num_heads=2, scale=0.1, eps=1e-5, intermediate_size=8, kv_heads=2
        )
        out = step.attention(0, torch.zeros(1, 6 * 128), write=False)
        want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.equal(out.view(-1), want), f"isa {isa}"


def resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_host_kv_pool_holds_memory_only_where_blocks_were_written() -> None:
    """A 512 MiB pool: resident only as its blocks are written (a standby worker holds its warm-up's
    blocks, not the pool), and read as zeros everywhere else."""
    layout = KVLayout(16, 8, 128, 16, "bfloat16")  # 1 MiB a block (16 layers x 64 KiB)
    before = resident_mib()
    cache = KVCache(layout, 512)
    assert resident_mib() - before < 16  # allocated, not touched
    cache.tensor[:, :8].fill_(1.0)  # eight blocks written, every layer
    grew = resident_mib() - before
    assert 6 <= grew < 40, grew  # eight blocks' MiB, give or take the pages around them
    assert float(cache.tensor[:, 8:].abs().sum()) == 0.0 and float(cache.tensor[:, :8].min()) == 1.0
