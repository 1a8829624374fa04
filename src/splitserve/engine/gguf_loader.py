"""GGUF files: metadata to ModelConfig, tensors to HF-named weights: a matrix in a block
format the CPU kernels compute on (engine/gguf_formats.py) stays in its blocks, mapped from
the file, when the caller asks to keep them; anything else is dequantized.

llama.cpp's converter renames tensors (blk.N.attn_q, ...) and, for some architectures
(llama, mistral), permutes the rows of Q and K so that its rotary kernel can rotate
adjacent pairs; HF's Llama rotates the two halves of each head instead. Each family's
module (engine/models/) declares both names of every tensor and which rows were
permuted; we undo that permutation, exactly as transformers' own GGUF loader does, so
the weights here are interchangeable with a Hugging Face checkpoint's.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import replace
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from splitserve.engine.config import ModelConfig, RopeScaling
from splitserve.engine.gguf_formats import FORMATS, BlockFormat
from splitserve.engine.loaded_model import LoadedModel, ModelLoadError, ProgressLine
from splitserve.engine.models import declare, registry
from splitserve.engine.quant.weight import QuantizedWeight, Weight
from splitserve.engine.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style RoPE scaling, stored as per-frequency divisors
_LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE factors


class _Reader(gguf.GGUFReader):
    # The reader slices its np.memmap once per metadata item, and memmap's per-slice
    # bookkeeping is half of a SmolLM2 load. A plain ndarray view of the same mapping
    # reads the same bytes without it.
    @property  # type: ignore[override]  # a property where the base class has an attribute
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)


def looks_like_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_gguf(path: str, dtype: torch.dtype, progress: bool, keep_blocks: bool = False) -> LoadedModel:
    reader = open_gguf(path)
    meta = read_metadata(reader, path)
    config = model_config_from_gguf(meta, reader, path)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(tokenizer_metadata(meta))
    except ValueError as e:
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding only {config.vocab_size} rows"
        )
    config = replace(config, eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id)
    weights = load_gguf_weights(reader, config, dtype, progress, path, keep_blocks)
    return LoadedModel(config, weights, tokenizer)


def tokenizer_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with what llama.cpp fills in for the file's family where the file leaves it out:
    its chat template, and its end-of-turn token as an end of generation."""
    try:
        family = registry.for_gguf(meta)
    except registry.UnsupportedArchitecture:
        return meta
    out = dict(meta)
    if family.chat_template and not meta.get("tokenizer.chat_template"):
        out["tokenizer.chat_template"] = family.chat_template
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if family.end_of_turn and "tokenizer.ggml.eot_token_id" not in meta and family.end_of_turn in tokens:
        out["tokenizer.ggml.eot_token_id"] = tokens.index(family.end_of_turn)
    return out


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over the file, with every way it can fail turned into ModelLoadError."""
    try:
        reader = _Reader(path, "r")
    except Exception as e:  # the reader fails with whatever numpy/struct raise on a bad header
        raise ModelLoadError(f"{path}: malformed or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
    return reader


def read_metadata(reader: Any, path: str) -> dict[str, Any]:
    """Every key-value field as plain Python values (str, int, float, bool, or lists of them)."""

    def scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.BOOL:
            return bool(part[0])
        if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(part[0])
        return int(part[0])

    meta: dict[str, Any] = {}
    try:
        for name, field in reader.fields.items():
            if not field.types:
                continue
            if field.types[0] == GGUFValueType.ARRAY:
                kind = field.types[-1]
                if kind == GGUFValueType.STRING:
                    meta[name] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                elif kind == GGUFValueType.ARRAY:
                    continue  # nested arrays: nothing we read uses them
                else:
                    meta[name] = [scalar(field.parts[i], kind) for i in field.data]
            else:
                meta[name] = scalar(field.parts[field.data[0]], field.types[0])
    except (UnicodeDecodeError, IndexError, ValueError) as e:
        raise ModelLoadError(f"{path}: malformed GGUF metadata field {name!r} ({e})") from None
    if "general.architecture" not in meta:
        raise ModelLoadError(f"{path}: GGUF metadata lacks general.architecture")
    return meta


def model_config_from_gguf(meta: dict[str, Any], reader: Any, path: str) -> ModelConfig:
    """ModelConfig from the `{arch}.*` metadata keys and the tensors' shapes."""
    arch = meta["general.architecture"]
    try:
        family = registry.for_gguf(meta)
    except registry.UnsupportedArchitecture as e:
        raise ModelLoadError(f"{path}: {e}") from None

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {full}")
        return meta[full]

    def get(key: str) -> Any:  # the file's value, else what llama.cpp fixes for the family
        return meta.get(f"{arch}.{key}", family.gguf_defaults.get(key))

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
    raw = {key: need(key) for key in _REQUIRED_KEYS}
    try:
        hidden, num_heads = int(raw["embedding_length"]), int(raw["attention.head_count"])
        rope_dims = int(meta.get(f"{arch}.rope.dimension_count") or 0)
        head_dim = int(meta.get(f"{arch}.attention.key_length") or (rope_dims if family.gguf_head_dim_from_rope else 0))
        if num_heads > 0 and head_dim == hidden // num_heads:
            head_dim = 0  # let ModelConfig derive it, as HF does when config.json has no head_dim
        rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        full_head = head_dim or hidden // max(num_heads, 1)
        rotary_dim = rope_dims or full_head
        return family.configure(
            ModelConfig(
                # GGUF shapes are innermost-first: token_embd is [hidden, vocab]. The embedding, not the
                # token list, sets the logits' width (converters may pad one or the other).
                vocab_size=int(tensors["token_embd.weight"].shape[-1]),
                hidden_size=hidden,
                num_layers=int(raw["block_count"]),
                num_heads=num_heads,
                num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
                intermediate_size=int(raw["feed_forward_length"]),
                head_dim=head_dim,
                rms_norm_eps=float(raw["attention.layer_norm_rms_epsilon"]),
                rope_theta=rope_theta,
                rope_scaling=_rope_scaling(meta, arch, tensors, rope_theta, rotary_dim, path),
                partial_rotary_factor=rotary_dim / full_head,
                rope_local_theta=float(get("rope.freq_base_swa") or 0.0),
                **_sliding_window(get("attention.sliding_window"), get("attention.sliding_window_pattern"), raw),
                max_position=int(raw["context_length"]),
                tie_embeddings="output.weight" not in tensors,
                attention_bias="blk.0.attn_q.bias" in tensors,
                **_experts(meta, arch, raw),
                name=str(meta.get("general.name") or os.path.basename(path)),
            )
        )
    except ModelLoadError:
        raise
    except (TypeError, ValueError) as e:  # e.g. per-layer head counts (a list), or zero sizes
        raise ModelLoadError(f"{path}: unsupported or inconsistent GGUF metadata: {e}") from None


def _experts(meta: dict[str, Any], arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture of experts, where the file has one."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(meta.get(f"{arch}.expert_used_count") or 0),
        # llama.cpp's llama architecture (Mixtral) gives the experts' width as feed_forward_length
        "moe_intermediate_size": int(meta.get(f"{arch}.expert_feed_forward_length") or raw["feed_forward_length"]),
    }


def _sliding_window(window: Any, pattern: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's window and layer types: llama.cpp applies a window only with a pattern (every
    pattern-th layer global, or one flag per layer, true where windowed)."""
    if not window or pattern is None:
        return {}
    layers = int(raw["block_count"])
    if isinstance(pattern, list):
        windowed = [bool(p) for p in pattern]
    else:
        windowed = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    types = tuple("sliding_attention" if w else "full_attention" for w in windowed)
    return {"sliding_window": int(window), "layer_types": types}


def _rope_scaling(
    meta: dict[str, Any], arch: str, tensors: dict[str, Any], theta: float, head_dim: int, path: str
) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)
    if _LONGROPE[0] in tensors and _LONGROPE[1] in tensors:  # Phi-3's factors, and its attention factor
        short, long = (tuple(np.asarray(tensors[n].data, dtype=np.float64).reshape(-1).tolist()) for n in _LONGROPE)
        return RopeScaling(
            kind="longrope",
            original_max_position=int(meta.get(f"{arch}.rope.scaling.original_context_length") or 4096),
            short_factor=short,
            long_factor=long,
            attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
        )
    if _ROPE_FREQS in tensors:
        return _llama3_scaling_from_freqs(tensors[_ROPE_FREQS], meta, arch, theta, head_dim, path)
    if kind in ("none", "") or factor == 1.0:
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (only linear and llama3)")


def _llama3_scaling_from_freqs(
    tensor: Any, meta: dict[str, Any], arch: str, theta: float, head_dim: int, path: str
) -> RopeScaling:
    """Recover llama3 RoPE parameters from the per-frequency divisors llama.cpp stores instead.

    The converter computes the divisors from (factor, low_freq_factor, high_freq_factor,
    original context); every Llama 3.x release uses 1, 4 and 8192 for the last three, so we take
    the factor from the largest divisor and accept only if recomputing reproduces the tensor.
    """
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    scaling = RopeScaling(kind="llama3", factor=float(divisors.max()), original_max_position=original)
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    expected = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, scaling.factor, 1 / ((1 - smooth) / scaling.factor + smooth)),
    )
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4):
        raise ModelLoadError(f"{path}: {_ROPE_FREQS} does not match llama3 RoPE scaling; unsupported RoPE variant")
    return scaling


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved -> halves per head)."""
    rows_per_half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, rows_per_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in HF's order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(t.shape))


def kept_format(t: Any, shape: tuple[int, ...]) -> BlockFormat | None:
    """The block format the kernels compute a 2-D tensor on in place, None where they cannot (the
    rule the loader keeps blocks by, and engine/memory.py counts them by)."""
    fmt = FORMATS.get(int(t.tensor_type))
    if fmt is None or len(shape) != 2 or shape[1] % fmt.block_elems:
        return None
    return fmt


def _kept_blocks(t: Any, shape: tuple[int, ...]) -> QuantizedWeight | None:
    """A 2-D tensor in a block format the kernels compute on, as a QuantizedWeight over the file's
    mapped bytes (nothing copied); None for any other tensor."""
    fmt = kept_format(t, shape)
    if fmt is None:
        return None
    data = np.asarray(t.data).reshape(shape[0], fmt.row_bytes(shape[1]))
    with warnings.catch_warnings():  # a read-only mapping: the kernels only ever read it
        warnings.simplefilter("ignore", UserWarning)
        return QuantizedWeight.of(fmt, torch.from_numpy(data), shape[1])


def load_gguf_weights(
    reader: Any, cfg: ModelConfig, dtype: torch.dtype, progress: bool, path: str, keep_blocks: bool = False
) -> dict[str, Weight]:
    """Every tensor under its HF name, as the family's module declares it (engine/models/);
    with `keep_blocks`, each matrix in a block format the kernels take as a QuantizedWeight."""
    names = declare.gguf_to_hf(registry.for_config(cfg), cfg)
    line = ProgressLine(os.path.basename(path), cfg.num_layers, progress)
    weights: dict[str, Weight] = {}
    layer_seen = -1
    for t in reader.tensors:
        if t.name == _ROPE_FREQS or t.name in _LONGROPE:
            continue  # folded into config.rope_scaling
        if t.name not in names:
            raise ModelLoadError(f"{path}: unsupported tensor {t.name} for architecture {cfg.architecture!r}")
        name, decl = names[t.name]
        m = _LAYER_TENSOR.fullmatch(t.name)
        if m and int(m.group(1)) != layer_seen:
            layer_seen = int(m.group(1))
            line.update(layer_seen, "layers")
        shape = tensor_shape(t)
        kept = _kept_blocks(t, shape) if keep_blocks and not decl.experts else None
        if kept is not None:
            if decl.gguf_rotary:  # the rows stay in the file; each product's columns are reordered
                heads = cfg.num_heads if decl.gguf_rotary == "q" else cfg.num_kv_heads
                kept = kept.in_row_order(torch.from_numpy(unpermute_rotary_rows(np.arange(shape[0]), heads)))
            weights[name] = kept
            continue
        try:
            if t.tensor_type == GGMLQuantizationType.F32:
                w = np.array(t.data, dtype=np.float32)
            else:
                w = dequantize(t.data, t.tensor_type)
            w = w.reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize tensor {t.name} of type {t.tensor_type.name}: {e}"
            ) from None
        if decl.gguf_rotary:
            w = unpermute_rotary_rows(w, cfg.num_heads if decl.gguf_rotary == "q" else cfg.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)
    line.update(cfg.num_layers, "layers")
    line.close()
    return weights
