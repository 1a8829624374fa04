"""The sampler, one processor at a time, on hand-made logits; and the engine's
per-request sampling contract (seeds, stops, lengths, logprobs)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampler import apply_penalties, filter_logits, sample
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = 1, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sample(logits[None], [params], [[]], [[]], [None], g).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax():
    assert draw(SamplingParams(temperature=0)) == [4]


def test_top_k_one_and_tiny_top_p_and_full_min_p_are_greedy():
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        assert set(draw(p, n=50)) == {4}


def test_top_k_keeps_exactly_k_tokens():
    kept = torch.isfinite(filter_logits(LOGITS, SamplingParams(top_k=2)))
    assert kept.tolist() == [True, False, False, False, True]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # sorted: 4 (0.61), 0 (0.22), 1 (0.08), ...
    p = float(probs[4] + probs[0]) - 1e-4
    kept = torch.isfinite(filter_logits(LOGITS, SamplingParams(top_p=p)))
    assert kept.tolist() == [True, False, False, False, True]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    kept = torch.isfinite(filter_logits(LOGITS, SamplingParams(min_p=0.3)))
    probs = torch.softmax(LOGITS, -1)
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()


def test_temperature_sampling_follows_the_softmax():
    counts = torch.bincount(torch.tensor(draw(SamplingParams(temperature=1.0), n=4000)), minlength=5).float()
    expected = torch.softmax(LOGITS, -1) * 4000
    assert torch.all((counts - expected).abs() < 4 * expected.sqrt() + 5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = apply_penalties(LOGITS, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[3])
    assert out[0] == pytest.approx(1.0) and out[3] == pytest.approx(-2.0) and out[4] == pytest.approx(3.0)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, p, prompt_ids=[1], output_ids=[4, 4, 2])
    assert out[4] == pytest.approx(3.0 - 0.5 - 0.5) and out[2] == pytest.approx(0.5 - 0.5 - 0.25)
    assert out[1] == pytest.approx(1.0)


def test_logprob_is_the_raw_log_softmax_of_the_chosen_token():
    g = torch.Generator()
    res = sample(LOGITS[None], [SamplingParams(temperature=0, logprobs=True)], [[]], [[]], [None], g)
    lp = res.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[4]))


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("seed", -1),
        ("temperature", math.nan),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- through the engine

CFG = tiny_model_config(num_layers=1)
WEIGHTS = random_weights(CFG, seed=4)


def engine() -> Engine:
    return Engine(CFG, WEIGHTS, EngineConfig(num_blocks=64))


def test_same_seed_same_tokens_different_seed_different_tokens():
    # a high temperature: the tiny random model is sharply peaked
    p = list(range(10))
    a = engine().generate([p], SamplingParams(max_tokens=20, temperature=20.0, seed=7, ignore_eos=True))
    b = engine().generate([p], SamplingParams(max_tokens=20, temperature=20.0, seed=7, ignore_eos=True))
    c = engine().generate([p], SamplingParams(max_tokens=20, temperature=20.0, seed=8, ignore_eos=True))
    assert a == b and a != c


def test_stop_token_ids_and_max_tokens_end_a_request():
    p = list(range(10))
    free = engine().generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(free) == 12
    stopped = engine().generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(free[3],)))[0]
    assert stopped == free[: free.index(free[3]) + 1]


def test_engine_reports_logprobs_when_asked():
    e = engine()
    e.add_request("r", list(range(5)), SamplingParams(max_tokens=3, temperature=0, logprobs=True, ignore_eos=True))
    outs = []
    while e.has_work:
        outs += e.step()
    assert len(outs) == 3 and all(o.logprob is not None and o.logprob.logprob <= 0 for o in outs)


# ---- no accepted value may make a step fail (a failed step aborts the whole batch)

EXTREME_FLOATS = (1e-45, 1e-38, 1e-30, 1e-6, 1e-5, 1.0000001e-5, 0.5, 1.0, 2.0, 100.0)
VOCAB = 7


@st.composite
def extreme_params(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.sampled_from((0.0, *EXTREME_FLOATS))),
        top_p=draw(st.sampled_from((1e-45, 1e-6, 0.5, 1.0))),
        top_k=draw(st.integers(0, VOCAB)),
        min_p=draw(st.sampled_from((0.0, 1e-45, 0.5, 1.0))),
        repetition_penalty=draw(st.sampled_from(EXTREME_FLOATS)),
        presence_penalty=draw(st.sampled_from((-2.0, 0.0, 2.0))),
        frequency_penalty=draw(st.sampled_from((-2.0, 0.0, 2.0))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        logprobs=draw(st.booleans()),
    )


@pytest.fixture(scope="module", params=["torch", "kernel"])
def draw_rows(request):
    """How the temperature-only rows are drawn: sampler.py's torch path, or the CPU kernel."""
    if request.param == "torch":
        return None
    return request.getfixturevalue("cpu_decode_kernels").draw


@settings(max_examples=400, deadline=None)
@given(
    params=st.lists(extreme_params(), min_size=1, max_size=4),
    logits=st.lists(
        st.lists(
            st.sampled_from((-3.4e38, -1e30, -1.0, 0.0, 1e-30, 1.0, 1e30, 3.4e38)), min_size=VOCAB, max_size=VOCAB
        ),
        min_size=4,
        max_size=4,
    ),
    history=st.lists(st.integers(0, VOCAB - 1), max_size=6),
)
def test_sampler_never_fails_on_any_accepted_value(params, logits, history, draw_rows):
    n = len(params)
    rows = torch.tensor(logits[:n], dtype=torch.float32)
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    result = sample(
        rows, params, [history] * n, [history[::-1]] * n, gens, torch.Generator().manual_seed(0), draw_rows=draw_rows
    )
    assert len(result.token_ids) == n
    assert all(0 <= t < VOCAB for t in result.token_ids)
    for p, row, t in zip(params, rows, result.token_ids, strict=True):
        if p.greedy and not p.has_penalties:
            assert t == int(row.argmax())


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 9.99e-6])
def test_temperature_below_epsilon_is_greedy(temperature):
    p = SamplingParams(temperature=temperature)
    assert p.greedy
    assert set(draw(p, n=20)) == {4}


def test_a_tiny_repetition_penalty_samples_a_token_instead_of_raising():
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-45)
    g = torch.Generator().manual_seed(0)
    out = sample(LOGITS[None], [p], [[0, 1]], [[4]], [None], g).token_ids
    assert 0 <= out[0] < len(LOGITS)


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    from splitserve.engine.sampler import draw

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(5)
    for _ in range(20000):
        counts[draw(probs[None], [gen], probs[None])[0]] += 1
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts / 20000, probs, atol=0.015)
    one, two = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first = [draw(probs[None], [one], probs[None])[0] for _ in range(50)]
    assert first == [draw(probs[None], [two], probs[None])[0] for _ in range(50)]  # seeded: repeatable


def test_draw_across_blocks_follows_each_row_and_skips_zero_blocks():
    """A vocabulary of several blocks and a partial last one: whole blocks of zeros, zeros at a
    block's edges, and mass in the tail, on rows drawn together."""
    from splitserve.engine.sampler import _BLOCK, draw

    vocab = 2 * _BLOCK + 300
    probs = torch.zeros(2, vocab)
    picks = {0: [5, _BLOCK - 1, _BLOCK + 0, 2 * _BLOCK + 299], 1: [_BLOCK - 2, 2 * _BLOCK]}  # row 1: block 1 all 0
    for row, ids in picks.items():
        probs[row, ids] = 1.0 / len(ids)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    counts = [torch.zeros(vocab), torch.zeros(vocab)]
    for _ in range(4000):
        for row, token in enumerate(draw(probs, gens, probs)):
            counts[row][token] += 1
    for row, ids in picks.items():
        assert set(torch.nonzero(counts[row]).flatten().tolist()) == set(ids)
        assert torch.allclose(counts[row][ids] / 4000, torch.full((len(ids),), 1.0 / len(ids)), atol=0.04)


def test_a_block_search_past_its_rounded_end_takes_a_token_of_nonzero_probability():
    from splitserve.engine.sampler import _search_block

    within = torch.tensor([0.0, 0.25, 0.25, 0.75, 0.75], dtype=torch.float64)  # tokens 1 and 3 only
    assert _search_block(within, 0.75) == 3 and _search_block(within, 0.9) == 3
    assert _search_block(within, -1e-17) == 1 and _search_block(within, 0.0) == 1
    assert _search_block(within, 0.25) == 3 and _search_block(within, 0.1) == 1


def test_an_unusable_row_takes_its_argmax_and_spares_the_others():
    from splitserve.engine.sampler import draw

    probs = torch.tensor([[float("nan")] * 4, [0.0, 0.0, 1.0, 0.0]])
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert draw(probs, [torch.Generator(), torch.Generator()], logits) == [1, 2]


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    """The temperature-only rows of a step are drawn together; a seeded request's token must not
    depend on which other rows share its step (greedy, filtered, penalised, unseeded)."""
    vocab = 3000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 2
    seeded = SamplingParams(temperature=0.8, seed=11)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, repetition_penalty=1.2),
    ]

    def token(params: list[SamplingParams], rows: torch.Tensor, at: int) -> int:
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        n = len(params)
        return sample(rows, params, [[1]] * n, [[2]] * n, gens, torch.Generator().manual_seed(5)).token_ids[at]

    alone = token([seeded], logits[2:3], 0)
    assert token([others[0], others[1], seeded, others[2], others[3]], logits, 2) == alone
    assert token([others[2], seeded], logits[1:3], 1) == alone
