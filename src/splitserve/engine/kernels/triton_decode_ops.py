"""The Triton kernels of a CUDA decode step (launched by triton_decode.py, which
owns shapes, checks and buffers; this module imports triton unconditionally).

Rounding follows the torch code in engine/model.py and engine/attention.py
op for op where torch rounds to the model dtype between operations (the
residual add, RMSNorm's normalised value before the weight, each product of
RoPE, SiLU before the multiply by up), so that bf16 results match torch's bits
but for reordered fp32 sums. Attention keeps fp32 from the scores to the
output and rounds once.

Indices (block tables, slots, context lengths) are int64, and every cache
offset is computed in int64: a cache of a few GiB overflows int32 element offsets.

A quantized cache (KV_QUANT 1 int8, 2 e4m3; engine/kv_cache.py's format: one-byte values,
then a fp32 scale per token and kv head, inside each block) is read in place: its values
widen to fp32 in registers, each token's K scale multiplies its score and its V scale its
probability, and the products run in fp32 ("ieee"), as the C++ kernel computes them. The
write of a quantized cache is the torch code's (triton_decode.py), this module only rotates.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(out_ptr, h_ptr, res_ptr, w_ptr, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: with HAS_RESIDUAL, h += residual (in place, rounded as torch
    adds), then out = w * RMSNorm(h), normalised in fp32 and rounded before the weight."""
    dtype = h_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h_row = h_ptr + row * hidden + offs
    h = tl.load(h_row, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * hidden + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(h_row, h, mask=mask)
    x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    xn = (x * tl.math.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * xn.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, y.to(dtype), mask=mask)


@triton.jit
def rope_write_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_blocks_ptr,
    slot_offsets_ptr,
    qkv_stride,
    rope_stride,
    stride_block,
    stride_kv,
    stride_tok,
    stride_head,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    STORE_KV: tl.constexpr,
):
    """Grid (tokens, heads + 2 kv_heads): program (b, j) takes head j of row b of qkv, q heads
    first, then k, then v. q and k heads are rotated in place (HF's rotate_half); with STORE_KV,
    k and v heads are stored at the token's slot of `cache_ptr` (one layer: [blocks, 2, bs, kv, dim])."""
    dtype = qkv_ptr.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)
    mask = offs < half
    src = qkv_ptr + b * qkv_stride + head * HEAD_DIM
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0)
    block = tl.load(slot_blocks_ptr + b)
    slot = cache_ptr + block * stride_block + tl.load(slot_offsets_ptr + b) * stride_tok
    if head < NUM_HEADS + KV_HEADS:
        cs = b * rope_stride + offs
        c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + half, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + half, mask=mask, other=0.0).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype as torch does
        y1 = ((f1 * c1).to(dtype).to(tl.float32) - (f2 * s1).to(dtype).to(tl.float32)).to(dtype)
        y2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
        tl.store(src + offs, y1, mask=mask)
        tl.store(src + half + offs, y2, mask=mask)
        if STORE_KV and head >= NUM_HEADS:
            dst = slot + (head - NUM_HEADS) * stride_head
            tl.store(dst + offs, y1, mask=mask)
            tl.store(dst + half + offs, y2, mask=mask)
    elif STORE_KV:
        dst = slot + stride_kv + (head - NUM_HEADS - KV_HEADS) * stride_head
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + half + offs, x2, mask=mask)


@triton.jit
def paged_decode_attention_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qkv_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qkv_stride,
    table_stride,
    stride_block,
    stride_kv,
    stride_tok,
    stride_head,
    tokens_per_split,
    scale_log2,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Grid (sequences, kv_heads, splits): one program attends the GROUP query heads that share
    a kv head, so each K/V tile is read once for all of them, over its split's share of the
    context (tokens_per_split from split * tokens_per_split on; one split: all of it), tile by
    tile with an online softmax. One split writes the output; several write their partial sums
    for combine_splits_kernel. KV_QUANT: 0 a cache of the model's dtype, 1 int8, 2 e4m3 bits."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = (kvh * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(qkv_ptr + b * qkv_stride + heads, mask=q_mask, other=0.0)
    first = split * tokens_per_split
    end = tl.minimum(tl.load(context_lens_ptr + b), first + tokens_per_split)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    k_head = cache_ptr + kvh * stride_head
    table_row = block_tables_ptr + b * table_stride
    for start in range(first, end, BLOCK_N):  # no iteration for a split past the context
        k, tok, kv_mask, t_valid, ks, vs = _load_k_tile(
            k_head, table_row, start, end, d, stride_block, stride_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N, cache_ptr, kvh
        )
        m, l, acc = _online_softmax_step(
            q, k, t_valid, m, l, acc, scale_log2, k_head + stride_kv, tok, d, kv_mask, QK_PRECISION, ks, vs, KV_QUANT
        )
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + b * (NUM_HEADS * HEAD_DIM) + heads, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (b * NUM_HEADS + kvh * GROUP + g) * NUM_SPLITS + split  # [GROUP_PAD]
        _store_split_part(part_acc_ptr, part_ml_ptr, row, m, l, acc, d, q_mask, g < GROUP, HEAD_DIM)


@triton.jit
def _load_k_tile(
    k_head,
    table_row,
    start,
    end,
    d,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    cache_ptr,
    kvh,
):
    """K [BLOCK_N, dim] of the context tokens from `start` on (those from `end` on masked to
    zeros, t_valid False), addressed token by token through the sequence's block table
    `table_row` (any block size, no gather); `k_head`: the layer's cache at one kv head.
    Also each token's offset in the cache and the tile's mask, for its V; and where a quantized
    cache (engine/kv_cache.py: a block's values, then its fp32 K scales [block_size, kv_heads],
    then its V scales) keeps the tokens' K and V scales of kv head `kvh` (addresses only: nothing
    is read there)."""
    n = tl.arange(0, BLOCK_N)
    t = start + n
    t_valid = t < end
    # masked: a table's last tile may run past its width, and padding entries are never read
    block = tl.load(table_row + t // BLOCK_SIZE, mask=t_valid, other=0)
    tok = block * stride_block + (t % BLOCK_SIZE) * stride_tok
    kv_mask = t_valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_head + tok[:, None] + d[None, :], mask=kv_mask, other=0)
    # one-byte values: stride_block is a block's bytes, stride_tok kv_heads * HEAD_DIM
    kv_heads = stride_tok // HEAD_DIM
    ks = (
        cache_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        + kvh
        + block * (stride_block // 4)
        + BLOCK_SIZE * stride_tok // 2
        + (t % BLOCK_SIZE) * kv_heads
    )
    return k, tok, kv_mask, t_valid, ks, ks + BLOCK_SIZE * kv_heads


@triton.jit
def _widen(x, KV_QUANT: tl.constexpr):
    """One-byte cache values as fp32, exactly: int8 (KV_QUANT 1), or e4m3 bits read as uint8
    (2; the C++ kernel's kv_f32, with no fp32 subnormal on the way: a normal's exponent
    rebased by 127 - 7, a subnormal m * 2^-9 as 2^-6 * (1 + m/8) - 2^-6)."""
    if KV_QUANT == 1:
        return x.to(tl.float32)
    v = x.to(tl.uint32)
    mag = (v & 0x7F) << 20
    sub = (v & 0x78) == 0
    f = tl.where(sub, mag | (121 << 23), mag + (120 << 23)).to(tl.float32, bitcast=True)
    f = tl.where(sub, f - 0.015625, f)
    return (f.to(tl.uint32, bitcast=True) | ((v & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _online_softmax_step(
    q,
    k,
    t_valid,
    m,
    l,
    acc,
    scale_log2,
    v_head,
    tok,
    d,
    kv_mask,
    QK_PRECISION: tl.constexpr,
    ks,
    vs,
    KV_QUANT: tl.constexpr,
):
    """One K/V tile into the running max m, denominator l and unnormalised output acc of the
    query group q, all fp32, in base 2 (scale_log2 = scale * log2(e)). V is read (at v_head, the
    cache's V at the kv head) once the tile's probabilities are known. A quantized tile's values
    widen to fp32, against q in fp32 (as the C++ kernel computes), and its tokens' scales (at ks
    and vs) weigh their scores and probabilities."""
    if KV_QUANT == 0:
        # bf16 x bf16 products are exact in fp32, so this dot is as accurate as an fp32 one
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale_log2
    else:
        k_scale = tl.load(ks, mask=t_valid, other=0.0)
        s = tl.dot(q.to(tl.float32), tl.trans(_widen(k, KV_QUANT)), input_precision="ieee")
        s = s * (k_scale * scale_log2)[None, :]
    s = tl.where(t_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_head + tok[:, None] + d[None, :], mask=kv_mask, other=0)
    # probabilities stay fp32 (no rounding to bf16 as flash kernels do): decode is bound by K/V reads
    if KV_QUANT == 0:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        v_scale = tl.load(vs, mask=t_valid, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], _widen(v, KV_QUANT), input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _store_split_part(part_acc_ptr, part_ml_ptr, row, m, l, acc, d, q_mask, g_valid, HEAD_DIM: tl.constexpr):
    """One split's unnormalised sums and (max, denominator) at `row` (a head's row per split) of
    the part buffers, [B, heads, splits, dim] and [B, heads, splits, 2] fp32. An empty split
    leaves m = -inf, l = 0, acc = 0: weight 0 in the combine."""
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    tl.store(part_ml_ptr + row * 2, m, mask=g_valid)
    tl.store(part_ml_ptr + row * 2 + 1, l, mask=g_valid)


@triton.jit
def combine_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid (sequences, heads): the splits' partial softmaxes rescaled to their common max and
    summed (split 0 always holds token 0, so that max is finite)."""
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64) * NUM_HEADS + tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    sp_valid = sp < NUM_SPLITS
    ml = part_ml_ptr + (row * NUM_SPLITS + sp) * 2
    m = tl.load(ml, mask=sp_valid, other=float("-inf"))
    l = tl.load(ml + 1, mask=sp_valid, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    mask = sp_valid[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + sp)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(dtype), mask=d < HEAD_DIM)


@triton.jit
def silu_mul_kernel(out_ptr, gate_up_ptr, inter, BLOCK: tl.constexpr):
    """Grid (rows, column tiles): out = silu(gate) * up from gate_up = [gate | up], silu rounded
    to the dtype before the multiply, as F.silu(gate) * up does."""
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < inter
    src = gate_up_ptr + row * 2 * inter + col
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + col, (silu * u).to(dtype), mask=mask)


@triton.jit
def gemv_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    rows,
    N,
    K,
    x_stride,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (column tiles of y,): y = x @ w.T (+ bias) for a few rows of x, each weight read once.

    Decode's matrix products at batch 1..4 are weight streams: the program reads a tile of
    BLOCK_N weight rows and multiplies it against every row of x at once, fp32 sums rounded
    once at the end. With SILU_MUL, x is gate_up = [gate | up] (x_stride = 2 K) and each of its
    values is silu(gate) * up rounded as silu_mul_kernel rounds it, so the MLP's down product
    needs no activation buffer and no kernel of its own.
    """
    dtype = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, ROWS_PAD)
    r_mask = r < rows
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + r.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        xm = r_mask[:, None] & k_mask[None, :]
        if SILU_MUL:
            g = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + k[None, :], mask=xm, other=0.0).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            x = (silu * u).to(dtype).to(tl.float32)
        else:
            x = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + r.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(dtype), mask=r_mask[:, None] & n_mask[None, :])
