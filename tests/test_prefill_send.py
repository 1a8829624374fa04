"""The prefill side's send from open to confirmation, and the typed commands both
workers give the engine thread, on CPU engines joined by the in-memory fake
transport (tests/worker_helpers.py): a confirmed send frees the held request through
the connector's poll, a refused confirmation ends it and frees its blocks, the
commands admit, bound the waiting queue and abort, and the scheduler alone
counts the free seats. Every test ends with both engines empty."""

from __future__ import annotations

import queue

import pytest

from splitserve.engine.commands import Abort, Admit, Admitted, QueueFull, Reserve
from splitserve.engine.connector import TransferOutcome
from splitserve.engine.engine import StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import DuplicateRequest
from splitserve.engine.sequence import SeqStatus
from splitserve.workers.prefill.connector import SenderConnector
from tests.worker_helpers import EnginePair, assert_engine_empty, tiny_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 23))  # 22 tokens: five full blocks of 4 and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
WAIT_S = 10.0  # every wait below has this deadline


@pytest.fixture
def pair():
    p = EnginePair.tiny()
    yield p
    p.close()
    assert_engine_empty(p.prefill)
    assert_engine_empty(p.decode)


def connector_outcomes(pair: EnginePair) -> list[TransferOutcome]:
    """The prefill connector's poll, woken by its news, until it reports something."""
    for _ in range(100):
        pair.prefill_news.clear()
        got = pair.prefill_connector.poll()
        if got:
            return got
        assert pair.prefill_news.wait(WAIT_S), "the send never reported"
    raise AssertionError("woken a hundred times without an outcome")


# ---- the send: open to confirmed ----


def test_a_confirmed_send_releases_the_held_request_through_poll(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    ticket = pair.start_prefill("r", PROMPT, GREEDY, remote)
    first = pair.prefill_until_done("r")  # the connector sent Done as the first token was sampled
    (outcome,) = connector_outcomes(pair)
    assert outcome == TransferOutcome("r", ticket, first, None)
    assert pair.prefill.lookup("r").status is SeqStatus.HELD  # nothing frees it but the engine's poll
    assert pair.prefill.apply_transfers([outcome]) == []
    assert pair.prefill.lookup("r") is None
    (committed,) = pair.poll_decode(WAIT_S)
    assert not committed.finished
    assert pair.decode.abort("r")


def test_a_refused_confirmation_aborts_the_held_request_and_frees_its_blocks(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    ticket = pair.start_prefill("r", PROMPT, GREEDY, remote)
    pair.prefill_connector.wants_layers = False  # no layer goes out: the receiver refuses the Done
    pair.prefill_until_done("r")
    (outcome,) = connector_outcomes(pair)
    assert (outcome.request_id, outcome.transfer_id, outcome.first_token) == ("r", ticket, None)
    assert outcome.code == "transport"
    (ended,) = pair.prefill.apply_transfers([outcome])
    assert (ended.finished, ended.finish_reason, ended.token_id) == (True, "transport", -1)
    assert_engine_empty(pair.prefill)
    (failed,) = pair.poll_decode(WAIT_S)  # the decode side's reservation failed too
    assert failed.finished and failed.finish_reason == "incomplete"


def test_an_aborted_send_reports_nothing_and_a_second_send_on_its_ticket_is_refused(pair):
    from opentelemetry.context import Context

    from splitserve.kv_transfer import TransferError

    remote = pair.reserve("r", PROMPT, GREEDY)
    ticket = pair.start_prefill("r", PROMPT, GREEDY, remote)
    with pytest.raises(TransferError):  # the receiver takes one stream per reservation, and so does the connector
        pair.prefill_connector.open("r2", remote.transfer, 0, Context())
    pair.prefill_connector.abort(ticket, "cancelled")
    assert pair.prefill.abort("r")
    (failed,) = pair.poll_decode(WAIT_S)
    assert failed.finish_reason == "aborted_by_sender"
    assert pair.prefill_connector.poll() == []


def test_a_held_id_is_refused_as_a_duplicate_and_an_abort_on_another_ticket_leaves_it(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    pair.start_prefill("r", PROMPT, GREEDY, remote)
    pair.prefill_until_done("r")
    with pytest.raises(DuplicateRequest):
        pair.prefill.add_request("r", PROMPT, GREEDY, prefill_only=True)
    pair.poll_prefill(WAIT_S)
    pair.poll_decode(WAIT_S)
    assert pair.decode.abort("r")


def test_a_connector_built_on_a_sender_takes_its_cache_shape():
    pair = EnginePair.tiny()
    try:
        c: SenderConnector = pair.prefill_connector
        assert (c.block_size, c.last_layer, c.cuda) == (4, pair.prefill.model_cfg.num_layers - 1, False)
    finally:
        pair.close()


# ---- typed commands into the engine thread ----


def test_commands_admit_stream_to_the_sink_and_abort():
    loop = EngineLoop(tiny_engine(), waiting_limit=4)
    try:
        outs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        admitted = loop.submit(Admit("a", PROMPT, GREEDY), outs.put).result(timeout=WAIT_S)
        assert isinstance(admitted, Admitted) and admitted.num_cached_tokens == 0
        tokens: list[StepOutput] = []
        while not tokens or not tokens[-1].finished:
            tokens.append(outs.get(timeout=WAIT_S))
        assert [o.finish_reason for o in tokens] == [None] * 5 + ["length"]
        assert loop.submit(Abort("a")).result(timeout=WAIT_S) is False  # finished: nothing to abort
        with pytest.raises(ValueError, match="prompt is empty"):
            loop.submit(Admit("b", [], GREEDY)).result(timeout=WAIT_S)
        with pytest.raises(RuntimeError, match="no KV connector"):
            loop.submit(Reserve("c", PROMPT, GREEDY, 30.0)).result(timeout=WAIT_S)
    finally:
        loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(Abort("a")).result(timeout=WAIT_S)
    assert_engine_empty(loop.engine)


def test_the_admit_command_refuses_past_the_waiting_limit():
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    loop = EngineLoop(tiny_engine(max_num_seqs=1, num_blocks=128), waiting_limit=1)
    try:
        loop.submit(Admit("running", [1, 2, 3], long)).result(timeout=WAIT_S)
        loop.submit(Admit("waiting", [1, 2, 3], long)).result(timeout=WAIT_S)
        # one seat, taken or about to be: "waiting" waits for it, which is the limit
        with pytest.raises(QueueFull, match="limit 1"):
            loop.submit(Admit("refused", [1, 2, 3], long)).result(timeout=WAIT_S)
        assert loop.submit(Abort("waiting", transfer_id=b"another")).result(timeout=WAIT_S) is False
        for rid in ("running", "waiting"):
            assert loop.submit(Abort(rid)).result(timeout=WAIT_S) is True
    finally:
        loop.stop()
    assert_engine_empty(loop.engine)


# ---- free seats: the scheduler's count ----


def test_the_scheduler_counts_free_seats_for_admission_and_the_waiting_queue():
    pair = EnginePair.tiny(decode_max_num_seqs=2)
    try:
        s = pair.decode.scheduler
        assert (s.free_seats(), s.waiting_for_seat()) == (2, -2)
        pair.reserve("reserved", PROMPT, GREEDY)
        for i in range(3):
            pair.decode.add_request(f"local{i}", PROMPT, GREEDY)
        assert (s.free_seats(), s.waiting_for_seat()) == (1, 2)  # the next step starts one of three
        pair.decode.step()
        assert (s.free_seats(), s.waiting_for_seat()) == (0, 2)
        for rid in ("reserved", "local0", "local1", "local2"):
            assert pair.decode.abort(rid)
    finally:
        pair.close()
    assert_engine_empty(pair.decode)
