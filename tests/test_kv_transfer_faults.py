"""Faults on the KV plane, over real loopback sockets. Each one: the receiver stays
up, a bystander transfer running alongside still completes, the bad reservation
fails with its code and reason, and its blocks are reset and released (no leak).

Slow and silent peers too: each is dropped by its deadline (the receiver built
with small ones), counted, and holds no thread afterwards."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import pytest

from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer import Completed, Failed, FailureCode, KVReceiver, KVSender, TransferError, frame
from splitserve.kv_transfer.transport import Buffer, ConnectionClosed, Watchdog, Watched
from tests.kv_transfer_helpers.common import (
    LAYOUT,
    Bystander,
    RawPeer,
    assert_arrived,
    assert_no_leak,
    assert_zero,
    closed_by_peer,
    complete_stream,
    metric,
    random_cache,
    send_all,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

BAD_IDS, BAD_SRC = [1, 2, 3], [10, 11, 12]
BYSTANDER_IDS, BYSTANDER_SRC = [30, 31, 40], [20, 21, 22]


@contextlib.contextmanager
def receiver_with_bystander(**limits):
    src, dst = random_cache(seed=11), KVCache(LAYOUT, 64)
    rx = KVReceiver(dst, **limits)
    bystander = Bystander(rx, src, BYSTANDER_IDS, BYSTANDER_SRC)
    yield rx, src, bystander
    bystander.finish()  # the receiver stayed up and the other transfer completed
    assert_no_leak(rx, range(64))
    rx.close()


@pytest.fixture
def setup():
    with receiver_with_bystander() as s:
        yield s


# Small deadlines, so slow and silent peers are dropped within a test. The handshake
# deadline is the tighter, so a fresh connection's drops say "handshake_timeout";
# the rate gives a layer frame of 3 blocks (1,536 bytes) 1.5 s over the base.
class Deadlines(TypedDict):
    handshake_timeout_s: float
    frame_timeout_s: float
    frame_min_bytes_per_s: int
    idle_timeout_s: float


TIGHT = Deadlines(handshake_timeout_s=0.5, frame_timeout_s=0.8, frame_min_bytes_per_s=1024, idle_timeout_s=0.5)
DROPPED = "splitserve_kv_connections_dropped_total"


@pytest.fixture
def tight():
    with receiver_with_bystander(**TIGHT) as s:
        yield s


def expect_failure(rx: KVReceiver, r, code: FailureCode, reason: str) -> None:
    outcome = rx.wait(r.ticket, 10)
    assert isinstance(outcome, Failed), outcome
    assert outcome.code is code, outcome
    assert reason in outcome.reason, outcome.reason
    assert_zero(rx.cache, r.block_ids)


def started(rx, src, request_id="bad"):
    """A reservation with one good layer already written, and a raw peer on it."""
    r = rx.reserve(request_id, BAD_IDS, lease_s=30)
    peer = RawPeer(r)
    h, _ = peer.handshake()
    assert h.kind == frame.ACK
    hdr, payload = peer.layer_frame(src, 0, BAD_SRC[0], BAD_IDS[0], 3)
    peer.send(hdr + payload)
    return r, peer


def test_sender_killed_mid_stream(setup):
    rx, src, _ = setup
    r = rx.reserve("killed", BAD_IDS, lease_s=30)
    helper = Path(__file__).parent / "kv_transfer_helpers" / "sender_proc.py"
    lay = LAYOUT
    proc = subprocess.Popen(
        [
            sys.executable,
            str(helper),
            "--ticket",
            r.ticket.hex(),
            "--request-id",
            r.request_id,
            "--endpoint",
            r.endpoint,
            "--tcp-endpoint",
            r.tcp_endpoint,
            "--dst",
            ",".join(map(str, BAD_IDS)),
            "--src",
            ",".join(map(str, BAD_SRC)),
            "--layers",
            "0,2",
            "--seed",
            "11",
            "--layout",
            f"{lay.num_layers},{lay.num_kv_heads},{lay.head_dim},{lay.block_size},{lay.dtype}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "sent"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    expect_failure(rx, r, FailureCode.DISCONNECTED, "sender disconnected before done")


def test_truncated_payload(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    peer.send(hdr + payload[: len(payload) // 2])
    peer.close()
    expect_failure(rx, r, FailureCode.DISCONNECTED, "sender disconnected before done")


def test_truncated_header(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, _ = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    peer.send(hdr[:50])
    peer.close()
    expect_failure(rx, r, FailureCode.DISCONNECTED, "sender disconnected before done")


def test_corrupted_payload(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 3] ^= 0x04
    peer.send(hdr + bytes(corrupted))
    assert b"checksum mismatch" in peer.read_until_closed()
    expect_failure(rx, r, FailureCode.CHECKSUM_MISMATCH, "checksum mismatch on layer 1")


def test_forged_ticket_is_refused_and_the_real_reservation_lives_on(setup):
    rx, src, _ = setup
    r = rx.reserve("victim", BAD_IDS, lease_s=30)
    forger = RawPeer(r)
    h, text = forger.handshake(ticket=os.urandom(16))  # right request id, guessed ticket
    assert h.kind == frame.ERROR and text == b"unknown ticket"
    forger.close()
    # the rightful sender still gets through
    sender = KVSender(src)
    with sender.open(r) as stream:
        for layer in range(LAYOUT.num_layers):
            stream.send_layer(layer, BAD_SRC)
        stream.finish(5, timeout=10)
    assert rx.wait(r.ticket, 10).first_token == 5


def test_other_ticket_mid_stream(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, ticket=os.urandom(16))
    peer.send(hdr + payload)
    expect_failure(rx, r, FailureCode.TICKET_MISMATCH, "another ticket")


def test_block_outside_the_reservation(setup):
    rx, src, bystander = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BYSTANDER_IDS[0], 2)  # aims at another request's blocks
    peer.send(hdr + payload)
    expect_failure(rx, r, FailureCode.BLOCK_OUT_OF_RANGE, f"block {BYSTANDER_IDS[0]} is not in the reservation")
    assert not rx.cache.tensor[1, BYSTANDER_IDS].any()  # the bystander sends layer 1 only later


def test_block_id_beyond_the_cache(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, first_block=10_000)
    peer.send(hdr + payload)
    expect_failure(rx, r, FailureCode.BLOCK_OUT_OF_RANGE, "block 10000 is not in the reservation")


def test_oversized_length(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, payload_length=10 * LAYOUT.bytes_per_block)
    peer.send(hdr + payload)
    expect_failure(rx, r, FailureCode.LENGTH_MISMATCH, "payload length")


def test_a_layer_frame_without_its_payload_is_refused_unless_device_copies_were_granted(setup):
    rx, src, _ = setup
    r = rx.reserve("no-payload", BAD_IDS, lease_s=30)
    peer = RawPeer(r)
    h, _ = peer.handshake(value=frame.PAYLOAD_DEVICE_COPY)  # asks; this receiver does not offer CUDA IPC
    assert h.kind == frame.ACK and h.value == frame.PAYLOAD_ON_CONNECTION
    hdr, _ = peer.layer_frame(src, 0, BAD_SRC[0], BAD_IDS[0], 3, payload_length=0, checksum_kind=frame.CHECKSUM_NONE)
    peer.send(hdr)  # claims the blocks were copied in
    expect_failure(rx, r, FailureCode.LENGTH_MISMATCH, "payload length 0 does not match 3 blocks")


def test_length_over_the_frame_limit(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, _ = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, payload_length=1 << 40)
    peer.send(hdr)
    expect_failure(rx, r, FailureCode.BAD_FRAME, "over the limit")


def test_garbage_bytes_mid_stream(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    peer.send(os.urandom(frame.HEADER_SIZE))
    expect_failure(rx, r, FailureCode.BAD_FRAME, "bad magic")


@pytest.mark.parametrize("size", [3, frame.HEADER_SIZE, 10_000])
def test_garbage_bytes_to_the_port(setup, size):
    rx, _, bystander = setup
    peer = RawPeer(bystander.r)
    assert peer.send_and_wait_dropped(os.urandom(size)) == b""  # dropped without a word


class _Boom:
    def __reduce__(self):
        return (open, (MARKER, "w"))


MARKER = os.path.join(tempfile.gettempdir(), f"kv-transfer-unpickled-{os.getpid()}")


def test_pickle_payload_to_the_port_is_never_unpickled(setup):
    rx, _, bystander = setup
    peer = RawPeer(bystander.r)
    assert peer.send_and_wait_dropped(pickle.dumps(_Boom()) * 20) == b""
    assert not os.path.exists(MARKER)


def test_pickle_payload_mid_stream(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    blob = pickle.dumps(_Boom())
    peer.send(peer.header(frame.ERROR, payload_length=len(blob)) + blob)  # a well-formed frame carrying a pickle
    expect_failure(rx, r, FailureCode.ABORTED_BY_SENDER, "sender aborted")
    assert not os.path.exists(MARKER)


def test_lease_expires_on_its_own(setup):
    rx, src, _ = setup
    r = rx.reserve("slow", BAD_IDS, lease_s=0.3)
    stream = KVSender(src).open(r)
    stream.send_layer(0, BAD_SRC)  # and then nothing: the prefill worker stalls
    expect_failure(rx, r, FailureCode.LEASE_EXPIRED, "lease expired")
    with pytest.raises(TransferError):
        stream.finish(1, timeout=10)


def test_lease_expired_before_the_sender_connects(setup):
    rx, src, _ = setup
    r = rx.reserve("late", BAD_IDS, lease_s=0.05)
    expect_failure(rx, r, FailureCode.LEASE_EXPIRED, "lease expired")
    with pytest.raises(TransferError, match="unknown ticket|no longer live"):
        KVSender(src).open(r)


def test_sender_abort(setup):
    rx, src, _ = setup
    r = rx.reserve("aborted", BAD_IDS, lease_s=30)
    with pytest.raises(RuntimeError):
        with KVSender(src).open(r) as stream:
            stream.send_layer(0, BAD_SRC)
            raise RuntimeError("prefill crashed")
    expect_failure(rx, r, FailureCode.ABORTED_BY_SENDER, "sender aborted: prefill failed")


def test_second_stream_on_a_ticket_is_refused(setup):
    rx, src, _ = setup
    r = rx.reserve("dup", BAD_IDS, lease_s=30)
    first = KVSender(src).open(r)
    with pytest.raises(TransferError, match="already has a stream"):
        KVSender(src).open(r)
    for layer in range(LAYOUT.num_layers):
        first.send_layer(layer, BAD_SRC)
    first.finish(2, timeout=10)
    assert rx.wait(r.ticket, 10).first_token == 2


def test_a_silent_connection_is_closed_after_the_handshake_timeout(tight):
    rx, _, bystander = tight
    before = metric(DROPPED, reason="handshake_timeout")
    start = time.monotonic()
    peer = RawPeer(bystander.r)  # connects and says nothing
    assert peer.read_until_closed() == b""
    held = time.monotonic() - start
    assert TIGHT["handshake_timeout_s"] - 0.05 <= held < 5, held
    wait_until(lambda: metric(DROPPED, reason="handshake_timeout") == before + 1, 5, "the drop counted")


def test_a_half_header_is_dropped_at_the_handshake_deadline(tight):
    rx, _, bystander = tight
    before = metric(DROPPED, reason="handshake_timeout")
    peer = RawPeer(bystander.r)
    start = time.monotonic()
    peer.send(peer.header(frame.HANDSHAKE, payload_length=21)[:50])  # and then nothing, the socket left open
    assert peer.read_until_closed() == b""
    held = time.monotonic() - start
    assert held < 5, held
    wait_until(lambda: metric(DROPPED, reason="handshake_timeout") == before + 1, 5, "the drop counted")


def test_a_handshake_whose_payload_never_comes_is_dropped(tight):
    rx, _, bystander = tight
    before = metric(DROPPED, reason="handshake_timeout")
    peer = RawPeer(bystander.r)
    start = time.monotonic()
    peer.send(peer.header(frame.HANDSHAKE, payload_length=21))  # announces the layout, never sends it
    assert peer.read_until_closed() == b""
    assert time.monotonic() - start < 5
    wait_until(lambda: metric(DROPPED, reason="handshake_timeout") == before + 1, 5, "the drop counted")


def test_a_layer_payload_that_stalls_fails_the_reservation_at_the_frame_deadline(tight):
    rx, src, _ = tight
    before = metric(DROPPED, reason="frame_timeout")
    r, peer = started(rx, src)  # bound to a live reservation, whose lease (30 s) is far off
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    start = time.monotonic()
    peer.send(hdr + payload[: len(payload) // 2])  # and then nothing, the socket left open
    expect_failure(rx, r, FailureCode.FRAME_TIMEOUT, "frame timeout: frame not complete")
    held = time.monotonic() - start
    allowed = TIGHT["frame_timeout_s"] + len(payload) / TIGHT["frame_min_bytes_per_s"]
    assert allowed - 0.05 <= held < allowed + 5, (held, allowed)
    assert b"ack" not in peer.read_until_closed()
    wait_until(lambda: metric(DROPPED, reason="frame_timeout") == before + 1, 5, "the drop counted")


def test_a_slow_but_live_frame_gets_time_in_proportion_to_its_length(tight):
    rx, src, _ = tight
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    start = time.monotonic()
    peer.send(hdr)
    for i in range(4):  # a trickle: 1.2 s for the frame, over the base 0.8 s, within 0.8 s + 1.5 s for its length
        time.sleep(0.3)
        peer.send(payload[i * len(payload) // 4 : (i + 1) * len(payload) // 4])
    assert time.monotonic() - start > TIGHT["frame_timeout_s"]
    for layer in (2, 3):
        hdr, payload = peer.layer_frame(src, layer, BAD_SRC[0], BAD_IDS[0], 3)
        peer.send(hdr + payload)
    peer.send(peer.header(frame.DONE, value=4))
    assert peer.read()[0].kind == frame.ACK
    assert rx.wait(r.ticket, 10) == Completed(4)


def test_a_pooled_connection_left_silent_is_closed_after_the_idle_timeout(tight):
    rx, src, _ = tight
    before = metric(DROPPED, reason="idle")
    r = rx.reserve("pooled", BAD_IDS, lease_s=30)
    peer = RawPeer(r)
    complete_stream(peer, src, BAD_SRC, first_token=6)
    start = time.monotonic()
    assert peer.read_until_closed() == b""  # the sender would now open a fresh one
    held = time.monotonic() - start
    assert TIGHT["idle_timeout_s"] - 0.05 <= held < 5, held
    assert rx.wait(r.ticket, 10) == Completed(6)
    wait_until(lambda: metric(DROPPED, reason="idle") == before + 1, 5, "the drop counted")


def test_a_half_header_on_a_reused_connection_is_dropped_at_the_frame_deadline(tight):
    rx, src, _ = tight
    before = metric(DROPPED, reason="frame_timeout")
    r = rx.reserve("reused", BAD_IDS, lease_s=30)
    peer = RawPeer(r)
    complete_stream(peer, src, BAD_SRC, first_token=6)
    start = time.monotonic()
    peer.send(peer.header(frame.HANDSHAKE, payload_length=21)[:50])  # the next stream starts, and stalls
    assert peer.read_until_closed() == b""
    held = time.monotonic() - start
    assert TIGHT["frame_timeout_s"] - 0.05 <= held < 5, held  # the frame deadline replaced the idle one
    assert rx.wait(r.ticket, 10) == Completed(6)
    wait_until(lambda: metric(DROPPED, reason="frame_timeout") == before + 1, 5, "the drop counted")


def test_silent_connections_beyond_the_cap_are_closed_at_once_and_the_rest_at_the_handshake_deadline():
    cap, extra, handshake_s = 8, 112, 3.0
    with receiver_with_bystander(handshake_timeout_s=handshake_s, max_unbound_connections=cap) as (rx, src, _):
        threads = threading.active_count()
        refused0 = metric(DROPPED, reason="too_many_unbound")
        timed_out0 = metric(DROPPED, reason="handshake_timeout")
        host, _, port = rx.tcp_endpoint.rpartition(":")
        start = time.monotonic()
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(cap + extra)]
        try:
            wait_until(lambda: sum(map(closed_by_peer, socks)) >= extra, handshake_s * 0.9, "the extra ones closed")
            assert time.monotonic() - start < handshake_s  # at once: no handshake deadline has passed yet
            assert sum(not closed_by_peer(s) for s in socks) == cap  # exactly the cap is held
            wait_until(lambda: all(map(closed_by_peer, socks)), 10, "the held ones closed")
            assert time.monotonic() - start >= handshake_s
        finally:
            for s in socks:
                s.close()
        wait_until(lambda: metric(DROPPED, reason="too_many_unbound") == refused0 + extra, 5, "refusals counted")
        wait_until(lambda: metric(DROPPED, reason="handshake_timeout") == timed_out0 + cap, 5, "time-outs counted")
        wait_until(lambda: threading.active_count() <= threads, 5, "no connection thread left")
        # and an honest sender still gets through, on a fresh connection
        r = rx.reserve("honest", BAD_IDS, lease_s=30)
        send_all(KVSender(src), r, BAD_SRC, first_token=8)
        assert rx.wait(r.ticket, 10) == Completed(8)
        assert_arrived(rx.cache, src, BAD_IDS, BAD_SRC)


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
def test_ucx_peers_are_held_to_the_same_deadlines():
    """UCX is message-based (no first-byte read): its frame deadline starts when the header arrives."""
    from splitserve.kv_transfer.ucx import UCXTransport

    dst = KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport="ucx", **TIGHT) as rx:
        assert rx.transport == "ucx"
        ucx = UCXTransport()
        host, _, port = rx.endpoint.rpartition(":")
        timed_out0 = metric(DROPPED, reason="handshake_timeout")
        r = rx.reserve("ucx-stall", BAD_IDS, lease_s=30)

        def header(kind: int, **fields) -> bytes:
            return frame.encode_header(frame.Header(kind, r.ticket, r.request_id, **fields))

        for announced in (None, 21):  # silent; a handshake header whose payload never comes
            conn = ucx.connect(host, int(port), 5)
            if announced is not None:
                conn.send([header(frame.HANDSHAKE, payload_length=21)])
            start = time.monotonic()
            with pytest.raises(ConnectionClosed):
                conn.recv_into(bytearray(frame.HEADER_SIZE))  # until the receiver drops us
            assert time.monotonic() - start < 5
            conn.close()
        wait_until(lambda: metric(DROPPED, reason="handshake_timeout") == timed_out0 + 2, 5, "the drops counted")
        # bound, then a layer header whose payload never comes
        conn = ucx.connect(host, int(port), 5)
        lay = LAYOUT
        body = frame.encode_layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)
        conn.send([header(frame.HANDSHAKE, payload_length=len(body)), body])
        ack = bytearray(frame.HEADER_SIZE)
        conn.recv_into(ack)
        assert frame.decode_header(ack).kind == frame.ACK
        conn.send(
            [
                header(
                    frame.LAYER,
                    layer=1,
                    first_block=BAD_IDS[0],
                    block_count=3,
                    dtype_code=frame.DTYPE_CODES[lay.dtype],
                    element_count=3 * lay.elements_per_block,
                    payload_length=3 * lay.bytes_per_block,
                    checksum_kind=frame.CHECKSUM_LANESUM,
                )
            ]
        )
        expect_failure(rx, r, FailureCode.FRAME_TIMEOUT, "frame timeout: frame not complete")
        conn.close()


class _Conn:
    """A connection that only records its closing: all a watchdog does to one."""

    peer = "watched"
    stream = True
    authenticated = False

    def __init__(self) -> None:
        self.closed = threading.Event()

    def send(self, buffers: Sequence[Buffer]) -> None:
        raise ConnectionClosed("a watched stand-in moves no bytes")

    def recv_into(self, buffer: Buffer) -> None:
        raise ConnectionClosed("a watched stand-in moves no bytes")

    def close(self) -> None:
        self.closed.set()


def closed(w: Watched) -> threading.Event:
    assert isinstance(w.conn, _Conn)
    return w.conn.closed


def test_the_watchdog_closes_a_connection_at_its_current_deadline_only():
    fired: list[Watched] = []
    dog = Watchdog(fired.append)
    later, earlier, disarmed = Watched(_Conn()), Watched(_Conn()), Watched(_Conn())
    now = time.monotonic()
    dog.arm(later, now + 0.1, "first", now)
    dog.arm(later, now + 0.5, "moved_later", now)
    dog.arm(earlier, now + 30, "first", now)
    dog.arm(earlier, now + 0.2, "moved_earlier", now)
    dog.arm(disarmed, now + 0.1, "first", now)
    dog.disarm(disarmed)
    try:
        assert closed(earlier).wait(5) and earlier.expired == "moved_earlier"
        assert closed(later).wait(5) and later.expired == "moved_later"
        assert time.monotonic() - now >= 0.5
        assert fired == [earlier, later]
        assert not closed(disarmed).is_set() and disarmed.expired == ""
    finally:
        dog.close()
