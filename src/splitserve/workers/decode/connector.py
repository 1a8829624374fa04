"""The decode role's KV connector: reservations on the KV receiver, and the
outcomes its threads report, queued for the engine loop's poll.

The receiver's threads never touch the engine: they queue what ended and wake
the loop. A reserved request's blocks are freed by the engine only after
`cancel` has confirmed that no write into them can still land, or after the
transfer's own outcome says so; the check in `cancel` counts any block that
is still writable (a broken promise, which must never happen) and keeps it.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from collections.abc import Sequence as Seq

from google.protobuf.message import DecodeError

from splitserve.engine.connector import TransferOutcome
from splitserve.engine.handoff import Handoff
from splitserve.engine.sequence import Sequence
from splitserve.kv_transfer import Completed, KVReceiver, Outcome, Reservation
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.workers.decode import metrics

log = logging.getLogger(__name__)


# How long `cancel` may hold the engine thread waiting for a write into the blocks to stop
# (closing the connection wakes it at once); past it the blocks wait for the transfer's outcome.
CANCEL_WAIT_S = 1.0


class ReceiverConnector:
    wants_layers = False

    def __init__(self, receiver: KVReceiver, cancel_timeout_s: float, wake: Callable[[], None] = lambda: None) -> None:
        self.receiver = receiver
        self.cancel_timeout_s = cancel_timeout_s
        self.wake = wake  # the engine loop's: a poll is due
        self._outcomes: queue.SimpleQueue[TransferOutcome] = queue.SimpleQueue()
        self._blocks: dict[bytes, tuple[int, ...]] = {}  # ticket -> its blocks (engine thread only)

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        pass

    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> None:
        pass  # a decode worker sends nothing

    def reserve(
        self, request_id: str, block_ids: list[int], lease_s: float, context_len: int = 0, first_index: int = 0
    ) -> Reservation:
        r = self.receiver.reserve(request_id, block_ids, lease_s, self._on_done, context_len, first_index)
        self._blocks[r.ticket] = r.block_ids
        return r

    def _on_done(self, r: Reservation, outcome: Outcome) -> None:
        """On a receiver thread, once no write into the blocks can still land."""
        if isinstance(outcome, Completed):
            try:
                handoff = _handoff(outcome.handoff)
            except ValueError as e:  # the blocks are whole but the request cannot go on from them
                log.warning("request %s: the prefill worker's handoff is unusable: %s", r.request_id, e)
                self._outcomes.put(TransferOutcome(r.request_id, r.ticket, None, "bad_handoff"))
            else:
                self._outcomes.put(TransferOutcome(r.request_id, r.ticket, outcome.first_token, None, handoff))
        else:
            self._outcomes.put(TransferOutcome(r.request_id, r.ticket, None, outcome.code or "failed"))
        self.wake()

    def cancel(self, transfer_id: bytes) -> bool:
        blocks = self._blocks.pop(transfer_id, ())
        try:
            self.receiver.cancel(transfer_id, timeout=self.cancel_timeout_s)
        except TimeoutError:
            log.error(
                "a write into a cancelled reservation did not stop in %gs; its blocks are freed when it does",
                self.cancel_timeout_s,
            )
            return False
        live = self.receiver.live_blocks(list(blocks))
        if live:
            metrics.BLOCKS_FREED_WHILE_RESERVED.inc(len(live))
            log.error("blocks %s are still in a live reservation after its cancel; keeping them", live[:8])
            return False
        return True

    def poll(self) -> list[TransferOutcome]:
        out: list[TransferOutcome] = []
        while True:
            try:
                o = self._outcomes.get_nowait()
            except queue.Empty:
                return out
            self._blocks.pop(o.transfer_id, None)
            out.append(o)


def _handoff(payload: bytes) -> Handoff | None:
    """The done frame's handoff record (None: a sender that sent the first token alone)."""
    if not payload:
        return None
    try:
        return convert.handoff_from_proto(wpb.Handoff.FromString(payload))
    except DecodeError as e:
        raise ValueError(f"not a Handoff message: {e}") from None
