"""Tiny seeded models of every family, built offline from transformers' own config and
model classes, saved as a Hugging Face directory (safetensors, with the embedded model's
tokenizer) and, where llama.cpp's gguf package names the architecture, as a GGUF file
written the way its converter writes one: its own tensor-name map, its Q/K row permutation
for the llama and mistral architectures, its metadata keys. Neither file is written from
splitserve's declarations, so a wrong name or shape there fails the conformance suite.

The weights are drawn so that nothing is trivially 1 or 0: transformers starts norms at 1
and biases at 0, which would hide a missing norm or bias.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

# Shapes every tiny family shares: small, but GQA (4 heads over 2 KV heads), head_dim not
# hidden / heads where the family allows it, a vocabulary as large as the embedded tokenizer's.
VOCAB = 49152
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# head_dim is the config's own attribute, which its signature does not list
QWEN3_MOE: dict[str, Any] = dict(
    head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True
)


# Six layers: five windowed, then a global one (Gemma 3's pattern, which llama.cpp's GGUF leaves
# unsaid); a window of 8 tokens, shorter than every test prompt; its own RoPE base per kind.
GEMMA3: dict[str, Any] = dict(
    COMMON,
    num_hidden_layers=6,
    head_dim=32,
    query_pre_attn_scalar=32,
    sliding_window=8,
    tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
)


# Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE factors (one per rotated pair),
# its attention factor from the context (1,024) over the original (128, past the test prompts).
PHI3: dict[str, Any] = dict(
    COMMON,
    partial_rotary_factor=0.75,
    original_max_position_embeddings=128,
    sliding_window=None,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.15 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)],
        "original_max_position_embeddings": 128,
        "partial_rotary_factor": 0.75,
    },
)


def _phi3_gguf(cfg: Any, w: gguf.GGUFWriter) -> None:
    """convert_hf_to_gguf.py's Phi3MiniModel: the rotary width, LongRoPE's factors as tensors and
    its attention factor (sqrt(1 + ln(scale) / ln(original)))."""
    import math

    rope = cfg.rope_parameters
    head = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(int(head * rope["partial_rotary_factor"]))
    original = rope["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


@dataclass(frozen=True)
class Family:
    name: str  # splitserve's registry name
    config: Callable[[], Any]  # a transformers config of the tiny model
    model: Callable[[Any], Any]  # its transformers causal-LM class
    gguf_arch: gguf.MODEL_ARCH | None  # llama.cpp's architecture; None where gguf cannot write it
    permute_qk: bool = False  # llama.cpp's converter permutes q's and k's rows (llama, mistral)
    gguf_kv: dict[str, Any] = field(default_factory=dict)  # metadata keys past the common ones
    gguf_norm_shift: float = 0.0  # added to every norm's gain (llama.cpp's Gemma converter: 1 + w)
    gguf_extra: Callable[[Any, gguf.GGUFWriter], None] | None = None  # what else its converter writes


def _families() -> dict[str, Family]:
    import transformers as t

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {
        f.name: f
        for f in (
            Family(
                "llama",
                lambda: t.LlamaConfig(**COMMON, head_dim=32, rope_parameters=rope),
                t.LlamaForCausalLM,
                gguf.MODEL_ARCH.LLAMA,
                permute_qk=True,
            ),
            Family(
                "mistral",
                lambda: t.MistralConfig(**COMMON, head_dim=16, sliding_window=None, rope_parameters=rope),
                t.MistralForCausalLM,
                gguf.MODEL_ARCH.LLAMA,  # llama.cpp converts Mistral checkpoints to its llama architecture
                permute_qk=True,
            ),
            Family(
                "qwen2",
                lambda: t.Qwen2Config(**COMMON, rope_parameters=rope, use_sliding_window=False),
                t.Qwen2ForCausalLM,
                gguf.MODEL_ARCH.QWEN2,
            ),
            Family(
                "qwen3",
                lambda: t.Qwen3Config(**COMMON, head_dim=32, rope_parameters=rope, use_sliding_window=False),
                t.Qwen3ForCausalLM,
                gguf.MODEL_ARCH.QWEN3,
            ),
            Family(
                "qwen3_moe",
                lambda: t.Qwen3MoeConfig(**COMMON, **QWEN3_MOE, rope_parameters=rope),
                t.Qwen3MoeForCausalLM,
                gguf.MODEL_ARCH.QWEN3MOE,
                gguf_kv={
                    "expert_count": (8, gguf.GGUFValueType.UINT32),
                    "expert_used_count": (2, gguf.GGUFValueType.UINT32),
                    "expert_feed_forward_length": (48, gguf.GGUFValueType.UINT32),
                },
            ),
            Family(
                "mixtral",
                lambda: t.MixtralConfig(
                    **COMMON, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rope_parameters=rope
                ),
                t.MixtralForCausalLM,
                gguf.MODEL_ARCH.LLAMA,  # llama.cpp's llama architecture with expert tensors
                permute_qk=True,
                gguf_kv={
                    "expert_count": (8, gguf.GGUFValueType.UINT32),
                    "expert_used_count": (2, gguf.GGUFValueType.UINT32),
                },
            ),
            Family(
                "phi3",
                lambda: t.Phi3Config(**PHI3),
                t.Phi3ForCausalLM,
                gguf.MODEL_ARCH.PHI3,
                gguf_extra=_phi3_gguf,
            ),
            Family(
                "gemma3",
                lambda: t.Gemma3TextConfig(**GEMMA3),
                t.Gemma3ForCausalLM,
                gguf.MODEL_ARCH.GEMMA3,
                gguf_kv={"attention.sliding_window": (GEMMA3["sliding_window"], gguf.GGUFValueType.UINT32)},
                gguf_norm_shift=1.0,
            ),
        )
    }


FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3")


def family(name: str) -> Family:
    return _families()[name]


def build(name: str, seed: int = 0) -> Any:
    """The family's tiny model in float32, eval mode, eager attention, every weight drawn from `seed`."""
    fam = family(name)
    cfg = fam.config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = fam.model(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # a norm's gain around 1, a bias around 0
                p.copy_((1.0 if "norm" in pname else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in pname:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # outputs of about the scale of the inputs
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


def save_hf_dir(model: Any, directory: str, tokenizer: Any) -> str:
    """`model` as a Hugging Face directory (config.json, model.safetensors) with `tokenizer`
    (splitserve's Tokenizer, saved as tokenizer.json and tokenizer_config.json)."""
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save(directory)
    return directory


def save_gguf(name: str, model: Any, hf_dir: str, path: str, block_format: str = "") -> str:
    """The checkpoint in `hf_dir` (`model`'s, saved by `save_hf_dir`) as an F32 GGUF file, the way
    llama.cpp's converter writes one: from the checkpoint's own tensor names, each expert's
    tensors stacked into one (a tiny sentencepiece vocabulary stands in for the tokenizer: the
    logits are what is compared). `block_format` ("Q8_0", "Q4_0", ...): every 2-D matrix
    quantized to it by the gguf package, as llama-quantize would write it."""
    fam = family(name)
    assert fam.gguf_arch is not None, f"gguf cannot write {name}"
    cfg = model.config
    arch_name = gguf.MODEL_ARCH_NAMES[fam.gguf_arch]
    names = gguf.get_tensor_name_map(fam.gguf_arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch_name)
    w.add_name(f"tiny-{name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if fam.gguf_extra is None:  # the families whose converter writes the head's width
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        fam.gguf_extra(cfg, w)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    from tests.test_weights import add_spm_tokenizer  # a stand-in: the logits are what is compared

    add_spm_tokenizer(w)
    for key, value in fam.gguf_kv.items():
        w.add_key_value(f"{arch_name}.{key}", *value)
    for hf_name, t in _checkpoint(hf_dir).items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"llama.cpp's name map has no {hf_name} for {arch_name}"
        arr = t.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            arr = arr + fam.gguf_norm_shift
        if fam.permute_qk and hf_name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif fam.permute_qk and hf_name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if block_format and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[block_format]
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _checkpoint(hf_dir: str) -> dict[str, torch.Tensor]:
    """The safetensors' tensors by name, each expert's (`experts.{e}.`) stacked as llama.cpp stacks them."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for n, t in sorted(tensors.items()):
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m is None:
            out[n] = t
        else:
            experts.setdefault(n[: m.start()] + ".experts." + n[m.end() :], {})[int(m.group(1))] = t
    for n, by_index in experts.items():
        out[n] = torch.stack([by_index[e] for e in sorted(by_index)])
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K permutation (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
