"""Transports: how frame bytes get from a sender to a receiver.

The interface is four verbs (STYLE.md habit 7): a `Transport` can `listen`
and `connect`; a `Connection` can `send`, `recv_into` and `close`. Calls are
blocking and meant for a connection's own thread; `close` may be called from
any thread and wakes a blocked `recv_into`. Buffers are bytes-like objects or
contiguous uint8 tensors (`frame.as_bytes`), so the payload moves straight
between cache memory and the wire with no staging copy.

`send(buffers)` sends the buffers back to back; message transports (UCX)
send each buffer as one message, so a receiver's `recv_into` calls must use
the same sizes the sender's buffers had. The frame protocol does exactly that:
one header, then one payload per frame.

TCP, plain or sealed under the cluster's TLS, lives in `tcp.py` (the
records in `sealed.py`); UCX in `ucx.py`; the in-memory fake for unit tests
in `tests/kv_transfer_helpers/fake.py`. Which one a stream uses is links.py's choice (CUDA IPC is not a
transport: it changes how layer payloads move, over a TCP connection).

`Watchdog`, here too, bounds how long a peer may keep a connection's thread
waiting: it closes a connection whose deadline passed, and the close wakes
the blocked `recv_into`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview | torch.Tensor


class ConnectionClosed(Exception):
    """The peer went away (or `close` was called) before the bytes were moved."""


class Connection(Protocol):
    peer: str
    stream: bool  # a byte stream (a payload may be read in pieces), not messages
    # every byte authenticated by the connection itself (sealed.py's AEAD): a frame then needs no checksum
    authenticated: bool

    def send(self, buffers: Sequence[Buffer]) -> None: ...
    def recv_into(self, buffer: Buffer) -> None: ...
    def close(self) -> None: ...


class Listener(Protocol):
    host: str
    port: int

    def close(self) -> None: ...


class Transport(Protocol):
    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> Listener: ...
    def connect(self, host: str, port: int, timeout: float) -> Connection: ...


def host_view(buf: Buffer) -> memoryview:
    """A writable-if-possible byte memoryview of CPU memory, without copying."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError("this transport moves host memory; stage device tensors first")
        return buf.numpy().data.cast("B")  # ndarray.data: memoryview(ndarray), typed as one
    return memoryview(buf).cast("B")


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill `view` from `sock` (a stream delivers it in pieces); ConnectionClosed, naming `what`,
    when the peer closes first or the socket fails."""
    got, n = 0, view.nbytes
    try:
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionClosed(f"{what}: the peer closed the connection")
            got += k
    except OSError as e:
        raise ConnectionClosed(f"{what} failed: {e}") from None


class Watched:
    """One connection under a `Watchdog`: its current deadline, and why it was closed if it was."""

    __slots__ = ("conn", "deadline", "reason", "since", "expired", "held_s", "_entry", "_queued")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.deadline: float | None = None  # time.monotonic(); None while the wait is unbounded
        self.reason = ""  # label of the current deadline, e.g. "frame_timeout"
        self.since = 0.0  # when the bounded wait began
        self.expired = ""  # the label of the deadline that closed the connection, once it did
        self.held_s = 0.0  # since -> close, once it did
        self._entry = -1  # sequence number of this connection's live heap entry; -1: none
        self._queued = 0.0  # that entry's deadline


class Watchdog:
    """One thread that closes each watched connection whose deadline passes.

    One thread and one heap serve every connection, instead of a timer thread
    per read. A connection has at most one live heap entry: moving its deadline
    later (every frame does) only writes its fields, and when the entry comes up
    the watchdog re-queues it at the current deadline; only an earlier deadline
    pushes a new entry. So the heap stays the size of the connection count, and
    the thread wakes about once per deadline period per connection, not per frame.
    """

    def __init__(self, on_expired: Callable[[Watched], None], name: str = "kv-watchdog", slack_s: float = 0.01) -> None:
        """`on_expired(watched)` runs on the watchdog's thread after the close; it must not block.
        `slack_s`: deadlines due within this much of each other are handled in one wakeup."""
        self._on_expired = on_expired
        self._slack = slack_s
        self._heap: list[tuple[float, int, Watched]] = []
        self._stale = 0  # heap entries superseded by an earlier deadline of the same connection
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, w: Watched, deadline: float, reason: str, since: float) -> None:
        """Close `w.conn` at `deadline` (monotonic) unless re-armed or disarmed first."""
        with self._cv:
            if w.expired:
                return
            w.deadline, w.reason, w.since = deadline, reason, since
            if w._entry < 0 or deadline < w._queued:
                self._push(w, deadline)
                if self._heap[0][2] is w:
                    self._cv.notify()

    def disarm(self, w: Watched) -> None:
        """No deadline until the next `arm` (the heap entry goes when it comes up)."""
        with self._cv:
            w.deadline = None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _push(self, w: Watched, deadline: float) -> None:
        if w._entry >= 0:
            self._stale += 1
            if self._stale > 64 and 2 * self._stale > len(self._heap):  # drop them all in O(n), rarely
                self._heap = [e for e in self._heap if e[1] == e[2]._entry and e[2] is not w]
                heapq.heapify(self._heap)
                self._stale = 0
        w._entry, w._queued = next(self._seq), deadline
        heapq.heappush(self._heap, (deadline, w._entry, w))

    def _run(self) -> None:
        while True:
            fired: list[Watched] = []
            with self._cv:
                while not self._closed and not (self._heap and self._heap[0][0] <= time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() + self._slack if self._heap else None)
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, seq, w = heapq.heappop(self._heap)
                    if seq != w._entry:
                        self._stale -= 1  # superseded by an earlier deadline
                        continue
                    w._entry = -1
                    if w.deadline is None:
                        continue
                    if w.deadline > now:
                        self._push(w, w.deadline)  # moved later since this entry was pushed
                        continue
                    w.expired, w.held_s, w.deadline = w.reason, now - w.since, None
                    fired.append(w)
            for w in fired:
                w.conn.close()
                try:
                    self._on_expired(w)
                except Exception:
                    log.exception("kv_transfer: watchdog callback raised")
