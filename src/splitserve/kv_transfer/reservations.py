"""The receiver's reservations: which blocks may be written, until when, and how each one ended.

`Reservations` is the bookkeeping half of a `KVReceiver` (receiver.py serves the
connections): it hands out reservations, expires their leases, and reports each
one's outcome through `wait` or the `on_done` callback.

What it promises the block manager (which stays the worker's): writes land
only in a live reservation's blocks; on any failure (bad frame, lost sender,
lease run out, cancel) it resets those blocks and reports the failure only
after no write into them can still be in progress, so the worker may free the
blocks as soon as it hears. The connection side keeps its part by binding a
stream to its reservation (`bind`), bracketing every write into the blocks
with `begin_write` and `end_write`, and ending the stream with `complete` or
`fail`.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

from splitserve.engine.blocks import window_start
from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer import frame, metrics
from splitserve.kv_transfer.reservation import Completed, Failed, FailureCode, Outcome, Reservation, TransportName
from splitserve.kv_transfer.transport import Connection, ConnectionClosed

log = logging.getLogger(__name__)

_ACTIVE, _FAILING, _DONE = "active", "failing", "done"


class Rejected(Exception):
    """A frame, connection or stream refused: `code` labels the metric and the failure; the message is the reason."""

    def __init__(self, code: FailureCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Slot:
    """One reservation's state, shared by the bookkeeping and the stream that fills it."""

    def __init__(self, r: Reservation, deadline: float, on_done: Callable[[Reservation, Outcome], None] | None) -> None:
        self.reservation = r
        self.position = {b: i for i, b in enumerate(r.block_ids)}  # block id -> index in the reservation
        # What the stream wrote, per layer, block and KV head: every head of every layer counts
        # (frames carry one receiver shard's heads each), so done needs them all.
        self.received = np.zeros((r.layout.num_layers, len(r.block_ids), r.layout.num_kv_heads), dtype=bool)
        self.deadline = deadline  # time.monotonic()
        self.on_done = on_done
        self.lock = threading.Lock()
        self.state = _ACTIVE
        self.writers = 0  # connection threads inside a write into the blocks
        self.conn: Connection | None = None  # the stream's, once bound
        self.outcome: Outcome | None = None
        self.code: FailureCode | None = None  # once failed
        self.finished = threading.Event()


class Reservations:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._slots: dict[bytes, Slot] = {}  # active, plus finished ones nobody has collected
        self._reserved: set[int] = set()
        self._closed = False
        self._leases: list[tuple[float, bytes]] = []
        self._lease_cv = threading.Condition(self._lock)
        self._lease_thread = threading.Thread(target=self._lease_loop, name="kv-leases", daemon=True)
        self._lease_thread.start()

    # ---- the decode worker's side (KVReceiver's public methods) -------------------

    def reserve(
        self,
        request_id: str,
        block_ids: list[int],
        lease_s: float,
        on_done: Callable[[Reservation, Outcome], None] | None,
        *,
        transport: TransportName,
        endpoint: str,
        tcp_endpoint: str,
        context_len: int = 0,
        first_index: int = 0,
    ) -> Reservation:
        """A new reservation of `block_ids`; `transport` and the endpoints are the receiver's offer;
        `context_len` and `first_index`: see KVReceiver.reserve."""
        if not block_ids:
            raise ValueError("a reservation needs at least one block")
        if len(request_id.encode()) > frame.REQUEST_ID_BYTES:
            raise ValueError(f"request id longer than {frame.REQUEST_ID_BYTES} bytes")
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        ids = tuple(int(b) for b in block_ids)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.cache.num_blocks:
            raise ValueError(f"block ids must be distinct and in 0..{self.cache.num_blocks - 1}")
        r = Reservation(
            request_id=request_id,
            ticket=secrets.token_bytes(16),
            transport=transport,
            endpoint=endpoint,
            tcp_endpoint=tcp_endpoint,
            block_ids=ids,
            layout=self.cache.layout,
            lease_deadline_unix_ms=int((time.time() + lease_s) * 1000),
        )
        slot = Slot(r, time.monotonic() + lease_s, on_done)
        if context_len:  # a windowed layer's blocks behind its window never travel: nothing to wait for
            lay = self.cache.layout
            for layer, window in enumerate(lay.windows):
                skip = window_start(context_len, window, lay.block_size) - first_index
                if skip > 0:
                    slot.received[layer, :skip] = True
        with self._lock:
            if self._closed:
                raise RuntimeError("receiver is closed")
            overlap = self._reserved.intersection(ids)
            if overlap:
                raise ValueError(f"blocks {sorted(overlap)[:8]} are already in a live reservation")
            self._reserved.update(ids)
            self._slots[r.ticket] = slot
            heapq.heappush(self._leases, (slot.deadline, r.ticket))
            self._lease_cv.notify()
        return r

    def wait(self, ticket: bytes, timeout: float) -> Outcome:
        with self._lock:
            slot = self._slots.get(ticket)
        if slot is None:
            raise KeyError("unknown ticket (never reserved, or its outcome was already collected)")
        if not slot.finished.wait(timeout):
            raise TimeoutError(f"reservation {slot.reservation.request_id} still in flight after {timeout}s")
        with self._lock:
            self._slots.pop(ticket, None)
        assert slot.outcome is not None
        return slot.outcome

    def cancel(self, ticket: bytes, timeout: float) -> None:
        with self._lock:
            slot = self._slots.get(ticket)
        if slot is None:
            return
        self.fail(slot, FailureCode.CANCELLED, "cancelled")
        if not slot.finished.wait(timeout):
            raise TimeoutError("a write into the cancelled reservation did not stop")
        with self._lock:
            self._slots.pop(ticket, None)

    def live_blocks(self, block_ids: list[int]) -> list[int]:
        with self._lock:
            return [b for b in block_ids if b in self._reserved]

    def active(self) -> int:
        with self._lock:
            return sum(1 for s in self._slots.values() if s.state != _DONE)

    def close(self) -> None:
        """No more reservations; every live one fails as "receiver_closed"."""
        with self._lock:
            self._closed = True
            slots = list(self._slots.values())
            self._lease_cv.notify()
        for s in slots:
            self.fail(s, FailureCode.RECEIVER_CLOSED, "receiver closed")
        self._lease_thread.join(timeout=5)

    # ---- the stream's side --------------------------------------------------------

    def bind(self, ticket: bytes, request_id: str, conn: Connection) -> Slot:
        """The live reservation a handshake names, now bound to `conn`'s stream; raises Rejected."""
        with self._lock:
            slot = self._slots.get(ticket)
        if slot is None or slot.reservation.request_id != request_id:
            raise Rejected(FailureCode.UNKNOWN_TICKET, "unknown ticket")
        with slot.lock:
            if slot.state != _ACTIVE or slot.conn is not None:
                busy = "already has a stream" if slot.state == _ACTIVE else "is no longer live"
                raise Rejected(FailureCode.TICKET_IN_USE, f"reservation {busy}")
            slot.conn = conn
        return slot

    def unbind(self, slot: Slot, conn: Connection) -> None:
        """`conn`'s stream is over (a failure still tells the sender on it, until then)."""
        with slot.lock:
            if slot.conn is conn:
                slot.conn = None

    def begin_write(self, slot: Slot) -> None:
        """Before a write into the slot's blocks; raises Rejected if it is no longer live."""
        with slot.lock:
            if slot.state != _ACTIVE:
                raise Rejected(slot.code or FailureCode.NOT_LIVE, "reservation no longer live")
            slot.writers += 1

    def end_write(self, slot: Slot) -> None:
        """After the write, however it went. A failure that came meanwhile left the reset to us."""
        with slot.lock:
            slot.writers -= 1
            orphaned = slot.state == _FAILING and slot.writers == 0
        if orphaned:
            self._finalize(slot)

    def complete(self, slot: Slot, first_token: int, handoff: bytes = b"") -> None:
        """Every layer of every block arrived, then done: the reservation completes (raises
        Rejected if it is no longer live)."""
        with slot.lock:
            if slot.state != _ACTIVE:
                raise Rejected(slot.code or FailureCode.NOT_LIVE, "reservation no longer live")
            slot.state, slot.outcome = _DONE, Completed(first_token, handoff)
        metrics.RESERVATIONS_COMPLETED.inc()
        self._finish(slot)

    def fail(self, slot: Slot, code: FailureCode, reason: str) -> None:
        """Fail a live reservation: tell its sender why (best effort) and drop its stream;
        its blocks are reset and the worker told once no write into them is in progress."""
        with slot.lock:
            if slot.state != _ACTIVE:
                return
            slot.state, slot.outcome, slot.code = _FAILING, Failed(reason, code), code
            conn, idle = slot.conn, slot.writers == 0
        if conn is not None:
            r = slot.reservation
            try:
                conn.send(frame.control(frame.ERROR, r.ticket, r.request_id, reason))
            except ConnectionClosed:
                pass
            conn.close()  # wakes a write blocked in recv_into; that thread then finalizes
        if idle:
            self._finalize(slot)

    # ---- internals -----------------------------------------------------------------

    def _finalize(self, slot: Slot) -> None:
        """Reset a failed reservation's blocks, then tell the worker (no writer is left)."""
        r = slot.reservation
        self.cache.reset_blocks(list(r.block_ids))
        with slot.lock:
            slot.state = _DONE
        outcome = slot.outcome
        assert isinstance(outcome, Failed)
        if slot.code != FailureCode.CANCELLED:
            log.warning("kv_transfer: reservation %s failed: %s", r.request_id, outcome.reason)
        metrics.RESERVATIONS_FAILED.labels(reason=outcome.code).inc()
        self._finish(slot)

    def _finish(self, slot: Slot) -> None:
        r = slot.reservation
        with self._lock:
            self._reserved.difference_update(r.block_ids)
            if slot.on_done is not None:
                self._slots.pop(r.ticket, None)
        slot.finished.set()
        if slot.on_done is not None:
            assert slot.outcome is not None
            try:
                slot.on_done(r, slot.outcome)
            except Exception:
                log.exception("kv_transfer: on_done callback raised")

    def _lease_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    now = time.monotonic()
                    if self._leases and self._leases[0][0] <= now:
                        break
                    self._lease_cv.wait(timeout=self._leases[0][0] - now if self._leases else None)
                if self._closed:
                    return
                _, ticket = heapq.heappop(self._leases)
                slot = self._slots.get(ticket)
            if slot is not None:
                self.fail(slot, FailureCode.LEASE_EXPIRED, "lease expired")
