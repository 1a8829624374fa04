"""Which rows and columns of each weight a tensor-parallel rank keeps.

Megatron's split: q, k and v are column-parallel by whole heads (rank r has its
q heads and the KV heads their groups read, so grouped-query attention never
needs another rank's KV), o is row-parallel (its input is the rank's heads),
gate and up are column-parallel and down row-parallel over the intermediate
size. The outputs of o and down are then partial sums over the ranks, which one
all-reduce each completes. The embedding, the norms and lm_head stay whole on
every rank: after the all-reduces every rank holds the same residual stream.
Each family's module declares which of these each tensor is (`TensorDecl.split`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.models import registry
from splitserve.engine.quant.weight import QuantizedWeight, Weight

log = logging.getLogger(__name__)


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError unless the model's heads, KV heads and MLP split evenly over `size` ranks."""
    if size <= 0:
        raise ValueError(f"tensor_parallel_size must be positive, got {size}")
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("intermediate size", cfg.intermediate_size),
        ("experts' intermediate size", cfg.moe_intermediate_size or size),
    ):
        if n % size:
            raise ValueError(
                f"tensor-parallel size {size} does not divide the model's {n} {what} "
                f"({cfg.name}: {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
                f"intermediate size {cfg.intermediate_size})"
            )


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank computes: a model with 1/size of the heads, KV heads and MLP.
    head_dim stays the model's (it is already resolved, so it is not re-derived)."""
    check_tp_size(cfg, size)
    if size == 1:
        return cfg
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
    )


def shard_weights(cfg: ModelConfig, weights: Mapping[str, Weight], rank: int, size: int) -> dict[str, Weight]:
    """Rank `rank`'s weights under the same Hugging Face names, shaped for `rank_config(cfg, size)`.

    The shards are views of `weights` (nothing is copied here), but for a checkpoint's own fused
    tensors (Phi-3's qkv_proj and gate_up_proj), whose parts' rows are joined anew, and a
    quantized matrix's columns (each row cut on a block boundary: ValueError where the rank's
    slice is not whole blocks).
    """
    check_tp_size(cfg, size)
    if not 0 <= rank < size:
        raise IndexError(f"rank {rank} outside 0..{size - 1}")
    if size == 1:
        return dict(weights)
    per_rank = _per_rank(cfg, rank, size)
    decls = registry.for_config(cfg).tensors(cfg)
    out: dict[str, Weight] = {}
    for name, t in weights.items():
        split = decls[name].split if name in decls else "whole"
        if split == "whole":  # embedding, norms, lm_head: whole on every rank
            out[name] = t
        elif split == "qkv_rows":  # a fused q, k and v: the rank's rows of each part
            q, kv = cfg.q_size, cfg.kv_size
            parts = (per_rank["q"], _shift(per_rank["kv"], q), _shift(per_rank["kv"], q + kv))
            out[name] = _cat([_rows(t, p) for p in parts])
        elif split == "gate_up_rows":  # a fused gate and up
            ff = per_rank["ff"]
            out[name] = _cat([_rows(t, ff), _rows(t, _shift(ff, cfg.intermediate_size))])
        elif split.endswith("_rows"):  # a matrix's rows (every expert's, in a stack), or a bias
            out[name] = _rows(t, per_rank[split.removesuffix("_rows")])
        else:  # a matrix's columns
            out[name] = _cols(t, per_rank[split.removesuffix("_cols")])
    return out


def _rows(t: Weight, s: slice) -> Weight:
    """Rows `s` of a matrix (of each expert's, in a stack) or of a bias; a quantized matrix's are
    whole blocks."""
    if isinstance(t, QuantizedWeight):
        return t.rows(s)
    return t[..., s, :] if t.dim() > 1 else t[s]


def _cols(t: Weight, s: slice) -> Weight:
    """Columns `s` of every row: a quantized matrix's cut on block boundaries (ValueError elsewhere)."""
    return t.cols(s) if isinstance(t, QuantizedWeight) else t[..., s]


def _cat(parts: list[Weight]) -> Weight:
    """Rows joined: blocks stay blocks (the parts of one matrix are all quantized or all floats)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat([p for p in parts if isinstance(p, QuantizedWeight)])
    return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])


def _per_rank(cfg: ModelConfig, rank: int, size: int) -> dict[str, slice]:
    """Rank `rank`'s rows (or columns) of q's heads, k's and v's, the MLP and an expert's MLP."""
    d = cfg.head_dim
    return {
        "q": _part(rank, cfg.num_heads // size * d),
        "kv": _part(rank, cfg.num_kv_heads // size * d),
        "ff": _part(rank, cfg.intermediate_size // size),
        "eff": _part(rank, cfg.moe_intermediate_size // size),
    }


def split_on_blocks(
    cfg: ModelConfig, weights: Mapping[str, Weight], size: int, dtype: torch.dtype
) -> dict[str, Weight]:
    """`weights` as `size` ranks can take them: every quantized matrix in its blocks where each
    rank's columns are whole blocks, and dequantized into `dtype` where a rank's would cut one (the
    tiny test models' 96-column MLP over two ranks: 48 columns, a block and a half of 32). Each
    matrix so dequantized is logged by name."""
    decls = registry.for_config(cfg).tensors(cfg)
    out = dict(weights)
    for name, w in weights.items():
        split = decls[name].split if name in decls else "whole"
        if not isinstance(w, QuantizedWeight) or not split.endswith("_cols"):
            continue  # rows and whole matrices split anywhere: a row is whole blocks
        cut = [_per_rank(cfg, r, size)[split.removesuffix("_cols")] for r in range(size)]
        if any(s.start % p.fmt.block_elems or s.stop % p.fmt.block_elems for s in cut for p in w.parts):
            log.warning("%s: %d ranks' columns would cut its %s blocks; dequantized", name, size, w.format_names)
            out[name] = w.dequantize(dtype)
    return out


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _part(rank: int, per_rank: int) -> slice:
    return slice(rank * per_rank, (rank + 1) * per_rank)
