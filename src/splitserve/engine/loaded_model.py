"""What every weight-format loader shares: the result (`LoadedModel`), the error
(`ModelLoadError`), the check of the tensor names and shapes a config implies (its
family's declaration, engine/models/), and the progress line.

The format loaders (`gguf_loader.py`, `hf_loader.py`) and the entry point that picks
one (`weights.py`) all stand on this module, so none of them imports another to get it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

from splitserve.engine.config import ModelConfig
from splitserve.engine.models import declare, registry
from splitserve.engine.quant.weight import Weight
from splitserve.engine.tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A model file or directory is missing, malformed or describes an unsupported model."""


class LoadedModel(NamedTuple):
    config: ModelConfig
    # HF names, CPU, in the requested dtype; a matrix kept in its GGUF blocks is a QuantizedWeight
    weights: dict[str, Weight]
    tokenizer: Tokenizer


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config needs, by HF name, in HF's [out, in] orientation, as
    its family's module declares them (engine/models/)."""
    return declare.expected_shapes(registry.for_config(cfg), cfg)


def check_weights(cfg: ModelConfig, weights: Mapping[str, Weight], path: str) -> None:
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
