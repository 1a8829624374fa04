"""Which transport each end of a KV stream uses, and how its layer payloads move.

Decided here and nowhere else; receiver.py and sender.py call this module and
never name a transport.

- A receiver always listens on TCP (the fallback, and the control channel of
  CUDA IPC) and offers one transport in its reservations (`listen`).
- A sender connects by what a reservation offers and what it can use itself,
  and keeps connections for the next stream (`Dialer.dial`).
- At each stream's handshake the two settle how layer payloads travel
  (`grant` on the receiver, `Dialer.accept` on the sender): as bytes on the
  stream's connection (TCP, UCX, the fake), or, for CUDA IPC, as device copies
  straight into the receiver's cache, the frames then carrying no payload
  (frame.py, "A handshake's value").

Why CUDA IPC is a way of moving payloads and not a `Transport` of its own: it
changes only where a layer frame's bytes go, and that is settled per stream at
the handshake (a receiver offering it still serves plain TCP senders on the same
listener, and a sender that cannot map the cache still uses TCP), while the
frames travel over an ordinary TCP connection. So each end holds one small
object for the stream's payloads, picked here: the sender calls
`LayerPayloads.place` for every frame, and the receiver reads the number of
bytes per block that `grant` says arrive on the connection (zero for device
copies). Neither knows which it has.

Every fallback to TCP is decided, counted (`splitserve_kv_transport_fallbacks`)
and, where an operator should hear of it, logged here; so is the transport
each end ends up with (`splitserve_kv_transport_chosen`).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer import codec as codec_mod
from splitserve.kv_transfer import cuda_ipc, frame, metrics
from splitserve.kv_transfer.reservation import TRANSPORT_NAMES, Reservation, TransportName
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Connection, Listener, Transport

log = logging.getLogger(__name__)

IDLE_PER_RECEIVER = 8  # connections a sender keeps per (transport, endpoint) for its next streams


def _fall_back(wanted: TransportName, reason: str, why: str | None) -> None:
    """Count a fallback to TCP; `why`, when given, is logged (None: too routine to log each time)."""
    if why is not None:
        log.warning("kv_transfer: %s; using TCP", why)
    metrics.TRANSPORT_FALLBACKS.labels(wanted=wanted, reason=reason).inc()


def _open_ucx() -> Transport | None:
    """UCX, or None (a fallback) when ucxx does not import or UCX fails to initialise."""
    try:
        from splitserve.kv_transfer.ucx import UCXTransport

        return UCXTransport()
    except Exception as e:  # ImportError, or UCX failing to initialise
        _fall_back("ucx", type(e).__name__, f"UCX unavailable ({e})")
        return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


_this_host: dict[str, bool] = {}  # host -> whether it is this machine (looked up once each)


def is_this_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine: loopback, or an address assigned to
    one of its interfaces (a socket can bind to it). Resolving the host name is not enough: a
    machine's name often resolves to loopback alone while its interfaces carry other addresses,
    and a receiver there advertises one of those."""
    if host in ("localhost", socket.gethostname()):
        return True
    known = _this_host.get(host)
    if known is None:
        known = _this_host[host] = _bindable(host)
    return known


def _bindable(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            if ipaddress.ip_address(addr[0]).is_loopback:
                return True
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except (OSError, ValueError):
            continue
    return False


# ---- the receiver's side ----------------------------------------------------------------


class Listening(NamedTuple):
    """A receiver's listeners, and what its reservations offer."""

    transport: TransportName  # offered to senders
    endpoint: str  # "host:port" of that transport's listener
    tcp: Listener  # always there: TCP's (or the fake's in its place)
    extra: Listener | None  # the offered transport's own listener, where it has one (UCX)


def listen(
    transport: TransportName | Transport, cache: KVCache, host: str, port: int, serve: Callable[[Connection], None]
) -> Listening:
    """Open a receiver's listeners on `host`; `port` is TCP's (0: any). A `Transport`
    object listens in place of TCP (the fake); a name that this machine or `cache`
    cannot serve falls back to TCP."""
    if isinstance(transport, str) and transport not in TRANSPORT_NAMES:
        raise ValueError(f"unknown transport {transport!r}; expected one of {TRANSPORT_NAMES}")
    wanted: TransportName = transport if isinstance(transport, str) else "tcp"
    tcp = (TCPTransport() if isinstance(transport, str) else transport).listen(host, port, serve)
    tcp_endpoint = f"{host}:{tcp.port}"
    out = Listening("tcp", tcp_endpoint, tcp, None)
    if wanted == "ucx":
        ucx = _open_ucx()
        if ucx is not None:
            try:
                extra = ucx.listen(host, 0, serve)
                out = Listening("ucx", f"{host}:{extra.port}", tcp, extra)
            except Exception as e:
                _fall_back("ucx", type(e).__name__, f"UCX listener failed ({e})")
    elif wanted == "cuda_ipc":
        if cuda_ipc.can_map(cache):
            out = Listening("cuda_ipc", tcp_endpoint, tcp, None)  # control frames on the TCP listener
        else:
            _fall_back("cuda_ipc", "cpu_cache", "CUDA IPC needs a CUDA cache")
    metrics.TRANSPORT_CHOSEN.labels(side="receiver", transport=out.transport).inc()
    return out


class Grant(NamedTuple):
    """How one stream's layer payloads reach a receiver, settled at its handshake."""

    value: int  # the ack's value: frame.PAYLOAD_ON_CONNECTION or frame.PAYLOAD_DEVICE_COPY
    payload: bytes  # the ack's payload: the mapping of the cache for device copies, else nothing
    bytes_per_block: int  # what each block of a layer frame carries on the connection (0: copied in already)
    codec: int = codec_mod.CODEC_RAW  # the ack's block count: the codec the stream's layer payloads use


def grant(offered: TransportName, asked: int, cache: KVCache, codecs: int = 0) -> Grant:
    """The receiver's answer to a handshake asking for payloads to travel as `asked`, with
    the codecs the sender offers (`codecs`, a bit set: frame.py)."""
    if asked == frame.PAYLOAD_DEVICE_COPY and offered == "cuda_ipc":
        return Grant(frame.PAYLOAD_DEVICE_COPY, cuda_ipc.export_cache(cache), 0)
    lay = cache.layout
    if codecs & codec_mod.OFFER_INT8 and accepts_int8(lay) is None:
        shard_elements = lay.elements_per_block // lay.tp_size
        per_block = codec_mod.wire_bytes(codec_mod.CODEC_INT8, shard_elements, lay.head_dim, 1)
        assert lay.dtype != "int8" or per_block == lay.shard_bytes_per_block  # an int8 pool's block is a frame's
        return Grant(frame.PAYLOAD_ON_CONNECTION, b"", per_block, codec_mod.CODEC_INT8)
    return Grant(frame.PAYLOAD_ON_CONNECTION, b"", lay.shard_bytes_per_block)  # a frame is one shard's


def accepts_int8(layout: KVLayout) -> str | None:
    """Why a receiver with this cache cannot take int8 frames, or None: it decodes them into
    its own dtype (codec.DECODES_INTO)."""
    if layout.dtype not in codec_mod.DECODES_INTO:
        return (
            f"FAILED_PRECONDITION: the int8 wire codec cannot be written into a {layout.dtype} KV cache "
            f"(int8 frames decode into {', '.join(codec_mod.DECODES_INTO)})"
        )
    return codec_mod.check_aligned(layout.head_dim)


# ---- the sender's side ------------------------------------------------------------------


class LayerPayloads(Protocol):
    """How a stream's layer payloads leave the sender; one per stream, from `Dialer.accept`."""

    checksum_kind: int  # for the layer headers

    def place(self, layer: int, first_block: int, rank: int, parts: Sequence[HeadsPart]) -> list[torch.Tensor]:
        """Move one frame's blocks toward the receiver: `parts` are the receiver shard
        `rank`'s heads of them, bound for its blocks from `first_block` on; returns the
        buffers that follow the frame's header on the connection."""
        ...


# One piece of a frame's payload: (first head within the receiver's shard, the sender's
# blocks `[count, 2, block_size, heads, head_dim]` for those heads, a view of its cache).
HeadsPart = tuple[int, torch.Tensor]


class OnConnection:
    """Layer payloads as bytes on the stream's connection (TCP, UCX, the fake): straight
    from the cache when one sender shard is the receiver's shard, else packed (heads.py)."""

    def __init__(self, checksum_kind: int) -> None:
        self.checksum_kind = checksum_kind
        self._packer = Packer()

    def place(self, layer: int, first_block: int, rank: int, parts: Sequence[HeadsPart]) -> list[torch.Tensor]:
        return [frame.as_bytes(self._packer.pack(parts))]


class Packer:
    """Packs a frame's heads into one contiguous `[count, 2, block_size, heads, head_dim]`.

    Into one staging buffer, kept and reused: the stream's thread checksums and
    sends each frame (`Connection.send` returns once the bytes are the kernel's,
    or UCX's send completed) before it packs the next, and a fresh buffer per
    frame would cost its page faults on every frame (on this machine's CPU more
    than the copy itself: bench/transfer_tp.py)."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def pack(self, parts: Sequence[HeadsPart]) -> torch.Tensor:
        first = parts[0][1]
        if len(parts) == 1 and first.is_contiguous():
            return first  # one sender shard whole (equal sizes): the cache's own memory
        shape = (*first.shape[:3], sum(t.shape[3] for _, t in parts), first.shape[4])
        numel = math.prod(shape)
        s = self._staging
        if s is None or s.numel() < numel or s.dtype != first.dtype or s.device != first.device:
            s = self._staging = torch.empty(numel, dtype=first.dtype, device=first.device)
        out = s[:numel].view(shape)
        for offset, t in parts:  # shards on several devices: gathered on the first's
            out[:, :, :, offset : offset + t.shape[3]].copy_(t)
        return out


class Dialed(NamedTuple):
    """A sender's connection for one stream, before its handshake."""

    conn: Connection
    transport: TransportName  # what it was made for
    ask: int  # the handshake's value: how the stream asks its payloads to travel
    pool: tuple[str, str]  # (transport, endpoint): where it goes back once its stream is confirmed
    reused: bool  # kept from an earlier stream (the receiver may have closed it since)


class Dialer:
    """A sender's ways to its receivers: the connection a reservation gets, the
    transport and payloads a stream ends up with, and connections kept for reuse."""

    def __init__(self, cache: KVCache, tcp: Transport, connect_timeout: float) -> None:
        """`tcp`: TCP, or the fake in its place."""
        self._cache = cache
        self._tcp = tcp
        self._connect_timeout = connect_timeout
        self._ucx: Transport | None = None
        self._ucx_tried = False  # opened (or found unusable) once per sender, not per stream
        self._mapped: dict[str, list[torch.Tensor]] = {}  # receivers' shards mapped through CUDA IPC, once each
        # Connections whose last stream completed, per (transport, endpoint): the next
        # stream to that receiver skips connecting (and UCX's endpoint wire-up).
        self._idle: dict[tuple[str, str], list[Connection]] = {}
        self._lock = threading.Lock()

    def dial(self, r: Reservation) -> Dialed:
        """A connection for `r`, an idle one if there is one; raises ConnectionClosed."""
        if r.transport == "ucx":
            ucx = self._ucx_transport()
            if ucx is not None:
                pool = ("ucx", r.endpoint)
                conn = self._take_idle(pool)
                if conn is not None:
                    return Dialed(conn, "ucx", frame.PAYLOAD_ON_CONNECTION, pool, True)
                try:
                    conn = ucx.connect(*split_endpoint(r.endpoint), self._connect_timeout)
                    return Dialed(conn, "ucx", frame.PAYLOAD_ON_CONNECTION, pool, False)
                except Exception as e:
                    _fall_back("ucx", type(e).__name__, f"UCX endpoint to {r.endpoint} failed ({e})")
        transport: TransportName = "tcp"
        if r.transport == "cuda_ipc":
            if cuda_ipc.can_map(self._cache):
                transport = "cuda_ipc"
            else:
                _fall_back("cuda_ipc", "cpu_cache", None)  # every stream of a CPU sender: too routine to log
        ask = frame.PAYLOAD_DEVICE_COPY if transport == "cuda_ipc" else frame.PAYLOAD_ON_CONNECTION
        pool = (transport, r.tcp_endpoint)
        conn = self._take_idle(pool)
        if conn is not None:
            return Dialed(conn, transport, ask, pool, True)
        conn = self._tcp.connect(*split_endpoint(r.tcp_endpoint), self._connect_timeout)
        return Dialed(conn, transport, ask, pool, False)

    def accept(
        self, d: Dialed, r: Reservation, value: int, payload: bytes, checksum_kind: int
    ) -> tuple[TransportName, LayerPayloads]:
        """The stream's transport and payloads, from its handshake's ack (`value`, `payload`)."""
        if d.ask == frame.PAYLOAD_DEVICE_COPY and value == frame.PAYLOAD_DEVICE_COPY:
            dest = self._mapped.get(r.tcp_endpoint)
            if dest is None:
                dest = self._mapped[r.tcp_endpoint] = cuda_ipc.import_shards(payload, r.layout)
            chosen: tuple[TransportName, LayerPayloads] = ("cuda_ipc", cuda_ipc.DeviceCopy(dest))
        elif d.ask == frame.PAYLOAD_DEVICE_COPY:  # the receiver does not offer CUDA IPC after all
            _fall_back(d.transport, "not_granted", None)
            chosen = ("tcp", OnConnection(checksum_kind))
        else:
            chosen = (d.transport, OnConnection(checksum_kind))
        metrics.TRANSPORT_CHOSEN.labels(side="sender", transport=chosen[0]).inc()
        return chosen

    def release(self, pool: tuple[str, str], conn: Connection) -> None:
        """Keep a connection whose stream was confirmed, for the next stream to that receiver."""
        with self._lock:
            idle = self._idle.setdefault(pool, [])
            if len(idle) < IDLE_PER_RECEIVER:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()

    def _take_idle(self, pool: tuple[str, str]) -> Connection | None:
        with self._lock:
            idle = self._idle.get(pool)
            return idle.pop() if idle else None

    def _ucx_transport(self) -> Transport | None:
        with self._lock:
            if not self._ucx_tried:
                self._ucx, self._ucx_tried = _open_ucx(), True
            return self._ucx
