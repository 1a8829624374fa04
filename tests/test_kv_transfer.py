"""kv_transfer over real loopback sockets (TCP, and UCX where ucxx imports): KV arrives
bit-identical in the right blocks, whatever the layer order or chunking; streams
do not mix; the layout handshake names the field that differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer import (
    Completed,
    Failed,
    FailureCode,
    KVReceiver,
    KVSender,
    Outcome,
    Reservation,
    TransferError,
    codec,
    frame,
)
from tests.kv_transfer_helpers.common import LAYOUT, assert_arrived, assert_no_leak, random_cache, send_all
from tests.kv_transfer_helpers.fake import FakeTransport

HAS_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAS_UCX, reason="ucxx not installed"))]


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


# ---- frames ---------------------------------------------------------------------


def test_header_round_trips_and_rejects_tampering():
    h = frame.Header(
        frame.LAYER,
        b"t" * 16,
        "req-1",
        layer=3,
        first_block=9,
        block_count=2,
        dtype_code=2,
        element_count=10,
        payload_length=20,
        checksum_kind=2,
        checksum=123,
        value=codec.CODEC_INT8,  # a layer frame's value is its codec: version 3
    )
    raw = frame.encode_header(h)
    assert len(raw) == frame.HEADER_SIZE
    assert raw[4] == frame.VERSION_CODEC
    assert frame.decode_header(raw) == h
    for i in (0, 5, 40, 100, 130):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(frame.FrameError):
            frame.decode_header(bad)


@pytest.mark.parametrize("kind", [frame.CHECKSUM_CRC32, frame.CHECKSUM_LANESUM])
def test_checksum_catches_a_flipped_bit_anywhere(kind):
    data = torch.randint(0, 256, (3 * frame.LANE_BYTES + 100,), dtype=torch.uint8)
    good = frame.checksum(kind, [data])
    for pos in (0, 7, frame.LANE_BYTES + 1, data.numel() - 1):
        bad = data.clone()
        bad[pos] ^= 0x10
        assert frame.checksum(kind, [bad]) != good
    swapped = torch.cat(
        [data[frame.LANE_BYTES : 2 * frame.LANE_BYTES], data[: frame.LANE_BYTES], data[2 * frame.LANE_BYTES :]]
    )
    assert frame.checksum(kind, [swapped]) != good


def test_lanesum_is_the_same_however_the_payload_is_split():
    data = torch.randint(0, 256, (5 * frame.LANE_BYTES + 24,), dtype=torch.uint8)
    whole = frame.checksum(frame.CHECKSUM_LANESUM, [data])
    assert frame.checksum(frame.CHECKSUM_LANESUM, [data[: 2 * frame.LANE_BYTES], data[2 * frame.LANE_BYTES :]]) == whole
    assert frame.checksum(frame.CHECKSUM_LANESUM, [data[:1000], data[1000:]]) == whole
    fed = frame.PayloadChecksum(frame.CHECKSUM_LANESUM)  # as the receiver feeds it, piece by piece
    for at in range(0, data.numel(), 2 * frame.LANE_BYTES):
        fed.update(data[at : at + 2 * frame.LANE_BYTES])
    assert fed.value == whole


# ---- arrival ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_layers_out_of_order_arrive_bit_identical_in_the_right_blocks(transport):
    src, dst = random_cache(seed=1), KVCache(LAYOUT, 64)
    rng = random.Random(1)
    dst_ids = [5, 6, 7, 20, 21, 40, 3, 4, 60, 61, 62]  # runs, gaps, and a step backwards
    src_ids = [10, 11, 30, 31, 32, 33, 2, 50, 51, 52, 1]
    layers = list(range(LAYOUT.num_layers))
    rng.shuffle(layers)
    with KVReceiver(dst, transport=transport) as rx:
        r = rx.reserve("req-order", dst_ids, lease_s=30)
        assert r.transport == transport
        sender = KVSender(src)
        with sender.open(r) as stream:
            assert stream.transport == transport
            for layer in layers:
                stream.send_layer(layer, src_ids)
            stream.finish(1234, timeout=10)
        assert rx.wait(r.ticket, 10) == Completed(1234)
        assert_arrived(dst, src, dst_ids, src_ids)
        untouched = [b for b in range(64) if b not in dst_ids]
        assert not dst.tensor[:, untouched].any(), "a block outside the reservation was written"
        assert_no_leak(rx, range(64))


@pytest.mark.timeout(60)
def test_chunked_prefill_resends_a_partial_block(transport):
    src, dst = random_cache(seed=2), KVCache(LAYOUT, 64)
    dst_ids, src_ids = [8, 9, 10, 11, 12], [0, 1, 2, 3, 4]
    with KVReceiver(dst, transport=transport) as rx:
        r = rx.reserve("req-chunks", dst_ids, lease_s=30)
        with KVSender(src).open(r) as stream:
            partial = src.tensor[:, 2].clone()
            src.tensor[:, 2, :, 2:] = 0  # chunk 1 filled only half of block 2
            for layer in range(LAYOUT.num_layers):
                stream.send_layer(layer, src_ids[:3], first_index=0, snapshot=True)
            src.tensor[:, 2] = partial  # chunk 2 completes block 2 and fills 3, 4
            for layer in reversed(range(LAYOUT.num_layers)):
                stream.send_layer(layer, src_ids[2:], first_index=2)
            stream.finish(5, timeout=10)
        assert rx.wait(r.ticket, 10) == Completed(5)
        assert_arrived(dst, src, dst_ids, src_ids)


@pytest.mark.timeout(90)
def test_concurrent_reservations_on_one_receiver_do_not_mix(transport):
    dst = KVCache(LAYOUT, 64)
    srcs = [random_cache(seed=10 + i) for i in range(4)]
    plans = [(list(range(16 * i, 16 * i + 16))[::-1][:12], list(range(12))) for i in range(4)]
    errors: list[BaseException] = []
    with KVReceiver(dst, transport=transport) as rx:
        rs = [rx.reserve(f"req-{i}", plans[i][0], lease_s=30) for i in range(4)]
        start = threading.Barrier(4)

        def run(i: int) -> None:
            try:
                start.wait(timeout=10)
                send_all(KVSender(srcs[i]), rs[i], plans[i][1], first_token=i, layers=[3, 1, 0, 2])
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for i, r in enumerate(rs):
            assert rx.wait(r.ticket, 10) == Completed(i)
            assert_arrived(dst, srcs[i], plans[i][0], plans[i][1])
        assert_no_leak(rx, range(64))


@pytest.mark.timeout(30)
def test_the_fake_transport_runs_the_same_protocol():
    fake = FakeTransport()
    src, dst = random_cache(seed=3), KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport=fake) as rx:
        r = rx.reserve("req-fake", [1, 2, 9], lease_s=30)
        send_all(KVSender(src, transport=fake), r, [4, 5, 6], first_token=3)
        assert rx.wait(r.ticket, 10) == Completed(3)
        assert_arrived(dst, src, [1, 2, 9], [4, 5, 6])


@pytest.mark.timeout(30)
def test_crc32_checksum_works_end_to_end():
    src, dst = random_cache(seed=4), KVCache(LAYOUT, 64)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-crc", [1, 2], lease_s=30)
        send_all(KVSender(src, checksum="crc32"), r, [3, 4])
        assert rx.wait(r.ticket, 10) == Completed(7)
        assert_arrived(dst, src, [1, 2], [3, 4])


# ---- handshake, completion, cancel ------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "field,value", [("num_layers", 8), ("num_kv_heads", 4), ("head_dim", 32), ("block_size", 8), ("dtype", "float32")]
)
def test_layout_mismatch_is_refused_naming_the_field(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    dst = KVCache(LAYOUT, 64)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-layout", [1, 2], lease_s=30)
        with pytest.raises(TransferError, match=field) as refused:
            KVSender(KVCache(other, 8)).open(r)  # refused before connecting
        assert refused.value.code is FailureCode.LAYOUT_MISMATCH
        # a sender that lies about the layout in the reservation is refused by the receiver
        with pytest.raises(TransferError, match=field):
            KVSender(KVCache(other, 8)).open(dataclasses.replace(r, layout=other))
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and field in outcome.reason
        assert outcome.code is FailureCode.LAYOUT_MISMATCH and outcome.code == "layout_mismatch"


@pytest.mark.timeout(30)
def test_done_before_every_layer_fails_and_resets():
    src, dst = random_cache(seed=5), KVCache(LAYOUT, 64)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-short", [1, 2], lease_s=30)
        stream = KVSender(src).open(r)
        stream.send_layer(0, [3, 4])
        with pytest.raises(TransferError, match="layer 1 block 1"):
            stream.finish(1, timeout=10)
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and "missing" in outcome.reason
        assert outcome.code is FailureCode.INCOMPLETE
        assert not dst.tensor[:, [1, 2]].any()


@pytest.mark.timeout(30)
def test_on_done_callback_and_cancel():
    src, dst = random_cache(seed=6), KVCache(LAYOUT, 64)
    seen: list = []
    done = threading.Event()
    with KVReceiver(dst) as rx:

        def on_done(res: Reservation, out: Outcome) -> None:
            seen.append((res.request_id, out))
            done.set()

        r = rx.reserve("req-cb", [1], lease_s=30, on_done=on_done)
        send_all(KVSender(src), r, [2])
        assert done.wait(10) and seen == [("req-cb", Completed(7))]

        r2 = rx.reserve("req-cancel", [5, 6], lease_s=30)
        stream = KVSender(src).open(r2)
        stream.send_layer(0, [7, 8])
        rx.cancel(r2.ticket)  # returns once the blocks are reset
        assert not dst.tensor[:, [5, 6]].any()
        with pytest.raises(TransferError):
            stream.finish(1, timeout=10)
        assert_no_leak(rx, range(64))


def test_reserve_refuses_bad_requests():
    with KVReceiver(KVCache(LAYOUT, 8)) as rx:
        with pytest.raises(ValueError):
            rx.reserve("r", [8], 1)
        with pytest.raises(ValueError):
            rx.reserve("r", [1, 1], 1)
        with pytest.raises(ValueError):
            rx.reserve("x" * 65, [1], 1)
        r = rx.reserve("r", [1, 2], 5)
        with pytest.raises(ValueError, match="already"):
            rx.reserve("r2", [2, 3], 5)
        assert len(r.ticket) == 16 and isinstance(r.lease_deadline_unix_ms, int)


@pytest.mark.timeout(60)
def test_a_sender_reuses_its_connection_and_replaces_a_dead_one(transport):
    src, dst = random_cache(seed=8), KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport=transport) as rx:
        sender = KVSender(src)
        for i in range(3):
            r = rx.reserve(f"req-reuse-{i}", [1, 2], lease_s=30)
            send_all(sender, r, [3 + i, 4 + i], first_token=i)
            assert rx.wait(r.ticket, 10) == Completed(i)
            assert_arrived(dst, src, [1, 2], [3 + i, 4 + i])
            assert sum(len(v) for v in sender._dialer._idle.values()) == 1
        for conn in list(rx._conns):  # the receiver drops the idle connection
            conn.close()
        r = rx.reserve("req-after-drop", [1, 2], lease_s=30)
        send_all(sender, r, [9, 10], first_token=9)
        assert rx.wait(r.ticket, 10) == Completed(9)
        sender.close()


@pytest.mark.timeout(60)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_from_another_process():
    import subprocess

    dst = KVCache(LAYOUT, 64, device="cuda")
    on_wire0 = _metric("splitserve_kv_bytes_received_total", transport="cuda_ipc")
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        r = rx.reserve("req-ipc", [3, 4, 10], lease_s=30)
        assert r.transport == "cuda_ipc"
        helper = Path(__file__).parent / "kv_transfer_helpers" / "sender_proc.py"
        lay = LAYOUT
        out = subprocess.run(
            [
                sys.executable,
                str(helper),
                "--ticket",
                r.ticket.hex(),
                "--request-id",
                r.request_id,
                "--transport",
                r.transport,
                "--endpoint",
                r.endpoint,
                "--tcp-endpoint",
                r.tcp_endpoint,
                "--dst",
                "3,4,10",
                "--src",
                "1,2,3",
                "--layers",
                "3,1,0,2",
                "--seed",
                "7",
                "--device",
                "cuda",
                "--finish",
                "11",
                "--layout",
                f"{lay.num_layers},{lay.num_kv_heads},{lay.head_dim},{lay.block_size},{lay.dtype}",
            ],
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["finished", "cuda_ipc"]  # granted device copies, no fallback
        assert rx.wait(r.ticket, 10) == Completed(11)
        src = random_cache(seed=7)
        assert torch.equal(dst.tensor[:, [3, 4, 10]].cpu(), src.tensor[:, [1, 2, 3]])
    assert _metric("splitserve_kv_bytes_received_total", transport="cuda_ipc") == on_wire0  # no payload on the wire


# ---- fallback and metrics ------------------------------------------------------------


def _metric(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.timeout(30)
def test_ucx_unusable_falls_back_to_tcp_and_says_so(monkeypatch):
    import types

    def broken() -> None:
        raise RuntimeError("no UCX transports here")

    fake_module = types.ModuleType("splitserve.kv_transfer.ucx")
    fake_module.UCXTransport = broken  # type: ignore[attr-defined]  # a stand-in module, built here
    monkeypatch.setitem(sys.modules, "splitserve.kv_transfer.ucx", fake_module)
    before = _metric("splitserve_kv_transport_fallbacks_total", wanted="ucx", reason="RuntimeError")
    src, dst = random_cache(seed=9), KVCache(LAYOUT, 64)
    with KVReceiver(dst, transport="ucx") as rx:
        assert rx.transport == "tcp"
        r = rx.reserve("req-fallback", [1], lease_s=30)
        send_all(KVSender(src), r, [2])
        assert rx.wait(r.ticket, 10) == Completed(7)
    assert _metric("splitserve_kv_transport_fallbacks_total", wanted="ucx", reason="RuntimeError") == before + 1


@pytest.mark.timeout(30)
def test_metrics_count_bytes_frames_and_outcomes():
    src, dst = random_cache(seed=10), KVCache(LAYOUT, 64)
    b0 = _metric("splitserve_kv_bytes_received_total", transport="tcp")
    f0 = _metric("splitserve_kv_frames_received_total", transport="tcp")
    c0 = _metric("splitserve_kv_reservations_completed_total")
    x0 = _metric("splitserve_kv_reservations_failed_total", reason="lease_expired")
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-metrics", [1, 2, 5], lease_s=30)
        send_all(KVSender(src), r, [3, 4, 6])
        rx.wait(r.ticket, 10)
        r2 = rx.reserve("req-expires", [9], lease_s=0.01)
        assert isinstance(rx.wait(r2.ticket, 10), Failed)
    assert (
        _metric("splitserve_kv_bytes_received_total", transport="tcp")
        == b0 + 3 * LAYOUT.num_layers * LAYOUT.bytes_per_block
    )
    assert (
        _metric("splitserve_kv_frames_received_total", transport="tcp") == f0 + 2 * LAYOUT.num_layers
    )  # runs 1-2 and 5
    assert _metric("splitserve_kv_reservations_completed_total") == c0 + 1
    assert _metric("splitserve_kv_reservations_failed_total", reason="lease_expired") == x0 + 1


@pytest.mark.timeout(120)
def test_the_transfer_benchmark_runs_at_ci_size(capsys):
    from splitserve.cli import main

    assert (
        main(
            [
                "bench",
                "transfer",
                "--size",
                "8M",
                "--layers",
                "4",
                "--repeats",
                "1",
                "--transports",
                "tcp,cuda_ipc",
                "--latency-blocks",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tcp        raw" in out and "ratio" in out and "pipelining (tcp)" in out


# ---- CUDA IPC on a CPU: the export faked, the rest as on a GPU ----------------------------


def fake_cuda_ipc(monkeypatch, mappable=lambda cache: True):
    """CUDA IPC without CUDA: torch's reduce_tensor gives made-up handles and every cache
    is on "one GPU"; `mappable(cache)` says which caches may take part. A sender in the
    receiver's process is handed the cache tensor itself (no handle is opened), so a whole
    stream runs here: the grant at the handshake, device copies, frames without payload."""
    from torch.multiprocessing import reductions

    from splitserve.kv_transfer import cuda_ipc

    def fake_reduce(t):  # the 15 fields torch's reduce_tensor gives a CUDA tensor
        return None, (
            type(t),
            t.shape,
            t.stride(),
            0,
            t.dtype,
            False,
            0,
            b"handle",
            t.numel() * 4,
            0,
            False,
            b"ref",
            0,
            b"",
            True,
        )

    monkeypatch.setattr(reductions, "reduce_tensor", fake_reduce)
    monkeypatch.setattr(cuda_ipc, "_uuid", lambda device: b"u" * 16)
    monkeypatch.setattr(cuda_ipc, "can_map", mappable)
    return cuda_ipc


def test_cuda_ipc_mapping_in_the_exporting_process_is_the_cache_itself(monkeypatch):
    # CUDA will not open a process's own IPC handle, so a sender in the decode worker's
    # process (a benchmark, a test) must get the tensor itself; no CUDA call on that path.
    cuda_ipc = fake_cuda_ipc(monkeypatch)
    cache = KVCache(LAYOUT, 8)
    blob = cuda_ipc.export_cache(cache)
    assert cuda_ipc.import_cache(blob, cache) is cache.tensor
    assert cuda_ipc.export_cache(cache) == blob  # every handshake of one cache: one entry, not one each
    other = cuda_ipc.export_cache(KVCache(LAYOUT, 8))  # its cache is gone once exported: no stale tensor
    with pytest.raises(frame.FrameError, match="no live cache"):
        cuda_ipc.import_cache(other, cache)


@pytest.mark.timeout(30)
def test_a_cuda_ipc_stream_copies_blocks_in_and_its_frames_carry_no_payload(monkeypatch):
    fake_cuda_ipc(monkeypatch)
    src, dst = random_cache(seed=12), KVCache(LAYOUT, 64)
    dst_ids, src_ids = [3, 4, 10], [1, 2, 3]
    bytes_rx0 = _metric("splitserve_kv_bytes_received_total", transport="cuda_ipc")
    bytes_tx0 = _metric("splitserve_kv_bytes_sent_total", transport="cuda_ipc")
    frames0 = _metric("splitserve_kv_frames_received_total", transport="cuda_ipc")
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        sender = KVSender(src)
        for first_token in (11, 12):  # the second stream reuses the connection and the mapping
            r = rx.reserve(f"req-ipc-cpu-{first_token}", dst_ids, lease_s=30)
            assert r.transport == "cuda_ipc" and r.endpoint == r.tcp_endpoint  # frames over the TCP listener
            with sender.open(r) as stream:
                assert stream.transport == "cuda_ipc"
                for layer in [3, 1, 0, 2]:
                    stream.send_layer(layer, src_ids)
                stream.finish(first_token, timeout=10)
            assert rx.wait(r.ticket, 10) == Completed(first_token)
            assert_arrived(dst, src, dst_ids, src_ids)
            dst.reset_blocks(dst_ids)
        assert len(sender._dialer._mapped) == 1 and sum(len(v) for v in sender._dialer._idle.values()) == 1
        assert_no_leak(rx, range(64))
    assert _metric("splitserve_kv_bytes_received_total", transport="cuda_ipc") == bytes_rx0  # nothing on the wire
    assert _metric("splitserve_kv_bytes_sent_total", transport="cuda_ipc") == bytes_tx0
    assert _metric("splitserve_kv_frames_received_total", transport="cuda_ipc") == frames0 + 2 * 2 * LAYOUT.num_layers


@pytest.mark.timeout(30)
def test_cuda_ipc_falls_back_to_tcp_where_it_cannot_be_used_and_counts_it(monkeypatch):
    def fallbacks(reason: str) -> float:
        return _metric("splitserve_kv_transport_fallbacks_total", wanted="cuda_ipc", reason=reason)

    src, dst = random_cache(seed=13), KVCache(LAYOUT, 64)
    # a receiver whose cache cannot be mapped offers TCP
    fake_cuda_ipc(monkeypatch, mappable=lambda cache: False)
    before = fallbacks("cpu_cache")
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        assert rx.transport == "tcp"
        assert fallbacks("cpu_cache") == before + 1
    # a sender whose cache cannot be mapped uses TCP to a receiver that offers CUDA IPC
    fake_cuda_ipc(monkeypatch, mappable=lambda cache: cache is dst)
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        r = rx.reserve("req-ipc-fallback", [5, 6], lease_s=30)
        assert r.transport == "cuda_ipc"
        with KVSender(src).open(r) as stream:
            assert stream.transport == "tcp"
            for layer in range(LAYOUT.num_layers):
                stream.send_layer(layer, [7, 8])
            stream.finish(3, timeout=10)
        assert rx.wait(r.ticket, 10) == Completed(3)
        assert_arrived(dst, src, [5, 6], [7, 8])
        assert fallbacks("cpu_cache") == before + 2
    # a reservation that claims CUDA IPC from a receiver that does not offer it: the ask is refused
    fake_cuda_ipc(monkeypatch)
    refused = fallbacks("not_granted")
    with KVReceiver(dst) as rx:
        r = dataclasses.replace(rx.reserve("req-ipc-refused", [9], lease_s=30), transport="cuda_ipc")
        with KVSender(src).open(r) as stream:
            assert stream.transport == "tcp"
            for layer in range(LAYOUT.num_layers):
                stream.send_layer(layer, [11])
            stream.finish(4, timeout=10)
        assert rx.wait(r.ticket, 10) == Completed(4)
        assert_arrived(dst, src, [9], [11])
    assert fallbacks("not_granted") == refused + 1
