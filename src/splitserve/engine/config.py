"""Frozen configuration of the model and of one engine process.

`ModelConfig` is what the weights say (shapes, RoPE, norms); `EngineConfig` is
what the operator chose (device, dtype, cache size, batching limits). Both are
validated once in `__post_init__` and never mutated; derived values are
properties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.engine.itl_budget import parse_itl_target
from splitserve.engine.prefill_order import PREFILL_ORDERS

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name ("bf16", "float32", ...) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


# --kv-cache-dtype's choices; "auto" is the model's dtype. int8 and fp8 (e4m3) are quantized
# with scales beside the values (engine/kv_cache.py has the format).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")  # canonical names of the quantized storage dtypes
# --quantization's choices (EngineConfig.quantization)
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_k")
# --batch-invariant's choices (EngineConfig.batch_invariant)
BATCH_INVARIANCE = ("on", "strict", "off")
_KV_ALIASES = {"int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def kv_dtype_name(kv_cache_dtype: str, model_dtype: str | torch.dtype) -> str:
    """The canonical storage dtype name of a KV cache: "float32", "bfloat16", "float16" (the
    model's dtype for "auto"), "int8" or "fp8_e4m3". ValueError for anything else."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        return dtype_name(parse_dtype(model_dtype))
    if name in _KV_ALIASES:
        return _KV_ALIASES[name]
    try:
        return dtype_name(parse_dtype(name))
    except ValueError:
        choices = list(KV_CACHE_DTYPES)
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; expected one of {choices}") from None


SPECULATIVE_MODES = ("ngram", "auto", "off")  # --speculative's choices (engine/spec/)
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the MLP gate's activation (ModelConfig.hidden_act)
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")  # a layer's attention kind, in HF's words


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF's `rope_scaling` (linear, llama3 and longrope kinds).

    longrope (Phi-3/4): each frequency divided by its factor, `short_factor` at positions below
    `original_max_position` and `long_factor` from there on, cos and sin times
    `attention_factor`. Chosen per position, so a cached key is never re-rotated and a token's
    rotation does not depend on its batch: transformers switches a whole forward pass to the
    long factors once any position reaches the original context (the same rotations for every
    decode step and for prompts below it, the only ones its own cache sees consistently)."""

    kind: str = "none"  # "none" | "linear" | "llama3" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3", "longrope"):
            raise ValueError(f"unsupported rope_scaling type {self.kind!r}")
        if self.factor <= 0:
            raise ValueError("rope_scaling.factor must be positive")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope needs short_factor and long_factor of one length (rotary_dim / 2)")

    @staticmethod
    def from_hf(d: dict[str, Any] | None, max_position: int = 0) -> RopeScaling:
        """`max_position`: the model's context, which with longrope's original one sets its
        attention factor where the config gives none (as transformers computes it)."""
        if not d:
            return RopeScaling()
        kind = d.get("rope_type", d.get("type", "none")) or "none"
        if kind == "default":
            return RopeScaling()
        original = int(d.get("original_max_position_embeddings", 8192))
        if kind == "longrope":
            factor = float(d.get("factor") or (max_position / original if max_position else 1.0))
            attention = d.get("attention_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            return RopeScaling(
                kind=kind,
                factor=factor,
                original_max_position=original,
                short_factor=tuple(float(x) for x in d["short_factor"]),
                long_factor=tuple(float(x) for x in d["long_factor"]),
                attention_factor=float(attention),
            )
        return RopeScaling(
            kind=kind,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position=original,
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder. `architecture` names its family's module
    (engine/models/), which declares the tensors; the traits below are what the forward
    pass reads of the family."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 8192
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm of q and of k before RoPE
    # A mixture of experts in every layer's MLP (Mixtral, Qwen3-MoE); 0: a dense MLP. Each token
    # runs through its router's top num_experts_per_tok experts of moe_intermediate_size each,
    # weighted by their softmax probabilities (renormalized over the top k with norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma)
    # Gemma 3: the attention's and the MLP's outputs are normed before their residual adds
    # (post_attn_norm, post_mlp_norm), beside the norms before each (input_norm, post_norm)
    sandwich_norms: bool = False
    embedding_scale: float = 1.0  # Gemma: the embedding rows times sqrt(hidden_size), in the model's dtype
    query_pre_attn_scalar: float = 0.0  # attention's scale is its -1/2 power (0: head_dim's, as most families)
    # Sliding-window attention: a windowed layer's query at position p sees keys p - window + 1 .. p.
    # layer_types names each layer's kind ("sliding_attention" or "full_attention", HF's words);
    # empty with a window: every layer is windowed (Mistral's first release).
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # RoPE's base on the windowed layers (Gemma 3's 10,000; 0: rope_theta)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim of each head's dims (Phi-4-mini: 0.75)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    architecture: str = "llama"  # the family (engine/models/registry.py), which sets the traits above

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f} must be positive, got {getattr(self, f)}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be divisible by num_heads when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"a mixture of experts needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                f"({self.num_experts}) and a positive moe_intermediate_size ({self.moe_intermediate_size})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unknown layer type(s) {sorted(unknown)} (supported: {', '.join(LAYER_TYPES)})")
        if self.sliding_window < 0:
            raise ValueError("sliding_window must be >= 0 (0: no window)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int:
        """The sliding window of layer `layer` in tokens; 0: it attends to the whole context."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window

    @property
    def windows(self) -> tuple[int, ...]:
        """Every layer's `window`."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf(d: dict[str, Any], name: str = "model") -> ModelConfig:
        """The fields every family's `config.json` spells alike (the family's module adds its
        traits: engine/models/declare.py's `Architecture.configure`). RoPE's base and scaling
        come from transformers 5's `rope_parameters` or from the older top-level keys."""
        eos = d.get("eos_token_id")
        if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step") or 1) != 1:
            raise ValueError(
                "dense MLP layers among mixture-of-experts ones (mlp_only_layers, decoder_sparse_step): unsupported"
            )
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        rope = d.get("rope_parameters") or {}
        local_rope: dict[str, Any] = {}
        if "full_attention" in rope:  # transformers 5: one set per layer type (Gemma 3)
            rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
        scaling = rope if rope.get("rope_type", "default") != "default" else d.get("rope_scaling")
        act = d.get("hidden_act") or d.get("hidden_activation") or "silu"
        window, layer_types = _sliding_window(d)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            return ModelConfig(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=int(d["num_attention_heads"]),
                num_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                intermediate_size=int(d["intermediate_size"]),
                head_dim=int(d.get("head_dim") or 0),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope.get("rope_theta") or d.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_hf(scaling, int(d.get("max_position_embeddings", 8192))),
                max_position=int(d.get("max_position_embeddings", 8192)),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                num_experts=experts,
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if experts else 0,
                moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if experts else 0,
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                hidden_act=_HF_ACTS.get(act, act),
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 0.0),
                sliding_window=window,
                layer_types=layer_types,
                rope_local_theta=float(local_rope.get("rope_theta") or d.get("rope_local_base_freq") or 0.0),
                partial_rotary_factor=float(d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None


def _sliding_window(d: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """config.json's window and the layers it applies to: every layer where it names no layer
    types, none where `use_sliding_window` is false (Qwen2 writes a window it does not use)."""
    window = int(d.get("sliding_window") or 0)
    if not window or d.get("use_sliding_window") is False:
        return 0, ()
    types = tuple(d.get("layer_types") or ())
    pattern = int(d.get("sliding_window_pattern") or 0)  # Gemma 3's older configs: every pattern-th layer is full
    if not types and pattern:
        n = int(d["num_hidden_layers"])
        types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))
    if types and "sliding_attention" not in types:
        return 0, ()
    return window, types


@dataclass(frozen=True)
class EngineConfig:
    """What one engine process runs with. One instance per process, never mutated."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 2048  # KV cache capacity in blocks
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per step; prompts longer than this are chunked
    # A prompt with more than this many tokens left to prefill yields its place in a step to a
    # waiting prompt of at most this many, and takes what the step has left (0: strict arrival
    # order, as vLLM by default). Bounds the TTFT of short prompts that arrive behind a long one.
    long_prefill_token_threshold: int = 0
    # Which waiting prompt starts first (engine/prefill_order.py, applied by the scheduler):
    # "shortest" remaining, aged, fairly across tenants; or "arrival" order.
    prefill_order: str = "shortest"
    enable_prefix_caching: bool = True
    # A model of windowed and global layers keeps its KV in pages whose windowed part goes back to
    # the pool once every window has passed it (engine/kv_groups.py); False: one row per layer, the
    # whole context held for every layer (what `splitserve bench windows` compares against).
    hybrid_kv_cache: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    use_cuda_graphs: bool = True
    seed: int = 0
    # Processes (ranks) that split every layer's heads and MLP between them (engine/parallel/);
    # on CUDA one GPU each, from `device`'s on. The model's heads, KV heads and intermediate
    # size must divide by it (checked when the engine loads the model).
    tensor_parallel_size: int = 1
    # The KV pool's storage dtype: "auto" (the model's), "bfloat16", "float32", "int8" or "fp8"
    # (e4m3); the quantized ones keep a scale per token and KV head (engine/kv_cache.py).
    kv_cache_dtype: str = "auto"
    # The KV pool in bytes (all layers, every rank's shard): when set, num_blocks is what fits in
    # them in kv_cache_dtype (engine/kv_cache.py: pool_blocks); 0: num_blocks as given.
    kv_cache_bytes: int = 0
    # Tiers behind the prefix cache (engine/kv_tiers.py): bytes of evicted cached blocks kept in
    # RAM, and on disk under `kv_disk_tier_dir` ("": a temporary directory); 0 turns a tier off.
    kv_host_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_dir: str = ""
    # Speculative decoding (engine/spec/): "ngram" verifies prompt-lookup drafts of up to
    # num_speculative_tokens in every decode step, "auto" only where the measured acceptance pays
    # for the draft's rows at the measured step costs, "off" never. The n-gram matched is the
    # longest of ngram_max down to ngram_min tokens.
    speculative: str = "off"
    num_speculative_tokens: int = 4
    # The weights' format (engine/quant/): "auto" computes a GGUF file's block-format matrices
    # (Q4_0 .. Q8_0, Q4_K .. Q6_K) on their blocks where the CPU kernels run, "none" dequantizes
    # them into `dtype`; "q8_0" and "q4_k" also quantize float matrices at load.
    quantization: str = "none"
    # What keeps a row's result from depending on the rows that share its step (BATCH_INVARIANCE):
    # "on": a step mixing decode rows with prefill chunks runs its decode rows as a pure decode step
    # (model_runner.py's `_forward_apart`) and a seeded request recomputes its output tokens one a
    # step after a migration or preemption (scheduler.py's `step_tokens`), so that with the block
    # kernel (a row's bits whatever shares the call, up to kernel.max_rows) a seed gives one text in
    # every mode; "strict": also every prefill row of a quantized matrix on the kernel, past
    # max_rows too (vLLM's VLLM_BATCH_INVARIANT), at the kernel's pace rather than a GEMM's; "off":
    # mixed steps whole, and resumed outputs in chunks.
    batch_invariant: str = "on"
    # What a step beside decode rows may last (engine/itl_budget.py): "auto", two decode steps of
    # this worker's; milliseconds; "off": the whole chunk. Its prompt tokens are capped to fit. A
    # worker's flag defaults to "auto" (ITL_TARGET_FLAG_DEFAULT); an engine built in code (offline
    # generation, the tests) is "off": the cap follows measured times, so its steps would too.
    itl_target: str = "off"
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        parse_itl_target(self.itl_target)
        if self.batch_invariant not in BATCH_INVARIANCE:
            raise ValueError(f"batch_invariant must be one of {BATCH_INVARIANCE}, got {self.batch_invariant!r}")
        self._check_speculation()
        kv_dtype_name(self.kv_cache_dtype, self.dtype)
        if self.kv_cache_bytes < 0:
            raise ValueError("kv_cache_bytes must be >= 0 (0: num_blocks decides)")
        if self.kv_host_tier_bytes < 0 or self.kv_disk_tier_bytes < 0:
            raise ValueError("kv tier sizes must be >= 0")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.tensor_parallel_size <= 0:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_batched_tokens < self.block_size or self.max_num_batched_tokens % self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be a positive multiple "
                f"of block_size ({self.block_size}) so that prefill chunks end on block boundaries"
            )

    def _check_speculation(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.ngram_min < 1 or self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be >= 1 and ngram_max ({self.ngram_max}) >= ngram_min")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_dtype(self) -> str:
        """The KV pool's canonical storage dtype name (kv_cache_dtype with "auto" resolved)."""
        return kv_dtype_name(self.kv_cache_dtype, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
