"""A PEFT LoRA directory read into the model's fused slots (engine/lora/adapter.py), known by its
content: the rows each module lands in come from the family's declaration, B carries the scaling,
and what cannot be served is refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from splitserve.engine.lora.adapter import AdapterError, load_peft, module_rows
from splitserve.engine.random_model import tiny_model_config

CFG = tiny_model_config(num_layers=2)
KEY = "base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight"


def _write(path, r=4, alpha=8, modules=("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"), seed=0, **config):
    """A PEFT adapter directory as `save_pretrained` writes one, with random A and B."""
    g = torch.Generator().manual_seed(seed)
    rows = module_rows(CFG)
    tensors = {}
    for layer in range(CFG.num_layers):
        for m in modules:
            _, start, end = rows[m]
            fan_in = CFG.hidden_size if m != "mlp.down_proj" else CFG.intermediate_size
            fan_in = CFG.q_size if m == "self_attn.o_proj" else fan_in
            tensors[KEY.format(layer=layer, module=m, ab="A")] = torch.randn(r, fan_in, generator=g)
            tensors[KEY.format(layer=layer, module=m, ab="B")] = torch.randn(end - start, r, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": [m.split(".")[-1] for m in modules]}
    (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return tensors


def test_each_module_lands_in_its_slots_rows_in_declaration_order():
    rows = module_rows(CFG)
    q, kv, ff = CFG.q_size, CFG.kv_size, CFG.intermediate_size
    assert rows["self_attn.q_proj"] == ("qkv", 0, q)
    assert rows["self_attn.k_proj"] == ("qkv", q, q + kv)
    assert rows["self_attn.v_proj"] == ("qkv", q + kv, q + 2 * kv)
    assert rows["self_attn.o_proj"] == ("o", 0, CFG.hidden_size)
    assert rows["mlp.gate_proj"] == ("gate_up", 0, ff) and rows["mlp.up_proj"] == ("gate_up", ff, 2 * ff)
    assert rows["mlp.down_proj"] == ("down", 0, CFG.hidden_size)


def test_an_adapter_is_read_into_its_slots_with_b_scaled(tmp_path):
    tensors = _write(tmp_path, r=4, alpha=8)
    a = load_peft(str(tmp_path), "tenant-a", CFG, torch.float32)
    assert (a.rank, a.scaling) == (4, 2.0)
    (q, v) = a.parts(1, "qkv")
    assert (q.start, q.end) == (0, CFG.q_size) and v.start == CFG.q_size + CFG.kv_size
    assert torch.equal(q.a, tensors[KEY.format(layer=1, module="self_attn.q_proj", ab="A")])
    assert torch.equal(q.b, 2.0 * tensors[KEY.format(layer=1, module="self_attn.q_proj", ab="B")])
    assert a.parts(0, "o") == () and len(a.parts(0, "gate_up")) == 1
    rs = tmp_path / "rs"
    rs.mkdir()
    _write(rs, r=4, alpha=8, use_rslora=True)
    assert load_peft(str(rs), "rs", CFG, torch.float32).scaling == 8 / math.sqrt(4)


def test_the_id_is_the_content_not_the_name(tmp_path):
    one, two, other = (tmp_path / n for n in ("one", "two", "other"))
    for d in (one, two, other):
        d.mkdir()
    _write(one, seed=1)
    _write(two, seed=1)
    tensors = _write(other, seed=1)
    key = KEY.format(layer=0, module="mlp.up_proj", ab="B")
    tensors[key][0, 0] += 1e-3  # one value
    save_file(tensors, str(other / "adapter_model.safetensors"))
    a = load_peft(str(one), "support-bot", CFG, torch.float32)
    b = load_peft(str(two), "sales-bot", CFG, torch.float32)
    c = load_peft(str(other), "support-bot", CFG, torch.float32)
    assert a.id == b.id and a.id != c.id
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    _write(scaled, seed=1, alpha=16)  # the same tensors, another scaling
    assert load_peft(str(scaled), "x", CFG, torch.float32).id != a.id


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"lora_alpha": "eight"}, "lora_alpha must be a number"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(tmp_path, config, named):
    _write(tmp_path, **config)
    with pytest.raises(AdapterError, match=named):
        load_peft(str(tmp_path), "a", CFG, torch.float32)


def test_a_tensor_that_adapts_nothing_here_a_bad_shape_and_a_rank_too_large_are_refused(tmp_path):
    tensors = _write(tmp_path)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, CFG.hidden_size)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="target no module this model adapts.*lm_head"):
        load_peft(str(tmp_path), "a", CFG, torch.float32)
    del tensors["base_model.model.lm_head.lora_A.weight"]
    tensors[KEY.format(layer=0, module="self_attn.q_proj", ab="B")] = torch.zeros(3, 4)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"q_proj of layer 0 is A \(4, \d+\), B \(3, 4\)"):
        load_peft(str(tmp_path), "a", CFG, torch.float32)
    _write(tmp_path, r=16)
    with pytest.raises(AdapterError, match="rank 16 is more than --max-lora-rank 8"):
        load_peft(str(tmp_path), "a", CFG, torch.float32, max_rank=8)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft(str(empty), "a", CFG, torch.float32)
