"""A GGUF file's block-format weights computed in place (EngineConfig.quantization "auto"):
tiny seeded models written in Q8_0 and Q4_0 by the gguf package load as QuantizedWeights (no
float copy), compute the logits of the file dequantized to float32 to fp32 rounding and its
every teacher-forced top-1 token, count their real bytes, and serve through the engine; "none"
keeps the dequantized path."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.fingerprint import model_fingerprint
from splitserve.engine.kernels import quant as qk
from splitserve.engine.model import DecoderModel
from splitserve.engine.quant.weight import QuantizedWeight, floats
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from tests.family_helpers.build import build, save_gguf, save_hf_dir
from tests.family_helpers.logits import chunked_logits

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not qk.available(), reason="the quantized kernel does not build on this platform"),
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def quantized_file(request, tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp(f"quant-{request.param}")
    hf = build("llama", seed=5)
    hf_dir = save_hf_dir(hf, str(directory / "hf"), tokenizer)
    return request.param, save_gguf("llama", hf, hf_dir, str(directory / "tiny.gguf"), block_format=request.param)


def test_matrices_stay_in_their_blocks_and_compute_the_dequantized_models_logits(quantized_file):
    fmt, path = quantized_file
    kept = load_model(path, progress=False, quantization="auto")
    dense = load_model(path, progress=False, quantization="none")
    matrices = [n for n, t in dense.weights.items() if t.dim() == 2]
    assert all(isinstance(kept.weights[n], QuantizedWeight) for n in matrices)
    assert all(not isinstance(t, QuantizedWeight) for t in dense.weights.values())
    for n in matrices:  # llama.cpp's q/k row order undone on the blocks as on the floats
        q = kept.weights[n]
        assert isinstance(q, QuantizedWeight)
        assert torch.equal(q.dequantize(), floats(dense.weights)[n])
    # one model: the handshake's fingerprint does not see how the weights are held
    assert model_fingerprint(dense.config, kept.weights) == model_fingerprint(dense.config, dense.weights)

    cpu = torch.device("cpu")
    mq = DecoderModel(kept.config, kept.weights, cpu, torch.float32)
    # nothing copied, llama.cpp's permuted q and k neither: the model computes on the file's own bytes
    q = kept.weights["model.layers.1.self_attn.q_proj.weight"]
    v = kept.weights["model.layers.1.self_attn.v_proj.weight"]
    o = kept.weights["model.layers.1.self_attn.o_proj.weight"]
    assert isinstance(q, QuantizedWeight) and isinstance(v, QuantizedWeight) and isinstance(o, QuantizedWeight)
    assert q.order is not None  # its product's columns are put back in HF's order
    qkv, o_slot = mq.layers[1].qkv, mq.layers[1].o
    assert isinstance(qkv, QuantizedWeight) and isinstance(o_slot, QuantizedWeight)
    assert qkv.parts[0].data.data_ptr() == q.parts[0].data.data_ptr()
    assert qkv.parts[-1].data.data_ptr() + qkv.parts[-1].data.numel() == v.parts[0].data.data_ptr() + v.nbytes
    assert o_slot.parts[0].data.data_ptr() == o.parts[0].data.data_ptr()
    md = DecoderModel(dense.config, dense.weights, cpu, torch.float32)
    assert fmt in mq.weight_formats
    assert mq.weight_bytes < md.weight_bytes / 3  # the blocks' bytes, not float32's
    tokens = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(9)).tolist()
    got = chunked_logits(mq, tokens, prompt_len=24, chunk=16)
    want = chunked_logits(md, tokens, prompt_len=24, chunk=16)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-4, rel  # the blocks dequantized in registers: the float model, to fp32 rounding
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_engine_serves_a_quantized_file(quantized_file):
    _, path = quantized_file
    outs = {}
    for mode in ("auto", "none"):
        engine, _ = Engine.from_path(path, EngineConfig(quantization=mode, num_blocks=64), progress=False)
        try:
            outs[mode] = engine.generate([[5, 9, 200, 31]] * 3, SamplingParams(max_tokens=12, temperature=0.0))
        finally:
            engine.close()
    assert all(len(o) == 12 for o in outs["auto"])
    assert outs["auto"][0] == outs["auto"][1] == outs["auto"][2]  # one row's arithmetic, whatever the batch


def test_quantization_names_are_checked():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


def test_tensor_parallel_shards_of_a_quantized_file_are_its_blocks(quantized_file):
    """A rank's shard of each quantized matrix keeps its blocks (rows whole, columns cut on block
    boundaries) and dequantizes to the shard of the dequantized file; a split inside a block is
    refused by name (the tiny MLP's 96 columns over two ranks are 48: not whole blocks of 32)."""
    from splitserve.engine.parallel.shard import shard_weights

    _, path = quantized_file
    kept = load_model(path, progress=False, quantization="auto")
    dense = load_model(path, progress=False, quantization="none")
    with pytest.raises(ValueError, match="split only on 32-column blocks"):
        shard_weights(kept.config, kept.weights, 0, 2)
    for rank in (0, 1):
        ds = shard_weights(dense.config, dense.weights, rank, 2)
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight"):
            full = f"model.layers.1.{name}"
            t = kept.weights[full]
            assert isinstance(t, QuantizedWeight)
            shard = shard_weights(kept.config, {full: t}, rank, 2)[full]
            assert isinstance(shard, QuantizedWeight)
            assert torch.equal(shard.dequantize(), floats(ds)[full]), name


def test_tensor_parallel_ranks_compute_on_their_shards_of_the_blocks(quantized_file):
    """Every rank holds its rows and columns of the file's blocks (handed over pickled, the bytes
    shared), but a matrix whose ranks' columns would cut a block (the MLP's down: 96 columns over
    two ranks), which is dequantized; the tokens are the single process's."""
    fmt, path = quantized_file
    outs = {}
    for tp in (1, 2):
        cfg = EngineConfig(quantization="auto", num_blocks=64, tensor_parallel_size=tp)
        engine, _ = Engine.from_path(path, cfg, progress=False)
        try:
            layer = engine.model.layers[1]
            assert isinstance(layer.qkv, QuantizedWeight) and isinstance(layer.o, QuantizedWeight)
            assert isinstance(layer.down, QuantizedWeight) == (tp == 1)
            outs[tp] = engine.generate([[5, 9, 200, 31], [7, 7, 1]], SamplingParams(max_tokens=10, temperature=0.0))
        finally:
            engine.close()
    assert outs[2] == outs[1]


@pytest.mark.parametrize("choice", ["q8_0", "q4_k"])
def test_float_checkpoints_are_quantized_at_load_and_cached_beside_them(choice, tmp_path, tokenizer):
    """A Hugging Face directory with --quantization q8_0 / q4_k: its whole-block matrices (all of
    them for Q8_0; for Q4_K the tiny model's 64-wide rows are not whole 256-blocks and stay floats)
    come back as blocks; the second load reads the cache the first wrote."""
    hf = build("llama", seed=6)
    hf_dir = save_hf_dir(hf, str(tmp_path / "hf"), tokenizer)
    first = load_model(hf_dir, progress=False, quantization=choice)
    dense = floats(load_model(hf_dir, progress=False, quantization="none").weights)
    cached = sorted((tmp_path / "hf" / ".splitserve-quantized").glob("splitserve-*.safetensors"))
    kept = {n for n, w in first.weights.items() if isinstance(w, QuantizedWeight)}
    if choice == "q8_0":
        assert kept == {n for n, t in dense.items() if t.dim() == 2}
        assert len(cached) == 1
        stamp = cached[0].stat().st_mtime_ns
        second = load_model(hf_dir, progress=False, quantization=choice)
        assert cached[0].stat().st_mtime_ns == stamp  # read, not written again
        for n in kept:
            a, b = first.weights[n], second.weights[n]
            assert isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
            assert torch.equal(a.parts[0].data, b.parts[0].data)
            rel = float((a.dequantize() - dense[n]).norm() / dense[n].norm())
            assert rel < 0.01, (n, rel)
    else:
        assert kept == set()


def test_a_seeded_request_is_the_same_alone_in_a_batch_and_at_any_thread_count(quantized_file):
    """With batch_invariant a prompt prefilled beside seven others (96 rows in one step: past the
    kernel's MAX_ROWS, where the default runs the dequantized GEMM) gives the KV and the sampled
    tokens it gives alone, at one thread or two."""
    _, path = quantized_file
    engine, _ = Engine.from_path(
        path, EngineConfig(quantization="auto", batch_invariant="strict", num_blocks=256), progress=False
    )
    prompt = [7, 300, 12, 99, 4, 1000, 31, 8, 250, 17, 3, 60]
    others = [[(i * 37 + j * 11) % 4000 + 5 for j in range(12)] for i in range(7)]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_1 = engine.generate([prompt], params)[0]
        torch.set_num_threads(2)
        alone_2 = engine.generate([prompt], params)[0]
        batched = engine.generate([prompt, *others], [params] + [SamplingParams(max_tokens=16)] * 7)[0]
    finally:
        torch.set_num_threads(before)
        engine.close()
    assert len(alone_1) == 16
    assert alone_1 == alone_2, (alone_1, alone_2)
    assert alone_1 == batched, (alone_1, batched)
