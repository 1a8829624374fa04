"""A seed gives the same text wherever a request ran (DESIGN.md, "The handoff
record"): output token i of a seeded request draws from (seed, sample index, i)
alone, so a request resumed from its first k tokens (the prefill worker's first
token, a migration's replay) continues as if it had run whole in one engine,
and the disaggregated pair (tests/worker_helpers.py) gives the colocated engine's text."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.engine.random_model import tiny_model_config
from splitserve.engine.sampler import draw_seed, splitmix64
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence
from tests.worker_helpers import EnginePair, assert_engine_empty, tiny_engine

pytestmark = pytest.mark.timeout(120)

# Untied embeddings: the tied tiny model puts nearly all its mass on one token, so temperature
# 0.8 would sample greedily and no test here could tell a wrong draw from a right one.
SPREAD = tiny_model_config(tie_embeddings=False)
N = 24
SEEDED = SamplingParams(max_tokens=N, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
PROMPTS = [list(range(1, 23)), list(range(100, 109)), [5, 3, 7] * 5, list(range(300, 340))]


def engine() -> Engine:
    return tiny_engine(model_cfg=SPREAD)


def run(e: Engine, prompt: list[int], params: SamplingParams, prior: list[int] | None = None) -> list[int]:
    """One request run to its end on `e`, continuing from `prior` output tokens produced elsewhere."""
    e.add_request("r", prompt, params, output_token_ids=prior)
    out = []
    while e.has_work:
        out += [o.token_id for o in e.step() if o.request_id == "r"]
    assert_engine_empty(e)
    return out


# ---- the draw's seed: a pure function


def test_splitmix64_gives_the_reference_outputs():
    # SplitMix64 seeded with 0: its first two outputs (Steele, Lea, Flood 2014; Vigna's splitmix64.c)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_draw_seed_depends_on_the_seed_the_sample_and_the_token_index_alone():
    seen = {draw_seed(s, k, i) for s in (0, 1, 7, 2**63 - 1) for k in range(4) for i in range(64)}
    assert len(seen) == 4 * 4 * 64  # every triple its own seed
    assert len({x & 0xFFFFFFFF for x in seen}) == len(seen)  # also in the low 32 bits, all torch's CPU generator keeps
    assert all(0 <= x < 2**64 for x in seen)
    assert draw_seed(7, 0, 5) == draw_seed(7, 0, 5)


def test_a_sequence_reseeds_for_its_next_output_token_and_its_sample_index():
    prior = [9, 9, 9]
    seq = Sequence("r", [1, 2], SEEDED, arrival=1, prior_output=prior, sample_index=2)
    gen = seq.next_draw_generator()
    assert gen is not None and gen.initial_seed() == draw_seed(7, 2, len(prior))
    unseeded = Sequence("u", [1, 2], replace(SEEDED, seed=None), arrival=2)
    assert unseeded.next_draw_generator() is None
    with pytest.raises(ValueError, match="sample_index"):
        Sequence("r", [1], SEEDED, arrival=3, sample_index=-1)


def test_the_generator_is_reseeded_not_reallocated_per_token():
    seq = Sequence("r", [1, 2], SEEDED, arrival=1)
    gen = seq.next_draw_generator()
    assert isinstance(gen, torch.Generator)
    seq.token_ids.append(4)
    assert seq.next_draw_generator() is gen and gen.initial_seed() == draw_seed(7, 0, 1)


# ---- one engine


def test_seeded_sampling_is_not_greedy_here():
    # the tests below would pass vacuously if this model sampled its argmax at temperature 0.8
    assert run(engine(), PROMPTS[0], SEEDED) != run(engine(), PROMPTS[0], replace(SEEDED, temperature=0))


@pytest.mark.parametrize("k", [1, 2, 9, N - 1])
def test_a_seeded_request_resumed_from_its_first_k_tokens_continues_as_if_whole(k):
    """The prefill handoff (k = 1) and a migration (any k): the resumed engine never drew tokens 0..k-1."""
    whole = run(engine(), PROMPTS[0], SEEDED)
    resumed = run(engine(), PROMPTS[0], SEEDED, prior=whole[:k])
    assert resumed == whole[k:]


def test_the_same_seed_twice_is_identical_cached_or_not():
    e = engine()
    first = run(e, PROMPTS[0], SEEDED)
    assert e.scheduler.cached_prefix_tokens(PROMPTS[0]) > 0  # the second run prefills from the cache
    again = run(e, PROMPTS[0], SEEDED)
    assert first == again == run(engine(), PROMPTS[0], SEEDED)


def test_two_seeds_differ():
    assert run(engine(), PROMPTS[0], SEEDED) != run(engine(), PROMPTS[0], replace(SEEDED, seed=8))


def test_an_unseeded_request_still_varies():
    e = engine()
    unseeded = replace(SEEDED, seed=None)
    assert run(e, PROMPTS[0], unseeded) != run(e, PROMPTS[0], unseeded)


# ---- the disaggregated pair: the prefill engine samples token 0, the decode engine the rest


def test_the_disaggregated_pair_gives_the_colocated_engines_text():
    pair = EnginePair.tiny(model_cfg=SPREAD)
    try:
        for i, prompt in enumerate(PROMPTS):
            want = run(engine(), prompt, SEEDED)
            rid = f"r{i}"
            remote = pair.reserve(rid, prompt, SEEDED)
            pair.start_prefill(rid, prompt, SEEDED, remote)
            first = pair.prefill_until_done(rid)
            pair.poll_prefill()
            pair.poll_decode()
            assert [first, *pair.decode_to_end(rid)] == want, f"prompt {i}"
    finally:
        pair.close()
    assert_engine_empty(pair.prefill)
    assert_engine_empty(pair.decode)
