"""Mistral: Llama's layer under its own name (no q/k/v bias). Its first release's 4,096-token
sliding window over every layer comes from config.json's `sliding_window`; a GGUF file does not
carry it (llama.cpp's llama architecture has no window), so from GGUF every layer is global."""

from __future__ import annotations

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, pre_norms, swiglu_mlp

ARCH = Architecture(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=("mistral",),
    globals=decoder_globals(),
    layer=(*pre_norms(), *attention(rotary_permuted=True, bias="never"), *swiglu_mlp()),
    traits={"attention_bias": False},
)
