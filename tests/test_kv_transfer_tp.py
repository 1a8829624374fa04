"""KV transfer between tensor-parallel sizes: a prefill cache at TP N into a decode cache at
TP M, each layer re-sharded on the way (kv_transfer/heads.py). The decode side's whole KV
(its shards side by side) is the prefill side's, block by block, for every pair of 1, 2
and 4; a pair that cannot map is refused by name before anything is written; a failed
re-sharding stream resets its blocks in every shard; done needs every head of every layer."""

from __future__ import annotations

import importlib.util
import itertools
import random

import pytest
import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer import Completed, Failed, FailureCode, KVReceiver, KVSender, TransferError, frame, heads
from tests.kv_transfer_helpers.common import RawPeer, assert_no_leak
from tests.kv_transfer_helpers.tp import TP_LAYOUT, assert_kv_arrived, assert_kv_zero, at_tp, random_tp_cache

HAS_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAS_UCX, reason="ucxx not installed"))]
SIZES = [1, 2, 4]
PAIRS = list(itertools.product(SIZES, SIZES))

# Runs that are consecutive on one side only, and a block sent twice (a partial last block).
DST_IDS = [5, 6, 7, 20, 30, 31]
SRC_IDS = [1, 2, 3, 4, 10, 11]


def _send_in_two_chunks(sender: KVSender, rx: KVReceiver, src: KVCache, request_id: str) -> None:
    """Chunked prefill: the first chunk's last block is partial (half its token slots
    written), sent, then completed and sent again with the rest."""
    r = rx.reserve(request_id, DST_IDS, lease_s=30)
    partial = SRC_IDS[3]
    whole = [shard[:, partial].clone() for shard in src.shards]
    for shard in src.shards:
        shard[:, partial, :, src.layout.block_size // 2 :] = 0
    layers = list(range(src.layout.num_layers))
    with sender.open(r) as stream:
        random.Random(request_id).shuffle(layers)
        for layer in layers:
            stream.send_layer(layer, SRC_IDS[:4], snapshot=True)  # the block changes before its resend
        for shard, block in zip(src.shards, whole, strict=True):
            shard[:, partial] = block
        random.Random(request_id + "2").shuffle(layers)
        for layer in layers:
            stream.send_layer(layer, SRC_IDS[3:], first_index=3)
        stream.finish(17, timeout=10)
    assert rx.wait(r.ticket, 10) == Completed(17)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("src_tp,dst_tp", PAIRS)
def test_kv_arrives_whole_between_any_two_tp_sizes(src_tp, dst_tp, transport):
    src = random_tp_cache(src_tp, seed=src_tp * 10 + dst_tp)
    dst = KVCache(at_tp(dst_tp), 48)
    with KVReceiver(dst, transport=transport) as rx:
        sender = KVSender(src)
        try:
            _send_in_two_chunks(sender, rx, src, f"req-tp-{src_tp}-{dst_tp}")
            assert_kv_arrived(dst, src, DST_IDS, SRC_IDS)
            untouched = sorted(set(range(48)) - set(DST_IDS))
            assert_kv_zero(dst, untouched)
            assert_no_leak(rx, range(48))
        finally:
            sender.close()


def test_the_plan_gives_each_receiver_shard_its_heads_and_zero_copy_only_at_equal_sizes():
    for src_tp, dst_tp in PAIRS:
        plan = heads.plan(at_tp(src_tp), at_tp(dst_tp))
        assert [f.dst_rank for f in plan] == list(range(dst_tp))
        covered: list[int] = []
        for f in plan:
            assert f.first_head == f.dst_rank * (4 // dst_tp) and f.head_count == 4 // dst_tp
            offset = 0
            for p in f.parts:
                assert p.dst_offset == offset
                covered.extend(
                    range(
                        p.src_rank * (4 // src_tp) + p.src_first,
                        p.src_rank * (4 // src_tp) + p.src_first + p.head_count,
                    )
                )
                offset += p.head_count
            assert offset == f.head_count
            assert f.zero_copy == (src_tp == dst_tp)
        assert covered == list(range(4))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "src_tp,dst_tp,change,words",
    [
        (2, 1, {"num_kv_heads": 2}, ["prefill TP 2 holds 2 KV heads (1 per rank)", "decode TP 1 holding 4 KV heads"]),
        (
            1,
            2,
            {"head_dim": 16},
            ["prefill TP 1", "head dim 16", "cannot map to decode TP 2", "head_dim: 16 at prefill"],
        ),
        (4, 2, {"num_layers": 5}, ["prefill TP 4", "5 layers", "num_layers"]),
    ],
)
def test_an_unmappable_pair_is_refused_by_name_and_nothing_is_written(src_tp, dst_tp, change, words):
    import dataclasses

    other = dataclasses.replace(TP_LAYOUT, **change)
    src = random_tp_cache(src_tp, seed=3, layout=other)
    dst = KVCache(at_tp(dst_tp), 48)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-unmappable", [1, 2], lease_s=30)
        with pytest.raises(TransferError) as refused:
            KVSender(src).open(r)  # refused before connecting: the reservation states the receiver's layout
        assert refused.value.code is FailureCode.LAYOUT_MISMATCH
        for w in words:
            assert w in str(refused.value)
        # a sender that claims the receiver's layout in its reservation is refused by the receiver
        lying = KVSender(src)
        with pytest.raises(TransferError, match="cannot map to decode TP"):
            lying.open(dataclasses.replace(r, layout=src.layout))
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.LAYOUT_MISMATCH
        for w in words:
            assert w in outcome.reason
        assert_kv_zero(dst, range(48))
        assert_no_leak(rx, range(48))


def _handshake(peer: RawPeer, sender_tp: int, cut_for_tp: int) -> tuple[frame.Header, bytes]:
    lay = peer.r.layout
    body = frame.encode_layout(
        lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype, sender_tp, cut_for_tp
    )
    peer.send(peer.header(frame.HANDSHAKE, payload_length=len(body)) + body)
    return peer.read()


def _shard_frame(peer: RawPeer, src: KVCache, layer: int, rank: int, dst_first: int, count: int, **override):
    """Rank `rank`'s heads of `count` blocks from block 0 of `src` (a cache at the receiver's size)."""
    payload = frame.as_bytes(src.blocks(layer, 0, count, rank))
    lay = src.layout
    fields = dict(
        layer=layer,
        first_block=dst_first,
        block_count=count,
        dtype_code=frame.DTYPE_CODES[lay.dtype],
        element_count=heads.frame_elements(lay, count, lay.kv_heads_per_rank),
        payload_length=payload.numel(),
        checksum_kind=frame.CHECKSUM_LANESUM,
        checksum=frame.checksum(frame.CHECKSUM_LANESUM, [payload]),
        first_head=lay.rank_heads(rank).start,
        head_count=lay.kv_heads_per_rank,
    )
    fields.update(override)
    return peer.header(frame.LAYER, **fields) + bytes(payload.numpy())


@pytest.mark.timeout(30)
def test_a_handshake_cut_for_another_tp_size_is_refused():
    dst = KVCache(at_tp(2), 16)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-cut", [1, 2], lease_s=30)
        peer = RawPeer(r)
        h, body = _handshake(peer, sender_tp=1, cut_for_tp=4)
        assert h.kind == frame.ERROR and b"cuts its KV for decode TP 4, this decode worker is TP 2" in body
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.LAYOUT_MISMATCH
        peer.close()
        assert_no_leak(rx, range(16))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first_head,head_count", [(1, 2), (0, 4), (0, 0), (4, 2), (2, 1)])
def test_a_frame_whose_heads_are_no_receiver_shard_is_refused_and_every_shard_reset(first_head, head_count):
    src = random_tp_cache(2, num_blocks=8, seed=5)
    dst = KVCache(at_tp(2), 16)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-heads", [3, 4], lease_s=30)
        peer = RawPeer(r)
        assert _handshake(peer, 2, 2)[0].kind == frame.ACK
        peer.send(_shard_frame(peer, src, 0, 0, 3, 2) + _shard_frame(peer, src, 0, 1, 3, 2))  # good: written
        peer.send(_shard_frame(peer, src, 1, 1, 3, 2, first_head=first_head, head_count=head_count))
        peer.read_until_closed()
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.HEAD_OUT_OF_RANGE, outcome
        assert "not one shard's at TP 2" in outcome.reason
        assert_kv_zero(dst, range(16))
        peer.close()
        assert_no_leak(rx, range(16))


@pytest.mark.timeout(30)
def test_done_needs_every_head_of_every_layer():
    src = random_tp_cache(2, num_blocks=8, seed=6)
    dst = KVCache(at_tp(2), 16)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-half", [3, 4], lease_s=30)
        peer = RawPeer(r)
        assert _handshake(peer, 2, 2)[0].kind == frame.ACK
        for layer in range(TP_LAYOUT.num_layers):  # rank 0's heads only
            peer.send(_shard_frame(peer, src, layer, 0, 3, 2))
        peer.send(peer.header(frame.DONE, value=1))
        peer.read_until_closed()
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.INCOMPLETE, outcome
        assert "layer 0 block 3 KV head 2" in outcome.reason
        assert_kv_zero(dst, range(16))
        peer.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (4, 2), (2, 1)])
def test_an_aborted_resharding_stream_resets_its_blocks_in_every_shard(src_tp, dst_tp):
    src = random_tp_cache(src_tp, seed=7)
    dst = KVCache(at_tp(dst_tp), 48)
    with KVReceiver(dst) as rx:
        r = rx.reserve("req-abort", DST_IDS, lease_s=30)
        sender = KVSender(src)
        stream = sender.open(r)
        stream.send_layer(0, SRC_IDS)
        stream.send_layer(2, SRC_IDS)
        stream.abort("prefill crashed")
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.ABORTED_BY_SENDER
        assert_kv_zero(dst, range(48))
        assert_no_leak(rx, range(48))
        sender.close()


# ---- CUDA IPC between sizes: the export faked on a CPU, the device copies real ----------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src_tp,dst_tp", PAIRS)
def test_cuda_ipc_copies_heads_into_every_receiver_shard(monkeypatch, src_tp, dst_tp):
    from tests.test_kv_transfer import fake_cuda_ipc

    fake_cuda_ipc(monkeypatch)
    src = random_tp_cache(src_tp, seed=20 + src_tp)
    dst = KVCache(at_tp(dst_tp), 48)
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        sender = KVSender(src)
        r = rx.reserve("req-ipc-tp", DST_IDS, lease_s=30)
        with sender.open(r) as stream:
            assert stream.transport == "cuda_ipc"
            for layer in range(TP_LAYOUT.num_layers):
                stream.send_layer(layer, SRC_IDS)
            stream.finish(5, timeout=10)
        assert rx.wait(r.ticket, 10) == Completed(5)
        assert len(sender._dialer._mapped[r.tcp_endpoint]) == dst_tp  # every shard mapped
        assert_kv_arrived(dst, src, DST_IDS, SRC_IDS)
        sender.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_cuda_ipc_between_tp_sizes_on_a_gpu(src_tp, dst_tp):
    # In one process the mapping is the shards themselves (cuda_ipc.py): the copies are
    # real device-to-device head slices, every rank's shard on the one GPU.
    src = random_tp_cache(src_tp, seed=30, device="cuda")
    dst = KVCache(at_tp(dst_tp), 48, "cuda")
    with KVReceiver(dst, transport="cuda_ipc") as rx:
        assert rx.transport == "cuda_ipc"
        sender = KVSender(src)
        r = rx.reserve("req-ipc-gpu", DST_IDS, lease_s=30)
        with sender.open(r) as stream:
            assert stream.transport == "cuda_ipc"
            for layer in range(TP_LAYOUT.num_layers):
                stream.send_layer(layer, SRC_IDS)
            stream.finish(5, timeout=30)
        assert rx.wait(r.ticket, 30) == Completed(5)
        assert_kv_arrived(dst, src, DST_IDS, SRC_IDS)
        sender.close()


# ---- engines at different sizes: a prefill at TP N feeding a decode at TP M ------------------


@pytest.mark.timeout(300)
# Not TP 2 on both sides here: a process holds one tensor-parallel engine at a time (one
# torch.distributed group); equal sizes above 1 are the cache-level tests' above.
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_a_prefill_at_one_tp_size_feeds_a_decode_at_another_token_for_token(prefill_tp, decode_tp):
    """The engines' own paths (the layer hook sends each layer as it lands, in chunks of
    8 tokens, a partial last block resent) over TCP: the colocated TP 1 engine's tokens."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.random_model import random_weights, tiny_model_config
    from splitserve.engine.sampling import SamplingParams
    from splitserve.workers.decode.connector import ReceiverConnector
    from splitserve.workers.prefill.connector import SenderConnector
    from tests.worker_helpers import EnginePair, assert_engine_empty

    cfg = tiny_model_config()  # 2 KV heads: TP 1 and 2
    weights = random_weights(cfg)
    prompt = list(range(1, 23))  # five full blocks of 4 and a partial one
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def engine(tp: int, max_num_batched_tokens: int = 64) -> Engine:
        return Engine(
            cfg,
            weights,
            EngineConfig(
                num_blocks=64, block_size=4, tensor_parallel_size=tp, max_num_batched_tokens=max_num_batched_tokens
            ),
        )

    colocated = engine(1)
    try:
        (want,) = colocated.generate([prompt], greedy)
    finally:
        colocated.close()
    prefill, decode = engine(prefill_tp, max_num_batched_tokens=8), engine(decode_tp)
    receiver = KVReceiver(decode.kv_cache)
    try:
        assert prefill.kv_cache.layout.tp_size == prefill_tp and decode.kv_cache.layout.tp_size == decode_tp
        decode_connector = ReceiverConnector(receiver, cancel_timeout_s=5.0)
        decode.connect(decode_connector)
        sender = KVSender(prefill.kv_cache)
        prefill_connector = SenderConnector(sender, confirm_timeout_s=10.0)
        prefill.connect(prefill_connector)
        pair = EnginePair(prefill, decode, receiver, sender, decode_connector, prefill_connector)
        remote = pair.reserve("r", prompt, greedy)
        assert remote.transfer.layout.tp_size == decode_tp  # the reservation states the decode side's size
        pair.start_prefill("r", prompt, greedy, remote)
        first = pair.prefill_until_done("r")
        assert pair.poll_prefill(timeout_s=10) == []  # confirmed: the held blocks are free
        pair.poll_decode(timeout_s=10)
        assert [first, *pair.decode_to_end("r")] == want
        sender.close()
        assert_engine_empty(prefill)
        assert_engine_empty(decode)
    finally:
        receiver.close()
        prefill.close()
        decode.close()


# ---- the benchmark ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_transfer_tp_prints_each_pair_per_layer_with_its_ratio(capsys):
    from splitserve.bench.transfer_tp import parse_pairs
    from splitserve.cli import main

    assert (
        main(
            [
                "bench",
                "transfer",
                "--size",
                "4M",
                "--layers",
                "2",
                "--repeats",
                "1",
                "--transports",
                "tcp",
                "--tp",
                "2:1,1:2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--tp 2:1,1:2" in out.splitlines()[0]
    for pair in ("TP 2 -> TP 1", "TP 1 -> TP 2"):
        row = next(line for line in out.splitlines() if line.startswith(f"  tcp  {pair}"))
        assert "plain" in row and "re-sharded" in row and "ms/layer" in row and "ratio" in row
        assert any(line.startswith(f"  {pair}: pack") and "scatter" in line for line in out.splitlines())
    with pytest.raises(ValueError, match="SENDER:RECEIVER"):
        parse_pairs("2-1")
