"""Speculative decoding gives exactly the tokens of plain decode: greedy and seeded, in batches
that mix speculating and plain sequences, under preemption, with logprobs, penalties,
min_tokens and stop tokens, n > 1, a grammar, and across a migration (a handoff carries tokens
only); and the engine's blocks all come back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import GrammarSpec, SamplingParams

pytestmark = pytest.mark.timeout(180)

CFG = tiny_model_config(num_layers=3)
WEIGHTS = random_weights(CFG, seed=11)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def mixed(n: int, max_tokens: int = 40) -> list[SamplingParams]:
    """Greedy and seeded sampled requests by turns: greedy on a random tiny model soon loops, and
    every draft of it is accepted; a sampled request's drafts are also rejected, often."""
    return [
        replace(GREEDY, max_tokens=max_tokens)
        if i % 2
        else replace(GREEDY, max_tokens=max_tokens, temperature=4.0, seed=i)
        for i in range(n)
    ]


def copying_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (a draft finds its n-grams) and plain random ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (3, 9, 17, 30, 45):
        text = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        out.append(text + text + text[: n // 2])
    out += [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (1, 12, 60)]
    return out


def engine(mode: str = "off", **kw: object) -> Engine:
    cfg = EngineConfig(**{"num_blocks": 256, "speculative": mode, **kw})  # type: ignore[arg-type]
    return Engine(CFG, WEIGHTS, cfg)


def run(e: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> dict:
    """Every sample's (tokens, logprobs) by (request, sample index); the engine ends empty."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        e.add_request(f"r{i}", p, sp)
    got: dict = {}
    while e.has_work:
        for o in e.step():
            toks, lps = got.setdefault((o.request_id, o.sample_index), ([], []))
            toks.append(o.token_id)
            lps.append(o.logprob)
    assert not e.scheduler.requests and e.blocks.num_free_blocks == e.blocks.num_blocks
    return got


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_greedy_output_is_plain_decode_s_for_a_batch_of_copying_and_plain_prompts(mode):
    prompts = copying_prompts()
    params = [replace(p, max_tokens=m) for p, m in zip(mixed(8), (40, 7, 33, 40, 2, 40, 25, 40), strict=True)]
    expected = run(engine(), prompts, params)
    e = engine(mode)
    assert run(e, prompts, params) == expected
    it = e.drain_iteration_stats()
    assert it.draft_tokens > it.accepted_draft_tokens > 0  # drafts ran, some paid, some were rejected


def test_each_prompt_alone_and_all_together_match_plain_decode():
    prompts = copying_prompts(seed=3)
    params = mixed(len(prompts))
    expected = run(engine(), prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone = run(engine("ngram"), [p], sp)
        assert alone[("r0", 0)] == expected[(f"r{i}", 0)]


def test_requests_joining_while_others_speculate_keep_their_tokens():
    prompts = copying_prompts(seed=4)
    params = mixed(len(prompts))
    expected = run(engine(), prompts, params)
    e = engine("ngram", max_num_batched_tokens=32)
    got: dict = {}
    pending = list(enumerate(prompts))
    while pending or e.has_work:
        if pending:
            i, p = pending.pop(0)
            e.add_request(f"r{i}", p, params[i])
        for o in e.step():
            toks, lps = got.setdefault((o.request_id, 0), ([], []))
            toks.append(o.token_id)
            lps.append(o.logprob)
    assert got == expected


def test_preemption_under_block_pressure_keeps_the_tokens():
    prompts = copying_prompts(seed=5)[:5]
    params = mixed(5, max_tokens=60)
    expected = run(engine(), prompts, params)
    e = engine("ngram", num_blocks=16, block_size=16, max_num_batched_tokens=64)
    assert run(e, prompts, params) == expected
    assert e.scheduler.num_preemptions > 0


def test_seeded_sampling_logprobs_penalties_min_tokens_and_stop_tokens_match_plain_decode():
    prompts = copying_prompts(seed=6)[:6]
    params = [
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, logprobs=True, top_logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, min_tokens=20, stop_token_ids=(7, 9, 11, 13)),
        SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=9, logit_bias=((3, 5.0),), ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    expected = run(engine(), prompts, params)
    e = engine("ngram")
    assert run(e, prompts, params) == expected
    assert e.drain_iteration_stats().accepted_draft_tokens > 0


def test_a_stop_token_inside_an_accepted_draft_ends_the_sequence_there():
    prompt = copying_prompts(seed=7)[3]
    plain = run(engine(), [prompt], GREEDY)[("r0", 0)][0]
    stop = plain[len(plain) // 2]  # a token the greedy output reaches midway
    params = replace(GREEDY, ignore_eos=False, stop_token_ids=(stop,))
    expected = run(engine(), [prompt], params)
    assert expected[("r0", 0)][0][-1] == stop
    assert run(engine("ngram"), [prompt], params) == expected


def test_n_samples_fork_and_each_matches_plain_decode():
    prompts = copying_prompts(seed=8)[2:4]
    params = SamplingParams(max_tokens=25, temperature=0.8, seed=3, n=3, ignore_eos=True)
    expected = run(engine(), prompts, params)
    assert len(expected) == 6
    assert run(engine("ngram"), prompts, params) == expected


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True)])
def test_a_migrated_request_continues_with_the_tokens_of_an_uninterrupted_run(params):
    """The handoff holds tokens only: the next engine derives its drafts from them."""
    prompt = copying_prompts(seed=9)[4]
    whole = run(engine(), [prompt], params)[("r0", 0)][0]
    first = engine("ngram")
    first.add_request("m", prompt, params)
    sent: list[int] = []
    while len(sent) < 15:
        sent += [o.token_id for o in first.step()]
    first.abort("m")
    second = engine("ngram")
    second.add_request("m", prompt, params, output_token_ids=sent)
    rest: list[int] = []
    while second.has_work:
        rest += [o.token_id for o in second.step()]
    assert sent + rest == whole


def test_speculation_off_drafts_nothing():
    e = engine("off")
    run(e, copying_prompts()[:3], GREEDY)
    assert e.speculator is None and e.drain_iteration_stats().draft_tokens == 0


def test_bad_speculation_settings_are_named():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(ngram_min=3, ngram_max=2)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Engine, Engine]:
    plain = Engine.from_path(None, EngineConfig(num_blocks=256), progress=False)[0]
    spec = Engine.from_path(None, EngineConfig(num_blocks=256, speculative="ngram"), progress=False)[0]
    return plain, spec


def test_a_grammar_request_gets_plain_decode_s_tokens_and_its_drafts_are_verified(smollm2):
    plain, spec = smollm2
    tok = plain.tokenizer
    assert tok is not None
    record = {"name": "Ada Lovelace", "city": "London", "born": 1815, "fields": ["mathematics", "computing"]}
    ask = "Copy this JSON object exactly:\n" + json.dumps(record)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "born": {"type": "integer"},
            "fields": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "city", "born", "fields"],
    }
    params = SamplingParams(max_tokens=48, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    expected = run(plain, [prompt], params)
    spec.drain_iteration_stats()
    assert run(spec, [prompt], params) == expected
    it = spec.drain_iteration_stats()
    assert it.accepted_draft_tokens > 0
    text = tok.decode(expected[("r0", 0)][0])
    assert json.loads(text)["name"] == "Ada Lovelace"
