"""Factories for tests and benchmarks: tiny random models with real shapes.

They live beside the engine (not in tests/) so that the benchmarks and the
workers' own tests can build the same models.
"""

from __future__ import annotations

import torch

from splitserve.engine.config import ModelConfig


def tiny_model_config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position=1024,
        tie_embeddings=True,
        rope_theta=10000.0,
        eos_token_ids=(),
        name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]  # the overrides' names and values are the caller's


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, scaled so activations stay in range."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(cfg.hidden_size, generator=g)).to(dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(cfg.vocab_size, h, std=1.0),
        "model.norm.weight": norm(),
    }
    if not cfg.tie_embeddings:
        w["lm_head.weight"] = randn(cfg.vocab_size, h, std=h**-0.5)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = randn(cfg.q_size, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = randn(cfg.kv_size, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = randn(cfg.kv_size, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = randn(h, cfg.q_size, std=cfg.q_size**-0.5)
        w[p + "mlp.gate_proj.weight"] = randn(i, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = randn(i, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = randn(h, i, std=i**-0.5)
        if cfg.attention_bias:
            for x, n in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
                w[p + f"self_attn.{x}_proj.bias"] = randn(n, std=0.1)
    return w
