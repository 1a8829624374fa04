"""The ITL budget (engine/itl_budget.py): a step beside decode rows takes only the prompt tokens that
fit in the ITL target, measured from the worker's own steps; a step without them takes its chunk."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.itl_budget import FLOOR_TOKENS, ItlBudget, parse_itl_target
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def test_the_target_is_auto_off_or_milliseconds_and_anything_else_is_named():
    assert parse_itl_target("auto") is None
    assert parse_itl_target("off") == 0.0
    assert parse_itl_target("40") == pytest.approx(0.040)
    for bad in ("-5", "0", "fast", ""):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_itl_target(bad)
    with pytest.raises(ValueError, match="itl_target"):
        EngineConfig(itl_target="soon")


def test_auto_lets_a_mixed_step_last_two_decode_steps():
    b = ItlBudget("auto", chunk_tokens=512)
    assert b.prefill_tokens() == FLOOR_TOKENS  # nothing measured yet
    b.observe(decode_rows=4, prefill_tokens=0, seconds=0.020)
    assert b.prefill_tokens() == FLOOR_TOKENS  # a prompt token's cost not yet measured
    b.observe(decode_rows=4, prefill_tokens=16, seconds=0.028)  # 0.5 ms a prompt token
    assert b.prefill_tokens() == 40  # (2 x 20 - 20) ms / 0.5 ms
    b.observe(decode_rows=0, prefill_tokens=300, seconds=1.0)  # no decode rows: nobody waited
    assert b.prefill_tokens() == 40


def test_milliseconds_set_the_step_and_the_cap_stays_between_the_floor_and_the_chunk():
    b = ItlBudget("40", chunk_tokens=32)
    b.observe(4, 0, 0.020)
    b.observe(4, 10, 0.025)
    assert b.prefill_tokens() == 32  # (40 - 20) / 0.5 = 40 tokens fit: the chunk is less
    slow = ItlBudget("21", chunk_tokens=512)
    slow.observe(4, 0, 0.020)
    slow.observe(4, 10, 0.070)
    assert slow.prefill_tokens() == FLOOR_TOKENS  # 1 ms of room: a prompt still progresses
    off = ItlBudget("off", chunk_tokens=512)
    off.observe(4, 0, 0.020)
    assert off.off and off.prefill_tokens() == 512


def test_a_capped_step_takes_its_decode_rows_and_only_the_cap_of_a_prompt():
    cfg = tiny_model_config(num_layers=2)
    engine = Engine(cfg, random_weights(cfg, seed=3), EngineConfig(num_blocks=128, max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("streaming", list(range(1, 20)), params)
    engine.step()  # its prompt: now it decodes
    engine.add_request("new", list(range(1, 101)), params)
    batch = engine.scheduler.schedule(0.0, prefill_cap=10)
    assert batch is not None
    assert {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)} == {
        "streaming": 1,
        "new": 10,
    }
    engine.close()
    alone = Engine(cfg, random_weights(cfg, seed=3), EngineConfig(num_blocks=128, max_num_batched_tokens=256))
    alone.add_request("new", list(range(1, 101)), params)
    batch = alone.scheduler.schedule(0.0, prefill_cap=10)
    assert batch is not None and batch.num_new_tokens == [100]  # no decode rows: the whole chunk
    alone.close()
