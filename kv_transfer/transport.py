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

TCP lives here; UCX in `ucx.py`; the in-memory fake for unit tests in
`fake.py`. `open_transport` picks one by name and falls back to TCP.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Protocol, Sequence, Union

import torch

from splitserve.kv_transfer import metrics

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview, torch.Tensor]

# Loopback moves bytes with two memcpys; bigger buffers mean fewer wakeups.
# The kernel caps them at net.core.[rw]mem_max.
SOCKET_BUFFER_BYTES = 32 << 20


class ConnectionClosed(Exception):
    """The peer went away (or `close` was called) before the bytes were moved."""


class Connection(Protocol):
    peer: str
    stream: bool  # a byte stream (a payload may be read in pieces), not messages


    def send(self, buffers: Sequence[Buffer]) -> None: ...
    def recv_into(self, buffer: Buffer) -> None: ...
    def close(self) -> None: ...


class Listener(Protocol):
    host: str
    port: int

    def close(self) -> None: ...


class Transport(Protocol):
    kind: str  # "tcp" | "ucx" | "fake"

    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> Listener: ...
    def connect(self, host: str, port: int, timeout: float) -> Connection: ...


def open_transport(kind: str) -> Transport:
    """The transport named `kind`; UCX falls back to TCP when ucxx is unusable."""
    if kind == "tcp":
        return TCPTransport()
    if kind == "ucx":
        try:
            from splitserve.kv_transfer.ucx import UCXTransport

            return UCXTransport()
        except Exception as e:  # ImportError, or UCX failing to initialise
            log.warning("kv_transfer: UCX unavailable (%s); using TCP", e)
            metrics.TRANSPORT_FALLBACKS.labels(wanted="ucx", reason=type(e).__name__).inc()
            return TCPTransport()
    raise ValueError(f"unknown transport {kind!r}; expected 'tcp' or 'ucx'")


def host_view(buf: Buffer) -> memoryview:
    """A writable-if-possible byte memoryview of CPU memory, without copying."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError("this transport moves host memory; stage device tensors first")
        return memoryview(buf.numpy()).cast("B")
    return memoryview(buf).cast("B")


class TCPConnection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self.stream = True
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)

    def send(self, buffers: Sequence[Buffer]) -> None:
        views = [v for v in (host_view(b) for b in buffers) if v.nbytes]
        try:
            while views:
                sent = self._sock.sendmsg(views[:64])
                while sent:
                    if sent >= views[0].nbytes:
                        sent -= views[0].nbytes
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except OSError as e:
            raise ConnectionClosed(f"send to {self.peer} failed: {e}") from None

    def recv_into(self, buffer: Buffer) -> None:
        view = host_view(buffer)
        got, n = 0, view.nbytes
        try:
            while got < n:
                k = self._sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                got += k
        except OSError as e:
            raise ConnectionClosed(f"receive from {self.peer} failed: {e}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked in another thread
        except OSError:
            pass
        self._sock.close()


class TCPListener:
    def __init__(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # set before listen so accepted sockets start with the large window
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._on_connection = on_connection
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-accept-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            conn = TCPConnection(sock, f"{addr[0]}:{addr[1]}")
            threading.Thread(target=self._on_connection, args=(conn,), name=f"kv-conn-{addr[1]}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


class TCPTransport:
    kind = "tcp"

    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> Listener:
        return TCPListener(host, port, on_connection)

    def connect(self, host: str, port: int, timeout: float) -> Connection:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise ConnectionClosed(f"cannot connect to {host}:{port}: {e}") from None
        sock.settimeout(None)
        return TCPConnection(sock, f"{host}:{port}")
