"""TCP for the KV plane: plain, or sealed under the cluster's mutual TLS (sealed.py).

Under TLS a connection is accepted or made with the cluster's SSL context,
the handshake proves both sides belong to the cluster, and then the
connection switches to sealed records (sealed.py says why not TLS records).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Sequence

from splitserve.kv_transfer import sealed
from splitserve.kv_transfer.transport import Buffer, Connection, ConnectionClosed, Listener, host_view, recv_exact
from splitserve.runtime.tls import CLUSTER_NAME

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake on an accepted connection

# Loopback moves bytes with two memcpys; bigger buffers mean fewer wakeups.
# The kernel caps them at net.core.[rw]mem_max.
SOCKET_BUFFER_BYTES = 32 << 20


class TCPConnection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self.stream = True
        self.authenticated = False
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
        recv_exact(self._sock, host_view(buffer), f"receive from {self.peer}")

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
    def __init__(
        self,
        host: str,
        port: int,
        on_connection: Callable[[Connection], None],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # set before listen so accepted sockets start with the large window
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._on_connection = on_connection
        self._tls = tls
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-accept-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name=f"kv-conn-{addr[1]}", daemon=True).start()

    def _serve(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        if self._tls is None:
            self._on_connection(TCPConnection(sock, peer))
            return
        try:  # the handshake on the connection's thread: a slow peer holds no other
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            plain, keys = sealed.switch_server(self._tls.wrap_socket(sock, server_side=True))
            plain.settimeout(None)
        except (OSError, ssl.SSLError, ConnectionClosed) as e:
            log.warning("KV connection from %s refused: TLS handshake failed (%s)", peer, e)
            sock.close()
            return
        self._on_connection(sealed.SealedConnection(TCPConnection(plain, peer), keys))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


class TCPTransport:
    """TCP, or TCP under mutual TLS with the cluster's contexts (runtime/tls.py ClusterTLS): each
    side has then proved it holds a certificate of the cluster's CA, and every frame travels in
    sealed records."""

    def __init__(self, server_tls: ssl.SSLContext | None = None, client_tls: ssl.SSLContext | None = None) -> None:
        self.server_tls = server_tls
        self.client_tls = client_tls

    def listen(self, host: str, port: int, on_connection: Callable[[Connection], None]) -> Listener:
        return TCPListener(host, port, on_connection, self.server_tls)

    def connect(self, host: str, port: int, timeout: float) -> Connection:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise ConnectionClosed(f"cannot connect to {host}:{port}: {e}") from None
        peer = f"{host}:{port}"
        if self.client_tls is None:
            sock.settimeout(None)
            return TCPConnection(sock, peer)
        try:
            plain, keys = sealed.switch_client(
                self.client_tls.wrap_socket(sock, server_side=False, server_hostname=CLUSTER_NAME)
            )
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise ConnectionClosed(f"cannot connect to {peer}: {e}") from None
        plain.settimeout(None)
        return sealed.SealedConnection(TCPConnection(plain, peer), keys)
