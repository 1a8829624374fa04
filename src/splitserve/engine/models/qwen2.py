"""Qwen2 and Qwen2.5: Llama's layer with q/k/v bias always. llama.cpp keeps HF's rotary
layout for it (no row permutation in its GGUF files)."""

from __future__ import annotations

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, pre_norms, swiglu_mlp

ARCH = Architecture(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    globals=decoder_globals(),
    layer=(*pre_norms(), *attention(rotary_permuted=False), *swiglu_mlp()),
    traits={"attention_bias": True},
)
