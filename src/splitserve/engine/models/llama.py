"""Llama 2/3.x (and SmolLM, which is Llama): pre-norm layers of grouped-query attention
and a SwiGLU MLP, RoPE with linear or llama3 scaling, q/k/v bias where config.json's
`attention_bias` says. llama.cpp permuted q's and k's rows in its GGUF files."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, pre_norms, swiglu_mlp


def _dense(meta: Mapping[str, Any]) -> bool:
    return not meta.get("llama.expert_count")  # with experts: Mixtral's (mixtral.py)


ARCH = Architecture(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    globals=decoder_globals(),
    layer=(*pre_norms(), *attention(rotary_permuted=True), *swiglu_mlp()),
    gguf_matches=_dense,
)
