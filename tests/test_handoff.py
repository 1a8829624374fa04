"""The handoff record across the engines: every sampling parameter gives the same tokens and
logprobs on one engine (colocated), through a prefill engine and a decode engine joined by the
KV plane (disaggregated), and on an engine that resumes a request from the tokens another
produced (migrated); n > 1 prefills once and forks on the decode side.

Run on the CPU harness (tests/worker_helpers.py): the tiny random model for the parameters, the
default model for grammars (they need its tokenizer)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import SampleState, TokenLogprob
from splitserve.engine.random_model import tiny_model_config
from splitserve.engine.sampling import GrammarSpec, SamplingParams
from splitserve.kv_transfer import metrics as kv_metrics
from tests.worker_helpers import EnginePair, assert_engine_empty
from tests.worker_helpers import tiny_engine as _tiny_engine

pytestmark = pytest.mark.timeout(300)

# Untied embeddings: the tied tiny model puts nearly all its mass on one token (see
# test_seeded_sampling.py), and a sampled parameter could not be told from greedy.
SPREAD = tiny_model_config(tie_embeddings=False)


def tiny_engine(num_blocks: int = 64) -> Engine:
    return _tiny_engine(num_blocks, model_cfg=SPREAD)


def tiny_pair() -> EnginePair:
    return EnginePair.tiny(model_cfg=SPREAD)


PROMPT = [3, 17, 41, 5, 9, 22, 8, 30, 11, 2, 7, 19, 4]  # 13 tokens: a partial last block of 4
N = 12
SEEDED = SamplingParams(max_tokens=N, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)

# every parameter the engine takes, each alone on a seeded and a greedy base
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.05},
    "penalties": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4},
    "logit_bias": {"logit_bias": ((5, 4.0), (9, -100.0))},
    "min_tokens_and_stop": {"min_tokens": 4, "stop_token_ids": (5, 9), "ignore_eos": False},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "n": {"n": 3},
    "prompt_logprobs": {"prompt_logprobs": 2},
}

Samples = dict[int, list[StepOutput]]


def collect(outs: list[StepOutput], into: Samples) -> Samples:
    for o in outs:
        into.setdefault(o.sample_index, []).append(o)
    return into


def tokens(samples: Samples) -> dict[int, list[int]]:
    return {k: [o.token_id for o in v if o.token_id >= 0] for k, v in sorted(samples.items())}


def logprobs(samples: Samples) -> dict[int, list[TokenLogprob | None]]:
    return {k: [o.logprob for o in v if o.token_id >= 0] for k, v in sorted(samples.items())}


def colocated(engine: Engine, prompt: list[int], params: SamplingParams) -> Samples:
    engine.add_request("r", prompt, params)
    out: Samples = {}
    while engine.has_work:
        collect(engine.step(), out)
    assert_engine_empty(engine)
    return out


def disaggregated(pair: EnginePair, prompt: list[int], params: SamplingParams) -> tuple[Samples, list[StepOutput]]:
    """The decode engine's samples, the first token of each taken from the prefill's handoff (as
    the router streams it); and the prefill engine's output (with its handoff)."""
    remote = pair.reserve("r", prompt, params)
    pair.start_prefill("r", prompt, params, remote)
    prefill_outs: list[StepOutput] = []
    while not any(o.finish_reason == "prefill_done" for o in prefill_outs):
        prefill_outs += pair.step_prefill()
    pair.poll_prefill()
    done = next(o for o in prefill_outs if o.finish_reason == "prefill_done")
    assert done.handoff is not None
    out: Samples = {}
    for s in done.handoff.samples:  # what the router sends the client first, from PrefillResult
        lp = s.logprobs[-1] if s.logprobs else None
        first = StepOutput("r", s.output_token_ids[-1], lp, False, None, len(prompt), 0, s.index)
        out[s.index] = [first._replace(prompt_logprobs=done.handoff.prompt_logprobs or None)]
    collect(pair.poll_decode(), {})  # the commit: no tokens of its own
    while pair.decode.has_work:
        collect(pair.decode.step(), out)
    assert_engine_empty(pair.decode)
    assert_engine_empty(pair.prefill)
    return out, prefill_outs


def migrated(engine: Engine, prompt: list[int], params: SamplingParams, whole: Samples, k: int) -> Samples:
    """A fresh engine continuing every sample from its first k tokens (what a migration hands over)."""
    states = [SampleState(i, toks[:k]) for i, toks in tokens(whole).items()]
    engine.add_request("r", prompt, params, samples=states)
    out: Samples = {i: list(whole[i][:k]) for i in whole}
    while engine.has_work:
        collect(engine.step(), out)
    assert_engine_empty(engine)
    return out


@pytest.mark.parametrize("base", [SEEDED, GREEDY], ids=["seeded", "greedy"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_parameter_gives_the_same_tokens_and_logprobs_in_all_three_modes(case, base):
    params = replace(base, **CASES[case])
    whole = colocated(tiny_engine(), PROMPT, params)
    assert len(whole) == params.n
    pair = tiny_pair()
    try:
        remote, _ = disaggregated(pair, PROMPT, params)
    finally:
        pair.close()
    assert tokens(remote) == tokens(whole)
    if not params.logprobs:
        assert all(lp is None for lps in logprobs(remote).values() for lp in lps)
    else:
        for k in whole:
            for a, b in zip(logprobs(remote)[k], logprobs(whole)[k], strict=True):
                assert a is not None and b is not None
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == params.top_logprobs
    if params.prompt_logprobs:
        assert whole[0][0].prompt_logprobs is not None and len(whole[0][0].prompt_logprobs) == len(PROMPT) - 1
        assert remote[0][0].prompt_logprobs is not None
        assert [p.logprob for p in remote[0][0].prompt_logprobs] == pytest.approx(
            [p.logprob for p in whole[0][0].prompt_logprobs], abs=1e-5
        )
    shortest = min(len(t) for t in tokens(whole).values())
    for k in sorted({1, shortest // 2, shortest - 1} - {0}):
        assert tokens(migrated(tiny_engine(), PROMPT, params, whole, k)) == tokens(whole), f"resumed after {k}"


def test_the_table_is_not_vacuous_and_the_old_way_fails_it():
    """The sampled cases differ from greedy, and the old way (the record not carried: n
    prefilled as n requests of index 0, a fresh generator from the seed on the decode side)
    does not give the colocated text."""
    whole = tokens(colocated(tiny_engine(), PROMPT, replace(SEEDED, n=3)))
    assert len({tuple(t) for t in whole.values()}) == 3  # three different seeded samples
    assert whole[0] != tokens(colocated(tiny_engine(), PROMPT, GREEDY))[0]
    old = {k: tokens(colocated(tiny_engine(), PROMPT, SEEDED))[0] for k in range(3)}
    assert old != whole
    # the old decode side: the prefill's first token taken, then a generator seeded afresh that
    # draws token 1 as if it were token 0
    first = whole[0][:1]
    old_rest = tokens(colocated(tiny_engine(), PROMPT + first, replace(SEEDED, max_tokens=N - 1)))[0]
    assert first + old_rest != whole[0]


def test_n4_prefills_once_sends_the_kv_once_and_frees_every_block():
    sent, computed = {}, {}
    for n in (1, 4):
        pair = tiny_pair()
        counted: list[int] = []
        schedule = pair.prefill.scheduler.schedule

        def spy(now, cap=None, schedule=schedule, counted=counted):  # the prefill engine's computed tokens
            batch = schedule(now, cap)
            if batch is not None:
                counted.extend(batch.num_new_tokens)
            return batch

        pair.prefill.scheduler.schedule = spy  # type: ignore[method-assign]
        before = kv_metrics.BYTES_SENT.labels(transport="tcp")._value.get()
        try:
            out, _ = disaggregated(pair, PROMPT, replace(SEEDED, n=n))
        finally:
            pair.close()
        sent[n] = kv_metrics.BYTES_SENT.labels(transport="tcp")._value.get() - before
        computed[n] = sum(counted)
        assert len(out) == n
    assert computed[4] == computed[1] == len(PROMPT)
    assert sent[4] == sent[1] > 0


def test_cancelling_an_n4_request_mid_stream_frees_all_four():
    e = tiny_engine()
    e.add_request("r", PROMPT, replace(SEEDED, n=4, max_tokens=50))
    for _ in range(3):
        e.step()
    assert len(e.scheduler.groups["r"]) == 4
    assert e.abort("r")
    assert_engine_empty(e)


def test_one_sample_stopped_frees_its_own_blocks_and_the_others_go_on():
    """The router ended sample 2 on a stop string: the worker stops it alone."""
    params = replace(SEEDED, n=3, max_tokens=20)
    whole = tokens(colocated(tiny_engine(), PROMPT, params))
    e = tiny_engine()
    e.add_request("r", PROMPT, params)
    out: Samples = {}
    for _ in range(3):
        collect(e.step(), out)
    free_before = e.blocks.num_free_blocks
    assert e.abort_sample("r", 2)
    assert not e.abort_sample("r", 2)  # gone already
    assert e.blocks.num_free_blocks > free_before  # its partial block (the prompt's are shared)
    while e.has_work:
        collect(e.step(), out)
    got = tokens(out)
    assert got[0] == whole[0] and got[1] == whole[1]
    assert got[2] == whole[2][: len(got[2])] and len(got[2]) < len(whole[2])
    assert_engine_empty(e)


def test_a_fork_without_a_free_block_waits_and_is_recomputed_with_the_same_tokens():
    params = replace(SEEDED, n=4)
    roomy = tokens(colocated(tiny_engine(num_blocks=64), PROMPT, params))
    tight = tokens(colocated(tiny_engine(num_blocks=8), PROMPT, params))  # 4 blocks of prompt: forks queue
    assert tight == roomy


@pytest.fixture(scope="module")
def smollm2() -> tuple[Engine, Engine, Engine]:
    cfg = EngineConfig(num_blocks=128, block_size=16)
    return tuple(Engine.from_path(None, cfg, progress=False)[0] for _ in range(3))  # type: ignore[return-value]


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "grammar",
    [
        GrammarSpec("json_schema", json.dumps(SCHEMA)),
        GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"),
        GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])),
    ],
    ids=lambda g: g.kind,
)
def test_a_grammar_travels_in_the_handoff_and_holds_in_every_mode(smollm2, grammar):
    colo, prefill, decode = smollm2
    tok = colo.tokenizer
    assert tok is not None
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A person, as JSON, please."}]))
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=11, grammar=grammar, n=2, logprobs=True)
    whole = colocated(colo, prompt, params)
    pair = EnginePair.of(prefill, decode)
    try:
        remote, _ = disaggregated(pair, prompt, params)
    finally:
        pair.close()
    assert tokens(remote) == tokens(whole)
    # a migration hands over unfinished samples only: at most all but the last (end) token
    k = min(3, *(len(t) - 1 for t in tokens(whole).values()))
    resumed = migrated(colo, prompt, params, whole, k)
    assert tokens(resumed) == tokens(whole)
    # the old way: the grammar not carried past the first tokens
    assert tokens(migrated(colo, prompt, replace(params, grammar=None), whole, k)) != tokens(whole)
    for k, ids in tokens(whole).items():
        assert whole[k][-1].finish_reason == "stop", f"sample {k} did not finish its grammar in 96 tokens"
        text = tok.decode(ids)
        if grammar.kind == "json_schema":
            value = json.loads(text)
            assert set(value) == set(SCHEMA["required"]) and set(value["pets"]) <= {"cat", "dog", "fish"}
        elif grammar.kind == "regex":
            assert __import__("re").fullmatch(grammar.source, text), text
        else:
            assert text in ("yes", "no", "maybe")
