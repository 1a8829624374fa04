"""Mixtral: Mistral's attention and a mixture of experts in every layer's MLP, top-k of a
softmax router, always renormalized over the k. llama.cpp writes it as its llama
architecture with expert tensors (and Q/K rows permuted), so a "llama" GGUF file with an
expert count is this family's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, moe_mlp, pre_norms


def _has_experts(meta: Mapping[str, Any]) -> bool:
    return bool(meta.get(f"{meta.get('general.architecture')}.expert_count"))


ARCH = Architecture(
    name="mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=("llama",),
    globals=decoder_globals(),
    layer=(
        *pre_norms(),
        *attention(rotary_permuted=True, bias="never"),
        *moe_mlp(
            "block_sparse_moe.gate.weight",
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
            "block_sparse_moe.experts.{e}.w2.weight",
        ),
    ),
    traits={"attention_bias": False, "norm_topk_prob": True},
    gguf_matches=_has_experts,
)
