"""The prefill side of the KV plane: push each finished layer into a reservation.

A prefill worker keeps one `KVSender` over its `KVCache`. For each request it
opens a stream with the decode worker's `Reservation` (connect, then a
handshake that checks the ticket and the layout), calls `send_layer` from the
compute loop right after a layer's K and V are written, and ends with
`finish(first_token, timeout)`, which returns only once the receiver has
confirmed every byte, or with `finish_async`, which returns at once and calls
back from the stream's own thread when the confirmation came or did not (the
sender's one watchdog thread bounds the wait: transport.py).

`send_layer` only queues views of the cache, one frame per run of blocks that
is contiguous on both sides and per shard of the receiver's cache (one, at
tensor-parallel size 1); the stream's own thread checksums the frames and
sends them zero-copy, so the compute loop goes on at once. Between different
tensor-parallel sizes each frame still carries exactly one receiver shard's
heads, packed from the sender's shards in the stream's thread (heads.py). The queue is
bounded: if the link is slower than compute, `send_layer` waits (back-pressure)
rather than letting memory grow.

The source blocks must not change until their frame is sent. Chunked prefill
that resends a partial last block needs nothing more as long as
`queue_depth + 1 < num_layers`: the stream is then never more than
`queue_depth + 1` layers behind the compute loop, so a chunk's layer L frame
has left before the next chunk writes layer L again. Otherwise (or for any
other reuse of source blocks) pass `snapshot=True`, which copies at call time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_groups import CacheGroups
from splitserve.kv_transfer import codec, frame, heads, links, metrics
from splitserve.kv_transfer.frame import FrameError, Header
from splitserve.kv_transfer.reservation import FailureCode, Reservation, TransportName
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Connection, ConnectionClosed, Transport, Watchdog, Watched

log = logging.getLogger(__name__)

# A stream must carry at least this much for its time to say what the link can do.
MIN_MEASURED_BYTES = 1 << 20
SPEED_TTL_S = 60.0  # how long a measured codec speed stands


class TransferError(Exception):
    """The stream failed; the message is the reason (the receiver's, when it gave one).

    `code` says what kind of failure, for code to act on: `FailureCode.LAYOUT_MISMATCH`
    (the two caches cannot exchange KV: no retry will help) or `FailureCode.TRANSPORT`
    (anything else).
    """

    def __init__(self, message: str, code: FailureCode = FailureCode.TRANSPORT) -> None:
        super().__init__(message)
        self.code = code


class _StaleConnection(TransferError):
    """The handshake found the connection dead (an idle one may have been closed by the receiver)."""


class KVSender:
    def __init__(
        self,
        cache: KVCache,
        *,
        checksum: str = "lanesum",
        queue_depth: int = 4,
        connect_timeout: float = 5.0,
        transport: Transport | None = None,
        wire_codec: codec.WireCodecMode = "raw",
        link_gbps: float | None = None,
        codec_speed: codec.CodecSpeed | None = None,
        same_host_raw: bool = True,
    ) -> None:
        """`checksum`: "lanesum" (fast, see frame.py) or "crc32"; `queue_depth`: queued
        send_layer calls before back-pressure; `transport`: in place of TCP (the fake).
        Which transport a stream uses is the reservation's offer and links.py's choice.

        `wire_codec`: "raw" never offers a codec, "int8" always offers int8 (the receiver
        still chooses), "auto" offers it on a link where `codec.choose` says it pays. The
        link's bandwidth: `link_gbps` (Gb/s, every receiver) if given, else measured on the
        earlier streams to each receiver (the first goes raw). `codec_speed`: the codec's
        throughput, else measured the first time "auto" weighs a link that is not this host's
        (a few milliseconds; not at start, when a worker is busy loading its model), and again
        each `SPEED_TTL_S` after.
        `same_host_raw=False`: "auto" treats a receiver on this host like any other (a benchmark
        whose slow link is a proxy on loopback)."""
        if wire_codec not in codec.WIRE_CODEC_MODES:
            raise ValueError(f"wire_codec must be one of {codec.WIRE_CODEC_MODES}, got {wire_codec!r}")
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError("link_gbps must be positive")
        self.cache = cache
        lay = cache.layout
        self.wire_codec: codec.WireCodecMode = wire_codec
        self.same_host_raw = same_host_raw
        self._link_bps = None if link_gbps is None else link_gbps * 1e9 / 8
        self._int8_unusable = codec.check_aligned(lay.head_dim)
        if lay.dtype not in codec.ENCODES_FROM:
            self._int8_unusable = f"FAILED_PRECONDITION: {lay.dtype} KV cannot be sent as int8 (no transcoder)"
        self.codec_speed = codec_speed  # None: measured when first needed (`speed`)
        self._speed_at: float | None = None  # when measured here (None: given, kept)
        self._speed_lock = threading.Lock()
        self._int8_ratio = codec.ratio(codec.CODEC_INT8, lay.head_dim, lay.torch_dtype.itemsize)
        self._measured_bps: dict[tuple[str, str], float] = {}  # per (transport, endpoint): measured streams'
        self._measured_lock = threading.Lock()
        self.checksum_kind = frame.CHECKSUM_KINDS[checksum]
        self.queue_depth = queue_depth
        self._dialer = links.Dialer(cache, transport or TCPTransport(), connect_timeout)
        self._watchdog: Watchdog | None = None  # bounds `finish_async`'s confirmations; started on first use
        self._watchdog_lock = threading.Lock()

    def open(self, reservation: Reservation) -> KVStream:
        """Connect and handshake; raises TransferError (e.g. a layout mismatch, naming the field)."""
        mismatch = heads.mapping_error(self.cache.layout, reservation.layout)
        if mismatch:  # caches of two dtypes exchange KV only through a codec the receiver decodes into its own
            if heads.mapping_error(self.cache.layout, reservation.layout, dtype=False) is not None:
                raise TransferError(mismatch, code=FailureCode.LAYOUT_MISMATCH)
            why_not = "--kv-wire-codec raw" if self.wire_codec == "raw" else self._int8_unusable
            if why_not is not None:
                raise TransferError(f"{mismatch}; no wire codec bridges them: {why_not}", FailureCode.LAYOUT_MISMATCH)
        if self.cache.layout.quantized and not all(
            sf.zero_copy for sf in heads.plan(self.cache.layout, reservation.layout)
        ):
            raise TransferError(
                f"KV layout: a {self.cache.layout.dtype} pool's blocks are sent whole; re-sharding them from "
                f"TP {self.cache.layout.tp_size} to TP {reservation.layout.tp_size} is not supported",
                code=FailureCode.LAYOUT_MISMATCH,
            )
        while True:
            try:
                d = self._dialer.dial(reservation)
            except ConnectionClosed as e:
                raise TransferError(str(e)) from None
            offer, why = self.codec_offer(d, needed=mismatch is not None)
            try:
                value, payload, chosen = self._handshake(d.conn, reservation, d.ask, offer)
                transport, payloads = self._dialer.accept(d, reservation, value, payload, self.checksum_kind)
                if chosen != codec.CODEC_RAW and (not offer >> chosen & 1 or transport == "cuda_ipc"):
                    raise TransferError(f"the receiver chose wire codec {chosen}, which was not offered")
                if mismatch and chosen == codec.CODEC_RAW:  # no codec offered, or the receiver took none
                    raise TransferError(
                        f"{mismatch}, and no wire codec bridges them ({why})", FailureCode.LAYOUT_MISMATCH
                    )
                break
            except _StaleConnection as e:
                d.conn.close()
                if not d.reused:
                    raise TransferError(str(e)) from None
            except BaseException:
                d.conn.close()
                raise
        if offer and not chosen:
            why = "the receiver chose raw"
        metrics.CODEC_CHOSEN.labels(codec=codec.CODEC_NAMES[chosen]).inc()
        log.debug("kv_transfer: %s to %s in %s (%s)", reservation.request_id, d.pool[1], codec.CODEC_NAMES[chosen], why)
        return KVStream(self, d, reservation, transport, payloads, chosen)

    def codec_offer(self, d: links.Dialed, needed: bool = False) -> tuple[int, str]:
        """The codecs a stream on `d` offers (a bit set, frame.py), and why. `needed`: the
        receiver's cache has another dtype, so raw cannot go into it."""
        if self.wire_codec == "raw":
            return 0, "--kv-wire-codec raw"
        if self._int8_unusable is not None:
            return 0, self._int8_unusable
        if needed:
            return codec.OFFER_INT8, "the receiver's cache has another dtype"
        if d.ask == frame.PAYLOAD_DEVICE_COPY:
            return 0, "device copies move no bytes on the connection"
        if self.wire_codec == "int8":
            return codec.OFFER_INT8, "--kv-wire-codec int8"
        same_host = self.same_host_raw and links.is_this_host(links.split_endpoint(d.pool[1])[0])
        bps = self.link_bps(d.pool)
        speed = None if same_host or bps is None else self.speed()
        c = codec.choose(bps, speed, self._int8_ratio, same_host=same_host)
        return (codec.OFFER_INT8 if c.codec == codec.CODEC_INT8 else 0), c.why

    def speed(self) -> codec.CodecSpeed:
        """The codec's speed: given, or measured here and again when `SPEED_TTL_S` old (a figure
        taken while the machine was busy must not keep the codec off for good)."""
        with self._speed_lock:
            now = time.monotonic()
            if self.codec_speed is None or (self._speed_at is not None and now - self._speed_at > SPEED_TTL_S):
                lay = self.cache.layout
                self.codec_speed = codec.measure_speed(lay.torch_dtype, lay.head_dim, device=self.cache.tensor.device)
                self._speed_at = now
            return self.codec_speed

    def link_bps(self, pool: tuple[str, str]) -> float | None:
        """The bandwidth to a receiver in bytes per second: configured, else measured, else None."""
        if self._link_bps is not None:
            return self._link_bps
        with self._measured_lock:
            return self._measured_bps.get(pool)

    def record_link(self, pool: tuple[str, str], wire_bytes: int, busy_s: float) -> None:
        """A confirmed stream's wire bytes over the seconds its thread had them to send (a running
        average per receiver, the half-life one stream; streams under `MIN_MEASURED_BYTES` skipped)."""
        if wire_bytes < MIN_MEASURED_BYTES or busy_s <= 0:
            return
        bps = wire_bytes / busy_s
        with self._measured_lock:
            old = self._measured_bps.get(pool)
            self._measured_bps[pool] = bps if old is None else (old + bps) / 2

    def close(self) -> None:
        """Close the idle connections (and stop the confirmation watchdog)."""
        self._dialer.close()
        with self._watchdog_lock:
            watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.close()

    def watchdog(self) -> Watchdog:
        """The one thread that closes a stream's connection whose confirmation is overdue."""
        with self._watchdog_lock:
            if self._watchdog is None:
                self._watchdog = Watchdog(lambda w: None, name="kv-tx-watchdog")
            return self._watchdog

    def _handshake(self, conn: Connection, r: Reservation, ask: int, offer: int) -> tuple[int, bytes, int]:
        """The ack's value and payload (how the stream's layer payloads travel: links.py), and the
        wire codec it chose among `offer` (frame.py)."""
        lay = self.cache.layout
        body = frame.encode_layout(
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.block_size,
            lay.dtype,
            lay.tp_size,
            r.layout.tp_size,
            lay.windows,
            lay.model_fingerprint,
        )
        h = Header(frame.HANDSHAKE, r.ticket, r.request_id, block_count=offer, payload_length=len(body), value=ask)
        try:
            conn.send([frame.encode_header(h), body])
            reply, payload = read_control(conn)
        except (ConnectionClosed, FrameError) as e:
            raise _StaleConnection(f"handshake with {r.endpoint} failed: {e}") from None
        if reply.kind == frame.ERROR:
            raise TransferError(payload.decode(errors="replace"))
        if reply.kind != frame.ACK:
            raise TransferError(f"handshake answered with a {frame.KIND_NAMES[reply.kind]} frame")
        return reply.value, payload, reply.block_count


def read_control(conn: Connection) -> tuple[Header, bytes]:
    """One control frame (handshake, ack, error, done) and its small payload."""
    buf = bytearray(frame.HEADER_SIZE)
    conn.recv_into(buf)
    h = frame.decode_header(buf)
    if h.kind == frame.LAYER:
        raise FrameError("unexpected layer frame")
    payload = bytearray(h.payload_length)
    if payload:
        conn.recv_into(payload)
    return h, bytes(payload)


def _paired_runs(dst: Sequence[int], src: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs that are consecutive on both sides: (first dst id, first src id, count).

    One frame per run, so the payload is one contiguous piece of memory at each
    end: the receiver reads it straight into its blocks, and a message
    transport (UCX) sees the same sizes on both sides.
    """
    runs: list[tuple[int, int, int]] = []
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        if i and runs and d == dst[i - 1] + 1 and s == src[i - 1] + 1:
            first_d, first_s, n = runs[-1]
            runs[-1] = (first_d, first_s, n + 1)
        else:
            runs.append((d, s, 1))
    return runs


class _Done:
    """The send queue's last item: Done goes out after the frames queued before it."""


_DONE_ITEM = _Done()
# One layer's frames, as queued: (layer, first destination block, blocks, the receiver shard's
# frame (heads.py), its parts: views of the cache, packed in the stream's thread).
_Frames = list[tuple[int, int, int, heads.ShardFrame, list[links.HeadsPart]]]


class KVStream:
    """One request's KV on its way; made by `KVSender.open`."""

    def __init__(
        self,
        sender: KVSender,
        d: links.Dialed,
        r: Reservation,
        transport: TransportName,
        payloads: links.LayerPayloads,
        wire_codec: int = codec.CODEC_RAW,
    ) -> None:
        self.reservation = r
        self.transport = transport
        self.codec = wire_codec
        self.wire_bytes = 0  # layer payload bytes sent so far
        self._encoder = codec.Int8Encoder() if wire_codec == codec.CODEC_INT8 else None
        self._busy_from: float | None = None  # the first frame's start: the link measurement's
        self._idle_s = 0.0  # after it, waiting for frames (the link was not the bottleneck then)
        self._encode_s = 0.0
        self._dialer, self._pool = sender._dialer, d.pool
        self._cache = sender.cache
        self._plan = heads.plan(sender.cache.layout, r.layout)  # checked to map by KVSender.open
        # both ends' grouping of windowed layers (engine/kv_groups.py), from the windows they agree on
        self._groups = CacheGroups.of(sender.cache.layout.windows)
        self._conn = d.conn
        self._payloads = payloads
        self._queue: queue.Queue[_Frames | _Done | None] = queue.Queue(maxsize=sender.queue_depth)
        self._error: str | None = None
        self._finished = threading.Event()
        self._first_token: int | None = None
        self._handoff = b""
        self._sent_done = False
        self._sender = sender
        self._watched = Watched(d.conn)
        self._confirm_s: float | None = None  # finish_async: how long the confirmation may take
        self._on_end: Callable[[TransferError | None], None] | None = None  # finish_async's callback
        self._end_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{r.request_id}", daemon=True)
        self._thread.start()

    def send_layer(
        self, layer: int, src_block_ids: Sequence[int], first_index: int = 0, snapshot: bool = False
    ) -> None:
        """Queue one layer's K and V: `src_block_ids[i]` goes to `reservation.block_ids[first_index + i]`.

        Returns at once unless the queue is full (back-pressure). A block may be
        sent again later (a partial block completed by the next chunk).
        """
        self._raise_if_failed()
        r, lay = self.reservation, self._cache.layout
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer {layer} outside 0..{lay.num_layers - 1}")
        if first_index < 0 or first_index + len(src_block_ids) > len(r.block_ids):
            raise ValueError("blocks beyond the reservation")
        dst = r.block_ids[first_index : first_index + len(src_block_ids)]
        frames: _Frames = []
        groups = self._groups
        if groups is not None and groups.is_windowed(layer):
            # a windowed layer's pages are wherever each block's are, at both ends: a frame per block
            runs = [(d, s, 1) for d, s in zip(dst, src_block_ids, strict=True)]
        else:
            runs = _paired_runs(dst, src_block_ids)
        for dst_first, src_first, n in runs:
            for sf in self._plan:  # one frame per receiver shard; one in all at equal TP 1
                parts: list[links.HeadsPart] = []
                for p in sf.parts:
                    shard_blocks = self._cache.blocks(layer, src_first, n, p.src_rank)
                    # a quantized pool's blocks are bytes `[n, block_bytes]`, sent whole (KVSender.open)
                    view = (
                        shard_blocks
                        if lay.quantized
                        else shard_blocks[:, :, :, p.src_first : p.src_first + p.head_count]
                    )
                    parts.append((p.dst_offset, view.clone() if snapshot else view))
                frames.append((layer, dst_first, n, sf, parts))
        self._put(frames)

    def finish(self, first_token: int, timeout: float, handoff: bytes = b"") -> None:
        """Send Done (carrying `handoff`, the workers' record of the request, opaque here); return
        once the receiver confirmed every byte, else raise TransferError."""
        deadline = time.monotonic() + timeout
        self._first_token, self._handoff = first_token, handoff
        self._put(_DONE_ITEM, timeout)
        if not self._finished.wait(max(0.0, deadline - time.monotonic())):
            self.abort(f"no confirmation within {timeout}s")
            raise TransferError(f"receiver did not confirm within {timeout}s")
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._raise_if_failed()

    def finish_async(
        self, first_token: int, timeout: float, on_end: Callable[[TransferError | None], None], handoff: bytes = b""
    ) -> None:
        """`finish` without the wait: queue Done (after the layers queued, with the same back-pressure)
        and return. `on_end` is called once, on the stream's thread, with None once the receiver
        confirmed every byte, else with the error (no confirmation within `timeout` included); it
        must not block."""
        self._first_token, self._handoff = first_token, handoff
        self._confirm_s = timeout
        self._on_end = on_end
        try:
            self._put(_DONE_ITEM)
        except TransferError:
            self._ended()  # the stream had failed: its thread may be gone already

    def abort(self, reason: str = "aborted by the prefill worker") -> None:
        """Give up: the receiver fails the reservation (its blocks are reset there)."""
        if self._finished.is_set():
            return
        self._fail(reason)
        try:
            self._queue.put_nowait(None)  # wakes the thread if it waits for work; it sends Error
        except queue.Full:
            pass
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():  # stuck in a send the receiver does not drain
            self._conn.close()
            self._thread.join(timeout=5)

    def __enter__(self) -> KVStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if not self._finished.is_set():
            self.abort(
                "stream left without finish" if exc_type is None else f"prefill failed: {exc_type.__name__}: {exc}"
            )

    # ---- internals ---------------------------------------------------------------

    def _put(self, item: _Frames | _Done, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                return
            except queue.Full:
                if time.monotonic() >= deadline:
                    self.abort("send queue stuck")
                    raise TransferError(f"send queue full for {timeout}s") from None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransferError(self._error)

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        self._finished.set()

    def _run(self) -> None:
        try:
            while self._error is None:
                waited = time.perf_counter()
                item = self._queue.get()
                if self._busy_from is not None:
                    self._idle_s += time.perf_counter() - waited
                else:
                    self._busy_from = time.perf_counter()
                if item is None:
                    break
                if isinstance(item, _Done):
                    self._send_done()
                    return
                for layer, first, n, sf, parts in item:
                    self._send_layer_frame(layer, first, n, sf, parts)
        except ConnectionClosed as e:
            if self._error is None:
                self._fail(self._receiver_reason() or f"connection lost: {e}")
        except Exception as e:
            log.exception("kv_transfer: send thread failed")
            self._fail(f"sender error: {e}")
        finally:
            if self._error is not None and not self._sent_done:
                self._send_error(self._error)
            if self._error is None and self._sent_done:
                self._dialer.release(self._pool, self._conn)  # confirmed: reusable for the next stream
            else:
                self._conn.close()
            self._ended()

    def _send_layer_frame(
        self, layer: int, first: int, n: int, sf: heads.ShardFrame, parts: list[links.HeadsPart]
    ) -> None:
        """One layer frame: blocks `first`.. (`n` of them) of `layer` for the receiver's shard `sf`,
        encoded with the stream's codec unless the pool is already quantized."""
        r = self.reservation
        lay = self._cache.layout
        ck = self._payloads.checksum_kind
        codec_name = codec.CODEC_NAMES[self.codec]
        payload = self._payloads.place(layer, first, sf.dst_rank, parts)
        cache_bytes = sum(p.numel() for p in payload)
        if self._encoder is not None and not lay.quantized:  # one piece (OnConnection), in its dtype
            t0 = time.perf_counter()
            (raw,) = payload
            payload = [self._encoder.encode(raw.view(lay.torch_dtype).view(n, -1, lay.head_dim))]
            self._encode_s += time.perf_counter() - t0
        length = sum(p.numel() for p in payload)
        h = Header(
            frame.LAYER,
            r.ticket,
            r.request_id,
            layer=layer,
            first_block=first,
            block_count=n,
            dtype_code=frame.DTYPE_CODES[lay.dtype],
            element_count=heads.frame_elements(r.layout, n, sf.head_count),
            payload_length=length,
            checksum_kind=ck,
            checksum=frame.checksum(ck, payload),
            value=self.codec,
            first_head=sf.first_head,
            head_count=sf.head_count,
        )
        self._conn.send([frame.encode_header(h), *payload])
        self.wire_bytes += length
        metrics.BYTES_SENT.labels(transport=self.transport).inc(length)
        metrics.WIRE_BYTES.labels(side="sender", codec=codec_name).inc(length)
        metrics.WIRE_KV_BYTES.labels(codec=codec_name).inc(cache_bytes)

    def _ended(self) -> None:
        """Tell `finish_async`'s caller how the stream ended, once (a failed stream may tell it from
        the caller's thread)."""
        with self._end_lock:
            on_end, self._on_end = self._on_end, None
        if on_end is None:
            return
        confirmed = self._error is None and self._finished.is_set()
        on_end(None if confirmed else TransferError(self._error or "the stream ended without a confirmation"))

    def _send_done(self) -> None:
        r = self.reservation
        assert self._first_token is not None
        self._sent_done = True
        done = Header(frame.DONE, r.ticket, r.request_id, payload_length=len(self._handoff), value=self._first_token)
        self._conn.send([frame.encode_header(done), self._handoff] if self._handoff else [frame.encode_header(done)])
        if self._confirm_s is not None:  # finish_async: nobody waits with a deadline, so the watchdog does
            now = time.monotonic()
            self._sender.watchdog().arm(self._watched, now + self._confirm_s, "confirm_timeout", now)
        try:
            reply, payload = read_control(self._conn)
        except (ConnectionClosed, FrameError) as e:
            overdue = self._watched.expired
            self._fail(
                f"receiver did not confirm within {self._confirm_s}s"
                if overdue
                else f"no confirmation from the receiver: {e}"
            )
            return
        finally:
            if self._confirm_s is not None:
                self._sender.watchdog().disarm(self._watched)
        if reply.kind != frame.ACK:
            self._fail(payload.decode(errors="replace") or "receiver refused the transfer")
            return
        if self._busy_from is not None and self.transport != "cuda_ipc":
            busy = time.perf_counter() - self._busy_from - self._idle_s - self._encode_s
            self._sender.record_link(self._pool, self.wire_bytes, busy)
        self._finished.set()

    def _receiver_reason(self) -> str | None:
        """After a failed send: the receiver's error frame, if it left one."""
        try:
            reply, payload = read_control(self._conn)
        except Exception:
            return None
        return payload.decode(errors="replace") if reply.kind == frame.ERROR else None

    def _send_error(self, reason: str) -> None:
        r = self.reservation
        try:
            self._conn.send(frame.control(frame.ERROR, r.ticket, r.request_id, reason))
        except Exception:
            pass
