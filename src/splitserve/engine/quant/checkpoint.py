"""Quantized Hugging Face checkpoints read as they are: GPTQ, AWQ, compressed-tensors (llm-compressor's
W4A16, W8A16, W8A8 and FP8) and transformers' block FP8, each linear layer's tensors repacked into
the GGUF block format that holds the same numbers, so the kernels of engine/kernels/quant.cpp
compute on them and nothing is widened to floats.

What each becomes, and why it is the same weight:

- int4 with a zero point per group of g columns (g a multiple of 32; a channel's is one group):
  w = s * (q - z) = s * q + (-z * s), which is Q4_1 (d = s, m = -z * s) block by block. Exact but
  for m's rounding to fp16 (z * s needs up to 15 bits of mantissa, fp16 has 11: a 2^-12 relative
  error of a weight's offset, against the half-step 2^-5 of the format itself).
- int4 symmetric (GPTQ's z = 8, compressed-tensors without zero points): w = s * (q - 8) is Q4_0,
  exactly.
- int8 symmetric, per channel or per group of 32k (W8A16, W8A8, GPTQ 8-bit with z = 128):
  w = s * q is Q8_0, exactly where s is a float16 (a float32 scale is rounded to one).
- FP8 E4M3 with a scale per tensor, channel or 128x128 block: re-encoded as Q8_0 (each 32 values
  over their largest, in 255 steps): not exact, as FP8 keeps a 3-bit mantissa at every magnitude
  while Q8_0 keeps steps of 1/127 of the block's largest; this CPU has no FP8 arithmetic to run
  the file's bytes, and Q8_0 is the same one byte a weight.

A W8A8 checkpoint's activations are not quantized: the kernels take float rows, so the result is
closer to the unquantized model than the W8A8 scheme's own. Refused by name: GPTQ's act-order
(g_idx not in column order: a 32-column block would mix groups), asymmetric int8, bit widths
other than 4 and 8, and compressed-tensors formats other than the three above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from splitserve.engine.gguf_formats import BY_NAME
from splitserve.engine.quant.quantize import quantize_q8_0
from splitserve.engine.quant.weight import QuantizedWeight

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds column 8c + _AWQ_ORDER[i]


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's quantized linear layers are stored (config.json's quantization_config)."""

    method: str  # "gptq" | "awq" | "compressed-tensors" | "fp8"
    bits: int  # 4 or 8
    kind: str  # "int" | "float"
    group_size: int  # columns a scale covers; 0: a whole row (per channel), -1: the whole tensor
    symmetric: bool
    marker: str  # the tensor whose presence marks a quantized linear ("qweight", "weight_scale", ...)
    ignore: tuple[str, ...] = ()  # module names kept in floats (compressed-tensors' "ignore")
    gptq_v1_zeros: bool = True  # GPTQ's original format stores each zero point minus one

    @property
    def describe(self) -> str:
        group = {0: "per channel", -1: "per tensor"}.get(self.group_size, f"groups of {self.group_size}")
        return f"{self.method} {self.kind}{self.bits}, {'symmetric' if self.symmetric else 'zero points'}, {group}"

    def tensor_names(self, prefix: str, present: Callable[[str], bool]) -> list[str] | None:
        """The checkpoint's tensors of the linear layer `prefix` (".weight" removed), or None where it
        is kept in floats (an ignored module, a head the quantizer skipped)."""
        if any(prefix == i or prefix.endswith("." + i) for i in self.ignore):
            return None
        if not present(f"{prefix}.{self.marker}"):
            return None
        if self.method in ("gptq", "awq"):
            return [f"{prefix}.{n}" for n in ("qweight", "qzeros", "scales")]
        if self.method == "fp8":
            return [f"{prefix}.weight", f"{prefix}.weight_scale_inv"]
        names = [f"{prefix}.{'weight_packed' if self.bits == 4 else 'weight'}", f"{prefix}.weight_scale"]
        if not self.symmetric:
            names.append(f"{prefix}.weight_zero_point")
        return names

    def repack(self, prefix: str, t: Mapping[str, Tensor]) -> QuantizedWeight:
        """The linear layer's tensors (named as `tensor_names` gives them) as one QuantizedWeight."""
        get: Callable[[str], Tensor] = lambda n: t[f"{prefix}.{n}"]  # noqa: E731
        if self.method == "gptq":
            return _gptq(self, get("qweight"), get("qzeros"), get("scales"))
        if self.method == "awq":
            return _awq(get("qweight"), get("qzeros"), get("scales"))
        if self.method == "fp8":
            return _fp8(get("weight"), get("weight_scale_inv"))
        if self.kind == "float":
            return _fp8(get("weight"), get("weight_scale"))
        if self.bits == 8:
            return _int8(get("weight"), get("weight_scale"))
        # both stored unsigned (q + 8, z + 8): w = s * (q - z) is the same on them
        zp = None if self.symmetric else _unpack_rows(get("weight_zero_point"), 4)  # [n, groups]
        codes = _unpack_cols(get("weight_packed"), 4)
        return _int4(codes, get("weight_scale"), zp)


def scheme_of(quantization_config: Mapping[str, Any] | None) -> Scheme | None:
    """The checkpoint's scheme, None for a float checkpoint; ValueError naming what is not supported."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq_scheme(qc)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("bits", 4) != 4 or not qc.get("zero_point", True):
            raise ValueError(f"AWQ {version} with bits={qc.get('bits')}: only the 4-bit GEMM layout is supported")
        return Scheme("awq", 4, "int", _group(qc.get("group_size", 128)), False, "qweight")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or list(block) != [128, 128]:
            raise ValueError(f"fp8 with weight_block_size={block}: only 128x128 blocks are supported")
        return Scheme("fp8", 8, "float", 128, True, "weight_scale_inv")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise ValueError(f"quantization method {method!r} is not supported (gptq, awq, compressed-tensors and fp8 are)")


def _group(size: Any) -> int:
    g = int(size if size is not None else -1)
    if g > 0 and g % 32:
        raise ValueError(f"group_size {g}: groups must be whole 32-column blocks")
    return 0 if g <= 0 else g


def _gptq_scheme(qc: dict[str, Any]) -> Scheme:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with bits={bits}: only 4 and 8 bits are supported")
    if qc.get("desc_act"):
        raise ValueError(
            "GPTQ with desc_act=true (act-order): its column groups are not in column order; "
            "quantize with desc_act=false"
        )
    sym = bool(qc.get("sym", True))
    if bits == 8 and not sym:
        raise ValueError("GPTQ 8-bit with sym=false: asymmetric int8 weights are not supported")
    v1 = str(qc.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    return Scheme("gptq", bits, "int", _group(qc.get("group_size", 128)), sym, "qweight", gptq_v1_zeros=v1)


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Scheme:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups: exactly one is supported")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    fmt = str(group.get("format") or qc.get("format") or "")
    bits, kind, sym = int(w.get("num_bits", 0)), str(w.get("type", "int")), bool(w.get("symmetric", True))
    strategy = str(w.get("strategy", "channel"))
    ok = {("pack-quantized", 4, "int"), ("int-quantized", 8, "int"), ("naive-quantized", 8, "int")}
    ok |= {("float-quantized", 8, "float"), ("naive-quantized", 8, "float")}
    if (fmt, bits, kind) not in ok:
        raise ValueError(f"compressed-tensors format {fmt!r} with {kind}{bits} weights is not supported")
    if bits == 8 and kind == "int" and not sym:
        raise ValueError("compressed-tensors asymmetric int8 weights are not supported")
    size = {"channel": 0, "tensor": -1, "block": 128}.get(strategy)
    if strategy == "group":
        size = _group(w.get("group_size"))
    if size is None or (strategy == "block" and list(w.get("block_structure") or []) != [128, 128]):
        raise ValueError(f"compressed-tensors strategy {strategy!r} is not supported")
    ignore = tuple(qc.get("ignore") or ())
    return Scheme("compressed-tensors", bits, kind, size, sym, "weight_scale", ignore=ignore)


# ---------------------------------------------------------------- unpacking


def _unpack_cols(packed: Tensor, bits: int) -> Tensor:
    """int32 [r, c] holding 32/bits values each, value i in bits i*bits.. -> uint8 [r, c * 32/bits]."""
    per = 32 // bits
    p = packed.to(torch.int32)
    out = torch.stack([(p >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
    return out.reshape(p.shape[0], -1).to(torch.uint8)


def _unpack_rows(packed: Tensor, bits: int) -> Tensor:
    """The same along rows: int32 [r, c] -> uint8 [r * 32/bits, c]."""
    return _unpack_cols(packed.T.contiguous(), bits).T.contiguous()


def _check_columns(k: int, scales: Tensor) -> None:
    groups = scales.shape[-1] if scales.dim() == 2 else 1
    if k % 32 or (k // 32) % groups:
        raise ValueError(f"{k} columns in {groups} scale groups: each group must be whole 32-column blocks")


def _per_block(s: Tensor, n: int, k: int) -> Tensor:
    """Scales [n, groups] (or [n, 1], or one) spread to one per 32-column block: [n, k / 32]."""
    s = s.float().reshape(n, -1) if s.numel() > 1 else s.float().reshape(1, 1).expand(n, 1)
    return s.repeat_interleave(k // 32 // s.shape[1], dim=1)


def _int4(codes: Tensor, scales: Tensor, zeros: Tensor | None) -> QuantizedWeight:
    """codes uint8 [n, k] in 0..15, scales [n, groups], zeros [n, groups] (None: 8) -> Q4_0 or Q4_1."""
    n, k = codes.shape
    _check_columns(k, scales)
    d = _per_block(scales, n, k).to(torch.float16)
    pairs = codes.reshape(n, k // 32, 2, 16)
    qs = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)  # GGUF: element j low nibble, j + 16 high
    head = [d.view(torch.uint8).reshape(n, -1, 2)]
    fmt = BY_NAME["Q4_0"]
    if zeros is not None:
        m = (-_per_block(zeros, n, k) * d.float()).to(torch.float16)
        head.append(m.view(torch.uint8).reshape(n, -1, 2))
        fmt = BY_NAME["Q4_1"]
    blocks = torch.cat([*head, qs], dim=-1).reshape(n, -1).contiguous()
    return QuantizedWeight.of(fmt, blocks, k)


def _int8(q: Tensor, scales: Tensor) -> QuantizedWeight:
    """int8 [n, k] and scales [n, groups] -> Q8_0 (w = s * q)."""
    n, k = q.shape
    _check_columns(k, scales)
    d = _per_block(scales, n, k).to(torch.float16)
    qs = q.to(torch.int8).reshape(n, k // 32, 32).view(torch.uint8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), qs], dim=-1).reshape(n, -1).contiguous()
    return QuantizedWeight.of(BY_NAME["Q8_0"], blocks, k)


def _fp8(w: Tensor, scale: Tensor) -> QuantizedWeight:
    """FP8 [n, k] with a scale per tensor, row ([n, 1]) or 128x128 block -> Q8_0, re-encoded."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"{k} columns: FP8 weights are re-encoded in 32-column blocks")
    x = w.float()
    if scale.numel() == 1 or scale.shape[0] == n:
        x = x * scale.float().reshape(-1, 1)
    else:  # [ceil(n/128), ceil(k/128)]
        s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        x = x * s
    return QuantizedWeight.of(BY_NAME["Q8_0"], quantize_q8_0(x), k)


def _gptq(sc: Scheme, qweight: Tensor, qzeros: Tensor, scales: Tensor) -> QuantizedWeight:
    """GPTQ: qweight int32 [k / per, n] packed along k, qzeros [groups, n / per], scales [groups, n]."""
    codes = _unpack_rows(qweight, sc.bits).T.contiguous()  # [n, k]
    zeros = _unpack_cols(qzeros, sc.bits).to(torch.int32).T  # [n, groups]
    if sc.gptq_v1_zeros:
        zeros = (zeros + 1) & ((1 << sc.bits) - 1)
    s = scales.T.contiguous()
    if sc.bits == 8:
        if not bool((zeros == 128).all()):
            raise ValueError("GPTQ 8-bit zero points other than 128: asymmetric int8 weights are not supported")
        return _int8((codes.to(torch.int16) - 128).to(torch.int8), s)
    sym = bool((zeros == 8).all())
    return _int4(codes, s, None if sym else zeros)


def _awq(qweight: Tensor, qzeros: Tensor, scales: Tensor) -> QuantizedWeight:
    """AWQ (GEMM): qweight int32 [k, n / 8] and qzeros [groups, n / 8], nibbles in _AWQ_ORDER."""
    undo = torch.tensor(_AWQ_ORDER).argsort()

    def unpack(p: Tensor) -> Tensor:
        u = _unpack_cols(p, 4).reshape(p.shape[0], -1, 8)
        return u[:, :, undo].reshape(p.shape[0], -1)

    return _int4(unpack(qweight).T.contiguous(), scales.T.contiguous(), unpack(qzeros).T.contiguous())
