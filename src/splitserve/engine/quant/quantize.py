"""Float weights quantized at load into a GGUF block format (`--quantization q8_0 | q4_k`), for a
user who brings a bfloat16 or float32 checkpoint: the matrices become QuantizedWeights that the
same kernels compute on, and the result is cached next to the model so a second start maps it.

Q8_0: per block of 32, d = amax / 127 (fp16) and q = round(w / d), as llama.cpp's quantize_row_q8_0.
Q4_K: per super-block of 256, eight sub-blocks of 32 with their own scale and min, each of those
rounded to 6 bits against the super-block's two fp16 scales (w = d * sc * q - dmin * m). This is
llama.cpp's layout with a plain min/max fit of each sub-block, not its iterative search
(make_qkx2_quants), so its error is somewhat larger than llama-quantize's for the same format.

The norms, the biases and every matrix whose rows are not whole blocks stay floats.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from splitserve.engine.gguf_formats import BY_NAME, BlockFormat
from splitserve.engine.quant.weight import QuantizedWeight, Weight

log = logging.getLogger(__name__)

# EngineConfig.quantization's choices that quantize float weights, by their format
AT_LOAD = {"q8_0": "Q8_0", "q4_k": "Q4_K"}


def quantize_q8_0(w: Tensor) -> Tensor:
    """[n, k] floats -> [n, k / 32 * 34] bytes of Q8_0 blocks."""
    n, k = w.shape
    x = w.float().reshape(n, k // 32, 32)
    d = (x.abs().amax(-1) / 127.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)
    return blocks.reshape(n, k // 32 * 34).contiguous()


def quantize_q4_k(w: Tensor) -> Tensor:
    """[n, k] floats -> [n, k / 256 * 144] bytes of Q4_K blocks (k a multiple of 256)."""
    n, k = w.shape
    x = w.float().reshape(n, k // 256, 8, 32)
    lo = x.amin(-1).clamp(max=0.0)  # a sub-block's min (never above 0: the format's m is subtracted)
    hi = x.amax(-1)
    scale = (hi - lo) / 15.0
    d = (scale.amax(-1) / 63.0).to(torch.float16)
    dmin = ((-lo).amax(-1) / 63.0).to(torch.float16)
    df, dminf = d.float()[..., None], dmin.float()[..., None]
    sc = torch.where(df > 0, torch.round(scale / df.clamp(min=1e-30)), torch.zeros_like(scale)).clamp(0, 63)
    mn = torch.where(dminf > 0, torch.round(-lo / dminf.clamp(min=1e-30)), torch.zeros_like(lo)).clamp(0, 63)
    step = (df * sc)[..., None]
    offset = (dminf * mn)[..., None]
    q = torch.where(step > 0, torch.round((x + offset) / step.clamp(min=1e-30)), torch.zeros_like(x)).clamp(0, 15)
    q = q.to(torch.uint8).reshape(n, k // 256, 4, 2, 32)  # [.., 64-chunk, low/high half, 32]
    qs = (q[:, :, :, 0, :] | (q[:, :, :, 1, :] << 4)).reshape(n, k // 256, 128)
    sc8, mn8 = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.empty(n, k // 256, 12, dtype=torch.uint8)
    scales[..., 0:4] = (sc8[..., 0:4] & 63) | ((sc8[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn8[..., 0:4] & 63) | ((mn8[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc8[..., 4:8] & 0xF) | ((mn8[..., 4:8] & 0xF) << 4)
    head = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), dmin.view(torch.uint8).reshape(n, -1, 2)], dim=-1)
    return torch.cat([head, scales, qs], dim=-1).reshape(n, k // 256 * 144).contiguous()


_QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k}


def _fits(name: str, w: Weight, fmt: BlockFormat) -> bool:
    return isinstance(w, Tensor) and w.dim() == 2 and w.shape[1] % fmt.block_elems == 0 and name.endswith(".weight")


def _cache_file(source: str, fmt: BlockFormat) -> Path:
    """Where the quantized blocks of `source` are kept: in a folder beside a directory's checkpoint
    (not among its *.safetensors, which the loader reads) when it is writable, else under
    ~/.cache/splitserve/quantized; named by the source's files, sizes and times."""
    p = Path(source)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    key = hashlib.sha256(repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode()).hexdigest()
    name = f"splitserve-{fmt.name.lower()}-{key[:16]}.safetensors"
    beside = p.is_dir() and os.access(p, os.W_OK)
    folder = p / ".splitserve-quantized" if beside else Path.home() / ".cache" / "splitserve" / "quantized"
    return folder / name


def quantize_weights(weights: Mapping[str, Weight], choice: str, source: str) -> dict[str, Weight]:
    """`weights` with every float matrix that is whole blocks quantized to AT_LOAD[choice]; blocks a
    file already holds stay as they are. The blocks come from the cache beside `source` when a
    previous start wrote them."""
    from safetensors.torch import load_file, save_file

    fmt = BY_NAME[AT_LOAD[choice]]
    names = [n for n, w in weights.items() if _fits(n, w, fmt)]
    cache = _cache_file(source, fmt)
    blocks: dict[str, Tensor] = {}
    if cache.exists():
        try:
            blocks = load_file(str(cache))
        except Exception as e:  # a torn or foreign file: quantize again
            log.warning("ignoring quantized cache %s (%s)", cache, e)
    if set(blocks) != set(names):
        blocks = {n: _QUANTIZERS[fmt.name](weights[n]) for n in names}  # type: ignore[arg-type]
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            save_file(blocks, str(tmp))
            tmp.replace(cache)
            log.info("quantized %d matrices to %s, cached in %s", len(names), fmt.name, cache)
        except OSError as e:
            log.warning("could not cache the quantized weights in %s (%s)", cache, e)
    out = dict(weights)
    for n in names:
        w = weights[n]
        out[n] = QuantizedWeight.of(fmt, blocks[n], w.shape[1])
    return out
