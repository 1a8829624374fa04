"""Sealed records (kv_transfer/sealed.py): what the KV plane carries under the cluster's TLS once
the handshake is done. Round trips across record boundaries, and a wire the test alters: a
flipped bit, a replayed record and a dropped one are each refused and close the connection."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import pytest
import torch

from splitserve.kv_transfer.sealed import RECORD_BYTES, TAG_BYTES, Keys, SealedConnection, TamperedRecord
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Buffer, Connection, ConnectionClosed, host_view
from splitserve.runtime.tls import make_cluster_tls

pytestmark = pytest.mark.timeout(60)

SIZES = [100, RECORD_BYTES, 2 * RECORD_BYTES + 5]  # one short record, one exact, three with a short last


class Wire:
    """Both ends of one direction in one object: what is sent stays, whole, for the test to read
    and alter before the receiver takes it."""

    peer, stream, authenticated = "wire", True, False

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def send(self, buffers: Sequence[Buffer]) -> None:
        for b in buffers:
            self.data += host_view(b)

    def recv_into(self, buffer: Buffer) -> None:
        view = host_view(buffer)
        if len(self.data) < view.nbytes:
            raise ConnectionClosed("the wire ran dry")
        view[:] = self.data[: view.nbytes]
        del self.data[: view.nbytes]

    def close(self) -> None:
        self.closed = True


def _ends(wire: Wire) -> tuple[SealedConnection, SealedConnection]:
    a, b = os.urandom(16), os.urandom(16)
    return SealedConnection(wire, Keys(a, b)), SealedConnection(wire, Keys(b, a))


def _payloads() -> list[bytes]:
    return [os.urandom(n) for n in SIZES]


def test_buffers_arrive_whole_across_record_boundaries_and_nothing_travels_in_the_clear() -> None:
    wire = Wire()
    tx, rx = _ends(wire)
    sent = _payloads()
    tx.send([*sent[:2], torch.frombuffer(bytearray(sent[2]), dtype=torch.uint8)])
    assert len(wire.data) == sum(SIZES) + TAG_BYTES * (1 + 1 + 3)
    assert all(p[:32] not in wire.data for p in sent)
    got = [bytearray(n) for n in SIZES]
    for g in got:
        rx.recv_into(g)
    assert [bytes(g) for g in got] == sent and not wire.data


@pytest.mark.parametrize("alter", ["flip", "replay", "drop"])
def test_an_altered_wire_is_refused_and_the_connection_closed(alter: str) -> None:
    wire = Wire()
    tx, rx = _ends(wire)
    tx.send([os.urandom(RECORD_BYTES), os.urandom(RECORD_BYTES)])  # records 0 and 1
    first = wire.data[: RECORD_BYTES + TAG_BYTES]
    if alter == "flip":
        wire.data[RECORD_BYTES + TAG_BYTES + 7] ^= 1  # one bit of record 1
    elif alter == "replay":
        wire.data[RECORD_BYTES + TAG_BYTES :] = first  # record 0 again in record 1's place
    else:
        del wire.data[: RECORD_BYTES + TAG_BYTES]  # record 0 never arrives
    received = bytearray(RECORD_BYTES)
    if alter != "drop":
        rx.recv_into(received)
    with pytest.raises(TamperedRecord, match="failed authentication"):
        rx.recv_into(received)
    assert wire.closed


def test_a_connection_under_the_clusters_tls_carries_sealed_records_both_ways() -> None:
    """The real switch: mutual TLS, the keys inside it, TLS ended, then records each way."""
    cluster = make_cluster_tls()
    accepted: list[Connection] = []
    ready = threading.Event()

    def on_connection(conn: Connection) -> None:
        accepted.append(conn)
        ready.set()

    listener = TCPTransport(server_tls=cluster.ssl_context(server_side=True)).listen("127.0.0.1", 0, on_connection)
    client = TCPTransport(client_tls=cluster.ssl_context(server_side=False)).connect("127.0.0.1", listener.port, 5)
    try:
        assert ready.wait(10)
        (server,) = accepted
        assert isinstance(client, SealedConnection) and isinstance(server, SealedConnection)
        sent = _payloads()
        done = threading.Thread(target=client.send, args=(sent,))  # bigger than the socket buffers
        done.start()
        got = [bytearray(n) for n in SIZES]
        for g in got:
            server.recv_into(g)
        done.join(10)
        server.send([b"ack"])
        reply = bytearray(3)
        client.recv_into(reply)
        assert [bytes(g) for g in got] == sent and reply == b"ack"
    finally:
        client.close()
        listener.close()
