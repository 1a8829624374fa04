"""Which waiting prompt starts first (engine/prefill_order.py), and the engine loop applying it."""

from __future__ import annotations

import math
import threading
import time

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.engine.prefill_order import RecentTokens, Share, Waiting, admission_order, prefill_rank
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams


def test_the_shortest_remaining_prompt_starts_first():
    waiting = [Waiting(1000, 0.0, False), Waiting(50, 0.0, False), Waiting(300, 0.0, False)]
    assert admission_order(waiting) == [1, 2, 0]


def test_equal_prompts_stay_first_come_first_served():
    assert admission_order([Waiting(100, 0.0, False), Waiting(100, 0.0, False)]) == [0, 1]


def test_a_long_prompt_that_has_waited_long_enough_goes_before_a_fresh_short_one():
    # 1,000 tokens that waited 2 s rank as 0 at 500 tokens/s: ahead of a fresh 50-token prompt
    assert prefill_rank(Waiting(1000, 2.0, False), aging_tokens_per_s=500) == 0
    assert admission_order([Waiting(50, 0.0, False), Waiting(1000, 2.0, False)], 500) == [1, 0]
    assert admission_order([Waiting(50, 0.0, False), Waiting(1000, 1.0, False)], 500) == [0, 1]


def test_a_preempted_request_keeps_its_place_at_the_head():
    waiting = [Waiting(900, 0.0, True), Waiting(10, 0.0, False), Waiting(800, 0.0, True)]
    assert admission_order(waiting) == [0, 2, 1]


NOISY, QUIET = Share("noisy"), Share("quiet")


def test_a_tenant_behind_on_prefill_tokens_goes_before_an_older_backlog():
    """The noisy tenant's five prompts waited longer (their age ranks them first), but it has had
    its tokens lately and the quiet tenant none: the quiet prompt starts first, then the noisy
    backlog in its own order."""
    waiting = [Waiting(256, 2.0 - i * 0.1, False, NOISY) for i in range(5)] + [Waiting(256, 0.0, False, QUIET)]
    assert admission_order(waiting, served={"noisy": 5000.0})[0] == 5
    assert admission_order(waiting, served={"noisy": 5000.0})[1:] == [0, 1, 2, 3, 4]
    # with no tenants the age decides: first come, first served
    anonymous = [w._replace(share=Share()) for w in waiting]
    assert admission_order(anonymous, served={"noisy": 5000.0}) == [0, 1, 2, 3, 4, 5]


def test_tenants_even_on_tokens_take_turns_by_token_cost_and_weight():
    # even at first: b's shorter prompt (100), then a's 300 (a is behind), then b's two (b
    # catches up to 300), then a's
    waiting = [Waiting(300, 0.0, False, Share("a")), Waiting(300, 0.0, False, Share("a"))]
    waiting += [Waiting(100, 0.0, False, Share("b")) for _ in range(3)]
    assert admission_order(waiting) == [2, 0, 3, 4, 1]
    # a at twice b's weight: its 300-token prompts count as 150, so its second comes sooner
    heavy = [w._replace(share=Share("a", 2.0)) if w.share.tenant == "a" else w for w in waiting]
    assert admission_order(heavy) == [2, 0, 3, 1, 4]


def test_a_higher_band_goes_first_whatever_the_tokens():
    waiting = [Waiting(10, 5.0, False, Share("a", band=1)), Waiting(900, 0.0, False, Share("b", band=0))]
    assert admission_order(waiting, served={"b": 1e6}) == [1, 0]


def test_prefill_shares_decay_by_e_every_window():
    shares = RecentTokens(window_s=10.0)
    shares.started("a", 1000, now=0.0)
    shares.started("a", 1000, now=10.0)
    assert shares.served(10.0)["a"] == pytest.approx(1000 * math.exp(-1) + 1000)
    assert shares.served(20.0)["a"] == pytest.approx((1000 * math.exp(-1) + 1000) * math.exp(-1))
    assert "a" not in shares.served(200.0) or shares.served(200.0) == {}  # forgotten once under a token
    assert shares.served(300.0) == {}


def _engine(order: str = "shortest") -> Engine:
    cfg = tiny_model_config()
    ecfg = EngineConfig(
        num_blocks=256, max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=False, prefill_order=order
    )
    return Engine(cfg, random_weights(cfg), ecfg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("order", "short_first"), [("shortest", True), ("arrival", False)])
def test_the_loop_starts_a_short_prompt_queued_behind_a_long_one_first(order, short_first):
    engine = _engine(order)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    long = engine.add_request("long", list(range(1, 257)), params)  # four chunks of 64
    short = engine.add_request("short", list(range(1, 17)), params)
    loop = EngineLoop(engine)
    idle = threading.Event()
    deadline = time.monotonic() + 30
    while engine.has_work and time.monotonic() < deadline:
        idle.wait(0.01)  # the engine thread owns the engine: watch it from here until it is done
    loop.stop()
    assert long.times.first_token is not None and short.times.first_token is not None
    assert (short.times.first_token < long.times.first_token) is short_first


def test_a_step_spends_its_budget_on_a_short_head_before_the_long_prefills_in_progress() -> None:
    """spend_step_budget, as the scheduler and the simulator both run it: running [long 300 left,
    decode 1], a 40-token prompt at the head, threshold 64, budget 128: the decode, then the short
    prompt, then the long prefill takes what is left; with no threshold the long one goes first."""
    from splitserve.engine.prefill_order import spend_step_budget

    def run(threshold: int) -> list[tuple[str, int]]:
        spent: list[tuple[str, int]] = []
        running = [("long", 300), ("decode", 1)]

        def take(item: tuple[str, int], budget: int, _may_preempt: bool) -> int:
            spent.append((item[0], min(item[1], budget)))
            return spent[-1][1]

        def admit(budget: int, max_tokens: int) -> int:
            if budget > 0 and not any(name == "short" for name, _ in spent) and (not max_tokens or 40 <= max_tokens):
                spent.append(("short", min(40, budget)))
                budget -= spent[-1][1]
            return budget

        left = spend_step_budget(running, lambda r: r[1], 40, threshold, 128, take, admit)
        assert left == 128 - sum(n for _, n in spent)
        return spent

    assert run(64) == [("decode", 1), ("short", 40), ("long", 87)]
    assert run(0) == [("long", 128)]
