"""Models with real shapes and random weights: the tiny model, and any shape's weights.

In the package, not in tests/, because the benchmarks run them without a checkpoint
(`splitserve bench engine --model tiny` and its random shapes, `bench.tensor_parallel
--tiny`); the tests build the same models.
"""

from __future__ import annotations

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.models import registry


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


def random_weights(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, every tensor its family's module declares
    (engine/models/), scaled so that activations stay in range. Drawn on `device` (an 8B model
    drawn on a CPU takes minutes, on a GPU a second), each tensor in float32 and then cast, so
    one seed gives one model on a device, whatever the dtype."""
    on = torch.device(device)
    g = None if on.type == "meta" else torch.Generator(device=on).manual_seed(seed)  # meta: shapes, no values
    w: dict[str, torch.Tensor] = {}
    for name, decl in registry.for_config(cfg).tensors(cfg).items():
        shape = decl.shape(cfg)
        t = torch.randn(*shape, generator=g, device=on)
        if decl.init == "norm":
            t = 1.0 + 0.1 * t
        elif decl.init == "bias":
            t = 0.1 * t
        elif decl.init != "embedding":  # a matrix: its outputs of about the scale of its inputs
            t = t * shape[-1] ** -0.5
        w[name] = t.to(dtype)
    return w
