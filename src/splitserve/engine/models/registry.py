"""Every model family splitserve serves, found by the checkpoint's own name: HF config.json's
`model_type` or GGUF's `general.architecture`. A new family is its module and one line here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.engine.config import ModelConfig
from splitserve.engine.models import declare, gemma3, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe
from splitserve.engine.models.declare import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (
    llama.ARCH,
    mistral.ARCH,
    qwen2.ARCH,
    qwen3.ARCH,
    qwen3_moe.ARCH,
    mixtral.ARCH,
    gemma3.ARCH,
    phi3.ARCH,
)

_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_HF = {t: a for a in ARCHITECTURES for t in a.hf_model_types}
_GGUF_NAMES = sorted({t for a in ARCHITECTURES for t in a.gguf_architectures})


class UnsupportedArchitecture(ValueError):
    """A checkpoint names a family that no module here declares."""


def for_config(cfg: ModelConfig) -> Architecture:
    """The family a ModelConfig was built for."""
    try:
        return _BY_NAME[cfg.architecture]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {cfg.architecture!r} is not supported (supported: {', '.join(sorted(_BY_NAME))})"
        ) from None


def for_hf_model_type(model_type: object) -> Architecture:
    arch = _BY_HF.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_BY_HF))})"
        )
    return arch


def for_gguf(meta: Mapping[str, Any]) -> Architecture:
    """The family of a GGUF file, from its metadata: `general.architecture`, and where two
    families share that name, what each one's `gguf_matches` tests."""
    name = meta["general.architecture"]
    for arch in ARCHITECTURES:
        if name in arch.gguf_architectures and arch.gguf_matches(meta):
            return arch
    raise UnsupportedArchitecture(f"GGUF architecture {name!r} is not supported (supported: {', '.join(_GGUF_NAMES)})")


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """The parameters of a model of `cfg`, as its family declares its tensors (`active`: those one
    token runs through, for a mixture of experts)."""
    return declare.param_count(for_config(cfg), cfg, active)
