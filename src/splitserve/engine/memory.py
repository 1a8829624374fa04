"""What one worker will hold in memory, from the model's header and the engine's config alone,
before anything loads: the weights in the format they will run in, the KV pool and the host KV
tier, the activations of its largest step, and the process itself.

`serve --model` of an 8B-shape Q4_0 GGUF with no flags inflated the file to bfloat16 in each of
its two workers and drove a 24 GB machine down to 1.4 GB available in 106 s, with no message,
before anyone stopped it. The start-time checks (cluster/preflight.py for `serve`, the worker's
own for `splitserve worker`) add these figures up per node and refuse in seconds what cannot fit.

Weights cost a node in one of two ways, so they are counted apart:
- private: copied into the worker (a GGUF's blocks dequantized into --dtype, a checkpoint cast to
  it, a float matrix quantized at load): every worker pays them;
- mapped: block-format matrices computed in place over the file's mapping (--quantization auto):
  the page cache holds them once for every worker on the node that maps the same file.

Pure but for reading the model's header (a GGUF's tensor table, safetensors' JSON headers; never
the weights).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from splitserve.engine.problems import Check, Problem

if TYPE_CHECKING:  # torch's modules, loaded only when a figure is asked for
    from splitserve.engine.config import EngineConfig, ModelConfig

# The worker process itself with no model in it: Python, torch and its thread pools, gRPC, the
# C++ kernels, the tokenizer. Measured on SmolLM2 decode workers (`splitserve worker`, RSS once
# listening, less the weights, KV pool and activations counted here): 0.34 GB (float32, the blocks
# inflated), 0.43 GB (bfloat16 inflated, 256 blocks), 0.33 GB (bfloat16, --quantization auto, the
# mapped blocks also taken out); rounded up.
RUNTIME_BYTES = 512 << 20
# A step's activations in float32, per token of the step: the residual stream and its norm, q, k,
# v and the attention output, gate, up and their product, with room for the matmuls' outputs.
_ACTIVATION_FLOATS_PER_TOKEN = ("hidden", 6), ("intermediate", 4)

# Fewer KV blocks than this is no fix worth naming: 64 blocks of 16 tokens is one 1,024-token prompt.
MIN_BLOCKS = 64


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes one worker holds; `mapped_weights` is shared by the workers of a node that map one file."""

    private_weights: int  # copied into the process, in the format they run in (or their peak at load)
    mapped_weights: int  # computed in place over the file's pages
    kv_pool: int  # every layer's blocks, all ranks
    kv_host_tier: int  # evicted prefix blocks kept in RAM (--kv-host-tier-mib)
    activations: int  # the largest step's, float32
    runtime: int = RUNTIME_BYTES

    @property
    def private(self) -> int:
        """What this worker alone adds to its node."""
        return self.private_weights + self.kv_pool + self.kv_host_tier + self.activations + self.runtime

    def parts(self) -> str:
        """The private sum written out, for a message."""
        named = (
            ("weights", self.private_weights),
            ("KV pool", self.kv_pool),
            ("host KV tier", self.kv_host_tier),
            ("activations", self.activations),
            ("runtime", self.runtime),
        )
        return " + ".join(f"{gib(n)} {what}" for what, n in named if n)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class ModelFile:
    """What the count needs of a model, read from its header once: its shapes, and its weights as
    elements that are always dequantized (or cast) into --dtype, and matrices the kernels can run on
    as they are stored (their elements, and their bytes in the file)."""

    model: ModelConfig
    dense_elements: int
    block_elements: int
    block_bytes: int
    blocks_mapped: bool  # a GGUF's blocks stay in the file's pages; a checkpoint's are read in

    def weight_bytes(self, cfg: EngineConfig) -> tuple[int, int]:
        """(private, mapped) under `cfg`: --quantization none dequantizes every block into --dtype; a
        float matrix quantized at load (q8_0, q4_k) is counted at its dense size, the peak before the
        blocks replace it."""
        size = cfg.torch_dtype.itemsize
        if cfg.quantization == "none":
            return (self.dense_elements + self.block_elements) * size, 0
        mapped = self.block_bytes if self.blocks_mapped else 0
        return self.dense_elements * size + self.block_bytes - mapped, mapped


def read_model_file(path: str | None) -> ModelFile:
    """The model at `path` (None: the default model), read from its header: a GGUF's tensor table,
    a checkpoint's safetensors headers (a ModelLoadError if they cannot be read)."""
    from splitserve.engine import embedded
    from splitserve.engine.preflight import read_model_config

    model = read_model_config(path)
    resolved = embedded.resolve(None if path is None else os.fspath(path))
    if os.path.isdir(resolved):
        return _hf_file(Path(resolved), model)
    return _gguf_file(resolved, model)


def _gguf_file(path: str, model: ModelConfig) -> ModelFile:
    """Each tensor as gguf_loader.load_gguf_weights places it: a matrix in a block format the
    kernels take (not an expert's) can stay in the file; every other tensor is dequantized."""
    from splitserve.engine import gguf_loader
    from splitserve.engine.models import declare, registry

    names = declare.gguf_to_hf(registry.for_config(model), model)
    dense = elements = stored = 0
    for t in gguf_loader.open_gguf(path).tensors:
        decl = names.get(t.name)
        if decl is None:  # rope factors, folded into the config
            continue
        if not decl[1].experts and gguf_loader.kept_format(t, gguf_loader.tensor_shape(t)) is not None:
            elements += int(t.n_elements)
            stored += int(t.n_bytes)
        else:
            dense += int(t.n_elements)
    return ModelFile(model, dense, elements, stored, blocks_mapped=True)


def _hf_file(path: Path, model: ModelConfig) -> ModelFile:
    """A Hugging Face checkpoint's tensors, read into the process: a float one cast to --dtype; a
    quantized one (config.json's quantization_config) as its files hold it, else dequantized into
    the model's parameters."""
    from splitserve.engine.hf_loader import read_scheme
    from splitserve.engine.models import declare, registry

    elements = stored = 0
    for f in sorted(path.glob("*.safetensors")):
        for name, entry in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            elements += math.prod(entry["shape"])
            start, end = entry["data_offsets"]
            stored += end - start
    if read_scheme(str(path)) is None:
        return ModelFile(model, elements, 0, 0, blocks_mapped=False)
    params = declare.param_count(registry.for_config(model), model)
    return ModelFile(model, 0, params, stored, blocks_mapped=False)


def kv_pool_bytes(model: ModelConfig, cfg: EngineConfig) -> int:
    """The KV pool the engine allocates: --kv-cache-bytes, else --num-blocks blocks."""
    from splitserve.engine.config import kv_dtype_name
    from splitserve.engine.kv_cache import KVLayout

    if cfg.kv_cache_bytes:
        return cfg.kv_cache_bytes
    layout = KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=cfg.block_size,
        dtype=kv_dtype_name(cfg.kv_cache_dtype, cfg.dtype),
        tp_size=1,
        windows=(),
        model_fingerprint=b"",
    )
    return cfg.num_blocks * model.num_layers * layout.bytes_per_block


def activation_bytes(model: ModelConfig, cfg: EngineConfig) -> int:
    """A step of max_num_batched_tokens tokens through one layer at a time, and the logits of
    max_num_seqs rows."""
    width = {"hidden": model.hidden_size, "intermediate": model.intermediate_size}
    per_token = sum(width[what] * n for what, n in _ACTIVATION_FLOATS_PER_TOKEN)
    return 4 * (cfg.max_num_batched_tokens * per_token + cfg.max_num_seqs * model.vocab_size)


def worker_memory(file: ModelFile, cfg: EngineConfig) -> WorkerMemory:
    """One worker's bytes for the model `file` under `cfg`."""
    private, mapped = file.weight_bytes(cfg)
    return WorkerMemory(
        private_weights=private,
        mapped_weights=mapped,
        kv_pool=kv_pool_bytes(file.model, cfg),
        kv_host_tier=cfg.kv_host_tier_bytes,
        activations=activation_bytes(file.model, cfg),
    )


def _safetensors_header(f: Path) -> dict[str, dict[str, list[int]]]:
    """A safetensors file's JSON header: its 8-byte little-endian length, then the JSON."""
    with f.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, dict[str, list[int]]] = json.loads(fh.read(n))
    return header


def available_memory() -> int:
    """What this machine can still give (/proc/meminfo's MemAvailable: free memory and the page cache
    that can be dropped), in bytes; 0 where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Pool(NamedTuple):
    """Workers of one role on one node, each running `engine`."""

    role: str
    workers: int
    engine: EngineConfig


def node_bytes(pools: Sequence[tuple[Pool, WorkerMemory]], others: int) -> int:
    """A node's need: each worker's private bytes, the mapped weights once (one file, one page
    cache), and `others` (processes beside the workers: the router, `serve` itself)."""
    private = sum(pool.workers * mem.private for pool, mem in pools)
    mapped = max((mem.mapped_weights for pool, mem in pools if pool.workers), default=0)
    return private + mapped + others


def fit_problems(
    path: str | None, pools: Sequence[Pool], available: int, others: int, fewer_workers: str
) -> list[Problem]:
    """Workers that a node of `available` bytes cannot hold, as one Problem with the arithmetic and
    the flags that would make them fit, each with what it would need; [] when they fit, and on a GPU,
    where the weights and the KV pool are the device's (its own checks are the engine's). Reads the
    model's header (engine/preflight.py has said already when it cannot be read at all)."""
    pools = [p for p in pools if p.workers and not p.engine.device.startswith("cuda")]
    if not pools or available <= 0:
        return []
    from splitserve.engine.loaded_model import ModelLoadError

    try:  # the header read once, for every pool and every alternative below
        file = read_model_file(path)
    except ModelLoadError as e:  # a header the shape checks read but this count cannot: said, not raised
        return [Problem(Check.MODEL, f"model {e}", "give --model a GGUF file or a Hugging Face directory")]
    sized = [(p, worker_memory(file, p.engine)) for p in pools]
    need = node_bytes(sized, others)
    if need <= available:
        return []
    terms = [f"{p.workers} {p.role} worker{'s' if p.workers > 1 else ''} x ({m.parts()})" for p, m in sized]
    mapped = max(m.mapped_weights for _, m in sized)
    terms += [f"{gib(mapped)} of the file's blocks, mapped once"] if mapped else []
    terms += [f"{gib(others)} for the router and serve"] if others else []
    fixes = []
    if any(p.engine.quantization == "none" for p in pools):
        auto = [(p, worker_memory(file, replace(p.engine, quantization="auto"))) for p in pools]
        if (need_auto := node_bytes(auto, others)) < need:
            fixes.append(f"--quantization auto, which computes the file's blocks in place ({gib(need_auto)})")
    # the KV pools scale with --num-blocks: the count that leaves them the room the rest leaves
    kv = sum(p.workers * m.kv_pool for p, m in sized)
    blocks = max(p.engine.num_blocks for p in pools)
    sized_by_blocks = kv and not any(p.engine.kv_cache_bytes for p in pools)
    if sized_by_blocks and (fit := int(blocks * (available - need + kv) / kv)) >= MIN_BLOCKS:
        fixes.append(f"--num-blocks {fit} (from {blocks})")
    # fewer workers only where one alone fits (a 70B file's blocks alone are more than the machine)
    if (
        sum(p.workers for p in pools) > 1
        and min(node_bytes([(p._replace(workers=1), m)], others) for p, m in sized) <= available
    ):
        fixes.append(f"fewer workers ({fewer_workers})")
    who = "the workers need" if sum(p.workers for p in pools) > 1 else "the worker needs"
    what = f"{who} {gib(need)} of memory and this machine has {gib(available)} available: " + " + ".join(terms)
    weights = min(m.private_weights + m.mapped_weights for _, m in sized)
    fix = "; or ".join(fixes)
    if not fix:
        fix = "run on a machine with more memory"
        if weights > available:
            fix = f"a smaller file (its weights alone take {gib(weights)}), or {fix}"
    return [Problem(Check.MEMORY, what, fix)]
