"""The parity table on real processes (issue 20): for every kind of request the handoff record
carries (a grammar with logprobs, n samples with logit_bias and min_tokens, penalties), the
tokens and logprobs a client gets through the router are the single-process engine's, whether
the request ran colocated, disaggregated, or was migrated off a decode worker killed mid-stream.
The engine-level table, every parameter alone, is tests/test_handoff.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import GrammarSpec, SamplingParams
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import FLAGS, stats, wait_all_blocks_free, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}

CASES: dict[str, SamplingParams] = {
    "grammar_logprobs_seeded": SamplingParams(
        max_tokens=80,
        temperature=0.8,
        top_p=0.95,
        seed=7,
        grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
        logprobs=True,
        top_logprobs=3,
    ),
    "n2_bias_min_tokens_seeded": SamplingParams(
        max_tokens=32, temperature=0.9, seed=3, n=2, logit_bias=((13, 3.0), (28, -5.0)), min_tokens=12, logprobs=True
    ),
    "penalties_greedy": SamplingParams(
        max_tokens=32,
        temperature=0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        ignore_eos=True,
    ),
}
Mode = Literal["colocated", "disaggregated", "migrated"]

Sample = tuple[list[int], list[float], list[list[int]]]  # tokens, logprobs, top logprob ids


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    return EngineTokenizer(model.tokenizer).encode_chat([("user", "Describe a person and their pets.")])


def _engine_answer(model: Any, prompt: list[int], params: SamplingParams) -> dict[int, Sample]:
    engine = Engine(model.config, model.weights, EngineConfig(num_blocks=512), tokenizer=model.tokenizer)
    engine.add_request("r", prompt, params)
    out: dict[int, Sample] = {}
    while engine.has_work:
        for o in engine.step():
            if o.token_id < 0:
                continue
            toks, lps, tops = out.setdefault(o.sample_index, ([], [], []))
            toks.append(o.token_id)
            if o.logprob is not None:
                lps.append(o.logprob.logprob)
                if params.top_logprobs:
                    tops.append([t for t, _ in o.logprob.top])
    return out


def _wire(p: SamplingParams) -> pb.SamplingParams:
    w = pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        max_tokens=p.max_tokens,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        min_tokens=p.min_tokens,
        n=p.n,
        logit_bias=dict(p.logit_bias),
    )
    if p.seed is not None:
        w.seed = p.seed
    if p.grammar is not None:
        w.grammar.json_schema = p.grammar.source
    return w


def _through_router(
    prompt: list[int], params: SamplingParams, mode: Mode, tokenizer: Any
) -> tuple[dict[int, Sample], int]:
    decode = [spawn_worker("decode", *FLAGS) for _ in range(2 if mode == "migrated" else 1)]
    prefill = [] if mode == "colocated" else [spawn_worker("prefill", *FLAGS)]
    routing = RoutingConfig(mode="colocated" if mode == "colocated" else "disaggregated")
    try:

        async def body(stub: Any, router: Any) -> tuple[dict[int, Sample], int]:
            out: dict[int, Sample] = {}
            killed: WorkerProcess | None = None
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=_wire(params))
            async for r in stub.Generate(req, timeout=300):
                toks, lps, tops = out.setdefault(r.index, ([], [], []))
                toks += list(r.token_ids)
                lps += list(r.logprobs)
                tops += [list(t.token_ids) for t in r.top_logprobs]
                if mode == "migrated" and killed is None and sum(len(s[0]) for s in out.values()) >= 6 * params.n:
                    killed = next(w for w in decode if stats(w).running_requests > 0)
                    killed.kill()  # SIGKILL, mid-stream
            return out, int(router.metrics.migrations._value.get())

        out, migrations = asyncio.run(with_router(decode, prefill, tokenizer, body, routing=routing))
        wait_all_blocks_free([w for w in [*decode, *prefill] if w.proc.poll() is None])
        return out, migrations
    finally:
        for w in [*decode, *prefill]:
            w.stop()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "migrated"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_client_gets_the_engine_s_tokens_and_logprobs_in_every_mode(model, prompt, case, mode):
    params = CASES[case]
    want = _engine_answer(model, prompt, params)
    got, migrations = _through_router(prompt, params, mode, model.tokenizer)
    assert sorted(got) == list(range(params.n))
    for k in range(params.n):
        assert got[k][0] == want[k][0], f"sample {k}: tokens differ"
        assert got[k][1] == pytest.approx(want[k][1], abs=2e-3), f"sample {k}: logprobs differ"
        assert got[k][2] == want[k][2], f"sample {k}: top logprob ids differ"
    if mode == "migrated":
        assert migrations >= 1
    if params.grammar is not None:
        for k in range(params.n):
            json.loads(model.tokenizer.decode(got[k][0]))
