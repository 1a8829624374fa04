"""The worker-side lifecycle of a disaggregated request, on CPU engines joined
by the in-memory fake transport (tests/worker_helpers.py): reserve, stream, commit,
release, cancel at every stage, lease expiry, a failed transfer's code, and
`max_num_seqs` on the decode side. Every test ends with both engines empty."""

from __future__ import annotations

import pytest

from splitserve.engine.connector import NullConnector, TransferOutcome
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import SeqStatus
from splitserve.kv_transfer import TransferError
from tests.worker_helpers import EnginePair, assert_engine_empty, tiny_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 23))  # 22 tokens: five full blocks of 4 and a partial one
LONG = list(range(1, 121))  # 15 prefill steps of 8 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def pair():
    p = EnginePair.tiny()
    yield p
    p.close()
    assert_engine_empty(p.prefill)
    assert_engine_empty(p.decode)


def test_a_remote_prefill_gives_the_local_engines_tokens(pair):
    (want,) = tiny_engine().generate([PROMPT], GREEDY)
    remote = pair.reserve("r", PROMPT, GREEDY)
    assert pair.decode.lookup("r").status is SeqStatus.RESERVED
    pair.start_prefill("r", PROMPT, GREEDY, remote)
    first = pair.prefill_until_done("r")
    assert pair.prefill.lookup("r").status is SeqStatus.HELD  # blocks kept while the sender reads them
    assert pair.poll_prefill() == []  # the confirmed send frees them
    assert pair.prefill.lookup("r") is None
    (committed,) = pair.poll_decode()
    assert committed.token_id == -1 and not committed.finished  # the router has the first token already
    assert [first, *pair.decode_to_end("r")] == want


def test_the_decode_side_admits_at_most_max_num_seqs():
    pair = EnginePair.tiny(decode_max_num_seqs=2)
    try:
        got = [pair.decode.reserve(f"r{i}", PROMPT, GREEDY, 30.0) for i in range(5)]
        assert [g is not None for g in got] == [True, True, False, False, False]
        pair.decode.add_request("local", PROMPT, GREEDY)  # a local request waits for a seat too
        assert pair.decode.scheduler.schedule(0.0) is None
        for i in range(2):
            pair.decode.abort(f"r{i}")
        assert pair.decode.scheduler.schedule(0.0) is not None
        pair.decode.abort("local")
    finally:
        pair.close()
    assert_engine_empty(pair.decode)


def test_abort_while_reserved_frees_blocks_and_the_reservation(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    assert pair.receiver.live_blocks(list(remote.transfer.block_ids))
    assert pair.decode.abort("r")
    assert not pair.receiver.live_blocks(list(remote.transfer.block_ids))
    with pytest.raises(TransferError):  # nobody may write there any more
        pair.sender.open(remote.transfer)
    assert pair.decode.apply_transfers(pair.decode_connector.poll()) == []  # the cancel's own outcome is ignored


def test_abort_on_the_decode_side_mid_stream_ends_the_prefill_with_the_streams_code(pair):
    remote = pair.reserve("r", LONG, GREEDY)
    pair.start_prefill("r", LONG, GREEDY, remote)
    pair.step_prefill()  # the first chunk's layers are on their way
    assert pair.decode.abort("r")  # the router went away
    outs = []
    for _ in range(15):
        outs += [o for o in pair.step_prefill() if o.request_id == "r"]
        if outs:
            break
    (out,) = outs
    assert out.finished and out.finish_reason not in ("prefill_done", "abort")  # the stream's failure code
    assert pair.prefill.lookup("r") is None


def test_abort_on_the_prefill_side_before_the_first_token(pair):
    for stage in ("waiting", "running"):
        remote = pair.reserve(stage, PROMPT, GREEDY)
        ticket = pair.start_prefill(stage, PROMPT, GREEDY, remote)
        if stage == "running":
            pair.step_prefill()
        assert pair.prefill.lookup(stage).status.value == stage
        assert pair.prefill.abort(stage)
        pair.prefill_connector.abort(ticket, "cancelled")  # what the service does when its call ends
        (failed,) = pair.poll_decode()
        assert failed.finish_reason == "aborted_by_sender"
    assert pair.poll_prefill() == []  # an aborted send reports nothing


def test_a_held_request_aborted_while_its_send_is_confirmed_frees_its_blocks_once(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    pair.start_prefill("r", PROMPT, GREEDY, remote)
    pair.prefill_until_done("r")  # Done is on its way
    assert pair.prefill.abort("r")
    (committed,) = pair.poll_decode()  # the decode side has every byte: the request runs there
    assert not committed.finished
    assert pair.poll_prefill() == []  # the confirmation finds no held request: nothing is freed twice
    assert pair.decode.abort("r")


def test_abort_after_commit_frees_a_running_request(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    pair.start_prefill("r", PROMPT, GREEDY, remote)
    pair.prefill_until_done("r")
    pair.poll_prefill()
    pair.poll_decode()
    pair.decode.step()
    assert pair.decode.lookup("r").status is SeqStatus.RUNNING
    assert pair.decode.abort("r")


def test_a_lease_that_runs_out_ends_the_request_with_its_code(pair):
    pair.reserve("r", PROMPT, GREEDY, lease_s=0.05)
    (out,) = pair.poll_decode()
    assert (out.finished, out.finish_reason, out.token_id) == (True, "lease_expired", -1)


def test_a_sender_that_aborts_ends_the_request_with_its_code(pair):
    remote = pair.reserve("r", PROMPT, GREEDY)
    pair.sender.open(remote.transfer).abort("prefill worker stopping")
    (out,) = pair.poll_decode()
    assert out.finish_reason == "aborted_by_sender"


def test_a_late_outcome_never_touches_a_newer_request_with_the_same_id(pair):
    old = pair.reserve("r", PROMPT, GREEDY)
    pair.decode.abort("r")
    pair.reserve("r", PROMPT, GREEDY)
    stale = TransferOutcome("r", old.transfer.ticket, None, "lease_expired")
    assert pair.decode.apply_transfers([stale]) == []
    assert pair.decode.lookup("r").status is SeqStatus.RESERVED
    pair.decode.abort("r")


class _StuckConnector(NullConnector):
    """A connector whose transfers cannot be stopped at once (a write still in progress)."""

    def __init__(self) -> None:
        self.tickets = iter(bytes([i]) * 16 for i in range(1, 100))

    def reserve(self, request_id, block_ids, lease_s, context_len=0, first_index=0):
        return type("T", (), {"ticket": next(self.tickets)})()

    def cancel(self, transfer_id: bytes) -> bool:
        return False


def test_blocks_a_transfer_may_still_write_are_freed_only_when_it_ends():
    engine = tiny_engine()
    engine.connect(_StuckConnector())
    remote = engine.reserve("r", PROMPT, GREEDY, 30.0)
    assert remote is not None
    free_before_abort = engine.blocks.num_free_blocks
    assert engine.abort("r")
    assert engine.lookup("r") is None and engine.blocks.num_free_blocks == free_before_abort
    assert engine.apply_transfers([TransferOutcome("r", remote.transfer.ticket, None, "cancelled")]) == []
    assert_engine_empty(engine)


def test_a_duplicate_id_is_refused_before_any_block_is_taken(pair):
    pair.reserve("r", PROMPT, GREEDY)
    free = pair.decode.blocks.num_free_blocks
    with pytest.raises(ValueError, match="already in use"):
        pair.decode.reserve("r", PROMPT, GREEDY, 30.0)
    assert pair.decode.blocks.num_free_blocks == free
    pair.decode.abort("r")
