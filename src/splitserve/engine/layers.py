"""The decoder's pure functions that more than the model stands on: RMSNorm and rotary
position embeddings (the inverse frequencies with linear or llama3 scaling, the cos and
sin tables, their application in HF's rotate_half convention).

The torch model (`model.py`) computes with them, and the fused decode kernels
(`kernels/`) check themselves against them, so they live below both.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, device: torch.device, local_theta: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_position, head_dim], in fp32 (cast per step, as HF does). `local_theta`:
    the windowed layers' tables (Gemma 3: their own base, unscaled)."""
    dim, scaling = cfg.rotary_dim, cfg.rope_scaling
    pos = torch.arange(cfg.max_position, dtype=torch.float32)
    if local_theta:
        freqs = pos[:, None] * rope_inv_freq(dim, cfg.rope_local_theta, RopeScaling())[None, :]
    elif scaling.kind == "longrope":  # per position: short factors below the original context, long from it
        base = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        short = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * base)
        long = 1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32) * base)
        inv = torch.where((pos < scaling.original_max_position)[:, None], short[None, :], long[None, :])
        freqs = pos[:, None] * inv
    else:
        freqs = pos[:, None] * rope_inv_freq(dim, cfg.rope_theta, scaling)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling.kind == "longrope" and not local_theta:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(device), sin.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim] in x's dtype. HF's rotate_half convention;
    a partial rotary (rotary_dim < head_dim) rotates the first rotary_dim dims and passes the rest."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # in fp32 whatever the model dtype, then back: the same arithmetic as HF's LlamaRMSNorm
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
