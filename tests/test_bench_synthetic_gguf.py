"""`splitserve bench synthetic-gguf`: a model shape written as a GGUF file of random blocks that
the engine loads in its blocks and generates from (the 8B shape's file is the same code at scale)."""

from __future__ import annotations

import pytest
import torch

from splitserve.bench.synthetic_gguf import SHAPES, more_bits, write
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.gguf_formats import BY_NAME
from splitserve.engine.kernels import quant as qk
from splitserve.engine.quant.weight import QuantizedWeight
from splitserve.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not qk.available(), reason="the quantized kernel does not build on this platform"),
]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K_M"])
def test_a_synthetic_file_loads_in_its_blocks_and_generates(fmt, tmp_path):
    path = str(tmp_path / f"tiny-{fmt}.gguf")
    size = write(path, fmt, SHAPES["tiny"])
    shape = SHAPES["tiny"]
    engine, tok = Engine.from_path(path, EngineConfig(quantization="auto", num_blocks=64), progress=False)
    try:
        cfg = engine.model_cfg
        assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (shape.hidden, shape.layers, shape.kv_heads)
        assert isinstance(engine.model.layers[0].gate_up, QuantizedWeight)
        assert engine.model.weight_bytes < size  # the blocks, not floats (the embedding's rows not read)
        out = engine.generate([tok.encode("Hello there")], SamplingParams(max_tokens=6, temperature=0.0))[0]
        assert len(out) == 6
        x = torch.randn(2, shape.hidden)
        assert torch.isfinite(engine.model.layers[0].qkv.linear(x)).all()  # type: ignore[union-attr]
    finally:
        engine.close()


def test_q4_k_m_spends_q6_k_where_llama_cpp_does(tmp_path):
    """llama-quantize's Q4_K_M: Q6_K for the output matrix and, in the first and last eighth of
    the layers and every third between, for attn_v and ffn_down; Q4_K for every other matrix."""
    from splitserve.engine.gguf_loader import open_gguf

    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    path = str(tmp_path / "q4_k_m.gguf")
    write(path, "Q4_K_M", SHAPES["tiny"], sparse=True)
    kinds = {t.name: int(t.tensor_type) for t in open_gguf(path).tensors if t.name.endswith("weight")}
    q4k, q6k = BY_NAME["Q4_K"].ggml_type, BY_NAME["Q6_K"].ggml_type
    assert kinds["output.weight"] == q6k and kinds["token_embd.weight"] == q4k
    assert kinds["blk.0.attn_v.weight"] == q4k and kinds["blk.1.attn_v.weight"] == q6k  # tiny: 2 layers
    assert kinds["blk.1.ffn_down.weight"] == q6k and kinds["blk.1.ffn_up.weight"] == q4k
