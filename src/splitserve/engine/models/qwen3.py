"""Qwen3 (dense): Qwen2's layer without the q/k/v bias and with a per-head RMSNorm of q and
of k before RoPE; head_dim is its own (128 where hidden / heads is not)."""

from __future__ import annotations

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, pre_norms, swiglu_mlp

ARCH = Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    globals=decoder_globals(),
    layer=(*pre_norms(), *attention(rotary_permuted=False, bias="never", qk_norm=True), *swiglu_mlp()),
    traits={"attention_bias": False, "qk_norm": True},
)
