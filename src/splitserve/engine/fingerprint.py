"""A model's fingerprint: 16 bytes that tell whether two workers' KV caches hold the same
model's keys and values, checked at every KV handshake (engine/kv_cache.py's KVLayout).

It covers what the KV depends on: the family, the shapes and traits (RoPE, windows, norms;
not the name a file gives it, nor its stop tokens), and every weight, each by its name, its
shape and a strided sample of about 4,096 of its values rounded to bfloat16, so that a model
loaded in float32 and in bfloat16 is the same model, and reading 16 GB of weights takes
milliseconds, not seconds. Two checkpoints whose sampled values all agree are taken as one.
A matrix kept in GGUF blocks is sampled from its dequantized values, so it is the same model as
the file dequantized.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.quant.weight import QuantizedWeight, Weight

_SAMPLES = 4096
# what a checkpoint's file says of itself without changing a single key or value
_NOT_THE_KV = ("name", "eos_token_ids", "bos_token_id")


def model_fingerprint(cfg: ModelConfig, weights: Mapping[str, Weight]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    shape = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_THE_KV}
    h.update(repr(sorted(shape.items())).encode())
    for name in sorted(weights):
        t = weights[name]
        h.update(f"{name}{tuple(t.shape)}".encode())
        numel = t.shape.numel()
        if isinstance(t, QuantizedWeight):
            sample = t.sample(max(1, numel // _SAMPLES), _SAMPLES)
        else:
            sample = t.detach().reshape(-1)[:: max(1, numel // _SAMPLES)][:_SAMPLES]
        h.update(sample.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.digest()
