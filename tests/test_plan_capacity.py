"""The capacity arithmetic of `splitserve plan` against the issue's worked examples."""

from __future__ import annotations

import json
from typing import Any

import pytest

from splitserve.plan import capacity, roofline
from splitserve.plan.hardware import GIB, GPUS
from splitserve.plan.shapes import BUILTIN, ModelShape, dense, dense_params, load_shape


def seventy_b_shape() -> ModelShape:
    """The issue's Llama-3-70B shape: 80 layers, 8 KV heads, head dim 128."""
    return BUILTIN["llama-3-70b"]


@pytest.mark.timeout(30)
def test_llama_3_8b_in_bf16_is_128_kib_per_token_and_512_mib_per_4k_request():
    shape = BUILTIN["llama-3-8b"]
    assert shape.kv_bytes_per_token(2) == 131_072
    assert capacity.kv_bytes_per_request(shape, 4096, 2) == 536_870_912


@pytest.mark.timeout(30)
def test_about_128_concurrent_4k_requests_fit_on_an_80_gb_gpu_after_16_gb_of_weights():
    per_request = capacity.kv_bytes_per_request(BUILTIN["llama-3-8b"], 4096, 2)
    # the back-of-the-envelope: (80 - 16) GiB / 0.5 GiB, no reserve
    assert capacity.max_concurrent_requests(80 * GIB, 16 * GIB, per_request, reserve=0.0) == 128
    # with the real weights (8.03B parameters in bf16) on an 80 GiB part, still about 128
    weights = capacity.weight_bytes_per_gpu(BUILTIN["llama-3-8b"], 2, tp=1)
    assert weights == pytest.approx(16.06e9, rel=1e-3)
    fits = capacity.max_concurrent_requests(GPUS["h100-sxm"].memory_bytes, weights, per_request, reserve=0.0)
    assert fits == pytest.approx(128, rel=0.03)
    # a 10% reserve for activations costs about 16 of them
    assert capacity.max_concurrent_requests(80 * GIB, weights, per_request) == 114


@pytest.mark.timeout(30)
def test_a_70b_shape_is_327_680_bytes_per_token_and_1_34_gb_per_4k_request():
    shape = seventy_b_shape()
    assert shape.kv_bytes_per_token(2) == 327_680
    assert capacity.kv_bytes_per_request(shape, 4096, 2) == pytest.approx(1.34e9, rel=0.005)


@pytest.mark.timeout(30)
def test_1_34_gb_takes_107_ms_at_100_gbps_and_27_ms_at_400_gbps():
    nbytes = capacity.kv_bytes_per_request(seventy_b_shape(), 4096, 2)
    assert capacity.transfer_seconds(nbytes, 100e9 / 8) == pytest.approx(0.107, abs=0.0005)
    assert capacity.transfer_seconds(nbytes, 400e9 / 8) == pytest.approx(0.027, abs=0.0005)


@pytest.mark.timeout(30)
def test_50_users_of_a_72b_model_on_4x80_gb_get_about_11_000_tokens_each():
    """The issue says about 110,000; its own numbers give a tenth of that: (320 - 140) GB leaves
    3.6 GB per user, and at 327,680 bytes per token that is 10,986 tokens. 110,000 tokens would be
    36 GB per user, 1.8 TB for the 50, more than the 4 GPUs hold."""
    shape = BUILTIN["qwen2.5-72b"]  # 80 layers, 8 KV heads
    tokens = capacity.max_context_tokens(4 * 80e9, 140e9, shape.kv_bytes_per_token(2), 50, reserve=0.0)
    assert tokens == 10_986  # 180e9 / 50 / 327,680
    # split 4 ways under TP 4, the same per GPU: 45 GB each for 50 users at 81,920 bytes per token
    assert capacity.max_context_tokens(80e9, 35e9, capacity.kv_bytes_per_token_per_gpu(shape, 2, 4), 50, 0.0) == tokens


@pytest.mark.timeout(30)
def test_layer_pipelining_leaves_the_last_layer_when_the_link_keeps_up_else_the_backlog():
    # 80 layers: 100 ms of transfer behind 400 ms of prefill leaves one layer's share
    assert capacity.kv_transfer_seconds(1.25e9, 12.5e9, 0.4, 80) == pytest.approx((0.1, 0.1 / 80))
    # a link 4x slower than compute: all but what overlapped 79 layers' compute is left
    whole, left = capacity.kv_transfer_seconds(1.25e9, 12.5e9, 0.025, 80)
    assert left == pytest.approx(0.1 - 0.025 * 79 / 80)


@pytest.mark.timeout(30)
def test_tensor_parallelism_splits_weights_and_kv_heads_but_not_an_mla_latent():
    llama = BUILTIN["llama-3-70b"]
    assert capacity.weight_bytes_per_gpu(llama, 2, tp=4) == llama.weight_bytes(2) / 4
    assert capacity.kv_bytes_per_token_per_gpu(llama, 2, tp=4) == 327_680 / 4
    assert capacity.kv_bytes_per_token_per_gpu(llama, 2, tp=16) == 327_680 / 8  # 8 KV heads at most
    deepseek = BUILTIN["deepseek-v3"]
    assert deepseek.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    assert capacity.kv_bytes_per_token_per_gpu(deepseek, 2, tp=8) == deepseek.kv_bytes_per_token(2)


@pytest.mark.timeout(30)
def test_the_built_in_shapes_have_their_published_parameter_counts():
    published = {
        "llama-3-8b": 8.03e9,
        "llama-3-70b": 70.55e9,
        "llama-3.1-405b": 405.85e9,
        "qwen2.5-72b": 72.71e9,
        "mistral-7b": 7.25e9,
        "smollm2-135m": 134.5e6,
        "deepseek-v3": 671e9,
    }
    for name, params in published.items():
        assert BUILTIN[name].total_params == pytest.approx(params, rel=0.002), name
    assert BUILTIN["deepseek-v3"].active_params == pytest.approx(37e9, rel=0.03)


@pytest.mark.timeout(120)
def test_a_config_json_goes_through_the_engines_model_config(tmp_path):
    from splitserve.engine.config import ModelConfig
    from splitserve.engine.models.registry import param_count

    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "_name_or_path": "my-llama",
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shape = load_shape(str(tmp_path))
    assert shape == dense("my-llama", 32, 4096, 32, 8, 128, 14336, 128256)
    assert shape.total_params == param_count(ModelConfig.from_hf(hf))
    assert dense_params(32, 4096, 32, 8, 128, 14336, 128256, False) == BUILTIN["llama-3-8b"].total_params


@pytest.mark.timeout(120)
def test_a_gguf_file_gives_its_shape(tmp_path):
    from tests.test_weights import TINY_HF_CONFIG, random_weights, spm_vocab, write_tiny_gguf

    cfg: dict[str, Any] = dict(TINY_HF_CONFIG, vocab_size=len(spm_vocab()[0]))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, random_weights(cfg), cfg)
    shape = load_shape(str(path))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.vocab) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    )
    assert shape.kv_bytes_per_token(2) == cfg["num_hidden_layers"] * 2 * shape.kv_heads * shape.head_dim * 2


@pytest.mark.timeout(30)
def test_prefill_is_compute_bound_and_decode_at_batch_1_reads_the_weights():
    shape, h100 = BUILTIN["llama-3-8b"], GPUS["h100-sxm"]
    eff = roofline.Efficiency(compute=1.0, memory=1.0)
    long_prefill = roofline.prefill_seconds(shape, h100, 8192, eff=eff)
    assert long_prefill == pytest.approx(shape.prefill_flops(8192) / h100.bf16_flops)
    step = roofline.decode_step_seconds(shape, h100, 1, 0, eff=eff)
    assert step == pytest.approx(shape.weight_bytes(2) / h100.hbm_bytes_per_s)  # about 4.8 ms
    # tensor parallelism divides the work and adds two all-reduces per layer
    assert roofline.decode_step_seconds(shape, h100, 1, 0, tp=2, eff=eff) == pytest.approx(
        step / 2 + roofline.allreduce_seconds(shape, h100, 1, 2)
    )


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [
        (  # Qwen3-30B-A3B's config.json: "30.5B in total and 3.3B activated"
            dict(
                model_type="qwen3_moe",
                vocab_size=151936,
                hidden_size=2048,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
            ),
            30.5e9,
            3.35e9,
        ),
        (  # Mixtral-8x7B's: 46.7B in total, 12.9B active
            dict(
                model_type="mixtral",
                vocab_size=32000,
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            46.7e9,
            12.9e9,
        ),
    ],
)
def test_a_mixture_of_experts_counts_total_and_active_parameters_from_its_declaration(config, total, active):
    from splitserve.plan.shapes import from_hf_config

    shape = from_hf_config(config, config["model_type"])
    assert shape.total_params == pytest.approx(total, rel=0.005)
    assert shape.active_params == pytest.approx(active, rel=0.005)
    assert shape.is_moe and shape.active_experts == config["num_experts_per_tok"]
    # a decode step at batch 1 reads the active experts' bytes, prefill multiplies by the active parameters
    assert shape.prefill_flops(1) == pytest.approx(
        2 * shape.matmul_params + 4 * shape.layers * shape.heads * shape.head_dim
    )
