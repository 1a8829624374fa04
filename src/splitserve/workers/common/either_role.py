"""The KV connector of a worker that serves both pools (`WorkerConfig.switchable`).

The pool manager may move such a worker from one pool to the other without a new
process: it stops routing to it, waits until it is idle, and hands it to the router
in its other role. The process is ready for either all along: one engine, both
roles' gRPC services, the decode role's KV receiver and the prefill role's sender.
The engine has one connector, so this one joins the two:

- what only a prefill worker's engine calls (each layer's KV done, a prefill done)
  goes to the sender; the layer hook is asked for only while a send is open, so a
  step of decodes alone keeps what a hook would turn off (CUDA graphs);
- what only a decode worker's engine calls (a reservation) goes to the receiver;
- `cancel` goes to the side that gave out the transfer id, and `poll` reads both.

The roles' own connectors are passed in: common/ imports neither role.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

from splitserve.engine.connector import KVConnector, Transfer, TransferOutcome

if TYPE_CHECKING:
    from splitserve.engine.handoff import Handoff
    from splitserve.engine.sequence import Sequence


class Sender(KVConnector, Protocol):
    @property
    def sending(self) -> bool: ...  # a send is open: the next step's layers may carry KV


class EitherRoleConnector:
    def __init__(self, sender: Sender, receiver: KVConnector) -> None:
        self.sender = sender
        self.receiver = receiver
        self._reserved: set[bytes] = set()  # the receiver's transfer ids not yet ended (engine thread only)

    @property
    def wants_layers(self) -> bool:
        return self.sender.sending

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        self.sender.on_layer_done(layer, seqs, counts)

    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> None:
        self.sender.on_prefill_done(request_id, transfer_id, handoff)

    def reserve(
        self, request_id: str, block_ids: list[int], lease_s: float, context_len: int = 0, first_index: int = 0
    ) -> Transfer:
        transfer = self.receiver.reserve(request_id, block_ids, lease_s, context_len, first_index)
        self._reserved.add(transfer.ticket)
        return transfer

    def cancel(self, transfer_id: bytes) -> bool:
        if transfer_id in self._reserved:
            freed = self.receiver.cancel(transfer_id)
            if freed:
                self._reserved.discard(transfer_id)
            return freed
        return self.sender.cancel(transfer_id)

    def poll(self) -> list[TransferOutcome]:
        received = self.receiver.poll()
        for o in received:
            self._reserved.discard(o.transfer_id)
        return self.sender.poll() + received
