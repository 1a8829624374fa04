"""Shared pieces of the kv_transfer tests: caches with random KV, raw frames, a bystander stream."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import torch
from prometheus_client import REGISTRY

from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer import frame
from splitserve.kv_transfer.frame import Header
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.reservation import Completed, Reservation
from splitserve.kv_transfer.sender import KVSender

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")


def random_cache(layout: KVLayout = LAYOUT, num_blocks: int = 64, seed: int = 0) -> KVCache:
    cache = KVCache(layout, num_blocks)
    g = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))
    return cache


def assert_arrived(dst: KVCache, src: KVCache, dst_ids, src_ids) -> None:
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(dst.tensor[:, d], src.tensor[:, s]), f"block {s} -> {d} differs"


def assert_zero(cache: KVCache, ids) -> None:
    for b in ids:
        assert not cache.tensor[:, b].any(), f"block {b} was not reset"


def assert_no_leak(rx: KVReceiver, all_ids) -> None:
    """Nothing live, and every block can be reserved again (the receiver let go of them all)."""
    assert rx.active() == 0
    r = rx.reserve("leak-check", list(all_ids), 1.0)
    rx.cancel(r.ticket)


def send_all(sender: KVSender, r: Reservation, src_ids, first_token: int = 7, layers=None) -> None:
    with sender.open(r) as stream:
        for layer in layers if layers is not None else range(r.layout.num_layers):
            stream.send_layer(layer, src_ids)
        stream.finish(first_token, timeout=10)


class RawPeer:
    """A hand-driven TCP client speaking (or mangling) the frame protocol."""

    def __init__(self, r: Reservation) -> None:
        host, _, port = r.tcp_endpoint.rpartition(":")
        self.r = r
        self.sock = socket.create_connection((host, int(port)), timeout=10)

    def header(self, kind: int, **fields) -> bytes:
        fields.setdefault("ticket", self.r.ticket)
        fields.setdefault("request_id", self.r.request_id)
        return frame.encode_header(Header(kind, **fields))

    def handshake(self, layout: KVLayout | None = None, **fields) -> tuple[Header, bytes]:
        lay = layout or self.r.layout
        body = frame.encode_layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)
        self.sock.sendall(self.header(frame.HANDSHAKE, payload_length=len(body), **fields) + body)
        return self.read()

    def layer_frame(self, cache: KVCache, layer: int, src_first: int, dst_first: int, count: int, **override):
        payload = frame.as_bytes(cache.blocks(layer, src_first, count))
        fields = dict(
            layer=layer,
            first_block=dst_first,
            block_count=count,
            dtype_code=frame.DTYPE_CODES[cache.layout.dtype],
            element_count=count * cache.layout.elements_per_block,
            payload_length=payload.numel(),
            checksum_kind=frame.CHECKSUM_LANESUM,
            checksum=frame.checksum(frame.CHECKSUM_LANESUM, [payload]),
        )
        fields.update(override)
        return self.header(frame.LAYER, **fields), bytes(payload.numpy())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> tuple[Header, bytes]:
        buf = self._read_exact(frame.HEADER_SIZE)
        h = frame.decode_header(buf)
        return h, self._read_exact(h.payload_length)

    def send_and_wait_dropped(self, data: bytes) -> bytes:
        """Send bytes the receiver should refuse; return what it said before dropping us."""
        try:
            self.sock.sendall(data)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # already dropped (reset with our bytes unread)
            pass
        return self.read_until_closed()

    def read_until_closed(self) -> bytes:
        """Everything the receiver sends until it drops the connection."""
        out = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:  # dropped with our bytes unread
                return out
            if not chunk:
                return out
            out += chunk

    def _read_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()


class Bystander:
    """A well-behaved transfer that runs alongside a fault and must still complete."""

    def __init__(self, rx: KVReceiver, src: KVCache, dst_ids, src_ids, request_id: str = "bystander") -> None:
        self.rx, self.src, self.dst_ids, self.src_ids = rx, src, list(dst_ids), list(src_ids)
        self.r = rx.reserve(request_id, self.dst_ids, lease_s=30)
        self.stream = KVSender(src).open(self.r)
        self.stream.send_layer(0, self.src_ids)  # half-way when the fault happens
        self.stream.send_layer(2, self.src_ids)

    def finish(self) -> None:
        self.stream.send_layer(1, self.src_ids)
        self.stream.send_layer(3, self.src_ids)
        self.stream.finish(99, timeout=10)
        outcome = self.rx.wait(self.r.ticket, 10)
        assert isinstance(outcome, Completed) and outcome.first_token == 99
        assert_arrived(self.rx.cache, self.src, self.dst_ids, self.src_ids)


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `condition` until it holds; the seconds it took. Fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.005)
    return time.monotonic() - start


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed `sock` (which it sent nothing on), without blocking."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # a socket with a timeout waits that long for data first, MSG_DONTWAIT or not
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(timeout)


def complete_stream(peer: RawPeer, cache: KVCache, src_ids, first_token: int) -> None:
    """One whole, honest stream by hand: handshake, every layer, done, and the receiver's ack."""
    h, _ = peer.handshake()
    assert h.kind == frame.ACK
    for layer in range(cache.layout.num_layers):
        hdr, payload = peer.layer_frame(cache, layer, src_ids[0], peer.r.block_ids[0], len(src_ids))
        peer.send(hdr + payload)
    peer.send(peer.header(frame.DONE, value=first_token))
    h, _ = peer.read()
    assert h.kind == frame.ACK
