"""UCX transport through `ucxx`: the same frames as TCP, as tagged messages.

ucxx's Python API is asyncio; the receiver and sender are written as blocking
code on their own threads. So one process-wide event loop runs in a daemon
thread (`_Runtime`), owns UCX's context and worker, and every blocking call
hops onto it once per frame (`send` submits all of a frame's buffers in one
coroutine). Each buffer is one tagged message; UCX keeps messages of one tag
between two endpoints in order, and the receiver posts receives of exactly the
sizes the sender sent (header, then payload), straight into cache memory.
UCX picks the wire (TCP, shared memory, CMA here; RDMA and CUDA memory where
the machine has them).

Importing this module fails without ucxx; links.py then falls back to TCP
and says so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx

from splitserve.kv_transfer.transport import Buffer, Connection, ConnectionClosed

log = logging.getLogger(__name__)
ANY_HOST = ("", "0.0.0.0", "::")


class _Runtime:
    """The event loop that owns this process's UCX worker."""

    _instance: _Runtime | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-ucx-loop", daemon=True)
        self._thread.start()

    @classmethod
    def get(cls) -> _Runtime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Runtime()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _ucx_buffer(buf: Buffer) -> Any:
    if isinstance(buf, torch.Tensor):
        return buf if buf.is_cuda else buf.numpy()
    return buf


class UCXConnection:
    def __init__(self, rt: _Runtime, ep: Any, peer: str, on_close: asyncio.Future[None] | None = None) -> None:
        self._rt = rt
        self._ep = ep
        self.peer = peer
        self.stream = False  # tagged messages: receives match the sender's sizes
        self.authenticated = False
        self._on_close = on_close
        self._closed = False

    def send(self, buffers: Sequence[Buffer]) -> None:
        bufs = [_ucx_buffer(b) for b in buffers if len(b)]

        async def go() -> None:
            for b in bufs:
                await self._ep.send(b)

        self._call(go())

    def recv_into(self, buffer: Buffer) -> None:
        self._call(self._ep.recv(_ucx_buffer(buffer)))

    def _call(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._closed:
            coro.close()
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        try:
            self._rt.run(coro)
        except Exception as e:  # UCXCanceled, UCXConnectionResetError, UCXError, ...
            raise ConnectionClosed(f"UCX transfer with {self.peer} failed: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def abort() -> None:
            try:
                self._ep.abort()  # cancels posted sends and receives
            except Exception:
                pass
            if self._on_close is not None and not self._on_close.done():
                self._on_close.set_result(None)

        self._rt.loop.call_soon_threadsafe(abort)


async def close_listener(listener: Any, timeout: float = 1.0) -> None:
    """Close a ucxx listener once the handlers of its closed connections have returned
    (ucxx keeps one for a loop turn after it ends, and warns when a listener goes
    with handlers alive); a handler still busy after `timeout` is left to its end."""
    wait = getattr(listener, "_wait_for_active_clients", None)  # ucxx >= 0.40; private but stable
    if wait is not None:
        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            pass
    listener.close()


class UCXListener:
    def __init__(self, rt: _Runtime, port: int, on_connection: Callable[[Connection], None], host: str = "") -> None:
        self._rt = rt
        # ucxx's create_listener takes no address: the listener is on every interface, whatever
        # the worker's --host says. Said at start, so that nobody believes it is bound there.
        self.host = "0.0.0.0"
        if host not in ANY_HOST:
            log.warning(
                "the UCX KV listener listens on every interface, not on --host %s only (ucxx binds no address); "
                "use --kv-transport tcp, or a firewall, to keep the KV plane on one interface",
                host,
            )

        async def handler(ep: Any) -> None:
            closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            conn = UCXConnection(rt, ep, f"ucx-peer-{id(ep):x}", closed)
            threading.Thread(target=on_connection, args=(conn,), name="kv-ucx-conn", daemon=True).start()
            await closed  # keep the handler (and so the endpoint) alive until the connection ends

        async def make() -> Any:
            return ucxx.create_listener(handler, port=port or None)

        self._listener = rt.run(make(), timeout=30)
        self.port = self._listener.port

    def close(self) -> None:
        async def stop() -> None:
            await close_listener(self._listener)

        try:
            self._rt.run(stop(), timeout=10)
        except Exception:
            pass


class UCXTransport:
    def __init__(self) -> None:
        self._rt = _Runtime.get()

    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> UCXListener:
        return UCXListener(self._rt, port, on_connection, host)

    def connect(self, host: str, port: int, timeout: float) -> Connection:
        async def make() -> Any:
            return await ucxx.create_endpoint(host, port, connect_timeout=timeout)

        try:
            ep = self._rt.run(make(), timeout=timeout + 5)
        except Exception as e:
            raise ConnectionClosed(f"cannot make a UCX endpoint to {host}:{port}: {e}") from None
        return UCXConnection(self._rt, ep, f"{host}:{port}")
