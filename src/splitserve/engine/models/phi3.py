"""Phi-3 and Phi-4 (mini): Llama's layer with the checkpoint's own fusions (q, k and v in one
qkv_proj; gate and up in one gate_up_proj, gate first), LongRoPE (short and long factors per
frequency, an attention factor on cos and sin), a partial rotary (Phi-4-mini rotates 3/4 of
each head), and a sliding window over every layer where config.json gives one (Phi-3-mini).

llama.cpp writes the fused tensors as they are (attn_qkv; ffn_up holds gate and up), the
LongRoPE factors as two tensors (rope_factors_short, rope_factors_long; the GGUF loader folds
them into the config), and the rotary width as rope.dimension_count: the head is hidden / heads.
"""

from __future__ import annotations

from splitserve.engine.config import ModelConfig
from splitserve.engine.models.declare import Architecture, TensorDecl
from splitserve.engine.models.parts import decoder_globals, pre_norms


def _qkv(c: ModelConfig) -> tuple[int, ...]:
    return (c.q_size + 2 * c.kv_size, c.hidden_size)


def _o(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size, c.q_size)


def _gate_up(c: ModelConfig) -> tuple[int, ...]:
    return (2 * c.intermediate_size, c.hidden_size)


def _down(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size, c.intermediate_size)


ARCH = Architecture(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    globals=decoder_globals(),
    layer=(
        *pre_norms(),
        TensorDecl("self_attn.qkv_proj.weight", "attn_qkv.weight", "qkv", _qkv, "qkv_rows"),
        TensorDecl("self_attn.o_proj.weight", "attn_output.weight", "o", _o, "q_cols"),
        TensorDecl("mlp.gate_up_proj.weight", "ffn_up.weight", "gate_up", _gate_up, "gate_up_rows"),
        TensorDecl("mlp.down_proj.weight", "ffn_down.weight", "down", _down, "ff_cols"),
    ),
    traits={"attention_bias": False},
    gguf_head_dim_from_rope=False,
)
