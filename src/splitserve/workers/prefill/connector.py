"""The prefill role's KV connector: one request's send, from opening its KV
stream to the decode worker's confirmation.

`open` (a gRPC handler's thread) connects to the reservation and keeps the
stream under the reservation's ticket, which is also the request's transfer id
in the engine. As each layer of a step lands in the cache (`on_layer_done`,
engine thread) it queues exactly the blocks the decode worker lacks (of a windowed
layer, only those its window still sees: engine/blocks.py's `window_start`), so the
transfer hides behind the remaining layers' compute. Once the engine has sampled
the request's first token (`on_prefill_done`, engine thread; the request is
HELD, its blocks kept for the sender) it sends Done and returns at once: the
stream's own thread waits for the confirmation, bounded by the sender's
watchdog, and reports how it ended. Every ending comes back through `poll`,
keyed by ticket: confirmed (the engine frees the held blocks) or failed with a
code (the engine ends the request: a broken stream makes the rest of its
prefill wasted work). `abort` (the handler's thread) gives up a send whose
call ends before its first token.

Traced: the request's KV span (prefill.kv_send, under the router's Prefill call)
runs from `open` to the confirmation, with an event per layer queued (kv.layer),
and under it prefill.kv_transfer_tail (the `kv_transfer_tail` phase: the last
layer of the context computed to the confirmation).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
from opentelemetry.context import Context
from opentelemetry.trace import Span

from splitserve.engine.blocks import cdiv, window_start
from splitserve.engine.connector import TransferOutcome
from splitserve.engine.handoff import Handoff
from splitserve.engine.sequence import Sequence
from splitserve.kv_transfer import KVSender, KVStream, Reservation, TransferError
from splitserve.proto import convert
from splitserve.runtime import tracing

if TYPE_CHECKING:
    from prometheus_client import Histogram

log = logging.getLogger(__name__)


@dataclass
class Outbound:
    """One request's KV on its way to the decode worker (its fields: the engine thread's)."""

    request_id: str
    stream: KVStream
    ticket: bytes  # the reservation's: the transfer id
    first_index: int  # index in this request's block table of the reservation's first block
    span: Span  # the request's KV span: one event per layer queued
    sent_hi: int  # blocks below this were sent in earlier chunks (the last may have been partial)
    chunk: tuple[int, int] = (0, 0)  # block range of the chunk in flight, fixed at its layer 0
    failed: bool = False  # the stream broke: nothing more is sent
    # time.monotonic() when the last layer of the context's last chunk was computed (and queued)
    computed_at: float | None = None


class SenderConnector:
    wants_layers = True

    def __init__(
        self,
        sender: KVSender,
        confirm_timeout_s: float,
        tail_time: Histogram | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """`confirm_timeout_s`: how long a send waits for the decode worker's confirmation;
        `tail_time`: the `kv_transfer_tail` phase's histogram; `wake`: the engine loop's (a poll is due)."""
        self.sender = sender
        self.block_size = sender.cache.layout.block_size
        self.last_layer = sender.cache.layout.num_layers - 1
        self.windows = sender.cache.layout.windows  # each layer's sliding window (0: global); () for none
        self.cuda = sender.cache.tensor.is_cuda
        self.confirm_timeout_s = confirm_timeout_s
        self.tail_time = tail_time
        self.wake = wake
        self._lock = threading.Lock()
        self._sends: dict[bytes, Outbound] = {}  # ticket -> the send, from `open` until it ends
        self._outcomes: queue.SimpleQueue[TransferOutcome] = queue.SimpleQueue()

    @property
    def sending(self) -> bool:
        """A send is open: the next step's layers may carry KV (a worker of both roles asks)."""
        return bool(self._sends)

    # ---- a gRPC handler's thread ----

    def open(self, request_id: str, reservation: Reservation, first_index: int, parent: Context) -> None:
        """Connect and handshake (raises TransferError); the send is kept under the reservation's
        ticket, which the engine's request must carry as its transfer id."""
        span = tracing.start_span(
            "prefill.kv_send",
            parent,
            {
                "splitserve.attempt_id": request_id,
                "splitserve.kv_endpoint": reservation.endpoint,
                "splitserve.blocks": len(reservation.block_ids),
            },
        )
        try:
            stream = self.sender.open(reservation)
        except TransferError as e:
            tracing.end_span(span, f"KV stream to {reservation.endpoint}: {e}")
            raise
        ob = Outbound(request_id, stream, reservation.ticket, first_index, span, sent_hi=first_index)
        with self._lock:
            clash = reservation.ticket in self._sends
            if not clash:
                self._sends[reservation.ticket] = ob
        if clash:  # one send per reservation: its ticket keys the send here and the request in the engine
            stream.abort("a send to this reservation is in flight already")
            tracing.end_span(span, "a send to this reservation is in flight already")
            raise TransferError("a send to this reservation is in flight already")

    def abort(self, ticket: bytes, reason: str) -> None:
        """Give up the send (the receiver fails its reservation); nothing is reported for it."""
        with self._lock:
            ob = self._sends.pop(ticket, None)
        if ob is not None:
            ob.stream.abort(reason)
            tracing.end_span(ob.span, reason)

    # ---- the engine thread ----

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        with self._lock:
            sends = [self._sends.get(seq.transfer_id) for seq in seqs]
        synced = False
        for seq, n, ob in zip(seqs, counts, sends, strict=True):
            if ob is None or ob.failed:
                continue
            start = seq.num_computed_tokens  # not yet advanced past this step
            if layer == 0:
                # a partial block of the last chunk is sent again; blocks this worker had cached
                # (computed by nobody in this step) go with the first chunk
                lo = max(ob.first_index, min(ob.sent_hi, start // self.block_size))
                ob.chunk = (lo, cdiv(start + n, self.block_size))
            lo, hi = ob.chunk
            # a windowed layer's blocks behind its window: the decode worker never reads them
            lo = max(lo, window_start(len(seq), self.windows[layer], self.block_size)) if self.windows else lo
            if hi <= lo:
                continue
            if self.cuda and not synced:
                torch.cuda.current_stream().synchronize()  # the layer's writes must land before the copy
                synced = True
            try:
                ob.stream.send_layer(layer, seq.block_table[lo:hi], first_index=lo - ob.first_index)
            except TransferError as e:
                log.warning("request %s: KV stream failed, dropping the prefill: %s", seq.request_id, e)
                ob.failed = True
                self._outcomes.put(TransferOutcome(seq.request_id, ob.ticket, None, e.code))
                continue
            if ob.span.is_recording():
                ob.span.add_event(
                    "kv.layer", {"layer": layer, "first_block": lo - ob.first_index, "blocks": hi - lo, "tokens": n}
                )
            if layer == self.last_layer:
                ob.sent_hi = hi
                if start + n >= len(seq):  # the context's last chunk: its KV is all computed
                    ob.computed_at = time.monotonic()

    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> None:
        """Send Done with the handoff record (what the decode worker continues from); the stream's
        thread reports the confirmation (a broken stream was reported)."""
        with self._lock:
            ob = self._sends.get(transfer_id)
        if ob is None or ob.failed:
            return
        first = handoff.samples[0].output_token_ids[-1]
        payload = convert.handoff_to_proto(handoff).SerializeToString()
        ob.stream.finish_async(
            first, self.confirm_timeout_s, lambda error: self._ended(ob, first, error), handoff=payload
        )

    def reserve(
        self, request_id: str, block_ids: list[int], lease_s: float, context_len: int = 0, first_index: int = 0
    ) -> NoReturn:
        raise RuntimeError("a prefill worker reserves nothing")

    def cancel(self, transfer_id: bytes) -> bool:
        return True  # nothing is written into this worker's blocks from outside

    def poll(self) -> list[TransferOutcome]:
        out = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                return out

    # ---- the stream's thread ----

    def _ended(self, ob: Outbound, first_token: int, error: TransferError | None) -> None:
        """The send is over: confirmed (error None) or not; the engine hears at its next poll."""
        confirmed = time.monotonic()
        with self._lock:
            mine = self._sends.get(ob.ticket) is ob
            if mine:
                del self._sends[ob.ticket]
        if error is None:
            self._outcomes.put(TransferOutcome(ob.request_id, ob.ticket, first_token, None))
        else:
            log.warning("request %s: KV not confirmed: %s", ob.request_id, error)
            self._outcomes.put(TransferOutcome(ob.request_id, ob.ticket, None, error.code))
        self.wake()
        if not mine:  # `abort` took it and ended its span
            return
        if error is None and ob.computed_at is not None:
            tracing.record_phase(
                "prefill.kv_transfer_tail", tracing.child(ob.span), self.tail_time, ob.computed_at, confirmed
            )
        tracing.end_span(ob.span, None if error is None else f"KV not confirmed: {error}")
