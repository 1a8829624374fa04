"""The tokenizer lengths are counted with: the served model's, by default the
embedded SmolLM2 that splitserve serves. An HF directory loads without torch
(the engine's GGUF reader needs it, and importing torch costs seconds)."""

from __future__ import annotations

import os

from splitserve.engine.tokenizer import Tokenizer


def load_text_tokenizer(path: str | None) -> Tokenizer:
    """`path`: a GGUF file or an HF directory (tokenizer.json); None: the default model's."""
    if path is not None and os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    from splitserve.engine.weights import load_tokenizer

    return load_tokenizer(path)
