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
from splitserve.engine.quant.weight import Weight
from splitserve.engine.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


def load_hf_dir(directory: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
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

    weights: dict[str, Weight] = dict(load_safetensors(directory, config, dtype, progress))
    return LoadedModel(config, weights, tokenizer)


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


def load_safetensors(directory: str, cfg: ModelConfig, dtype: torch.dtype, progress: bool) -> dict[str, torch.Tensor]:
    """The tensors `cfg` needs, from whichever shard holds each; a tied lm_head in the files is dropped."""
    from safetensors import SafetensorError, safe_open

    # the engine's name -> the checkpoint's (several for an expert stack, one tensor per expert)
    decls = registry.for_config(cfg).tensors(cfg)
    sources = {name: decl.checkpoint_names(name, cfg) for name, decl in decls.items()}
    wanted = [n for names in sources.values() for n in names]
    index_path = os.path.join(directory, _INDEX)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no weight_map")
        missing = [n for n in wanted if n not in weight_map]
        if missing:
            raise ModelLoadError(f"{index_path}: weight_map lacks tensor(s) {', '.join(missing[:3])}")
        shards: dict[str, list[str]] = {}
        for name in wanted:
            shards.setdefault(os.path.join(directory, weight_map[name]), []).append(name)
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ModelLoadError(f"{directory}: no *.safetensors files (and no {_INDEX})")
        shards = {f: [] for f in files}  # names resolved per file below

    line = ProgressLine(os.path.basename(os.path.abspath(directory)), len(shards), progress)
    weights: dict[str, torch.Tensor] = {}
    for done, (path, names) in enumerate(shards.items()):
        line.update(done, "files")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: no such file (named in {_INDEX})")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names or [n for n in wanted if n in present]:
                    if name not in present:
                        raise ModelLoadError(f"{path}: missing tensor {name} (the index says it is here)")
                    weights[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    line.update(len(shards), "files")
    line.close()
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise ModelLoadError(f"{directory}: missing tensor(s) {', '.join(missing[:3])} in the safetensors files")
    out = {name: weights[n[0]] if len(n) == 1 else _stack(weights, n, directory) for name, n in sources.items()}
    for name, decl in decls.items():
        if decl.hf_add:  # in float32, then back: the sum as the family's own norm computes it
            out[name] = (out[name].float() + decl.hf_add).to(dtype)
    return out


def _stack(weights: dict[str, torch.Tensor], names: list[str], directory: str) -> torch.Tensor:
    """The experts' tensors as one [num_experts, ...] stack (each expert's freed as it is copied)."""
    shapes = {tuple(weights[n].shape) for n in names}
    if len(shapes) != 1:
        raise ModelLoadError(f"{directory}: the experts' tensors {names[0]}, ... differ in shape: {sorted(shapes)}")
    return torch.stack([weights.pop(n) for n in names])


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
