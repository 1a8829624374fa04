"""The prefill role's KV connector: as each layer of a step lands in the cache,
queue exactly the blocks the decode worker lacks on the request's KV stream, so
the transfer hides behind the remaining layers' compute.

Streams are added and removed by the service on the engine thread, and the
layer hook runs there too. A stream that breaks (the decode side cancelled, its
lease ran out) stops sending and is reported by `poll`, which ends the request:
its prefill is wasted work from then on.

Each layer queued on a stream is an event (kv.layer) on the request's KV span
(prefill_worker/service.py), and the time the last layer of its last chunk was
computed starts the `kv_transfer_tail` phase.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NoReturn

import torch
from opentelemetry.trace import INVALID_SPAN, Span

from splitserve.engine.blocks import cdiv
from splitserve.engine.connector import TransferOutcome
from splitserve.engine.sequence import Sequence
from splitserve.kv_transfer import KVStream, TransferError

log = logging.getLogger(__name__)


@dataclass
class Outbound:
    """One request's KV on its way to the decode worker."""

    stream: KVStream
    ticket: bytes  # the reservation's: the transfer id
    first_index: int  # index in this request's block table of the reservation's first block
    sent_hi: int  # blocks below this were sent in earlier chunks (the last may have been partial)
    chunk: tuple[int, int] = (0, 0)  # block range of the chunk in flight, fixed at its layer 0
    failed: bool = False  # the stream broke: nothing more is sent
    span: Span = INVALID_SPAN  # the request's KV span: one event per layer queued
    # time.monotonic() when the last layer of the context's last chunk was computed (and queued)
    computed_at: float | None = None


class SenderConnector:
    wants_layers = True

    def __init__(self, block_size: int, num_layers: int, cuda: bool) -> None:
        self.block_size = block_size
        self.last_layer = num_layers - 1
        self.cuda = cuda
        self.outbound: dict[str, Outbound] = {}  # engine thread only
        self._failed: queue.SimpleQueue[TransferOutcome] = queue.SimpleQueue()

    def add(
        self, request_id: str, stream: KVStream, ticket: bytes, first_index: int, span: Span = INVALID_SPAN
    ) -> Outbound:
        ob = Outbound(stream, ticket, first_index, sent_hi=first_index, span=span)
        self.outbound[request_id] = ob
        return ob

    def remove(self, request_id: str, ticket: bytes) -> None:
        ob = self.outbound.get(request_id)
        if ob is not None and ob.ticket == ticket:
            del self.outbound[request_id]

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        bs = self.block_size
        synced = False
        for seq, n in zip(seqs, counts, strict=True):
            ob = self.outbound.get(seq.request_id)
            if ob is None or ob.failed:
                continue
            start = seq.num_computed_tokens  # not yet advanced past this step
            if layer == 0:
                # a partial block of the last chunk is sent again; blocks this worker had cached
                # (computed by nobody in this step) go with the first chunk
                lo = max(ob.first_index, min(ob.sent_hi, start // bs))
                ob.chunk = (lo, cdiv(start + n, bs))
            lo, hi = ob.chunk
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
                self._failed.put(TransferOutcome(seq.request_id, ob.ticket, None, e.code))
                continue
            if ob.span.is_recording():
                ob.span.add_event(
                    "kv.layer", {"layer": layer, "first_block": lo - ob.first_index, "blocks": hi - lo, "tokens": n}
                )
            if layer == self.last_layer:
                ob.sent_hi = hi
                if start + n >= len(seq):  # the context's last chunk: its KV is all computed
                    ob.computed_at = time.monotonic()

    def reserve(self, request_id: str, block_ids: list[int], lease_s: float) -> NoReturn:
        raise RuntimeError("a prefill worker reserves nothing")

    def cancel(self, transfer_id: bytes) -> bool:
        return True  # nothing is written into this worker's blocks from outside

    def poll(self) -> list[TransferOutcome]:
        out = []
        while True:
            try:
                out.append(self._failed.get_nowait())
            except queue.Empty:
                return out
