"""LoRA adapters in the engine (issue 46, the engine's part): a request naming a loaded adapter
gives the tokens of the base weights with its update merged in, on the torch path (prefill), the
fused decode kernels and a joined mixed step; base rows and the rows of two adapters share steps
and each gives its text alone; and KV computed with one adapter's weights is never another's
prefix hit, a reload under the same name included."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

CFG = tiny_model_config(num_layers=2)
BASE = random_weights(CFG, seed=11)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8


def _fan(module: str) -> tuple[int, int]:
    """(out, in) of a module of CFG."""
    h, q, kv, ff = CFG.hidden_size, CFG.q_size, CFG.kv_size, CFG.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ff, h),
            "up_proj": (ff, h), "down_proj": (h, ff)}[module]  # fmt: skip


def _adapter(path, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT directory of a rank-4 adapter of every module; returns its (A, B) by HF weight name."""
    g = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for layer in range(CFG.num_layers):
        for m in MODULES:
            out, fan_in = _fan(m)
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            a = torch.randn(RANK, fan_in, generator=g) * 0.2
            b = torch.randn(out, RANK, generator=g) * 0.2
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            pairs[f"model.layers.{layer}.{part}.{m}.weight"] = (a, b)
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES)})
    )
    return pairs


def _merged(pairs) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in: W + (alpha / r) B @ A."""
    merged = dict(BASE)
    for name, (a, b) in pairs.items():
        merged[name] = BASE[name] + (ALPHA / RANK) * (b @ a)
    return merged


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in (7, 19, 40, 3)]


def _engine(weights=BASE) -> Engine:
    return Engine(CFG, weights, EngineConfig(num_blocks=128, block_size=8))


def _run(e: Engine, requests: list[tuple[list[int], str | None]], stagger: int = 0) -> list[list[int]]:
    """Each (prompt, adapter)'s greedy tokens, added together or `stagger` steps apart."""
    out: dict[str, list[int]] = {}
    for i, (prompt, adapter) in enumerate(requests):
        e.add_request(f"r{i}", prompt, GREEDY, adapter=adapter)
        for _ in range(stagger):
            for o in e.step():
                out.setdefault(o.request_id, []).append(o.token_id)
    while e.has_work:
        for o in e.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return [[t for t in out[f"r{i}"] if t >= 0] for i in range(len(requests))]


def test_an_adapters_tokens_are_the_merged_weights_and_batches_mix_base_and_adapters(tmp_path):
    one, two = _adapter(tmp_path / "one", seed=1), _adapter(tmp_path / "two", seed=2)
    prompts = _prompts()
    merged_one = _run(_engine(_merged(one)), [(p, None) for p in prompts])
    merged_two = _run(_engine(_merged(two)), [(p, None) for p in prompts])
    base = _run(_engine(), [(p, None) for p in prompts])
    e = _engine()
    e.load_lora("one", str(tmp_path / "one"))
    e.load_lora("two", str(tmp_path / "two"))
    assert [_run(e, [(p, "one")])[0] for p in prompts] == merged_one  # alone: prefill, then fused decode
    assert merged_one != base and merged_one != merged_two  # the updates change the text
    mixed = [(p, a) for p in prompts for a in (None, "one", "two")]
    want = [t for i in range(len(prompts)) for t in (base[i], merged_one[i], merged_two[i])]
    assert _run(e, mixed) == want  # together
    assert _run(e, mixed, stagger=2) == want  # prompts beside decodes: joined mixed steps


def test_kv_of_one_adapter_is_never_anothers_prefix_hit_a_reload_included(tmp_path):
    _adapter(tmp_path / "a", seed=1)
    _adapter(tmp_path / "b", seed=2)
    e = _engine()
    e.load_lora("a", str(tmp_path / "a"))
    prompt = _prompts()[2]  # 40 tokens: five full blocks of 8

    sent: list[str] = []

    def cached(adapter: str | None) -> int:
        """The prompt's tokens the prefix cache gave a request of `adapter`."""
        sent.append(f"q{len(sent)}")
        seq = e.add_request(sent[-1], prompt, GREEDY, adapter=adapter)
        while e.has_work:
            e.step()
        return seq.num_cached_tokens

    assert cached(None) == 0
    assert cached("a") == 0  # the base model's blocks are not the adapter's
    assert cached("a") == 32  # its own: every full block but the last token's
    assert cached(None) == 32
    e.load_lora("a", str(tmp_path / "b"))  # the same name, other weights
    assert cached("a") == 0
    with pytest.raises(ValueError, match=r"adapter 'c' is not loaded \(loaded: a\)"):
        e.add_request("x", prompt, GREEDY, adapter="c")
