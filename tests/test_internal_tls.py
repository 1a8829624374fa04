"""The cluster's own planes under mutual TLS (runtime/tls.py ClusterTLS): the KV plane as a
capture between the two workers sees it, and a worker's control port against callers with and
without a certificate of the cluster's CA."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import grpc
import pytest
import torch

from splitserve.bench.transfer_codec import PacedProxy
from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer.links import TransportName
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.reservation import Completed
from splitserve.kv_transfer.sender import KVSender, TransferError
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Transport
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.runtime.tls import CLUSTER_NAME, ClusterTLS, load_cluster_tls, make_cluster_tls, save_cluster_tls
from tests.kv_transfer_helpers.common import LAYOUT, assert_arrived, random_cache, send_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def cluster() -> ClusterTLS:
    return make_cluster_tls()


@pytest.mark.parametrize("tls", [False, True])
def test_a_capture_of_the_kv_plane_holds_no_kv_and_no_request_id_under_tls(cluster: ClusterTLS, tls: bool) -> None:
    """In plaintext the capture holds the blocks' bytes and the request id (the probe can see
    them); under the cluster's TLS it holds neither, and the KV still arrives bit for bit."""
    src, dst = random_cache(seed=3), KVCache(LAYOUT, 64)
    src_ids, dst_ids = [3, 9, 27], [40, 41, 42]
    rx_transport: Transport | TransportName = (
        TCPTransport(server_tls=cluster.ssl_context(server_side=True)) if tls else "tcp"
    )
    with KVReceiver(dst, transport=rx_transport) as rx:
        r = rx.reserve("req-secret-7f3a", dst_ids, lease_s=30)
        host, _, port = r.tcp_endpoint.rpartition(":")
        seen = bytearray()  # what a reader on the path between the two sees
        tap = PacedProxy((host, int(port)), gbps=math.inf, tap=seen)
        endpoint = f"127.0.0.1:{tap.port}"
        tapped = dataclasses.replace(r, endpoint=endpoint, tcp_endpoint=endpoint)
        client = TCPTransport(client_tls=cluster.ssl_context(server_side=False)) if tls else None
        # as the workers run: under TLS without the frame checksum (GCM's tag checks every byte)
        sender = KVSender(src, transport=client, wire_codec="raw", checksum="none" if tls else "lanesum")
        try:
            send_all(sender, tapped, src_ids)
            assert rx.wait(r.ticket, 10) == Completed(7)
        finally:
            sender.close()
            tap.close()
        assert_arrived(dst, src, dst_ids, src_ids)
    captured = bytes(seen)
    # 64 values of one block of layer 0, as they lie in the cache (and so on the wire, raw codec)
    probe = src.tensor[0, src_ids[1]].contiguous().view(-1)[:64].view(torch.int16).numpy().tobytes()
    assert len(captured) > 4_000  # 3 blocks x 4 layers of KV, and the frames
    if tls:
        assert probe not in captured and b"req-secret-7f3a" not in captured
    else:
        assert probe in captured and b"req-secret-7f3a" in captured


def test_a_kv_sender_without_the_clusters_certificate_is_refused(cluster: ClusterTLS) -> None:
    stranger = make_cluster_tls()  # another cluster's CA
    src, dst = random_cache(seed=4), KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport=TCPTransport(server_tls=cluster.ssl_context(server_side=True))) as rx:
        for client in (None, TCPTransport(client_tls=stranger.ssl_context(server_side=False))):
            r = rx.reserve("req-refused", [1, 2], lease_s=30)
            sender = KVSender(src, transport=client, wire_codec="raw", connect_timeout=5)
            try:
                with pytest.raises(TransferError):
                    send_all(sender, r, [5, 6])
            finally:
                sender.close()
                rx.cancel(r.ticket)
        assert not dst.tensor[:, [1, 2]].any()  # nothing was written


def test_a_workers_control_port_answers_only_callers_of_the_cluster(cluster: ClusterTLS) -> None:
    """A gRPC server with the cluster's credentials: a caller in plaintext, or with another CA's
    certificate, is refused at the handshake; the router's credentials reach it."""

    class Stats(wgrpc.DecodeWorkerServicer):
        def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
            return wpb.WorkerStats(worker_id="w")

    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(2))
    wgrpc.add_DecodeWorkerServicer_to_server(Stats(), server)
    port = server.add_secure_port("127.0.0.1:0", cluster.grpc_server_credentials())
    server.start()
    stranger = make_cluster_tls()
    try:
        answers = {}
        for who, channel in (
            ("plaintext", grpc.insecure_channel(f"127.0.0.1:{port}")),
            (
                "stranger",
                grpc.secure_channel(f"127.0.0.1:{port}", stranger.grpc_channel_credentials(), stranger.CHANNEL_OPTIONS),
            ),
            (
                "member",
                grpc.secure_channel(f"127.0.0.1:{port}", cluster.grpc_channel_credentials(), cluster.CHANNEL_OPTIONS),
            ),
        ):
            with channel:
                try:
                    answers[who] = wgrpc.DecodeWorkerStub(channel).GetStats(wpb.StatsRequest(), timeout=5).worker_id
                except grpc.RpcError as e:
                    answers[who] = e.code()
        assert answers == {
            "plaintext": grpc.StatusCode.UNAVAILABLE,
            "stranger": grpc.StatusCode.UNAVAILABLE,
            "member": "w",
        }
    finally:
        server.stop(0)


def test_an_operators_cluster_credentials_are_read_from_a_directory(tmp_path: Path, cluster: ClusterTLS) -> None:
    (tmp_path / "ca.pem").write_bytes(cluster.ca_pem)
    (tmp_path / "cluster.pem").write_bytes(cluster.cert_pem)
    with pytest.raises(ValueError, match="cannot read cluster-key.pem"):
        load_cluster_tls(str(tmp_path))
    (tmp_path / "cluster-key.pem").write_bytes(cluster.key_pem)
    assert load_cluster_tls(str(tmp_path)) == cluster
    assert CLUSTER_NAME == "splitserve-cluster"


def test_a_frame_without_a_checksum_is_refused_on_a_connection_that_checks_nothing() -> None:
    src, dst = random_cache(seed=5), KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport="tcp") as rx:
        r = rx.reserve("req-unchecked", [1, 2], lease_s=30)
        sender = KVSender(src, wire_codec="raw", checksum="none")
        try:
            with pytest.raises(TransferError, match="without a checksum"):
                send_all(sender, r, [5, 6])
        finally:
            sender.close()
    assert not dst.tensor[:, [1, 2]].any()


def test_cluster_credentials_saved_are_read_back_and_the_key_is_the_users_alone(tmp_path: Path) -> None:
    cluster = make_cluster_tls()
    save_cluster_tls(cluster, str(tmp_path))
    assert load_cluster_tls(str(tmp_path)) == cluster
    assert (tmp_path / "cluster-key.pem").stat().st_mode & 0o077 == 0
