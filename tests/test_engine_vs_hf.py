"""The engine's model against Hugging Face transformers on random weights of
several Llama-family variants (GQA, untied head, llama3 RoPE scaling, Qwen2
biases): greedy tokens must be identical."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from splitserve.engine.config import EngineConfig, RopeScaling
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

VARIANTS: dict[str, dict[str, Any]] = {
    "llama-tied-gqa": dict(),
    "llama-untied-mha": dict(num_kv_heads=4, tie_embeddings=False),
    "llama3-rope-scaling": dict(
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    ),
    "qwen2-bias": dict(attention_bias=True, tie_embeddings=False),
}


def hf_model(cfg, weights):
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.kind == "llama3":
        s = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    if cfg.attention_bias:
        hf_cfg = transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
        model = transformers.LlamaForCausalLM(hf_cfg)
    sd = dict(weights)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.generation_config.eos_token_id = None  # the tiny configs have no EOS: run the full length
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(variant):
    cfg = tiny_model_config(**VARIANTS[variant])
    weights = random_weights(cfg, seed=3)
    model = hf_model(cfg, weights)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 37, 130)]
    engine = Engine(cfg, weights, EngineConfig(num_blocks=128, max_num_batched_tokens=64))
    ours = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # an explicit mask: HF would otherwise mask every prompt token equal to pad_token_id
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        assert got == out[0, len(prompt) :].tolist(), f"{variant}: prompt of {len(prompt)} tokens"
    assert engine.blocks.num_free_blocks == 128
