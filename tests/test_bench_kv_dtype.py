"""splitserve bench kv-dtype's measuring pieces on a tiny model: the teacher-forced and step-by-step
log-probabilities (the same over an fp32 pool; within the target over the prefill's int8 KV), the
greedy agreement count, the text it measures on being shipped, the contexts it times the decode
step at, and the decode-step timer it shares with bench structured (bench/step_timer.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from splitserve.bench import kv_dtype, teacher_forcing
from splitserve.bench.step_timer import decode_step_ms
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)


def _engine(kv: str) -> Engine:
    cfg = tiny_model_config(max_position=512)
    return Engine(cfg, random_weights(cfg, seed=5), EngineConfig(kv_cache_dtype=kv, num_blocks=64, block_size=8))


@pytest.mark.parametrize(("kv", "tol"), [("auto", 1e-4), ("int8", 0.05), ("fp8", 0.05)])
def test_prefill_against_decode_over_the_prefill_kv(kv: str, tol: float) -> None:
    tokens = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = _engine(kv)
    try:
        forced = teacher_forcing.teacher_forced(eng, tokens, 16)  # three chunks, the later ones reading the pool
        assert forced.shape == (47,)
        assert torch.allclose(forced, teacher_forcing.teacher_forced(eng, tokens, 48), atol=tol)
        over = teacher_forcing.step_by_step(eng, tokens, over_prefill=True)
        assert (forced - over).abs().max().item() <= tol
        scratch = teacher_forcing.step_by_step(eng, tokens)
        assert (forced - scratch).abs().max().item() <= (1e-4 if kv == "auto" else 1.0)
    finally:
        eng.close()


def test_agreement_counts_identical_prompts_and_first_divergences() -> None:
    same, firsts = kv_dtype._agreement([[1, 2, 3], [1, 2, 3], [4, 5, 6]], [[1, 2, 3], [1, 9, 3], [7, 5, 6]], 3)
    assert (same, firsts) == (1, [3, 1, 0])


def test_the_text_is_shipped_and_a_few_kilobytes() -> None:
    assert 2_000 <= len(kv_dtype.TEXT.read_bytes()) <= 20_000


def test_the_step_timer_waits_for_chunked_prefills_and_leaves_the_engine_idle() -> None:
    cfg = tiny_model_config(max_position=512)
    # prompts of 40 tokens in chunks of 16: three steps of prefill per request before any pure decode step
    eng = Engine(cfg, random_weights(cfg, seed=5), EngineConfig(num_blocks=64, block_size=8, max_num_batched_tokens=16))
    steps: list[bool] = []
    real_step = eng.step

    def step(between_layers: Callable[[], None] | None = None) -> list[StepOutput]:
        # a step counts as decode when every running sequence has only its one new token left to compute
        sched = eng.scheduler
        steps.append(
            bool(sched.running)
            and not sched.waiting
            and all(len(s) - s.num_computed_tokens == 1 for s in sched.running)
        )
        return real_step(between_layers)

    eng.step = step  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        ms = decode_step_ms(eng, list(range(3, 42)), params, batch=2, steps=3, tag="t")
        assert ms > 0
        assert not eng.has_work
        first_decode = steps.index(True)
        assert first_decode >= 3 and all(steps[first_decode:])
        with pytest.raises(RuntimeError, match="no pure decode step"):
            decode_step_ms(eng, list(range(3, 42)), SamplingParams(max_tokens=1, ignore_eos=True), 2, 3, "u")
    finally:
        eng.close()


def test_contexts_are_parsed_and_prompts_cut_to_them() -> None:
    assert kv_dtype._contexts("256, 1024,2048") == [256, 1024, 2048]
    for bad in ("", "1", "a,b"):
        with pytest.raises(SystemExit, match="--contexts"):
            kv_dtype._contexts(bad)
    assert kv_dtype._prompt_of([1, 2, 3], 8) == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_the_noise_floor_moves_each_weight_by_at_most_one_ulp(dtype: torch.dtype, bits: torch.dtype) -> None:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    w[0] = 0
    before = w.clone()
    kv_dtype._move_by_an_ulp(w, torch.Generator().manual_seed(0))
    step = w.view(bits).long() - before.view(bits).long()  # one ulp is one step of the bit pattern
    assert set(step.unique().tolist()) == {-1, 0, 1}
    assert not step[0].any()  # zeros stay zeros (no step into NaN bits)
    assert torch.equal(w.sign(), before.sign())


def test_the_speed_lines_give_each_ratio_per_repetition_beside_the_control(capsys) -> None:
    times = {"bfloat16": [10.0, 10.0, 10.0], "int8": [9.0, 11.0, 9.5], "control": [10.5, 10.0, 9.0]}
    verdicts = kv_dtype._print_speed(times, ["int8"], 8, 256)
    out = capsys.readouterr().out
    assert "control   a second bfloat16 KV engine: ratio 1.000 (per repetition: 1.050 1.000 0.900)" in out
    assert "int8      KV 9.50 ms, ratio 0.950 (per repetition: 0.900 1.100 0.950)  [target <= 1.000: met]" in out
    assert verdicts == [("decode batch 8 context 256 int8 not slower", True)]  # the control is no target
