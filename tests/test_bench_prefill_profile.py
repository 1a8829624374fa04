"""The prefill profile's arithmetic count (bench/prefill_profile.py)."""

from __future__ import annotations

from splitserve.bench.prefill_profile import prefill_flops
from splitserve.engine.random_model import tiny_model_config


def test_prefill_flops_count_the_linear_layers_and_the_causal_attention():
    cfg = tiny_model_config()  # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, 2 layers, vocab 512
    per_token = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # qkv, o, gate/up/down
    linear = 2 * 10 * per_token * 2 + 2 * 512 * 64  # ten tokens through both layers, the LM head once
    attention = 4 * 4 * 16 * 55 * 2  # QK^T and PV over 10*11/2 query-key pairs, per head and layer
    assert prefill_flops(cfg, 10) == linear + attention
