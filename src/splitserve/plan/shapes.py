"""What a model's shape says about serving it: KV bytes per token, weight bytes, FLOPs per token.

`ModelShape` holds only the numbers the arithmetic needs. It comes from the built-in
table of well-known models (`BUILTIN`), from a Hugging Face config.json, or from a
GGUF file's metadata; the dense Llama-family cases go through the engine's own
`ModelConfig` so that what `plan` reads is what `serve` would load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.engine.gguf_formats import FORMATS

if TYPE_CHECKING:
    from splitserve.engine.config import ModelConfig

# Bytes per element of a weight or KV dtype name.
DTYPE_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    # the GGUF block formats splitserve computes in place, their scales counted (Q4_0: 18 bytes a 32)
    **{f.name.lower(): f.block_bytes / f.block_elems for f in FORMATS.values()},
}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape. For a mixture of experts `total_params` counts every expert and
    `active_params` those one token runs through; for a dense model the two are equal."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    total_params: int
    active_params: int
    experts: int = 0  # routed experts per MoE layer; 0: dense
    active_experts: int = 0  # routed experts each token runs through
    # MLA (DeepSeek) caches one compressed latent plus the RoPE key per token and layer instead of
    # K and V per KV head: kv_lora_rank + qk_rope_head_dim elements. 0: standard K and V.
    kv_latent_dim: int = 0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "total_params", "active_params"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelShape.{f} must be positive, got {getattr(self, f)}")
        if self.active_params > self.total_params:
            raise ValueError("active_params cannot exceed total_params")
        if self.experts and not 0 < self.active_experts <= self.experts:
            raise ValueError("a mixture of experts needs 0 < active_experts <= experts")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def kv_elements_per_layer(self) -> int:
        """Cached elements per token and layer: K and V per KV head, or MLA's latent."""
        return self.kv_latent_dim or 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        return self.layers * self.kv_elements_per_layer * kv_dtype_bytes

    def weight_bytes(self, dtype_bytes: float) -> float:
        return self.total_params * dtype_bytes

    @property
    def matmul_params(self) -> int:
        """Active parameters a token multiplies by: the embedding table is a lookup, not a
        matmul, unless it is tied and doubles as the LM head."""
        return self.active_params - (0 if self.tie_embeddings else self.vocab * self.hidden)

    def prefill_flops(self, tokens: int, cached: int = 0) -> float:
        """FLOPs to prefill `tokens` new tokens after `cached` ones: 2 per matmul parameter per
        token, plus causal attention (QK^T and AV, 2 FLOPs each per head dim) over the context."""
        # the i-th new token attends to cached + i positions; summed over the new tokens
        positions = tokens * cached + tokens * (tokens + 1) / 2
        return 2.0 * self.matmul_params * tokens + 4.0 * self.layers * self.heads * self.head_dim * positions

    def decode_flops(self, context: int) -> float:
        """FLOPs for one decode token at `context` positions."""
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.heads * self.head_dim * context


def dense_params(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    tie_embeddings: bool,
    attention_bias: bool = False,
) -> int:
    """A Llama-family decoder's parameters, for the built-in table (a loaded config counts its
    family's declared tensors: engine/models/registry.py's param_count)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate + 2 * hidden
    if attention_bias:
        per_layer += q + 2 * kv
    return layers * per_layer + vocab * hidden * (1 if tie_embeddings else 2) + hidden


def dense(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    tie_embeddings: bool = False,
    attention_bias: bool = False,
) -> ModelShape:
    shape = (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab)
    params = dense_params(*shape, tie_embeddings, attention_bias)
    return ModelShape(name, *shape, params, params, tie_embeddings=tie_embeddings)


def from_model_config(cfg: ModelConfig) -> ModelShape:
    """The engine's own config (what `serve` would load) as a shape, its parameters counted from
    its family's declaration (engine/models/)."""
    from splitserve.engine.models.registry import param_count

    return ModelShape(
        name=cfg.name,
        layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size,
        vocab=cfg.vocab_size,
        total_params=param_count(cfg),
        active_params=param_count(cfg, active=True),
        experts=cfg.num_experts,
        active_experts=cfg.num_experts_per_tok,
        tie_embeddings=cfg.tie_embeddings,
    )


def deepseek_from_hf(d: dict[str, Any], name: str) -> ModelShape:
    """A DeepSeek-V2/V3 config.json: MLA attention, a few dense layers, then routed plus shared experts."""
    try:
        layers, hidden, heads = int(d["num_hidden_layers"]), int(d["hidden_size"]), int(d["num_attention_heads"])
        vocab, inter, moe_inter = int(d["vocab_size"]), int(d["intermediate_size"]), int(d["moe_intermediate_size"])
        experts, k = int(d["n_routed_experts"]), int(d["num_experts_per_tok"])
        shared, first_dense = int(d.get("n_shared_experts") or 0), int(d.get("first_k_dense_replace") or 0)
        kv_rank, rope, nope = int(d["kv_lora_rank"]), int(d["qk_rope_head_dim"]), int(d["qk_nope_head_dim"])
        v_dim, q_rank = int(d["v_head_dim"]), int(d.get("q_lora_rank") or 0)
    except KeyError as e:
        raise ValueError(f"DeepSeek config.json lacks {e.args[0]!r}") from None
    q_dim = heads * (nope + rope)
    q_proj = hidden * q_rank + q_rank * q_dim if q_rank else hidden * q_dim
    attention = q_proj + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    expert = 3 * hidden * moe_inter
    moe_layers = layers - first_dense
    common = layers * attention + first_dense * 3 * hidden * inter + moe_layers * (shared * expert + hidden * experts)
    embeddings = 2 * vocab * hidden
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=nope + rope,  # the QK width; attention FLOPs are counted with it
        intermediate=moe_inter,
        vocab=vocab,
        total_params=common + moe_layers * experts * expert + embeddings,
        active_params=common + moe_layers * k * expert + embeddings,
        experts=experts,
        active_experts=k,
        kv_latent_dim=kv_rank + rope,
    )


def from_hf_config(d: dict[str, Any], name: str) -> ModelShape:
    if "kv_lora_rank" in d:
        return deepseek_from_hf(d, name)
    from splitserve.engine.config import ModelConfig  # torch comes with it; only this path pays
    from splitserve.engine.models import registry

    # a family the engine serves counts as its module declares it; a config without model_type as Llama
    model_type = d.get("model_type") or ("mixtral" if "num_local_experts" in d else "llama")
    return from_model_config(registry.for_hf_model_type(model_type).configure(ModelConfig.from_hf(d, name=name)))


def from_gguf(path: str) -> ModelShape:
    """The shape in a GGUF file's metadata, read by the engine's GGUF loader (no tensor is read)."""
    from splitserve.engine.gguf_loader import model_config_from_gguf, open_gguf, read_metadata

    reader = open_gguf(path)
    return from_model_config(model_config_from_gguf(read_metadata(reader, path), reader, path))


# The built-in table: shapes as their config.json files give them.
_DEEPSEEK_V3 = {
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "vocab_size": 129280,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 1536,
}

BUILTIN: dict[str, ModelShape] = {
    s.name: s
    for s in (
        dense("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        dense("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        dense("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256),
        dense("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, attention_bias=True),
        dense("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768),
        dense("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True),
        deepseek_from_hf(_DEEPSEEK_V3, "deepseek-v3"),
    )
}


def load_shape(spec: str) -> ModelShape:
    """A built-in name, a config.json (or a folder holding one), or a .gguf file."""
    if spec.lower() in BUILTIN:
        return BUILTIN[spec.lower()]
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"{spec!r} is neither a built-in model ({', '.join(BUILTIN)}) nor a file")
    from splitserve.engine.gguf_loader import looks_like_gguf

    if looks_like_gguf(path):
        return from_gguf(path)
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return from_hf_config(d, str(d.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path)))))
