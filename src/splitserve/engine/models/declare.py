"""How a model module declares its decoder, and everything that reads the declaration.

A family is one module under `engine/models/` with one `Architecture`: the names it goes
by (HF `model_type`, GGUF `general.architecture`), the traits it fixes in `ModelConfig`
(q/k norm, q/k/v bias), and its tensors, each declared once as a `TensorDecl`: its name in
a Hugging Face checkpoint and in llama.cpp's GGUF spelling, the model's slot it lands in
(parts of one slot are concatenated in declaration order: q, k and v into `qkv`), its
shape, how tensor parallelism splits it, how the random-weight factory draws it.

What reads it, and nothing else spells a layer out:

- the loaders: `expected_shapes` (the shape check, which tensors a checkpoint must hold)
  and `gguf_to_hf` (llama.cpp's names, and the rows it permuted for its rotary kernel);
- the model (`engine/model.py`): `layer_slots` fuses a layer's tensors into its slots;
- tensor parallelism (`engine/parallel/shard.py`): `TensorDecl.split`;
- the random model of the benchmarks and the tests (`engine/random_model.py`): `TensorDecl.init`;
- the planner (`plan/shapes.py`): `param_count`.

Shapes are in HF's `[out, in]` orientation; GGUF lists its dimensions innermost first,
and the GGUF loader reverses them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from splitserve.engine.config import ModelConfig
from splitserve.engine.quant.weight import Weight, cat_rows

# How tensor parallelism splits a tensor (engine/parallel/shard.py): by rows (column-parallel:
# the rank's heads or its slice of the MLP) or by columns (row-parallel: the input is the rank's
# slice, the output a partial sum), or not at all.
# "eff": an expert's MLP width (moe_intermediate_size), split in every expert alike; "qkv" and
# "gate_up": a checkpoint's own fusion of those (Phi-3), each part split as its own would be.
Split = Literal[
    "whole", "q_rows", "kv_rows", "ff_rows", "q_cols", "ff_cols", "eff_rows", "eff_cols", "qkv_rows", "gate_up_rows"
]
# How engine/random_model.py draws it: a weight matrix (std fan_in ** -0.5), a norm's gain (1 + 0.1 n),
# a bias (0.1 n), the embedding (n, so that its rows are of unit scale).
Init = Literal["matrix", "norm", "bias", "embedding"]
Shape = Callable[[ModelConfig], tuple[int, ...]]


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class TensorDecl:
    hf: str  # in a layer: the name after "model.layers.{i}."
    gguf: str  # llama.cpp's; in a layer: the name after "blk.{i}."
    slot: str  # the model's slot (engine/model.py's LayerWeights field, or a global's)
    shape: Shape
    split: Split = "whole"
    init: Init = "matrix"
    present: Callable[[ModelConfig], bool] = _always  # e.g. a bias only some configs have
    # llama.cpp's converter permuted these rows ("q" or "k" heads) so that its rotary kernel
    # rotates adjacent pairs; HF rotates the two halves of each head. The loader undoes it.
    gguf_rotary: Literal["", "q", "k"] = ""
    # One tensor per expert in an HF checkpoint (`hf` holds "{e}."); the engine, like llama.cpp's
    # GGUF, keeps them stacked, [num_experts, ...], under `hf` without the "{e}." (`name`).
    experts: bool = False
    # Added to an HF checkpoint's values at load: Gemma stores a norm's gain as w for 1 + w, which
    # llama.cpp's GGUF (and the engine) hold as 1 + w.
    hf_add: float = 0.0

    @property
    def name(self) -> str:
        """The engine's name (in a layer: after "model.layers.{i}."): a stack for `experts`."""
        return self.hf.replace("{e}.", "") if self.experts else self.hf

    def checkpoint_names(self, full: str, cfg: ModelConfig) -> list[str]:
        """The names an HF checkpoint holds the tensor `full` (the engine's full name) under."""
        if not self.experts:
            return [full]
        prefix = full[: len(full) - len(self.name)]
        return [prefix + self.hf.replace("{e}", str(e)) for e in range(cfg.num_experts)]


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    globals: tuple[TensorDecl, ...]  # the embedding, the final norm, lm_head
    layer: tuple[TensorDecl, ...]  # one decoder layer's
    # ModelConfig fields the family fixes whatever its config file says (Qwen2: q/k/v bias)
    traits: Mapping[str, Any] = field(default_factory=dict)
    # Which GGUF files of `gguf_architectures` are this family's (llama.cpp writes Mixtral as
    # "llama" with expert tensors): a test of the file's metadata.
    gguf_matches: Callable[[Mapping[str, Any]], bool] = lambda meta: True
    # GGUF metadata (after "{arch}.") that llama.cpp fixes for the family instead of writing it
    # (Gemma 3: every sixth layer global, a local RoPE base of 10,000)
    gguf_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Whether llama.cpp's rope.dimension_count is the head's width (where key_length is absent):
    # not for a partial rotary (Phi-3's is the rotary width; its head is hidden / heads)
    gguf_head_dim_from_rope: bool = True
    # What the tokenizer takes from the family where the file leaves it out, as llama.cpp does:
    # the chat template, and the token that ends an assistant's turn (Gemma's "<end_of_turn>")
    chat_template: str | None = None
    end_of_turn: str | None = None
    # traits that follow from the shapes (Gemma: the embedding scale is sqrt(hidden_size))
    derive: Callable[[ModelConfig], Mapping[str, Any]] = lambda cfg: {}

    def tensors(self, cfg: ModelConfig) -> dict[str, TensorDecl]:
        """Every tensor a model of `cfg` has, by its full name in the engine (HF's, experts stacked)."""
        out = {d.name: d for d in self.globals if d.present(cfg)}
        for i in range(cfg.num_layers):
            out.update({f"model.layers.{i}.{d.name}": d for d in self.layer if d.present(cfg)})
        return out

    def configure(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this family's model: its name and its fixed and derived traits."""
        cfg = replace(cfg, architecture=self.name, **self.traits)
        return replace(cfg, **self.derive(cfg))


def expected_shapes(arch: Architecture, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config needs, by HF name, in HF's [out, in] orientation."""
    return {name: d.shape(cfg) for name, d in arch.tensors(cfg).items()}


def param_count(arch: Architecture, cfg: ModelConfig, active: bool = False) -> int:
    """The model's parameters, each tensor counted once (a tied lm_head is the embedding); with
    `active`, those one token runs through (num_experts_per_tok of each layer's experts)."""
    total = 0
    for d in arch.tensors(cfg).values():
        n = 1
        for dim in d.shape(cfg):
            n *= dim
        if active and d.experts:
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        total += n
    return total


def gguf_to_hf(arch: Architecture, cfg: ModelConfig) -> dict[str, tuple[str, TensorDecl]]:
    """llama.cpp's name of every tensor (with ".weight"/".bias" as GGUF writes them) -> (HF name, declaration)."""
    out = {d.gguf: (d.name, d) for d in arch.globals if d.present(cfg)}
    for i in range(cfg.num_layers):
        out.update({f"blk.{i}.{d.gguf}": (f"model.layers.{i}.{d.name}", d) for d in arch.layer if d.present(cfg)})
    return out


def layer_slots(arch: Architecture, cfg: ModelConfig, get: Callable[[str], Weight], layer: int) -> dict[str, Weight]:
    """Layer `layer`'s tensors, each read by name through `get`, fused into the model's slots:
    each slot's parts' rows concatenated in declaration order (q, k, v into `qkv`; gate, up into
    `gate_up`, an expert stack's per expert)."""
    parts: dict[str, list[Weight]] = {}
    for d in arch.layer:
        if d.present(cfg):
            parts.setdefault(d.slot, []).append(get(f"model.layers.{layer}.{d.name}"))
    return {slot: ts[0] if len(ts) == 1 else cat_rows(ts) for slot, ts in parts.items()}
