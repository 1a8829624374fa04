"""The stats an engine loop reports (what the router polls) are never older than what it was sent:
a prompt posted while a step runs counts as waiting, an admitted one shows before the next step
ends, and a finished request has left them before its last token is handed out. A worker busy
with a long prefill chunk looked idle to the router when its stats were a snapshot from before the
prompt arrived (issue 22: short prompts routed behind long prefills, TTFT p90 1.4 to 2 s)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from splitserve.engine.commands import Admit
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop, Stats
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import StepOutput

pytestmark = pytest.mark.timeout(60)

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def _held_engine() -> tuple[Engine, threading.Event, threading.Event]:
    """A tiny engine whose every step waits for `release` after setting `in_step`."""
    cfg = tiny_model_config()
    engine = Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=256, enable_prefix_caching=False))
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step(between_layers: Callable[[], None] | None = None) -> list[StepOutput]:
        in_step.set()
        assert release.wait(30), "the test never released the step"
        return real_step(between_layers)

    engine.step = held_step  # type: ignore[method-assign]
    return engine, in_step, release


def test_a_prompt_posted_during_a_step_counts_and_a_finished_one_leaves_before_its_token():
    engine, in_step, release = _held_engine()
    at_last_token: list[Stats] = []
    loop = EngineLoop(engine)

    def sink(out: StepOutput) -> None:  # on the engine thread, as each output is handed out
        if out.finished:
            at_last_token.append(loop.stats)

    try:
        assert loop.stats.queued_tokens == 0
        loop.submit(Admit("a", list(range(1, 65)), ONE_TOKEN), sink).result(10)
        assert in_step.wait(10)  # the loop is inside the step that prefills "a"
        # admitted before that step began: in the stats now, not once the step ends
        assert (loop.stats.queued_tokens, loop.stats.queue_length) == (64, 1)
        loop.submit(Admit("b", list(range(1, 33)), ONE_TOKEN))  # waits in the inbox behind the step
        assert (loop.stats.queued_tokens, loop.stats.queue_length) == (64 + 32, 2)
        c_done = threading.Event()
        loop.submit(Admit("c", [7, 8, 9], ONE_TOKEN), lambda out: c_done.set() if out.finished else None)
        release.set()
        assert c_done.wait(30)
    finally:
        release.set()
        loop.stop()
    # "a" finished in the held step: gone from the stats when its token was handed out, "b" and "c"
    # still posted (the inbox is read after the outputs)
    assert len(at_last_token) == 1
    assert at_last_token[0].running_tokens == 0 and at_last_token[0].queued_tokens == 32 + 3
    assert loop.stats.queued_tokens == 0 and loop.stats.queue_length == 0


def test_an_admission_refused_leaves_the_posted_count():
    engine, _, release = _held_engine()
    release.set()
    loop = EngineLoop(engine)
    try:
        with pytest.raises(ValueError):  # a token id past the vocabulary: the engine refuses it
            loop.submit(Admit("x", [1, 2, 10**9], ONE_TOKEN)).result(10)
    finally:
        loop.stop()
    assert loop.stats.queue_length == 0 and loop.stats.queued_tokens == 0
