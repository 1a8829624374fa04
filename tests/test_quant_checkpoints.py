"""Quantized Hugging Face checkpoints (engine/quant/checkpoint.py): a tiny seeded llama's linear
layers quantized here and written in each layout (GPTQ v1 4- and 8-bit, AWQ GEMM,
compressed-tensors pack-quantized with and without zero points, int-quantized and
float-quantized, transformers' block FP8) load as QuantizedWeights of the GGUF format that holds
the same numbers, and compute the logits of the same model written as floats. The packers below
follow each format's published layout and are written apart from the loader's unpackers, so a
nibble in the wrong place on either side fails."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from splitserve.engine.kernels import quant as qk
from splitserve.engine.loaded_model import ModelLoadError
from splitserve.engine.model import DecoderModel
from splitserve.engine.quant.weight import QuantizedWeight, floats
from splitserve.engine.weights import load_model
from tests.family_helpers.build import build, save_hf_dir
from tests.family_helpers.logits import chunked_logits

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not qk.available(), reason="the quantized kernel does not build on this platform"),
]

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
G = 32  # the tests' group size: the tiny model's rows are 64 and 96 columns


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values.astype(np.uint32)).view(np.int32))


def _pack(values: torch.Tensor, bits: int, axis: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `values` packed 32/bits to an int32 along `axis`: value i of each run at bits i*bits."""
    v = values.to(torch.int64).numpy()
    v = v if axis == 1 else v.T
    per = 32 // bits
    out = np.zeros((v.shape[0], v.shape[1] // per), dtype=np.uint64)
    for i in range(per):
        col = (order or tuple(range(per)))[i]
        out |= v[:, col::per].astype(np.uint64) << np.uint64(bits * i)
    packed = _int32(out)
    return packed if axis == 1 else packed.T.contiguous()


def _asym4(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups of G columns with a zero point: (q in 0..15, zero in 0..15, scale, w dequantized)."""
    n, k = w.shape
    g = w.reshape(n, k // G, G)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype)
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = torch.round(g / s.float()[..., None] + z[..., None]).clamp(0, 15)
    ref = ((q - z[..., None]) * s.float()[..., None]).reshape(n, k)
    return q.reshape(n, k).to(torch.uint8), z.to(torch.uint8), s, ref


def _sym(
    w: torch.Tensor, levels: int, group: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric: (q in -levels-1..levels, a scale per `group` columns, w dequantized)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    s = (g.abs().amax(-1) / levels).clamp(min=1e-6).to(scale_dtype)
    q = torch.round(g / s.float()[..., None]).clamp(-levels - 1, levels)
    return q.reshape(n, k).to(torch.int8), s, (q * s.float()[..., None]).reshape(n, k)


def gptq4(w):
    q, z, s, ref = _asym4(w)
    stored = (z.to(torch.int16) - 1) & 15  # the v1 format's zero minus one
    t = {"qweight": _pack(q.T, 4, axis=0), "qzeros": _pack(stored.T, 4, axis=1), "scales": s.T.contiguous()}
    return t, ref


def gptq8(w):
    q, s, ref = _sym(w, 127, G)
    zeros = torch.full(s.T.shape, 127, dtype=torch.int16)  # 128 - 1
    t = {"qweight": _pack((q.to(torch.int16) + 128).T, 8, axis=0), "qzeros": _pack(zeros, 8, axis=1)}
    return {**t, "scales": s.T.contiguous()}, ref


def awq(w):
    q, z, s, ref = _asym4(w)
    t = {"qweight": _pack(q.T, 4, axis=1, order=AWQ_ORDER), "qzeros": _pack(z.T, 4, axis=1, order=AWQ_ORDER)}
    return {**t, "scales": s.T.contiguous()}, ref


def ct_w4_sym(w):
    q, s, ref = _sym(w, 7, G, torch.bfloat16)  # llm-compressor keeps the model's dtype for scales
    packed = _pack(q.to(torch.int16) + 8, 4, axis=1)
    return {"weight_packed": packed, "weight_scale": s, "weight_shape": torch.tensor(w.shape)}, ref


def ct_w4_asym(w):
    q, z, s, ref = _asym4(w, torch.bfloat16)
    t = {"weight_packed": _pack(q, 4, axis=1), "weight_zero_point": _pack(z, 4, axis=0)}
    return {**t, "weight_scale": s, "weight_shape": torch.tensor(w.shape)}, ref


def ct_w8(w):
    q, s, ref = _sym(w, 127, w.shape[1], torch.bfloat16)
    return {"weight": q, "weight_scale": s}, ref


def _fp8(w, scale):
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def ct_fp8(w):
    s = (w.abs().amax(-1, keepdim=True) / 448).bfloat16()
    q, ref = _fp8(w, s.float())
    return {"weight": q, "weight_scale": s}, ref


def hf_fp8(w):
    s = w.abs().amax() / 448  # one 128x128 block covers the tiny model's matrices
    q, ref = _fp8(w, s)
    return {"weight": q, "weight_scale_inv": s.reshape(1, 1)}, ref


def _ct(fmt: str, weights: dict, ignore: list[str] | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, "ignore": ignore}


def _int(bits: int, symmetric: bool, strategy: str, **more) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, **more}


GPTQ = {"quant_method": "gptq", "group_size": G}
SCHEMES: dict[str, tuple[Callable, dict, str, float]] = {
    # name: (packer, quantization_config, the GGUF format it becomes, logits' relative error bound)
    "gptq-4bit": (gptq4, {**GPTQ, "bits": 4, "sym": False}, "Q4_1", 2e-3),
    "gptq-8bit": (gptq8, {**GPTQ, "bits": 8, "sym": True}, "Q8_0", 1e-4),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm"}, "Q4_1", 2e-3),
    "ct-w4a16": (ct_w4_sym, _ct("pack-quantized", _int(4, True, "group", group_size=G)), "Q4_0", 1e-4),
    "ct-w4a16-zp": (ct_w4_asym, _ct("pack-quantized", _int(4, False, "group", group_size=G)), "Q4_1", 2e-3),
    "ct-w8a8": (ct_w8, _ct("int-quantized", _int(8, True, "channel")), "Q8_0", 1e-4),
    "ct-fp8": (ct_fp8, _ct("float-quantized", {**_int(8, True, "channel"), "type": "float"}), "Q8_0", 0.05),
    "fp8-block": (hf_fp8, {"quant_method": "fp8", "weight_block_size": [128, 128]}, "Q8_0", 0.05),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))
    model = build("llama", seed=5)
    return model, tok, tmp_path_factory.mktemp("checkpoints")


def _write(tiny, name: str) -> tuple[str, str]:
    """The scheme's quantized checkpoint and the same weights as floats: their two directories."""
    model, tok, root = tiny
    pack, qc, _, _ = SCHEMES[name]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quantized, reference = dict(state), dict(state)
    for key in [k for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEARS]:
        tensors, ref = pack(state[key].float())
        del quantized[key]
        prefix = key.removesuffix(".weight")
        quantized.update({f"{prefix}.{t}": v for t, v in tensors.items()})
        reference[key] = ref
    dirs = []
    for kind, tensors in (("quantized", quantized), ("float", reference)):
        d = root / name / kind
        save_hf_dir(model, str(d), tok)
        for f in d.glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        if kind == "quantized":
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        dirs.append(str(d))
    return dirs[0], dirs[1]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_quantized_checkpoint_computes_on_its_blocks_the_models_logits(tiny, name):
    _, _, fmt, bound = SCHEMES[name]
    quantized_dir, float_dir = _write(tiny, name)
    kept = load_model(quantized_dir, progress=False, quantization="auto")
    ref = load_model(float_dir, progress=False, quantization="none")
    for key, w in floats(ref.weights).items():
        got = kept.weights[key]
        if key.split(".")[-2] in LINEARS:
            assert isinstance(got, QuantizedWeight) and got.format_names == (fmt,), (key, got)
            err = float((got.dequantize() - w).abs().max() / w.abs().max())
            assert err < (bound if "fp8" in name else 2e-3), (key, err)
        else:  # embeddings, norms and the head stay the checkpoint's floats
            assert isinstance(got, torch.Tensor) and torch.equal(got, w)
    dense = load_model(quantized_dir, progress=False, quantization="none")  # the same numbers, as floats
    assert not any(isinstance(w, QuantizedWeight) for w in dense.weights.values())

    cpu = torch.device("cpu")
    mq = DecoderModel(kept.config, kept.weights, cpu, torch.float32)
    mf = DecoderModel(ref.config, ref.weights, cpu, torch.float32)
    assert mq.weight_bytes < mf.weight_bytes
    tokens = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    got_logits = chunked_logits(mq, tokens, prompt_len=20, chunk=16)
    want = chunked_logits(mf, tokens, prompt_len=20, chunk=16)
    rel = float((got_logits - want).norm() / want.norm())
    assert rel < bound, rel


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "desc_act"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size 48"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "128x128"),
        (_ct("marlin-24", {"num_bits": 4, "type": "int"}), "marlin-24"),
    ],
)
def test_an_unsupported_quantization_is_refused_by_name(tiny, qc, message):
    quantized_dir, _ = _write(tiny, "gptq-4bit")
    path = Path(quantized_dir) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": qc}))
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(quantized_dir, progress=False, quantization="auto")
    assert os.path.join(quantized_dir, "config.json") in str(e.value)
