"""The tensors most decoder families share, declared once for the family modules to compose:
the embedding, final norm and output head; grouped-query attention (optional q/k/v bias,
optional per-head q/k RMSNorm); the SwiGLU MLP; the two pre-norms of a Llama-style layer.

A family whose layer differs declares its own pieces in its own module and composes them
with these.
"""

from __future__ import annotations

from typing import Literal

from splitserve.engine.config import ModelConfig
from splitserve.engine.models.declare import TensorDecl


def _untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_embeddings


def _with_bias(cfg: ModelConfig) -> bool:
    return cfg.attention_bias


def _embedding(c: ModelConfig) -> tuple[int, ...]:
    return (c.vocab_size, c.hidden_size)


def _hidden(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


def _head(c: ModelConfig) -> tuple[int, ...]:
    return (c.head_dim,)


def _q(c: ModelConfig) -> tuple[int, ...]:
    return (c.q_size, c.hidden_size)


def _kv(c: ModelConfig) -> tuple[int, ...]:
    return (c.kv_size, c.hidden_size)


def _o(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size, c.q_size)


def _ff(c: ModelConfig) -> tuple[int, ...]:
    return (c.intermediate_size, c.hidden_size)


def _ff_in(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size, c.intermediate_size)


def decoder_globals() -> tuple[TensorDecl, ...]:
    """The token embedding, the final norm and the output head (absent when tied to the embedding)."""
    return (
        TensorDecl("model.embed_tokens.weight", "token_embd.weight", "embed", _embedding, init="embedding"),
        TensorDecl("model.norm.weight", "output_norm.weight", "norm", _hidden, init="norm"),
        TensorDecl("lm_head.weight", "output.weight", "lm_head", _embedding, present=_untied),
    )


def pre_norms() -> tuple[TensorDecl, ...]:
    """A Llama-style layer's two norms: before attention, and before the MLP."""
    return (
        TensorDecl("input_layernorm.weight", "attn_norm.weight", "input_norm", _hidden, init="norm"),
        TensorDecl("post_attention_layernorm.weight", "ffn_norm.weight", "post_norm", _hidden, init="norm"),
    )


def attention(rotary_permuted: bool, bias: str = "config", qk_norm: bool = False) -> tuple[TensorDecl, ...]:
    """q, k and v into the fused `qkv` slot (column-parallel by heads), o row-parallel.

    `rotary_permuted`: llama.cpp's converter permuted q's and k's rows (its llama and mistral
    architectures); `bias`: "config" (q/k/v bias where `ModelConfig.attention_bias` says),
    "never"; `qk_norm`: a per-head RMSNorm of q and of k before RoPE (Qwen3, Gemma 3).
    """
    q_rot: Literal["", "q"] = "q" if rotary_permuted else ""
    k_rot: Literal["", "k"] = "k" if rotary_permuted else ""
    decls = [
        TensorDecl("self_attn.q_proj.weight", "attn_q.weight", "qkv", _q, "q_rows", gguf_rotary=q_rot),
        TensorDecl("self_attn.k_proj.weight", "attn_k.weight", "qkv", _kv, "kv_rows", gguf_rotary=k_rot),
        TensorDecl("self_attn.v_proj.weight", "attn_v.weight", "qkv", _kv, "kv_rows"),
        TensorDecl("self_attn.o_proj.weight", "attn_output.weight", "o", _o, "q_cols"),
    ]
    if bias == "config":
        decls += [
            TensorDecl(
                "self_attn.q_proj.bias", "attn_q.bias", "qkv_bias", lambda c: (c.q_size,), "q_rows", "bias", _with_bias
            ),
            TensorDecl(
                "self_attn.k_proj.bias",
                "attn_k.bias",
                "qkv_bias",
                lambda c: (c.kv_size,),
                "kv_rows",
                "bias",
                _with_bias,
            ),
            TensorDecl(
                "self_attn.v_proj.bias",
                "attn_v.bias",
                "qkv_bias",
                lambda c: (c.kv_size,),
                "kv_rows",
                "bias",
                _with_bias,
            ),
        ]
    if qk_norm:
        decls += [
            TensorDecl("self_attn.q_norm.weight", "attn_q_norm.weight", "q_norm", _head, init="norm"),
            TensorDecl("self_attn.k_norm.weight", "attn_k_norm.weight", "k_norm", _head, init="norm"),
        ]
    return tuple(decls)


def swiglu_mlp() -> tuple[TensorDecl, ...]:
    """gate and up into the fused `gate_up` slot (column-parallel), down row-parallel."""
    return (
        TensorDecl("mlp.gate_proj.weight", "ffn_gate.weight", "gate_up", _ff, "ff_rows"),
        TensorDecl("mlp.up_proj.weight", "ffn_up.weight", "gate_up", _ff, "ff_rows"),
        TensorDecl("mlp.down_proj.weight", "ffn_down.weight", "down", _ff_in, "ff_cols"),
    )


def _router(c: ModelConfig) -> tuple[int, ...]:
    return (c.num_experts, c.hidden_size)


def _experts_ff(c: ModelConfig) -> tuple[int, ...]:
    return (c.num_experts, c.moe_intermediate_size, c.hidden_size)


def _experts_ff_in(c: ModelConfig) -> tuple[int, ...]:
    return (c.num_experts, c.hidden_size, c.moe_intermediate_size)


def moe_mlp(router: str, gate: str, up: str, down: str) -> tuple[TensorDecl, ...]:
    """A mixture of experts: the router (whole on every rank) and each expert's SwiGLU, stacked,
    gate and up into `experts_gate_up` (every expert split alike over the ranks), down into
    `experts_down`. The names are the checkpoint's, after "model.layers.{i}.", with "{e}." for the
    expert (Qwen3-MoE: "mlp.experts.{e}.gate_proj.weight"; Mixtral: "...experts.{e}.w1.weight")."""
    return (
        TensorDecl(router, "ffn_gate_inp.weight", "router", _router),
        TensorDecl(gate, "ffn_gate_exps.weight", "experts_gate_up", _experts_ff, "eff_rows", experts=True),
        TensorDecl(up, "ffn_up_exps.weight", "experts_gate_up", _experts_ff, "eff_rows", experts=True),
        TensorDecl(down, "ffn_down_exps.weight", "experts_down", _experts_ff_in, "eff_cols", experts=True),
    )


def sandwich_norms() -> tuple[TensorDecl, ...]:
    """Gemma's four norms a layer: before attention, on its output, before the MLP, on its output."""
    return (
        TensorDecl("input_layernorm.weight", "attn_norm.weight", "input_norm", _hidden, init="norm"),
        TensorDecl(
            "post_attention_layernorm.weight", "post_attention_norm.weight", "post_attn_norm", _hidden, init="norm"
        ),
        TensorDecl("pre_feedforward_layernorm.weight", "ffn_norm.weight", "post_norm", _hidden, init="norm"),
        TensorDecl("post_feedforward_layernorm.weight", "post_ffw_norm.weight", "post_mlp_norm", _hidden, init="norm"),
    )
