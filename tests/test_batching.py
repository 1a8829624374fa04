"""Batching is invisible: prompts run together (mixed lengths, chunked prefill
with a small chunk, prefix-cache hits, requests joining mid-flight) give exactly
the tokens they give alone."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

CFG = tiny_model_config(num_layers=3)
WEIGHTS = random_weights(CFG, seed=11)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def prompts_with_shared_prefixes(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, CFG.vocab_size, (48,), generator=g).tolist()
    out = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 16, 33, 150)]
    out += [system + torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (0, 5, 16, 40)]
    return out


def alone(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = Engine(
        CFG, WEIGHTS, EngineConfig(num_blocks=256, max_num_batched_tokens=1024, enable_prefix_caching=False)
    )
    return engine.generate([prompt], params)[0]


def test_one_batch_with_small_chunks_and_prefix_hits_matches_alone():
    prompts = prompts_with_shared_prefixes()
    expected = [alone(p) for p in prompts]
    engine = Engine(CFG, WEIGHTS, EngineConfig(num_blocks=256, block_size=16, max_num_batched_tokens=32))
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.blocks.stats.hits > 0  # the shared system prompt was reused
    # a second round is served mostly from the prefix cache and must not change a token
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.blocks.num_free_blocks == 256


@pytest.mark.parametrize("long_prefill", [0, 16])
def test_requests_joining_between_steps_match_alone(long_prefill):
    prompts = prompts_with_shared_prefixes(seed=1)
    expected = [alone(p) for p in prompts]
    engine = Engine(
        CFG,
        WEIGHTS,
        EngineConfig(num_blocks=256, max_num_batched_tokens=48, long_prefill_token_threshold=long_prefill),
    )
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_work:
        if pending:  # one new request every step, while others decode
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected


def test_seeded_sampling_is_batch_invariant():
    prompts = prompts_with_shared_prefixes(seed=2)[:5]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(5)
    ]
    expected = [alone(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine = Engine(CFG, WEIGHTS, EngineConfig(num_blocks=256, max_num_batched_tokens=32))
    assert engine.generate(prompts, params) == expected


@pytest.mark.parametrize("long_prefill", [0, 16])
def test_preemption_under_block_pressure_keeps_outputs(long_prefill):
    prompts = prompts_with_shared_prefixes(seed=3)[:6]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [alone(p, params) for p in prompts]
    engine = Engine(
        CFG,
        WEIGHTS,
        EngineConfig(
            num_blocks=14, block_size=16, max_num_batched_tokens=64, long_prefill_token_threshold=long_prefill
        ),
    )
    assert engine.generate(prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == 14


@pytest.mark.parametrize("long_prefill", [0, 32])
def test_a_short_prompt_behind_a_long_prefill_goes_first_only_with_the_threshold(long_prefill):
    """Chunks of 64: a 300-token prompt takes 5 steps. A 20-token prompt arriving after its first
    chunk waits out the other 4 in arrival order; with the threshold it takes its first token in the
    very next step, beside what is left of that step for the long prompt, which still ends in step
    5 (the same tokens, in other chunks) and gives the same output."""
    g = torch.Generator().manual_seed(5)
    long_prompt, short_prompt = (torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (300, 20))
    engine = Engine(
        CFG,
        WEIGHTS,
        EngineConfig(num_blocks=256, max_num_batched_tokens=64, long_prefill_token_threshold=long_prefill),
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("long", long_prompt, params)
    engine.step()  # the long prompt's first chunk
    engine.add_request("short", short_prompt, params)
    first_token_step: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    step = 1
    while engine.has_work:
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
            got.setdefault(out.request_id, []).append(out.token_id)
    if long_prefill:
        assert first_token_step["short"] == 2 and first_token_step["long"] == 5
    else:
        assert first_token_step["long"] == 5 and first_token_step["short"] == 5
    assert got == {"long": alone(long_prompt, params), "short": alone(short_prompt, params)}
    assert engine.blocks.num_free_blocks == 256
