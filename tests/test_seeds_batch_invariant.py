"""A seed gives one text whatever was batched with it (issue 45): on the default engine (the tuned
dtype, the embedded GGUF's blocks computed in place, no engine flag), six seeded prompts prefilled and
decoded together give each prompt's text alone, at 1 thread and at 2. The blocks' kernel gives a row
its bits whatever shares the call (tests/test_quant_kernels.py); before it, the short prompts of this
check differed from their first tokens, because a prefill's logits depended on its batch.

And the prompts arriving one by one while the others decode (steps that mix decode rows with a
prefill) give the same texts: with --batch-invariant on (the default) those steps run their decode
rows as a pure decode step; with it off, the texts part. Across modes and a migration, through real
workers: tests/test_e2e_seeds.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve.cli import build_parser
from splitserve.engine.engine import Engine
from splitserve.engine.flags import engine_config_from_args
from splitserve.engine.kernels import quant
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.router.engine_tokenizer import EngineTokenizer

pytestmark = pytest.mark.timeout(600)

QUESTIONS = (
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU cache is in one paragraph.",
    "Tell me a short story about a robot who learns to paint, in a few sentences.",
)


def _default_engine(*flags: str) -> tuple[Engine, EngineTokenizer]:
    argv = ["worker", "--role", "decode", "--num-blocks", "512", *flags]
    cfg = engine_config_from_args(build_parser(argv).parse_args(argv), "decode")
    if cfg.torch_dtype is not torch.bfloat16 or not (quant.available() and quant._ext().bf16()):
        pytest.skip("the default here is not bf16 activations on the AVX-512 BF16 block kernel")
    loaded = load_model(None, cfg.torch_dtype, progress=False, quantization=cfg.quantization)
    return Engine(loaded.config, loaded.weights, cfg, tokenizer=loaded.tokenizer), EngineTokenizer(loaded.tokenizer)


@pytest.fixture(scope="module")
def engine() -> Any:
    e, tok = _default_engine()
    yield e, tok
    e.close()


PARAMS = SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True)


def _staggered(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt added three steps after the one before: its prefill shares steps with their decodes."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        e.add_request(f"s{i}", p, PARAMS)
        for _ in range(3):
            for o in e.step():
                out.setdefault(o.request_id, []).append(o.token_id)
    while e.has_work:
        for o in e.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return [[t for t in out[f"s{i}"] if t >= 0] for i in range(len(prompts))]


def test_six_seeded_prompts_together_give_each_prompts_text_alone_at_any_thread_count(engine):
    e, tok = engine
    prompts = [tok.encode_chat([("user", q)]) for q in QUESTIONS]
    params = PARAMS
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [e.generate([p], params)[0] for p in prompts]
        torch.set_num_threads(2)
        together = e.generate(prompts, params)
    finally:
        torch.set_num_threads(before)
    same = [a == t for a, t in zip(alone, together, strict=True)]
    assert all(same), f"{sum(same)} of {len(same)} prompts gave their text alone"
    assert len({tuple(t) for t in together}) == len(prompts)  # six texts, not one repeated


def test_prompts_arriving_while_others_decode_keep_their_texts_unless_batch_invariance_is_off(engine):
    e, tok = engine
    prompts = [tok.encode_chat([("user", q)]) for q in QUESTIONS]
    alone = [e.generate([p], PARAMS)[0] for p in prompts]
    assert _staggered(e, prompts) == alone
    off, _ = _default_engine("--batch-invariant", "off")
    try:
        parted = sum(a != b for a, b in zip(_staggered(off, prompts), alone, strict=True))
    finally:
        off.close()
    assert parted > 0  # what the default prevents: the mixed steps' decode rows took the torch path


def test_a_seeded_request_resumed_with_its_outputs_continues_its_text(engine):
    """As after a migration: both samples of a seeded n=2 request handed over with their first six
    tokens each, while a long prompt prefills beside them (steps of single-token rows and a chunk,
    none of which samples: such a step once failed to index its empty logits), go on to the texts of
    the run that was never interrupted."""
    from splitserve.engine.handoff import SampleState

    e, tok = engine
    prompt = tok.encode_chat([("user", QUESTIONS[4])])
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=3, n=2, ignore_eos=True)
    e.add_request("whole", prompt, params)
    whole = _by_sample(e)
    first, second = whole[("whole", 0)], whole[("whole", 1)]
    e.add_request("resumed", prompt, params, samples=[SampleState(0, first[:6]), SampleState(1, second[:6])])
    long_prompt = tok.encode_chat([("user", " ".join(QUESTIONS) * 20)])  # longer than a step's chunk
    assert len(long_prompt) > e.cfg.max_num_batched_tokens
    e.add_request("beside", long_prompt, PARAMS)
    resumed = _by_sample(e)
    assert [w[:6] + resumed[("resumed", k)] for k, w in enumerate((first, second))] == [first, second]


def _by_sample(e: Engine) -> dict[tuple[str, int], list[int]]:
    """Every token of the engine's requests until it is idle, by (request, sample index)."""
    out: dict[tuple[str, int], list[int]] = {}
    while e.has_work:
        for o in e.step():
            if o.token_id >= 0:
                out.setdefault((o.request_id, o.sample_index), []).append(o.token_id)
    return out


def test_a_mixed_step_runs_as_one_pass_with_the_bits_of_two(engine, monkeypatch):
    """The default engine joins a mixed step's decode rows and prefill chunks in one pass over the
    weights (the model's `joins`: every matrix on its row-wise kernel, attention apart), where it ran
    them as two passes: the staggered texts are those of the two passes, and of each prompt alone."""
    e, tok = engine
    prompts = [tok.encode_chat([("user", q)]) for q in QUESTIONS]
    alone = [e.generate([p], PARAMS)[0] for p in prompts]
    model = e.runner.model
    forward = model.forward
    joined: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        rows = args[6] if len(args) > 6 else kwargs.get("decode_rows", 0)
        if rows:
            joined.append(rows)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    assert _staggered(e, prompts) == alone
    assert joined, "no mixed step ran as one pass"
    monkeypatch.setattr(model, "joins", lambda *args: False)
    count = len(joined)
    assert _staggered(e, prompts) == alone  # two passes each
    assert len(joined) == count


@pytest.mark.parametrize("cap", [3, 5])
def test_prompts_prefilled_in_capped_chunks_beside_decodes_keep_their_texts(engine, monkeypatch, cap):
    """The ITL budget cuts a decode worker's local prompts into chunks of a few tokens, not on block
    boundaries, beside prefix hits: a prompt's last token alone in its chunk, or a chunk of one-token
    rows, is still a prefill row (attended as a prefill attends). Once, as a decode row, its K/V took
    the decode kernel's bits and a seeded text parted from its run alone three tokens later."""
    e, tok = engine
    prompts = [tok.encode_chat([("user", q)]) for q in QUESTIONS]
    alone = [e.generate([p], PARAMS)[0] for p in prompts]
    monkeypatch.setattr(e.itl_budget, "prefill_tokens", lambda: cap)
    monkeypatch.setattr(e.itl_budget, "target_s", None)  # on, whatever the flags said
    assert _staggered(e, prompts) == alone
