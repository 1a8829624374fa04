"""`splitserve bench synthetic-gguf`: a model shape written as a GGUF file of random blocks that
the engine loads in its blocks and generates from (the 8B shape's file is the same code at scale)."""

from __future__ import annotations

import pytest
import torch

from splitserve.bench.synthetic_gguf import SHAPES, write
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


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
def test_a_synthetic_file_loads_in_its_blocks_and_generates(fmt, tmp_path):
    path = str(tmp_path / f"tiny-{fmt}.gguf")
    size = write(path, BY_NAME[fmt], SHAPES["tiny"])
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
