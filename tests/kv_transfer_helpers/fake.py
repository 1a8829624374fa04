"""An in-memory transport with the same four verbs, for unit tests of the
receiver and sender logic without sockets (and for injecting raw bytes)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from splitserve.kv_transfer.transport import Buffer, Connection, ConnectionClosed, host_view


class _Pipe:
    """One direction of a connection: a byte queue."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self.cv = threading.Condition()


class FakeConnection:
    def __init__(self, inbox: _Pipe, outbox: _Pipe, peer: str) -> None:
        self._in, self._out, self.peer = inbox, outbox, peer
        self.stream = True
        self.authenticated = False

    def send(self, buffers: Sequence[Buffer]) -> None:
        with self._out.cv:
            if self._out.closed:
                raise ConnectionClosed(f"{self.peer} is closed")
            for b in buffers:
                self._out.data += host_view(b)
            self._out.cv.notify_all()

    def recv_into(self, buffer: Buffer) -> None:
        view = host_view(buffer)
        with self._in.cv:
            self._in.cv.wait_for(lambda: len(self._in.data) >= view.nbytes or self._in.closed)
            if len(self._in.data) < view.nbytes:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            view[:] = self._in.data[: view.nbytes]
            del self._in.data[: view.nbytes]

    def close(self) -> None:
        for p in (self._in, self._out):
            with p.cv:
                p.closed = True
                p.cv.notify_all()


class FakeListener:
    def __init__(self, transport: FakeTransport, port: int, on_connection: Callable[[Connection], None]) -> None:
        self.host, self.port = "fake", port
        self._transport, self.on_connection = transport, on_connection

    def close(self) -> None:
        self._transport.listeners.pop(self.port, None)


class FakeTransport:
    def __init__(self) -> None:
        self.listeners: dict[int, FakeListener] = {}
        self._ports = itertools.count(1)

    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> FakeListener:
        listener = FakeListener(self, port or next(self._ports), on_connection)
        self.listeners[listener.port] = listener
        return listener

    def connect(self, host: str, port: int, timeout: float) -> Connection:
        listener = self.listeners.get(port)
        if listener is None:
            raise ConnectionClosed(f"nothing listens on fake port {port}")
        a, b = _Pipe(), _Pipe()
        server = FakeConnection(a, b, "fake-client")
        threading.Thread(target=listener.on_connection, args=(server,), daemon=True).start()
        return FakeConnection(b, a, f"fake:{port}")
