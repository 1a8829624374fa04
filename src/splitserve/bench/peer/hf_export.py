"""The GGUF model as a Hugging Face directory, for servers that cannot read GGUF (vLLM's CPU build).

The weights come from splitserve's own GGUF loader: dequantized in float32,
renamed to HF's names and with llama.cpp's Q/K row permutation undone (as
transformers' GGUF reader does), so the directory holds the very tensors the
splitserve engine computes with, and both systems serve the same numbers.
`config.json` is written from the GGUF's ModelConfig; the tokenizer files from
the tokenizer built from the GGUF's vocabulary. A marker holding the GGUF's
path, size and mtime makes a second export of the same file a no-op.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from splitserve.engine.config import ModelConfig
from splitserve.engine.quant.weight import floats

MARKER = ".splitserve-export.json"
# Bumped when what is written changes, so that an old directory is rewritten.
EXPORT_VERSION = 1


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for LlamaForCausalLM with the GGUF's shapes and constants."""
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": "float32",  # dequantized: the exact values are fp32, a server may cast them down
        "_name_or_path": cfg.name,
    }
    return d


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    rs = cfg.rope_scaling
    if rs.kind == "none":
        return None
    d: dict[str, Any] = {"rope_type": rs.kind, "factor": rs.factor}
    if rs.kind == "llama3":
        d |= {
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        }
    return d


def generation_config(cfg: ModelConfig) -> dict[str, Any]:
    # Only the stop ids: sampling defaults in here would change what a server does for a request
    # that sets none, and the two systems must do the same.
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}


def _source_stamp(gguf_path: str) -> dict[str, Any]:
    st = os.stat(gguf_path)
    return {"gguf": os.path.abspath(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "v": EXPORT_VERSION}


def is_current(out_dir: str, gguf_path: str) -> bool:
    """True when out_dir already holds the export of this very file."""
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            return bool(json.load(f) == _source_stamp(gguf_path))
    except (OSError, ValueError):
        return False


def export_hf_dir(gguf_path: str | None, out_dir: str) -> str:
    """Write (or reuse) the HF directory of `gguf_path` (None: the embedded default model); returns out_dir."""
    from safetensors.torch import save_file

    from splitserve.engine.weights import default_model_path, load_model

    gguf_path = gguf_path or default_model_path()
    if is_current(out_dir, gguf_path):
        return out_dir
    loaded = load_model(gguf_path, progress=False)  # float32: dequantized exactly
    # Written beside the target and renamed into place, so an interrupted export never looks finished.
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # safetensors refuses tensors that share memory; ours are separate, contiguous copies
    weights = {name: t.contiguous() for name, t in floats(loaded.weights).items()}
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(tmp, "config.json"), hf_config(loaded.config))
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(loaded.config))
    loaded.tokenizer.save(tmp)
    _complete_tokenizer_config(tmp, loaded.config)
    _write_json(os.path.join(tmp, MARKER), _source_stamp(gguf_path))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def _complete_tokenizer_config(directory: str, cfg: ModelConfig) -> None:
    """What transformers' fast tokenizer wants beyond what Tokenizer.save writes: the context
    length (else it warns on every long prompt) and no cleanup of spaces (the GGUF's tokenizer
    decodes without it)."""
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        tc = json.load(f)
    tc.setdefault("model_max_length", cfg.max_position)
    tc.setdefault("clean_up_tokenization_spaces", False)
    _write_json(path, tc)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
        f.write("\n")
