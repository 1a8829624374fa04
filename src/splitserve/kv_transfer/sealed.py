"""The KV plane under the cluster's TLS: a mutual-TLS handshake, then AES-GCM records.

Why not TLS end to end: Python's ssl module writes one 16 KB record per
syscall and decrypts into its own buffer before copying out, and the KV plane
moved 0.41x of plaintext's bytes that way (bench/results/internal-tls-cpu.txt
at 882b00a). The handshake is what TLS is needed for: both sides prove they
hold a certificate of the cluster's CA. So the connecting side then sends two
fresh AES-128 keys (one per direction) inside the TLS session, both sides shut
TLS down (close_notify each way, `SSLSocket.unwrap`), and every buffer after
that travels as AES-GCM records of at most RECORD_BYTES: sealed straight from
the cache into a staging buffer small enough to stay in L2 until the socket
copies it, and opened straight into the blocks. cryptography's `*_into` calls
release the GIL and write no new buffer (allocating one per call ran at a
quarter of the speed here: page faults).

What the records guarantee, as TLS would: confidentiality, and integrity of
each record and of their order (the nonce is the record's number in its
direction, so a dropped, replayed or reordered record fails its tag). A
truncated stream is a closed connection, which the frame protocol already
reports. Keys are per connection and random, so a (key, nonce) pair never
repeats.

A sealed connection is a message transport, as UCX is (`stream` False): the
receiver's `recv_into` calls take the sizes of the sender's buffers, which the
frame protocol guarantees, and both sides cut a buffer into the same records.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from splitserve.kv_transfer.transport import Buffer, Connection, ConnectionClosed, host_view, recv_exact

KEY_BYTES = 16  # AES-128: the 16-byte tag bounds a forgery either way, and 128 runs faster
TAG_BYTES = 16
# Big enough that a syscall and a cipher call per record cost little, small enough that the
# staging buffer stays in L2 between being sealed and being copied into the socket.
RECORD_BYTES = 512 << 10


class TamperedRecord(ConnectionClosed):
    """A record failed its tag: altered, replayed or out of order. The connection is closed."""


class Keys:
    """One connection's two AES-GCM keys, each side's sending key the other's receiving key."""

    __slots__ = ("send", "recv")

    def __init__(self, send: bytes, recv: bytes) -> None:
        self.send, self.recv = send, recv


def switch_client(sock: ssl.SSLSocket) -> tuple[socket.socket, Keys]:
    """The connecting side's half of the switch: send both keys inside TLS, then end TLS."""
    keys = os.urandom(2 * KEY_BYTES)
    try:
        sock.sendall(keys)
    except OSError as e:
        raise ConnectionClosed(f"sending the record keys failed: {e}") from None
    return _unwrap(sock), Keys(keys[:KEY_BYTES], keys[KEY_BYTES:])


def switch_server(sock: ssl.SSLSocket) -> tuple[socket.socket, Keys]:
    """The accepting side's half: read the keys, then end TLS. The client's sending key is
    this side's receiving key."""
    keys = bytearray(2 * KEY_BYTES)
    recv_exact(sock, memoryview(keys), "reading the record keys")
    return _unwrap(sock), Keys(bytes(keys[KEY_BYTES:]), bytes(keys[:KEY_BYTES]))


def _unwrap(sock: ssl.SSLSocket) -> socket.socket:
    """close_notify each way. OpenSSL reads no further than the peer's (read-ahead is off), so
    what follows on the socket is the first record. `unwrap` hands back the SSLSocket itself,
    which refuses `sendmsg` even with TLS ended: the descriptor moves to a plain socket (with no
    timeout of its own; the caller sets one)."""
    try:
        sock.unwrap()
    except (OSError, ssl.SSLError) as e:
        raise ConnectionClosed(f"ending TLS after the handshake failed: {e}") from None
    return socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())


class SealedConnection:
    """A byte-stream connection whose every buffer travels as AES-GCM records (see the module's
    docstring); `raw` carries the records."""

    def __init__(self, raw: Connection, keys: Keys) -> None:
        self._raw = raw
        self.peer = raw.peer
        self.stream = False
        self.authenticated = True
        self._seal, self._open = AESGCM(keys.send), AESGCM(keys.recv)
        self._sent = self._received = 0  # records so far in each direction: the next nonce
        # a staging buffer per direction: send runs on one thread, recv_into on one other
        self._send_staging = memoryview(bytearray(RECORD_BYTES + TAG_BYTES))
        self._recv_staging = memoryview(bytearray(RECORD_BYTES + TAG_BYTES))

    def send(self, buffers: Sequence[Buffer]) -> None:
        for buf in buffers:
            view = host_view(buf)
            for at in range(0, view.nbytes, RECORD_BYTES):
                plain = view[at : at + RECORD_BYTES]
                sealed = self._send_staging[: plain.nbytes + TAG_BYTES]
                self._seal.encrypt_into(_nonce(self._sent), plain, None, sealed)
                self._sent += 1
                self._raw.send([sealed])

    def recv_into(self, buffer: Buffer) -> None:
        view = host_view(buffer)
        for at in range(0, view.nbytes, RECORD_BYTES):
            plain = view[at : at + RECORD_BYTES]
            sealed = self._recv_staging[: plain.nbytes + TAG_BYTES]
            self._raw.recv_into(sealed)
            try:
                self._open.decrypt_into(_nonce(self._received), sealed, None, plain)
            except InvalidTag:
                self.close()
                raise TamperedRecord(
                    f"record {self._received} from {self.peer} failed authentication "
                    "(altered, replayed or out of order): connection closed"
                ) from None
            self._received += 1

    def close(self) -> None:
        self._raw.close()


def _nonce(record: int) -> bytes:
    return record.to_bytes(12, "big")
