"""Gemma 3 (text): sliding-window layers interleaved with global ones (five to one), each
kind with its own RoPE base; per-head q/k RMSNorm; four norms a layer (sandwich: before and
after attention and the MLP), each a gain of 1 + w; a GeGLU MLP (tanh GELU); the embedding
scaled by sqrt(hidden_size); the output head tied to the embedding.

HF checkpoints store each norm's w (transformers computes x * (1 + w)); llama.cpp's GGUF
stores 1 + w, as the engine holds it. llama.cpp fixes what its GGUF files do not say: every
sixth layer global and a local RoPE base of 10,000 (the GGUF loader's defaults for "gemma3").
"""

from __future__ import annotations

from dataclasses import replace

from splitserve.engine.config import ModelConfig
from splitserve.engine.models.declare import Architecture, TensorDecl
from splitserve.engine.models.parts import attention, decoder_globals, sandwich_norms, swiglu_mlp

# The instruction-tuned Gemma 3 checkpoints' template (tokenizer_config.json), for text: a system
# message goes before the first user turn, the assistant's role is "model".
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


def _gains_as_stored(decls: tuple[TensorDecl, ...]) -> tuple[TensorDecl, ...]:
    """Every norm's gain as Gemma's HF checkpoints store it: w, for a gain of 1 + w."""
    return tuple(replace(d, hf_add=1.0) if d.init == "norm" else d for d in decls)


def _derived(cfg: ModelConfig) -> dict[str, float]:
    # The query scale: config.json says it (query_pre_attn_scalar); a GGUF file does not, and
    # llama.cpp takes head_dim's except for the 27B (62 layers), whose is hidden_size / heads (168).
    scalar = cfg.query_pre_attn_scalar
    if not scalar and cfg.num_layers == 62:
        scalar = cfg.hidden_size / cfg.num_heads
    return {"embedding_scale": cfg.hidden_size**0.5, "query_pre_attn_scalar": scalar}


ARCH = Architecture(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    globals=_gains_as_stored(decoder_globals()),
    layer=_gains_as_stored(
        (*sandwich_norms(), *attention(rotary_permuted=False, bias="never", qk_norm=True), *swiglu_mlp())
    ),
    traits={"attention_bias": False, "qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh"},
    derive=_derived,
    gguf_defaults={"attention.sliding_window_pattern": 6, "rope.freq_base_swa": 10000.0},
    chat_template=CHAT_TEMPLATE,
    end_of_turn="<end_of_turn>",
)
