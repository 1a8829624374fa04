"""Hugging Face model directories: config.json, *.safetensors (one file or sharded with
model.safetensors.index.json), tokenizer.json and tokenizer_config.json.

The tensor names already are the ones the engine uses; loading is reading the
right tensors from the right shards and casting them to the requested dtype.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Any

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.loaded_model import LoadedModel, ModelLoadError, ProgressLine
from splitserve.engine.models import registry
from splitserve.engine.quant.checkpoint import Scheme, scheme_of
from splitserve.engine.quant.weight import QuantizedWeight, Weight, dequantized
from splitserve.engine.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


def load_hf_dir(directory: str, dtype: torch.dtype, progress: bool, keep_blocks: bool = False) -> LoadedModel:
    """`keep_blocks`: a quantized checkpoint's linear layers stay in their blocks (QuantizedWeight);
    else they are dequantized into `dtype`."""
    config = read_hf_config(directory)

    # Generation stops on every id generation_config.json lists, not only config.json's.
    eos = list(config.eos_token_ids)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        gen_eos = _read_json(gen_path).get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    try:
        tokenizer = Tokenizer.from_hf_dir(directory, extra_eos_token_ids=eos)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: cannot build the tokenizer: {e}") from None
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = replace(config, eos_token_ids=tokenizer.eos_token_ids, bos_token_id=bos)

    scheme = read_scheme(directory)
    weights = load_safetensors(directory, config, dtype, progress, scheme)
    if not keep_blocks:
        weights = dict(dequantized(weights, dtype))
    return LoadedModel(config, weights, tokenizer)


def read_scheme(directory: str) -> Scheme | None:
    """A quantized checkpoint's scheme (config.json's quantization_config), None for a float one."""
    config_path = os.path.join(directory, "config.json")
    try:
        return scheme_of(_read_json(config_path).get("quantization_config"))
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None


def read_hf_config(directory: str) -> ModelConfig:
    """The model's shapes from config.json alone (no weights, no tokenizer): what a preflight reads."""
    config_path = os.path.join(directory, "config.json")
    raw = _read_json(config_path)
    try:
        arch = registry.for_hf_model_type(raw.get("model_type"))
        name = raw.get("_name_or_path") or os.path.basename(os.path.abspath(directory))
        return arch.configure(ModelConfig.from_hf(raw, name=name))
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{config_path}: {e}") from None


def load_safetensors(
    directory: str, cfg: ModelConfig, dtype: torch.dtype, progress: bool, scheme: Scheme | None = None
) -> dict[str, Weight]:
    """The tensors `cfg` needs, from whichever shard holds each; a tied lm_head in the files is dropped.
    With a quantized checkpoint's `scheme`, each quantized linear layer is read as its packed tensors
    and comes back as a QuantizedWeight (engine/quant/checkpoint.py)."""
    # the engine's name -> the checkpoint's (several for an expert stack, one tensor per expert)
    decls = registry.for_config(cfg).tensors(cfg)
    sources = {name: decl.checkpoint_names(name, cfg) for name, decl in decls.items()}
    located = _locate(directory)
    # a quantized linear's ".weight" -> its packed tensors (the checkpoint's names)
    packed: dict[str, list[str]] = {}
    for n in (n for names in sources.values() for n in names if n.endswith(".weight")):
        parts = scheme.tensor_names(n.removesuffix(".weight"), lambda t: t in located) if scheme else None
        if parts is not None:
            packed[n] = parts
    wanted = [p for names in sources.values() for n in names for p in packed.get(n, [n])]
    keep = frozenset(p for v in packed.values() for p in v)
    raw = _read_tensors(directory, located, wanted, dtype, keep, progress)
    weights: dict[str, Weight] = {n: raw[n] for n in wanted if n in raw}
    if scheme is not None:
        for n in packed:
            try:
                weights[n] = scheme.repack(n.removesuffix(".weight"), raw)
            except (ValueError, RuntimeError, KeyError) as e:
                raise ModelLoadError(f"{directory}: tensor {n} as {scheme.describe}: {e}") from None
    out = {name: weights[n[0]] if len(n) == 1 else _stack(weights, n, directory, dtype) for name, n in sources.items()}
    for name, decl in decls.items():
        if decl.hf_add:  # in float32, then back: the sum as the family's own norm computes it
            w = out[name]
            assert isinstance(w, torch.Tensor)  # a norm: never quantized
            out[name] = (w.float() + decl.hf_add).to(dtype)
    return out


def _locate(directory: str) -> dict[str, str]:
    """Every tensor name -> the file that holds it (the index's weight_map, or each file's header)."""
    from safetensors import SafetensorError, safe_open

    index_path = os.path.join(directory, _INDEX)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no weight_map")
        return {n: os.path.join(directory, f) for n, f in weight_map.items()}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files (and no {_INDEX})")
    where: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                where.update((n, path) for n in f.keys())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    return where


def _read_tensors(
    directory: str,
    located: dict[str, str],
    wanted: list[str],
    dtype: torch.dtype,
    keep_dtype: frozenset[str],
    progress: bool,
) -> dict[str, torch.Tensor]:
    """The `wanted` tensors, each cast to `dtype` but those in `keep_dtype` (packed integers, scales)."""
    from safetensors import SafetensorError, safe_open

    missing = [n for n in wanted if n not in located]
    if missing:
        where = _INDEX + "'s weight_map" if os.path.isfile(os.path.join(directory, _INDEX)) else "the safetensors files"
        raise ModelLoadError(f"{directory}: {where} lacks tensor(s) {', '.join(missing[:3])}")
    shards: dict[str, list[str]] = {}
    for name in wanted:
        shards.setdefault(located[name], []).append(name)
    line = ProgressLine(os.path.basename(os.path.abspath(directory)), len(shards), progress)
    out: dict[str, torch.Tensor] = {}
    for done, (path, names) in enumerate(shards.items()):
        line.update(done, "files")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: no such file (named in {_INDEX})")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ModelLoadError(f"{path}: missing tensor {name} (the index says it is here)")
                    t = f.get_tensor(name)
                    out[name] = t if name in keep_dtype else t.to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    line.update(len(shards), "files")
    line.close()
    return out


def _stack(weights: dict[str, Weight], names: list[str], directory: str, dtype: torch.dtype) -> torch.Tensor:
    """The experts' tensors as one [num_experts, ...] stack (each expert's freed as it is copied;
    a quantized expert dequantized: the kernels take 2-D matrices)."""
    floats = {n: w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w for n in names for w in [weights[n]]}
    shapes = {tuple(floats[n].shape) for n in names}
    if len(shapes) != 1:
        raise ModelLoadError(f"{directory}: the experts' tensors {names[0]}, ... differ in shape: {sorted(shapes)}")
    for n in names:
        weights.pop(n)
    return torch.stack([floats.pop(n) for n in names])


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
