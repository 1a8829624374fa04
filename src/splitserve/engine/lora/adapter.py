"""A LoRA adapter as PEFT saves one, read into the model's fused slots and known by its content.

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
`use_rslora`) and `adapter_model.safetensors`, whose tensors are named after the base model's
modules: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). A targeted module's output gains `(x @ A.T) @ B.T * scaling`,
scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).

The model computes q, k and v as one matrix (`qkv`) and gate and up as another (`gate_up`), so
each module lands in its slot's rows: which rows is read from the family's declaration
(engine/models/), the same one the loaders fuse the base weights by. B is stored already
multiplied by the scaling.

An adapter is known by its content, never its name: `LoraAdapter.id` is a digest of its
scaling, its targets and every tensor's bytes. Two uploads under one name with different
weights have different ids; two names for the same weights have one. (vLLM keys cached KV by the
adapter's name: vllm-project/vllm#30931.)

What PEFT can save and this cannot compute yet is refused naming the key: DoRA, trained biases,
`modules_to_save`, per-module alphas, Conv1D's `fan_in_fan_out`, an adapter of the embedding or
the experts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from splitserve.engine.config import ModelConfig
from splitserve.engine.models import registry

# PEFT's file names (safetensors only: a pickle is code, not weights)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_LAYER_KEY = "base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight"
# slots a module's update may land in: the dense matrices of a layer (not the experts' stacks)
_SLOTS = ("qkv", "o", "gate_up", "down")


class AdapterError(ValueError):
    """An adapter that cannot be served, with what is wrong named."""


@dataclass(frozen=True)
class LoraPart:
    """One module's update inside its slot: output rows [start, end) gain (x @ a.T) @ b.T."""

    start: int
    end: int
    a: Tensor  # [rank, in]
    b: Tensor  # [end - start, rank], times the scaling


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    id: str  # a digest of the content (scaling, targets, tensors): the adapter's identity
    rank: int
    scaling: float
    layers: tuple[dict[str, tuple[LoraPart, ...]], ...]  # per layer: slot -> its modules' parts

    def parts(self, layer: int, slot: str) -> tuple[LoraPart, ...]:
        return self.layers[layer].get(slot, ())


def module_rows(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Each adaptable module of a layer (its name after "model.layers.{i}.", as PEFT names it) ->
    (slot, first row, end row) in the model's fused slot, from the family's declaration."""
    arch = registry.for_config(cfg)
    out: dict[str, tuple[str, int, int]] = {}
    at: dict[str, int] = {}
    for d in arch.layer:
        if not d.present(cfg) or d.slot not in _SLOTS or d.experts or d.init != "matrix":
            continue
        rows = d.shape(cfg)[0]
        start = at.get(d.slot, 0)
        out[d.hf.removesuffix(".weight")] = (d.slot, start, start + rows)
        at[d.slot] = start + rows
    return out


def load_peft(path: str, name: str, cfg: ModelConfig, dtype: torch.dtype, max_rank: int = 0) -> LoraAdapter:
    """The PEFT adapter in directory `path`, for a model of `cfg`, its tensors in `dtype`;
    `max_rank` (0: any) refuses a larger rank. AdapterError naming what is wrong."""
    rank, alpha, rslora = _read_config(path)
    if rank < 1:
        raise AdapterError(f"adapter {name!r}: r is {rank}")
    if max_rank and rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is more than --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors = _read_tensors(path, name)
    rows = module_rows(cfg)
    layers: list[dict[str, tuple[LoraPart, ...]]] = []
    used: set[str] = set()
    for layer in range(cfg.num_layers):
        slots: dict[str, list[LoraPart]] = {}
        for module, (slot, start, end) in rows.items():
            ka, kb = (_LAYER_KEY.format(layer=layer, module=module, ab=ab) for ab in "AB")
            if ka not in tensors and kb not in tensors:
                continue
            a, b = _pair(tensors, ka, kb, name)
            if a.shape[0] != rank or b.shape != (end - start, rank):
                raise AdapterError(
                    f"adapter {name!r}: {module} of layer {layer} is A {tuple(a.shape)}, B {tuple(b.shape)}; the "
                    f"model's {module} needs A [{rank}, in] and B [{end - start}, {rank}]"
                )
            slots.setdefault(slot, []).append(LoraPart(start, end, a.to(dtype), (b.float() * scaling).to(dtype)))
            used.update((ka, kb))
        layers.append({slot: tuple(parts) for slot, parts in slots.items()})
    if stray := sorted(set(tensors) - used):
        raise AdapterError(
            f"adapter {name!r}: {len(stray)} tensors target no module this model adapts, e.g. {stray[0]!r} "
            f"(adaptable: {', '.join(sorted(m.rsplit('.', 1)[-1] for m in rows))})"
        )
    if not used:
        raise AdapterError(f"adapter {name!r}: no tensor of {WEIGHTS_FILE} targets a layer of this model")
    return LoraAdapter(name, content_id(rank, scaling, tensors), rank, scaling, tuple(layers))


def content_id(rank: int, scaling: float, tensors: dict[str, Tensor]) -> str:
    """The adapter's identity: a digest of its rank, scaling and every tensor (name, dtype, shape,
    bytes), in name order. A different value anywhere is a different adapter."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"lora1 r={rank} scaling={scaling!r}".encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"\n{key} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _read_config(path: str) -> tuple[int, float, bool]:
    """adapter_config.json's rank, alpha and rsLoRA switch, once what is not served is refused."""
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            settings = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter's directory holds one)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{file}: {e}") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{file}: not a JSON object")
    refused = {
        "peft_type": settings.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(settings.get("use_dora")),
        "bias": settings.get("bias", "none") != "none",
        "modules_to_save": bool(settings.get("modules_to_save")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
    }
    if bad := [k for k, v in refused.items() if v]:
        said = ", ".join(f"{k}={settings.get(k)!r}" for k in bad)
        raise AdapterError(f"{file}: {said} is not served (plain LoRA is)")
    r, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool):
        raise AdapterError(f"{file}: r must be a whole number, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    return r, float(alpha), bool(settings.get("use_rslora"))


def _read_tensors(path: str, name: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise AdapterError(f"adapter {name!r}: {path} has no {WEIGHTS_FILE}")
    try:
        return load_file(file)
    except Exception as e:  # a truncated or foreign file: said with its cause
        raise AdapterError(f"adapter {name!r}: {file} could not be read ({e})") from None


def _pair(tensors: dict[str, Tensor], ka: str, kb: str, name: str) -> tuple[Tensor, Tensor]:
    if ka not in tensors or kb not in tensors:
        missing = ka if ka not in tensors else kb
        raise AdapterError(f"adapter {name!r}: {missing} is missing (every lora_A needs its lora_B)")
    return tensors[ka], tensors[kb]
