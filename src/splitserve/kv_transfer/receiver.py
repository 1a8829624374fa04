"""The decode side of the KV plane: `KVReceiver`, and the connections that fill its reservations.

A decode worker starts one `KVReceiver` over its `KVCache`. For each request
it wants prefilled elsewhere it calls `reserve(request_id, block_ids, lease_s)`
and hands the plain-data `Reservation` to the router; a prefill worker opens a
stream with it and pushes frames, which land straight in the reserved blocks.
The worker learns the end through `wait(ticket, timeout)` or the `on_done`
callback: `Completed(first_token)` once every layer of every block arrived and
`Done` came, or `Failed(reason, code)`.

The reservations themselves, and what the receiver promises the block manager
about them, are reservations.py's. This module serves the connections: it
listens (links.py picks the transport), binds each stream to its reservation
at the handshake, checks every frame against it, and writes the payloads into
the reserved blocks.

What it promises the host: no peer holds a connection (and its thread) for
long without progress. A fresh connection must complete its handshake within
`handshake_timeout_s`; a frame, once its first byte arrived, must be whole
within `frame_timeout_s` plus its length at `frame_min_bytes_per_s`; a
connection between streams is closed after `idle_timeout_s`; the wait for a
stream's next frame is bounded by its reservation's lease. At most
`max_unbound_connections` connections may be open and not yet bound to a
reservation by a handshake with a valid ticket; one more is closed at once.
One watchdog thread enforces the deadlines; drops are counted by reason in
`splitserve_kv_connections_dropped_total`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from splitserve.engine.kv_cache import KVCache, quantize_into
from splitserve.kv_transfer import codec, frame, heads, links, metrics
from splitserve.kv_transfer.frame import FrameError, Header

# Reservation and the outcomes live in reservation.py; they are importable from here as well, as before.
from splitserve.kv_transfer.reservation import Completed, Failed, FailureCode, Outcome, Reservation, TransportName
from splitserve.kv_transfer.reservations import Rejected, Reservations, Slot
from splitserve.kv_transfer.transport import Connection, ConnectionClosed, Transport, Watchdog, Watched

__all__ = ["Completed", "Failed", "KVReceiver", "Outcome", "Reservation"]

log = logging.getLogger(__name__)

# How long a peer may keep a connection's thread waiting without progress (module docstring).
HANDSHAKE_TIMEOUT_S = 10.0  # connect -> handshake whole; an honest sender handshakes at once
FRAME_TIMEOUT_S = 10.0  # a frame's first byte -> its last, plus its length at FRAME_MIN_BYTES_PER_S
# Loose on purpose: only a bound stream (a valid ticket, and a lease bounding it
# anyway) sends big frames, and a live but slow link (1 GbE shared by a few
# streams) must still get a 0.5 GiB layer frame through (10 s + 32 s here).
FRAME_MIN_BYTES_PER_S = 16 << 20
IDLE_TIMEOUT_S = 60.0  # a connection with no stream under way is closed after this
MAX_UNBOUND_CONNECTIONS = 64  # open connections before or inside their handshake; more are closed at once
RECV_PIECE_BYTES = 1 << 20  # a whole number of checksum lanes

# Why the watchdog closed a connection, for the log line and the reservation's failure.
_DROP_TEXT = {
    FailureCode.HANDSHAKE_TIMEOUT: "handshake not complete {:.2f}s after connect",
    FailureCode.FRAME_TIMEOUT: "frame not complete {:.2f}s after its first byte",
    FailureCode.IDLE: "no stream started in {:.2f}s",
}


def _drop_text(w: Watched) -> str:
    return _DROP_TEXT[FailureCode(w.expired)].format(w.held_s)


class KVReceiver:
    def __init__(
        self,
        cache: KVCache,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportName | Transport = "tcp",
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        frame_min_bytes_per_s: float = FRAME_MIN_BYTES_PER_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_unbound_connections: int = MAX_UNBOUND_CONNECTIONS,
    ) -> None:
        """`transport`: "tcp", "ucx" (TCP as well, for fallback) or "cuda_ipc" (a CUDA
        cache; control over TCP), or a `Transport` object in place of TCP (the fake);
        what this machine and cache cannot serve falls back to TCP (links.py).
        The timeouts and the cap bound what slow or silent peers can hold (module docstring)."""
        if min(handshake_timeout_s, frame_timeout_s, frame_min_bytes_per_s, idle_timeout_s) <= 0:
            raise ValueError("timeouts and the minimum frame rate must be positive")
        if max_unbound_connections < 1:
            raise ValueError("max_unbound_connections must be at least 1")
        self.cache = cache
        self.handshake_timeout_s = handshake_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.frame_min_bytes_per_s = frame_min_bytes_per_s
        self.idle_timeout_s = idle_timeout_s
        self.max_unbound_connections = max_unbound_connections
        self._book = Reservations(cache)
        self._lock = threading.Lock()
        self._conns: dict[Connection, Watched] = {}
        self._unbound: set[Connection] = set()  # open, no handshake with a valid ticket yet
        self._refused_unlogged, self._refused_logged_at = 0, -1e9  # connections refused over the cap
        self._closed = False
        self._local = threading.local()  # per connection thread: the staging buffer of encoded frames
        self._watchdog = Watchdog(self._on_dropped, name="kv-rx-watchdog")
        try:
            self._listening = links.listen(transport, cache, host, port, self._serve)
        except BaseException:
            self._watchdog.close()
            self._book.close()
            raise
        self.transport: TransportName = self._listening.transport
        self.endpoint = self._listening.endpoint
        self.tcp_endpoint = f"{host}:{self._listening.tcp.port}"
        log.info("kv_transfer: receiver on %s (%s)", self.endpoint, self.transport)

    # ---- the decode worker's side (kept by reservations.py) ------------------------

    def reserve(
        self,
        request_id: str,
        block_ids: list[int],
        lease_s: float,
        on_done: Callable[[Reservation, Outcome], None] | None = None,
        context_len: int = 0,
        first_index: int = 0,
    ) -> Reservation:
        """Accept KV for `block_ids` until `lease_s` from now; returns what the sender needs.

        `on_done(reservation, outcome)` runs on a receiver thread when it ends; it
        must not block. Without it, collect the outcome with `wait`. With the context's
        length and the block-table index of `block_ids[0]`, a windowed layer (the layout's
        `windows`) needs only the blocks its window still sees (engine/blocks.py's
        `window_start`), and done asks for no more of it.
        """
        return self._book.reserve(
            request_id,
            block_ids,
            lease_s,
            on_done,
            transport=self.transport,
            endpoint=self.endpoint,
            tcp_endpoint=self.tcp_endpoint,
            context_len=context_len,
            first_index=first_index,
        )

    def wait(self, ticket: bytes, timeout: float) -> Outcome:
        """The reservation's outcome; raises TimeoutError if it has none within `timeout`."""
        return self._book.wait(ticket, timeout)

    def cancel(self, ticket: bytes, timeout: float = 5.0) -> None:
        """Drop a reservation (its request was cancelled); returns once its blocks are reset."""
        self._book.cancel(ticket, timeout)

    def live_blocks(self, block_ids: list[int]) -> list[int]:
        """Those of `block_ids` that a live reservation may still write (none, when the worker frees them)."""
        return self._book.live_blocks(block_ids)

    def active(self) -> int:
        """Reservations not yet completed or failed."""
        return self._book.active()

    def close(self) -> None:
        """Stop listening, drop every connection, fail every live reservation ("receiver_closed")."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self._listening.tcp.close()
        for c in conns:  # before the UCX listener, so that it closes with no handler alive
            c.close()
        if self._listening.extra is not None:
            self._listening.extra.close()
        self._book.close()
        self._watchdog.close()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one connection -----------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        """Serve one connection: streams one after another (senders reuse connections)."""
        w = Watched(conn)
        with self._lock:
            closed = self._closed
            admitted = not closed and len(self._unbound) < self.max_unbound_connections
            if admitted:
                self._conns[conn] = w
                self._unbound.add(conn)
        if not admitted:
            conn.close()
            if not closed:
                self._refuse_over_cap(conn)
            return
        try:
            header = bytearray(frame.HEADER_SIZE)
            connected = time.monotonic()
            first_by = connected + self.handshake_timeout_s
            handshake_by: float | None = first_by
            self._watchdog.arm(w, first_by, FailureCode.HANDSHAKE_TIMEOUT, connected)
            while True:
                try:
                    self._recv_frame_start(conn, header)  # idle between streams: a close here is no error
                except ConnectionClosed:
                    return
                if not self._serve_stream(conn, w, header, handshake_by):
                    return
                # A sender's pooled connection, bound before: it may wait for its next
                # stream, but not for ever (senders replace connections closed meanwhile).
                handshake_by, now = None, time.monotonic()
                self._watchdog.arm(w, now + self.idle_timeout_s, FailureCode.IDLE, now)
        finally:
            self._watchdog.disarm(w)
            with self._lock:
                self._conns.pop(conn, None)
                self._unbound.discard(conn)
            conn.close()

    def _serve_stream(self, conn: Connection, w: Watched, header: bytearray, handshake_by: float | None) -> bool:
        """One stream, its first frame begun in `header`: handshake, layer frames, done.

        True if the connection may carry another. `handshake_by`: a fresh
        connection's handshake deadline (None on a reused one).
        """
        slot: Slot | None = None
        try:
            h = self._recv_frame_header(conn, w, header, handshake_by)
            slot, grant = self._handshake(conn, h)
            # Bound: the wait for each next frame is the lease's to bound (its expiry closes us).
            self._watchdog.disarm(w)
            self._receive_until_done(conn, w, header, slot, grant)
            return True
        except (FrameError, Rejected, ConnectionClosed) as e:
            self._stream_failed(conn, w, slot, e)
        except Exception as e:  # a bug here must not take the receiver down
            log.exception("kv_transfer: connection handler failed")
            if slot is not None:
                self._book.fail(slot, FailureCode.INTERNAL, f"receiver error: {e}")
        finally:
            if slot is not None:
                self._book.unbind(slot, conn)
        return False

    def _receive_until_done(
        self, conn: Connection, w: Watched, header: bytearray, slot: Slot, grant: links.Grant
    ) -> None:
        """The stream's frames after its handshake: layers into the slot, until a Done that completes it."""
        while True:
            self._recv_frame_start(conn, header)
            h = self._recv_frame_header(conn, w, header, None)
            if h.ticket != slot.reservation.ticket:
                raise Rejected(FailureCode.TICKET_MISMATCH, "frame carries another ticket than the stream's")
            if time.monotonic() > slot.deadline:
                raise Rejected(FailureCode.LEASE_EXPIRED, "lease expired")
            if h.kind == frame.LAYER:
                self._receive_layer(conn, slot, h, grant)
                self._watchdog.disarm(w)
            elif h.kind == frame.DONE:
                self._complete(conn, slot, h)
                return
            elif h.kind == frame.ERROR:
                text = self._read_control(conn, h).decode(errors="replace")
                raise Rejected(FailureCode.ABORTED_BY_SENDER, f"sender aborted: {text}")
            else:
                raise Rejected(FailureCode.UNEXPECTED_FRAME, f"unexpected {frame.KIND_NAMES[h.kind]} frame mid-stream")

    def _complete(self, conn: Connection, slot: Slot, h: Header) -> None:
        """Done: every layer-block-head must have arrived; the slot completes and the sender is acked."""
        missing = np.argwhere(~slot.received)
        if len(missing):
            layer, i, head = missing[0]
            raise Rejected(
                FailureCode.INCOMPLETE,
                f"done before every layer arrived ({len(missing)} layer-block-heads missing, first: "
                f"layer {layer} block {slot.reservation.block_ids[i]} KV head {head})",
            )
        self._book.complete(slot, h.value, self._read_control(conn, h) if h.payload_length else b"")
        self._reply(conn, frame.ACK, slot.reservation.ticket, slot.reservation.request_id, "complete")

    def _stream_failed(
        self, conn: Connection, w: Watched, slot: Slot | None, e: FrameError | Rejected | ConnectionClosed
    ) -> None:
        """A stream that ended short of done: counted (unless the watchdog closed it, which counted
        it), and its slot failed with the reason; a stream that never bound a slot is logged instead."""
        if w.expired and isinstance(e, ConnectionClosed):  # the watchdog's doing; it counted and logged
            code, reason = FailureCode(w.expired), f"{w.expired.replace('_', ' ')}: {_drop_text(w)}"
        else:
            if isinstance(e, Rejected):
                code, reason = e.code, str(e)
            elif isinstance(e, FrameError):
                code, reason = FailureCode.BAD_FRAME, str(e)
            else:
                code, reason = FailureCode.DISCONNECTED, f"sender disconnected before done ({e})"
            metrics.FRAMES_REJECTED.labels(reason=code).inc()
        if slot is not None:
            self._book.fail(slot, code, reason)  # tells the sender why, if it still listens
        elif not w.expired:
            log.warning("kv_transfer: connection from %s rejected: %s", conn.peer, reason)

    @staticmethod
    def _recv_frame_start(conn: Connection, header: bytearray) -> None:
        """Wait for a frame to begin. On a byte stream read only its first byte, so the
        frame deadline runs from when the peer started it; a message transport (UCX)
        must receive the header whole, at the size it was sent."""
        conn.recv_into(memoryview(header)[:1] if conn.stream else header)

    def _recv_frame_header(self, conn: Connection, w: Watched, header: bytearray, handshake_by: float | None) -> Header:
        """The rest of a begun frame's header, then its deadline set for the payload."""
        started = time.monotonic()
        if conn.stream:
            self._arm_frame(w, started, 0, handshake_by)
            conn.recv_into(memoryview(header)[1:])
        h = frame.decode_header(header)
        self._arm_frame(w, started, h.payload_length, handshake_by)
        return h

    def _arm_frame(self, w: Watched, started: float, payload_length: int, handshake_by: float | None) -> None:
        deadline = started + self.frame_timeout_s + payload_length / self.frame_min_bytes_per_s
        if handshake_by is not None and handshake_by <= deadline:  # a fresh connection: the tighter bound
            self._watchdog.arm(w, handshake_by, FailureCode.HANDSHAKE_TIMEOUT, handshake_by - self.handshake_timeout_s)
        else:
            self._watchdog.arm(w, deadline, FailureCode.FRAME_TIMEOUT, started)

    def _on_dropped(self, w: Watched) -> None:
        """The watchdog closed a connection whose peer was too slow or silent: count it, say so once."""
        metrics.CONNECTIONS_DROPPED.labels(reason=w.expired).inc()
        # A sender's pooled connection closed after a quiet spell is routine; the others are not.
        level = logging.INFO if w.expired == FailureCode.IDLE else logging.WARNING
        log.log(level, "kv_transfer: dropped connection from %s: %s", w.conn.peer, _drop_text(w))

    def _refuse_over_cap(self, conn: Connection) -> None:
        metrics.CONNECTIONS_DROPPED.labels(reason=FailureCode.TOO_MANY_UNBOUND).inc()
        # One line a second at most: a flood of connections must not become a flood of log lines.
        now = time.monotonic()
        with self._lock:
            self._refused_unlogged += 1
            if now - self._refused_logged_at < 1.0:
                return
            n, self._refused_unlogged, self._refused_logged_at = self._refused_unlogged, 0, now
        log.warning(
            "kv_transfer: refused %d connection(s) since the last such line (latest from %s): "
            "%d connections without a handshake already open",
            n,
            conn.peer,
            self.max_unbound_connections,
        )

    def _handshake(self, conn: Connection, h: Header) -> tuple[Slot, links.Grant]:
        """Bind the connection to the handshake's reservation; the slot, and how its layer
        frames arrive (`links.grant`: the bytes each block carries on this connection, the codec)."""
        if h.kind != frame.HANDSHAKE:
            raise FrameError(f"expected a handshake, got a {frame.KIND_NAMES[h.kind]} frame")
        layout, cut_for_tp = frame.decode_layout(self._read_control(conn, h))
        try:
            slot = self._book.bind(h.ticket, h.request_id, conn)
        except Rejected as e:
            self._reply(conn, frame.ERROR, h.ticket, h.request_id, str(e))
            raise
        with self._lock:  # bound by a valid ticket: no longer counts against the cap
            self._unbound.discard(conn)
        grant = links.grant(self.transport, h.value, self.cache, h.block_count)
        # another dtype than this cache's: only through a codec decoded into it
        mismatch = heads.mapping_error(layout, self.cache.layout, dtype=grant.codec == codec.CODEC_RAW)
        if mismatch is None and cut_for_tp != self.cache.layout.tp_size:
            mismatch = (
                f"KV layout: the prefill worker cuts its KV for decode TP {cut_for_tp}, this decode worker "
                f"is TP {self.cache.layout.tp_size} (the reservation's layout is not this worker's)"
            )
        if mismatch:
            self._book.fail(slot, FailureCode.LAYOUT_MISMATCH, mismatch)  # replies with the reason
            raise Rejected(FailureCode.LAYOUT_MISMATCH, mismatch)
        ack = Header(
            frame.ACK,
            h.ticket,
            h.request_id,
            block_count=grant.codec,
            payload_length=len(grant.payload),
            value=grant.value,
        )
        conn.send([frame.encode_header(ack), grant.payload])
        return slot, grant

    def _receive_layer(self, conn: Connection, slot: Slot, h: Header, grant: links.Grant) -> None:
        ids, rank, expected = self._check_layer(slot, h, grant)
        if expected:  # else the sender copied the blocks in before sending this header (device copies)
            self._read_layer(conn, slot, h, grant, ids, rank, expected)
        layout = self.cache.layout
        shard_heads = layout.rank_heads(rank)
        slot.received[h.layer, [slot.position[b] for b in ids], shard_heads.start : shard_heads.stop] = True
        metrics.FRAMES_RECEIVED.labels(transport=self.transport).inc()

    def _check_layer(self, slot: Slot, h: Header, grant: links.Grant) -> tuple[range, int, int]:
        """A layer frame's header against the reservation and the agreed codec: its block ids, the
        rank whose shard it fills and its payload's bytes; Rejected naming what is wrong."""
        layout = self.cache.layout
        if h.layer >= layout.num_layers:
            raise Rejected(FailureCode.LAYER_OUT_OF_RANGE, f"layer {h.layer} outside 0..{layout.num_layers - 1}")
        if h.block_count == 0:
            raise Rejected(FailureCode.BAD_FRAME, "layer frame with no blocks")
        ids = range(h.first_block, h.first_block + h.block_count)
        outside = [b for b in ids if b not in slot.position]
        if outside:
            raise Rejected(FailureCode.BLOCK_OUT_OF_RANGE, f"block {outside[0]} is not in the reservation")
        if h.value != grant.codec:
            raise Rejected(
                FailureCode.BAD_FRAME,
                f"layer frame in codec {codec.CODEC_NAMES[h.value]}, the stream agreed on "
                f"{codec.CODEC_NAMES[grant.codec]}",
            )
        if grant.codec == codec.CODEC_RAW and h.dtype_code != frame.DTYPE_CODES[layout.dtype]:
            raise Rejected(FailureCode.DTYPE_MISMATCH, f"frame dtype code {h.dtype_code}, cache is {layout.dtype}")
        rank = heads.receiver_rank(layout, h.first_head, h.head_count)
        if rank is None:
            raise Rejected(
                FailureCode.HEAD_OUT_OF_RANGE,
                f"KV heads {h.first_head}..{h.first_head + h.head_count - 1} (count {h.head_count}) are not one "
                f"shard's at TP {layout.tp_size} ({layout.kv_heads_per_rank} of {layout.num_kv_heads} heads per rank)",
            )
        if h.element_count != heads.frame_elements(layout, h.block_count, h.head_count):
            raise Rejected(FailureCode.LENGTH_MISMATCH, f"element count {h.element_count} for {h.block_count} blocks")
        expected = h.block_count * grant.bytes_per_block
        if h.payload_length != expected:
            raise Rejected(
                FailureCode.LENGTH_MISMATCH,
                f"payload length {h.payload_length} does not match {h.block_count} blocks ({expected} bytes)",
            )
        return ids, rank, expected

    def _read_layer(
        self, conn: Connection, slot: Slot, h: Header, grant: links.Grant, ids: range, rank: int, expected: int
    ) -> None:
        """A checked layer frame's payload into the blocks (decoded first unless it is their own format)."""
        layout = self.cache.layout
        if h.checksum_kind == frame.CHECKSUM_NONE and not conn.authenticated:
            raise Rejected(FailureCode.BAD_FRAME, "layer frame without a checksum on a connection that checks nothing")
        blocks = self.cache.blocks(h.layer, h.first_block, h.block_count, rank)
        # raw, or int8 frames into an int8 pool (its own block format): straight into the blocks;
        # else into this thread's staging, decoded after the check
        direct = grant.codec == codec.CODEC_RAW or layout.dtype == "int8"
        view = frame.as_bytes(blocks) if direct else self._staging(expected)
        check = frame.PayloadChecksum(h.checksum_kind)
        # On a byte stream, check each piece as it lands (still in cache, and the
        # sender keeps filling the socket buffer meanwhile); messages come whole.
        step = RECV_PIECE_BYTES if conn.stream else view.numel()
        self._book.begin_write(slot)
        try:
            for at in range(0, view.numel(), step):
                piece = view[at : at + step]
                conn.recv_into(piece)
                check.update(piece)
            if check.value != h.checksum:
                raise Rejected(
                    FailureCode.CHECKSUM_MISMATCH,
                    f"checksum mismatch on layer {h.layer} blocks {h.first_block}..{ids[-1]}",
                )
            if not direct:
                self._decode(view, h, ids, rank)
        finally:
            self._book.end_write(slot)
        metrics.BYTES_RECEIVED.labels(transport=self.transport).inc(h.payload_length)
        metrics.WIRE_BYTES.labels(side="receiver", codec=codec.CODEC_NAMES[grant.codec]).inc(h.payload_length)

    def _decode(self, payload: torch.Tensor, h: Header, ids: range, rank: int) -> None:
        """An int8 frame's payload into blocks `ids` of shard `rank`, in this cache's dtype."""
        lay = self.cache.layout
        if not lay.quantized:
            codec.decode_into(payload, self.cache.blocks(h.layer, h.first_block, h.block_count, rank))
            return
        # fp8: decoded to float32, then quantized as the engine's own writes are
        kv = torch.empty(h.block_count, 2, lay.block_size, lay.kv_heads_per_rank, lay.head_dim)
        codec.decode_into(payload, kv)
        quantize_into(self.cache, h.layer, list(ids), kv[:, 0], kv[:, 1], rank)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """This connection thread's buffer for encoded payloads, kept and grown (a fresh one per
        frame would pay its page faults every frame)."""
        s: torch.Tensor | None = getattr(self._local, "staging", None)
        if s is None or s.numel() < nbytes:
            s = self._local.staging = torch.empty(nbytes, dtype=torch.uint8)
        return s[:nbytes]

    @staticmethod
    def _read_control(conn: Connection, h: Header) -> bytes:
        buf = bytearray(h.payload_length)
        if buf:
            conn.recv_into(buf)
        return bytes(buf)

    @staticmethod
    def _reply(conn: Connection, kind: int, ticket: bytes, request_id: str, text: str) -> None:
        """Best effort: a peer that went away needs no answer."""
        try:
            conn.send(frame.control(kind, ticket, request_id, text))
        except ConnectionClosed:
            pass
