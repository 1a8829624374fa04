"""splitserve bench spec's pieces: the copying load is built from shipped texts and this package's
source, the decode runs of a tiny engine count what they decoded and compare tokens with plain
decode, and the report names a mismatch as a missed target."""

from __future__ import annotations

import pytest
import torch

from splitserve.bench import spec
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

CFG = tiny_model_config(num_layers=2)
WEIGHTS = random_weights(CFG, seed=3)


class WordTokenizer:
    """Enough of the engine's tokenizer for the prompt builders: a chat template and ids per word."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "<user> " + messages[0]["content"]

    def encode(self, text: str) -> list[int]:
        return [hash(w) % CFG.vocab_size for w in text.split()]


def test_the_copying_load_takes_each_kind_by_turns_from_shipped_text_and_source():
    prompts = spec.copy_prompts(WordTokenizer(), 6)  # type: ignore[arg-type]
    assert len(prompts) == 6 and all(len(p) > 20 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 6
    assert spec._typos("aaaa bbbb cccc abcdef eeee ffff gggg hhhh") == "aaaa bbbb cccc acbdef eeee ffff gggg hhhh"


def test_decode_runs_count_their_tokens_and_the_report_checks_identity(capsys, tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() * 2) for n in (5, 9, 14)]
    engines = {m: Engine(CFG, WEIGHTS, EngineConfig(num_blocks=128, speculative=m)) for m in ("off", "ngram")}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = spec._measure(engines, prompts, params, batch=2, repeats=2)
    assert [len(r) for r in runs.values()] == [2, 2]
    assert all(r.tokens == 3 * 11 and r.seconds > 0 for rs in runs.values() for r in rs)
    assert runs["ngram"][0].outputs == runs["off"][0].outputs and runs["ngram"][0].drafted > 0
    out = spec._Tee(str(tmp_path / "spec.txt"))
    assert spec._report(out, "copy", prompts, runs, ["off", "ngram"])[0] == "copy ngram"
    runs["ngram"][1].outputs[0] = [0]  # a mismatch is never a met target, whatever the speed
    assert spec._report(out, "copy", prompts, runs, ["off", "ngram"])[1] is False
    out.close()
    text = (tmp_path / "spec.txt").read_text()
    assert "identical to off's in 6 of 6" in text and "identical to off's in 5 of 6" in text
