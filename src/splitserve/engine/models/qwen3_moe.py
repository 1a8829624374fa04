"""Qwen3-MoE: Qwen3's attention (q/k norm, no bias) and a mixture of experts in every
layer's MLP (no shared expert), top-k of a softmax router, renormalized over the k with
config.json's `norm_topk_prob`."""

from __future__ import annotations

from splitserve.engine.models.declare import Architecture
from splitserve.engine.models.parts import attention, decoder_globals, moe_mlp, pre_norms

ARCH = Architecture(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    globals=decoder_globals(),
    layer=(
        *pre_norms(),
        *attention(rotary_permuted=False, bias="never", qk_norm=True),
        *moe_mlp(
            "mlp.gate.weight",
            "mlp.experts.{e}.gate_proj.weight",
            "mlp.experts.{e}.up_proj.weight",
            "mlp.experts.{e}.down_proj.weight",
        ),
    ),
    traits={"attention_bias": False, "qk_norm": True},
)
