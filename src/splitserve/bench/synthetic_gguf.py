"""A model of a large shape that nothing here can download, written as a GGUF file: random
weights in a block format (Q4_0, Q8_0, ...) with the embedded SmolLM2's tokenizer, for the
benchmarks that need the bytes of an 8B model rather than its answers.

    splitserve bench synthetic-gguf --out /tmp/llama8b-q4_0.gguf [--format Q4_0] [--shape llama3-8b]
    splitserve bench synthetic-gguf --out /tmp/llama70b.gguf --format Q4_K_M --shape llama3-70b --sparse

Written the way llama.cpp's tools write one, by the `gguf` package (its writer, its names), so
that llama-server and splitserve load the same file. Each block holds random quants and an fp16
scale of 1 / (std(q) * sqrt(fan_in)), so every matrix keeps a unit-scale input at unit scale
and the forward pass stays finite for any length; the text it writes means nothing.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import gguf
import numpy as np

from splitserve.engine import embedded
from splitserve.engine.gguf_formats import BY_NAME, BlockFormat


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    context: int = 8192
    rope_theta: float = 500000.0


SHAPES = {
    "llama3-8b": Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8),
    "llama3-70b": Shape(hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8),
    "tiny": Shape(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, context=2048),
}
# the spread of a block's quants once the format's offset is taken off (uniform random bytes): the
# root mean square of q - 8 (Q4_0), of q (Q8_0), of sc * q (Q4_K: 6-bit scales, 4-bit quants, its
# min zeroed) and of sc * (q - 32) (Q6_K: int8 scales kept to 0..63, 6-bit quants)
_QUANT_STD = {"Q4_0": 4.61, "Q8_0": 73.9, "Q4_K": 321.0, "Q6_K": 674.0}
# Where llama.cpp's Q4_K_M recipe spends Q6_K (llama-quantize's use_more_bits): the output matrix,
# and attn_v and ffn_down in the first and last eighth of the layers and every third between.
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K")}
FORMATS = sorted([*_QUANT_STD, *MIXES])


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers of a Q4_K_M file whose attn_v and ffn_down are Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument(
        "--format",
        default="Q4_0",
        choices=FORMATS,
        help="every matrix's block format, or Q4_K_M: llama.cpp's mix of Q4_K and Q6_K",
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sparse",
        action="store_true",
        help="the header and a hole for the tensors: what the memory check at start reads, in seconds",
    )


def run(args: argparse.Namespace) -> int:
    size = write(args.out, args.format, SHAPES[args.shape], args.seed, sparse=args.sparse)
    sparse = " (sparse: no tensor bytes on disk)" if args.sparse else ""
    print(f"wrote {args.out}: {size / 1e9:.2f} GB{sparse}, {args.shape} in {args.format}, the embedded tokenizer")
    return 0


def _blocks(rng: np.random.Generator, fmt: BlockFormat, rows: int, cols: int) -> np.ndarray:
    """rows x cols weights as random `fmt` blocks, each scaled so that a unit input stays unit."""
    blocks = cols // fmt.block_elems
    data = rng.integers(0, 256, size=(rows, blocks, fmt.block_bytes), dtype=np.uint8)
    d = np.frombuffer(np.float16(1.0 / (_QUANT_STD[fmt.name] * np.sqrt(cols))).tobytes(), dtype=np.uint8)
    if fmt.name == "Q6_K":  # ql, qh, 16 int8 scales, then d
        data[:, :, 192:208] %= 64
        data[:, :, 208:210] = d
    else:
        data[:, :, 0:2] = d
    if fmt.name == "Q4_K":  # dmin zeroed: no offset to scale against
        data[:, :, 2:4] = 0
    return data.reshape(rows, blocks * fmt.block_bytes)


def _tokenizer_fields(writer: gguf.GGUFWriter) -> int:
    """The embedded SmolLM2's tokenizer and chat template, copied; returns its vocabulary size."""
    reader = gguf.GGUFReader(embedded.model_path(embedded.DEFAULT))
    vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), main, sub)
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    return vocab


def write(path: str, format: str, shape: Shape, seed: int = 0, sparse: bool = False) -> int:
    """Writes the file, every matrix in `format` (a FORMATS name); returns its size in bytes.
    `sparse`: the header and a hole where the tensors' bytes would be (seconds and no disk for an
    8B shape; what reads only the tensor table, such as engine/memory.py's count, sees the real
    file)."""
    base, more = (BY_NAME[f] for f in MIXES.get(format, (format, format)))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    vocab = _tokenizer_fields(w)
    head_dim = shape.hidden // shape.heads
    w.add_name(f"synthetic-{shape.hidden}x{shape.layers}-{format}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)

    def matrix(name: str, rows: int, cols: int, fmt: BlockFormat = base) -> None:
        qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
        if sparse:
            row = fmt.row_bytes(cols)
            w.add_tensor_info(name, (rows, row), np.dtype(np.uint8), rows * row, raw_dtype=qtype)
        else:
            w.add_tensor(name, _blocks(rng, fmt, rows, cols), raw_dtype=qtype)

    def norm(name: str) -> None:
        if sparse:
            w.add_tensor_info(name, (shape.hidden,), np.dtype(np.float32), shape.hidden * 4)
        else:
            w.add_tensor(name, np.ones(shape.hidden, dtype=np.float32))

    kv = shape.kv_heads * head_dim
    matrix("token_embd.weight", vocab, shape.hidden)
    norm("output_norm.weight")
    matrix("output.weight", vocab, shape.hidden, more)
    for i in range(shape.layers):
        extra = more if more_bits(i, shape.layers) else base
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", shape.hidden, shape.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.hidden, extra)
        matrix(f"blk.{i}.attn_output.weight", shape.hidden, shape.hidden)
        matrix(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn, extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if not sparse:
        w.write_tensors_to_file()
        w.close()
        return os.path.getsize(path)
    w.write_ti_data_to_file()
    w.close()
    _extend_to_tensors(path)
    return os.path.getsize(path)


def _extend_to_tensors(path: str) -> None:
    """A header-only GGUF made as long as its tensor table says, with a hole for the tensors: room
    first (the reader maps the whole file and checks every tensor lies inside it), then cut where
    the last tensor ends."""
    from splitserve.engine.gguf_loader import open_gguf

    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + (1 << 40))
    end = max(t.data_offset + int(t.n_bytes) for t in open_gguf(path).tensors)
    with open(path, "r+b") as f:
        f.truncate(end)
