"""Faults on the KV plane, over real loopback sockets. Each one: the receiver stays
up, a bystander transfer running alongside still completes, the bad reservation
fails with its reason, and its blocks are reset and released (no leak)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from kv_transfer_helpers.common import (  # noqa: E402
    LAYOUT, Bystander, RawPeer, assert_no_leak, assert_zero, random_cache,
)  # fmt: skip

from splitserve.engine.kv_cache import KVCache  # noqa: E402
from splitserve.kv_transfer import Failed, KVReceiver, KVSender, TransferError, frame  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BAD_IDS, BAD_SRC = [1, 2, 3], [10, 11, 12]
BYSTANDER_IDS, BYSTANDER_SRC = [30, 31, 40], [20, 21, 22]


@pytest.fixture
def setup():
    src, dst = random_cache(seed=11), KVCache(LAYOUT, 64)
    rx = KVReceiver(dst)
    bystander = Bystander(rx, src, BYSTANDER_IDS, BYSTANDER_SRC)
    yield rx, src, bystander
    bystander.finish()  # the receiver stayed up and the other transfer completed
    assert_no_leak(rx, range(64))
    rx.close()


def expect_failure(rx: KVReceiver, r, reason: str) -> None:
    outcome = rx.wait(r.ticket, 10)
    assert isinstance(outcome, Failed), outcome
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
        [sys.executable, str(helper), "--ticket", r.ticket.hex(), "--request-id", r.request_id,
         "--endpoint", r.endpoint, "--tcp-endpoint", r.tcp_endpoint, "--dst", ",".join(map(str, BAD_IDS)),
         "--src", ",".join(map(str, BAD_SRC)), "--layers", "0,2", "--seed", "11",
         "--layout", f"{lay.num_layers},{lay.num_kv_heads},{lay.head_dim},{lay.block_size},{lay.dtype}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "sent"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    expect_failure(rx, r, "sender disconnected before done")


def test_truncated_payload(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    peer.send(hdr + payload[: len(payload) // 2])
    peer.close()
    expect_failure(rx, r, "sender disconnected before done")


def test_truncated_header(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, _ = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    peer.send(hdr[:50])
    peer.close()
    expect_failure(rx, r, "sender disconnected before done")


def test_corrupted_payload(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 3] ^= 0x04
    peer.send(hdr + bytes(corrupted))
    assert b"checksum mismatch" in peer.read_until_closed()
    expect_failure(rx, r, "checksum mismatch on layer 1")


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
    expect_failure(rx, r, "another ticket")


def test_block_outside_the_reservation(setup):
    rx, src, bystander = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BYSTANDER_IDS[0], 2)  # aims at another request's blocks
    peer.send(hdr + payload)
    expect_failure(rx, r, f"block {BYSTANDER_IDS[0]} is not in the reservation")
    assert not rx.cache.tensor[1, BYSTANDER_IDS].any()  # the bystander sends layer 1 only later


def test_block_id_beyond_the_cache(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, first_block=10_000)
    peer.send(hdr + payload)
    expect_failure(rx, r, "block 10000 is not in the reservation")


def test_oversized_length(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, payload = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, payload_length=10 * LAYOUT.bytes_per_block)
    peer.send(hdr + payload)
    expect_failure(rx, r, "payload length")


def test_length_over_the_frame_limit(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    hdr, _ = peer.layer_frame(src, 1, BAD_SRC[0], BAD_IDS[0], 3, payload_length=1 << 40)
    peer.send(hdr)
    expect_failure(rx, r, "over the limit")


def test_garbage_bytes_mid_stream(setup):
    rx, src, _ = setup
    r, peer = started(rx, src)
    peer.send(os.urandom(frame.HEADER_SIZE))
    expect_failure(rx, r, "bad magic")


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
    expect_failure(rx, r, "sender aborted")
    assert not os.path.exists(MARKER)


def test_lease_expires_on_its_own(setup):
    rx, src, _ = setup
    r = rx.reserve("slow", BAD_IDS, lease_s=0.3)
    stream = KVSender(src).open(r)
    stream.send_layer(0, BAD_SRC)  # and then nothing: the prefill worker stalls
    expect_failure(rx, r, "lease expired")
    with pytest.raises(TransferError):
        stream.finish(1, timeout=10)


def test_lease_expired_before_the_sender_connects(setup):
    rx, src, _ = setup
    r = rx.reserve("late", BAD_IDS, lease_s=0.05)
    expect_failure(rx, r, "lease expired")
    with pytest.raises(TransferError, match="unknown ticket|no longer live"):
        KVSender(src).open(r)


def test_sender_abort(setup):
    rx, src, _ = setup
    r = rx.reserve("aborted", BAD_IDS, lease_s=30)
    with pytest.raises(RuntimeError):
        with KVSender(src).open(r) as stream:
            stream.send_layer(0, BAD_SRC)
            raise RuntimeError("prefill crashed")
    expect_failure(rx, r, "sender aborted: prefill failed")


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


def test_a_silent_connection_is_closed_after_the_idle_timeout(setup, monkeypatch):
    import splitserve.kv_transfer.receiver as receiver_module

    rx, _, bystander = setup
    monkeypatch.setattr(receiver_module, "IDLE_TIMEOUT_S", 0.2)
    peer = RawPeer(bystander.r)  # connects and says nothing
    assert peer.read_until_closed() == b""
