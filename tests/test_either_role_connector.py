"""The connector of a worker of both roles sends each engine call to the side that owns it."""

from __future__ import annotations

from typing import Any

from splitserve.engine.connector import TransferOutcome
from splitserve.workers.common.either_role import EitherRoleConnector


class Ticket:
    def __init__(self, ticket: bytes) -> None:
        self.ticket = ticket


class Side:
    """A role's connector that notes every call."""

    def __init__(self, frees: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.outcomes: list[TransferOutcome] = []
        self.frees = frees
        self.sending = False
        self.wants_layers = True

    def on_layer_done(self, layer: int, seqs: Any, counts: Any) -> None:
        self.calls.append(("layer", layer))

    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Any) -> None:
        self.calls.append(("prefill_done", request_id))

    def reserve(self, request_id: str, block_ids: list[int], lease_s: float, *_: int) -> Ticket:
        self.calls.append(("reserve", request_id))
        return Ticket(request_id.encode())

    def cancel(self, transfer_id: bytes) -> bool:
        self.calls.append(("cancel", transfer_id))
        return self.frees

    def poll(self) -> list[TransferOutcome]:
        out, self.outcomes = self.outcomes, []
        return out


def test_prefill_calls_go_to_the_sender_and_reservations_to_the_receiver() -> None:
    sender, receiver = Side(), Side()
    c = EitherRoleConnector(sender, receiver)
    assert not c.wants_layers  # no send open: a decode step keeps its CUDA graphs
    sender.sending = True
    assert c.wants_layers
    c.on_layer_done(0, [], [])
    c.on_prefill_done("p", b"p", None)
    assert c.reserve("d", [1, 2], 1.0).ticket == b"d"
    assert sender.calls == [("layer", 0), ("prefill_done", "p")]
    assert receiver.calls == [("reserve", "d")]


def test_a_cancel_goes_to_the_side_that_gave_the_transfer_id() -> None:
    sender, receiver = Side(), Side(frees=False)
    c = EitherRoleConnector(sender, receiver)
    c.reserve("d", [1], 1.0)
    assert c.cancel(b"d") is False  # a write may still land: the blocks wait for its outcome
    assert c.cancel(b"p") is True
    assert receiver.calls[-1] == ("cancel", b"d")
    assert sender.calls == [("cancel", b"p")]
    # the receiver's outcome ends the reservation: a later cancel of that id is the sender's
    receiver.outcomes = [TransferOutcome("d", b"d", None, "cancelled")]
    sender.outcomes = [TransferOutcome("p", b"p", 7, None)]
    assert [o.request_id for o in c.poll()] == ["p", "d"]
    c.cancel(b"d")
    assert sender.calls[-1] == ("cancel", b"d")
