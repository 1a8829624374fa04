"""`splitserve bench engine` end to end in quick mode on a tiny random model:
every figure it promises is printed, positive and finite. Speed itself is the
benchmark's business, not the test's."""

from __future__ import annotations

import math
import re

import pytest

from splitserve import cli
from splitserve.engine.models.registry import param_count

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

NUMBER = r"([0-9.]+(?:e[-+]?[0-9]+)?)"


def _figures(text: str, pattern: str) -> list[float]:
    found = [float(x) for m in re.findall(pattern, text) for x in (m if isinstance(m, tuple) else (m,))]
    assert found, f"no match for {pattern!r} in:\n{text}"
    assert all(math.isfinite(x) and x > 0 for x in found), (pattern, found)
    return found


def test_quick_run_prints_every_figure_for_both_dtypes(capsys):
    rc = cli.main(
        ["bench", "engine", "--model", "tiny", "--quick", "--batch", "4", "--prefill-len", "64", "--threads", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for dtype in ("fp32", "bf16"):
        tag = rf"\[tiny {dtype}\]"
        _figures(out, tag + rf" hardware  memory read {NUMBER} GB/s")
        _figures(out, tag + rf" hardware  F\.linear at batch 1 .*? = {NUMBER} GB/s")
        _figures(out, tag + rf" hardware  F\.linear at batch 4 .*? = {NUMBER} GFLOP/s")
        for batch in (1, 4):
            line = tag + rf" batch {batch}\s+decode  ours {NUMBER} tok/s .*\| HF {NUMBER} tok/s .*\| ratio {NUMBER}x"
            assert len(re.findall(line, out)) == 1, out
            _figures(out, line)
            assert re.search(tag + rf" batch {batch}\s+greedy    ours and HF's tokens identical", out)
        _figures(
            out, tag + rf" batch 1   roofline  {NUMBER} MB/step .* memory read {NUMBER} GB/s = floor {NUMBER} ms/step"
        )
        _figures(
            out,
            tag + rf" batch 1   achieved  ours {NUMBER} GB/s = {NUMBER}% of the memory roofline \| HF {NUMBER} GB/s",
        )
        _figures(out, tag + rf" batch 4\s+compute   {NUMBER} GFLOP/step .* = {NUMBER} GFLOP/s")
        _figures(out, tag + rf" batch 4\s+achieved  ours {NUMBER} GFLOP/s = {NUMBER}% of the matmul rate")
        _figures(
            out, tag + rf" prefill   64 tokens: ours {NUMBER} tok/s .* = {NUMBER} TFLOP/s = {NUMBER}% of F\.linear"
        )
    assert re.search(r"machine: .*; CPU flags: .*; torch .*, 1 threads", out)


def test_cuda_without_a_gpu_skips_cleanly(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["bench", "engine", "--device", "cuda", "--quick"]) == 0
    assert "CUDA is not available on this machine" in capsys.readouterr().out


def test_gpu_model_shapes_and_device_side_weights():
    """The GPU part's random models: the right sizes, and weights drawn on the device (the meta
    device here) under the names and shapes random_weights gives on the CPU."""
    import torch

    from splitserve.bench import engine as bench
    from splitserve.engine.random_model import random_weights, tiny_model_config

    for key, params in (("llama-3.2-1b", 1.24e9), ("llama-3-8b", 8.03e9)):
        cfg = bench._shape(key)
        assert abs(param_count(cfg) - params) / params < 0.01, (key, param_count(cfg))
        drawn = random_weights(cfg, dtype=torch.bfloat16, device=torch.device("meta"))
        assert sum(t.numel() for t in drawn.values()) == param_count(cfg)
    for cfg in (tiny_model_config(), tiny_model_config(tie_embeddings=False, attention_bias=True)):
        want = {name: tuple(t.shape) for name, t in random_weights(cfg).items()}
        drawn = random_weights(cfg, device=torch.device("meta"))
        assert {name: tuple(t.shape) for name, t in drawn.items()} == want


def test_smollm2_shape_is_the_embedded_models_config():
    """`smollm2-shape` stands in for SmolLM2 where its GGUF cannot travel (a GPU machine):
    every field that sets a step's work must be the GGUF's own."""
    import dataclasses

    import torch

    from splitserve.bench import engine as bench
    from splitserve.engine.weights import load_model

    real = load_model(None, torch.float32, progress=False).config
    shape = bench._shape("smollm2-shape")
    skip = {"name", "bos_token_id", "eos_token_ids", "rms_norm_eps", "rope_scaling"}
    for f in dataclasses.fields(real):
        if f.name not in skip:
            assert getattr(shape, f.name) == getattr(real, f.name), f.name
    assert shape.rms_norm_eps == pytest.approx(real.rms_norm_eps)
    assert shape.rope_scaling.kind == real.rope_scaling.kind == "none"
