"""The model families' conformance suite (issue 30): every family in engine/models/, as a
tiny seeded model built offline from transformers' own classes, loaded from a Hugging Face
directory and from a GGUF file, computes transformers' eager float32 logits within 1e-4 on
a prompt longer than the prefill chunk, and generates its greedy tokens through the engine."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.engine import Engine
from splitserve.engine.model import DecoderModel
from splitserve.engine.models import registry
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from tests.family_helpers.build import FAMILY_NAMES, build, family, save_gguf, save_hf_dir
from tests.family_helpers.logits import chunked_logits

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

CHUNK = 32  # the prefill chunk: the prompt below spans three of them
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))


def _saved(name: str, fmt: str, directory, tokenizer):
    hf = build(name, seed=11)
    hf_dir = save_hf_dir(hf, str(directory / name), tokenizer)
    if fmt == "safetensors":
        return hf, hf_dir
    if family(name).gguf_arch is None:
        pytest.skip(f"the gguf package cannot write {name}")
    return hf, save_gguf(name, hf, hf_dir, str(directory / f"{name}.gguf"))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_family_is_registered_under_its_checkpoint_names():
    for name in FAMILY_NAMES:
        arch = registry.for_hf_model_type(family(name).config().model_type)
        assert arch.name == name


def test_gemma3_query_scale_from_a_gguf_file_as_llama_cpp_takes_it():
    """A GGUF file has no query_pre_attn_scalar: head_dim's, except the 27B's (62 layers), whose
    is hidden / heads = 168, as llama.cpp fixes it; a config.json's own value is kept."""
    arch = registry.for_hf_model_type("gemma3_text")

    def gemma(layers: int, scalar: float = 0.0) -> ModelConfig:
        return arch.configure(
            ModelConfig(
                vocab_size=262208,
                hidden_size=5376,
                intermediate_size=21504,
                num_layers=layers,
                num_heads=32,
                num_kv_heads=16,
                head_dim=128,
                query_pre_attn_scalar=scalar,
            )
        )

    assert gemma(62).attention_scale == pytest.approx(168**-0.5)
    assert gemma(34).attention_scale == pytest.approx(128**-0.5)
    assert gemma(62, 144.0).attention_scale == pytest.approx(144**-0.5)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_logits_match_transformers(name, fmt, tmp_path, tokenizer):
    hf, path = _saved(name, fmt, tmp_path, tokenizer)
    loaded = load_model(path, torch.float32, progress=False)
    model = DecoderModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    tokens = _tokens(90, seed=5)
    ours = chunked_logits(model, tokens, prompt_len=75, chunk=CHUNK)
    with torch.inference_mode():
        theirs = hf(torch.tensor([tokens])).logits[0].float()
    err = (ours - theirs).abs().max().item()
    assert err < TOLERANCE, f"{name} from {fmt}: logits differ by {err:.2e} (scale {theirs.abs().max():.1f})"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_tokens_match_transformers(name, tmp_path, tokenizer):
    hf, path = _saved(name, "safetensors", tmp_path, tokenizer)
    loaded = load_model(path, torch.float32, progress=False)
    engine = Engine(
        loaded.config, loaded.weights, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=CHUNK)
    )
    prompts = [_tokens(n, seed=n) for n in (1, 17, 70)]
    ours = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert got == out[0, len(prompt) :].tolist(), name
