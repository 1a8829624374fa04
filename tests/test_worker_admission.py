"""A worker's bounded waiting queue (engine/commands.py, the scheduler's free seats) and its
warm-up step (workers/common/warm_up.py), on a real gRPC worker with a tiny model: past the limit
a request is refused at once with RESOURCE_EXHAUSTED while the admitted ones run to the end, and no
block is lost either way."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.common.warm_up import warm_up
from splitserve.workers.server import start_worker
from tests.worker_helpers import assert_engine_empty, tiny_engine

pytestmark = pytest.mark.timeout(120)

CFG = tiny_model_config()
WEIGHTS = random_weights(CFG, seed=3)
TOKEN = "admission-test-token"
META = (("x-splitserve-token", TOKEN),)


def decode_call(stub: wgrpc.DecodeWorkerStub, rid: str, max_tokens: int) -> Any:
    sampling = wpb.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, top_p=1.0, repetition_penalty=1.0
    )
    return stub.Decode(
        wpb.DecodeRequest(
            request_id=rid,
            handoff=wpb.Handoff(prompt_token_ids=[3, 4, 5, 6, 7], sampling=sampling),
            prefill_mode=wpb.PREFILL_MODE_LOCAL,
        ),
        metadata=META,
        timeout=60,
    )


def test_past_the_waiting_limit_a_request_is_refused_at_once_and_the_admitted_finish() -> None:
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    engine = Engine(CFG, WEIGHTS, ecfg)
    w = start_worker(WorkerConfig(role="decode", engine=ecfg, cluster_token=TOKEN, max_waiting_requests=1), engine)
    try:
        with grpc.insecure_channel(w.grpc_address) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            running = decode_call(stub, "running", 200)  # takes the only seat
            assert next(running).WhichOneof("event") == "local_prefill"
            first = next(running)
            assert first.WhichOneof("event") == "tokens"  # it runs
            waiting = decode_call(stub, "waiting", 4)  # queued behind it: the one waiting place
            assert next(waiting).WhichOneof("event") == "local_prefill"
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                next(decode_call(stub, "refused", 4))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit 1" in (e.value.details() or "")
            assert time.monotonic() - t < 2.0  # refused, not queued until a deadline
            tokens = [t for ev in running if ev.WhichOneof("event") == "tokens" for t in ev.tokens.token_ids]
            assert len(first.tokens.token_ids) + len(tokens) == 200  # an event may carry several tokens
            later = [t for ev in waiting if ev.WhichOneof("event") == "tokens" for t in ev.tokens.token_ids]
            assert len(later) == 4
        w.loop.stop()  # nothing touches the engine from here on
        assert_engine_empty(w.loop.engine)
    finally:
        w.stop()


def test_the_default_limit_is_twice_the_seats() -> None:
    cfg = WorkerConfig(role="decode", engine=EngineConfig(max_num_seqs=24))
    assert cfg.waiting_limit == 48
    assert WorkerConfig(role="decode", max_waiting_requests=5).waiting_limit == 5
    with pytest.raises(ValueError, match="max_waiting_requests"):
        WorkerConfig(role="decode", max_waiting_requests=-1)


def test_warm_up_runs_a_request_and_leaves_the_engine_empty() -> None:
    engine = Engine(CFG, WEIGHTS, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=32))
    free = engine.blocks.num_free_blocks
    assert warm_up(engine) >= 0.0
    assert engine.blocks.num_free_blocks == free
    assert_engine_empty(engine)
    assert not engine.blocks.hash_to_block  # nothing entered the prefix cache


def test_one_sample_cancelled_the_others_finish_and_every_block_comes_back() -> None:
    """Cancel with a sample index (the router matched that sample's stop string) stops it alone."""
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    w = start_worker(WorkerConfig(role="decode", engine=ecfg, cluster_token=TOKEN), Engine(CFG, WEIGHTS, ecfg))
    try:
        with grpc.insecure_channel(w.grpc_address) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            sampling = wpb.SamplingParams(
                temperature=0.9, seed=1, max_tokens=60, ignore_eos=True, top_p=1.0, repetition_penalty=1.0, n=3
            )
            call = stub.Decode(
                wpb.DecodeRequest(
                    request_id="n3",
                    handoff=wpb.Handoff(prompt_token_ids=[3, 4, 5, 6, 7], sampling=sampling),
                    prefill_mode=wpb.PREFILL_MODE_LOCAL,
                ),
                metadata=META,
                timeout=60,
            )
            assert next(call).WhichOneof("event") == "local_prefill"
            counts = {0: 0, 1: 0, 2: 0}
            finishes: dict[int, int] = {}
            cancelled = False
            for ev in call:
                if ev.WhichOneof("event") == "tokens":
                    counts[ev.tokens.index] += len(ev.tokens.token_ids)
                    if not cancelled and counts[1] >= 2:
                        cancelled = True
                        found = stub.Cancel(wpb.CancelRequest(request_id="n3", index=1), metadata=META, timeout=10)
                        assert found.found
                elif ev.WhichOneof("event") == "finish":
                    finishes[ev.finish.index] = ev.finish.reason
            assert counts[0] == counts[2] == 60 and counts[1] < 60
            assert finishes == {0: wpb.FINISH_REASON_LENGTH, 2: wpb.FINISH_REASON_LENGTH}
            gone = stub.Cancel(wpb.CancelRequest(request_id="n3", index=1), metadata=META, timeout=10)
            assert not gone.found
        w.loop.stop()
        assert_engine_empty(w.loop.engine)
    finally:
        w.stop()


def test_the_warm_up_leaves_no_prefill_speed_behind() -> None:
    """Its prompt of a few tokens measures fixed costs, not a speed: the first real prompts do."""
    engine = tiny_engine()
    warm_up(engine)
    assert engine.prefill_tokens_per_s is None
    engine.generate([list(range(40))], SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.prefill_tokens_per_s is not None and engine.prefill_tokens_per_s > 0


def test_a_stream_interval_groups_a_streams_tokens_after_its_first() -> None:
    """--stream-interval 4: the first event is not held for a group (it carries what is ready: the
    first token, or more on a busy machine), the next ones groups of at least 4, the last whatever is
    left; the same tokens as with each step's."""
    got = {}
    for interval in (1, 4):
        ecfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
        cfg = WorkerConfig(role="decode", engine=ecfg, cluster_token=TOKEN, stream_interval=interval)
        w = start_worker(cfg, Engine(CFG, WEIGHTS, ecfg))
        try:
            with grpc.insecure_channel(w.grpc_address) as ch:
                events = list(decode_call(wgrpc.DecodeWorkerStub(ch), f"s{interval}", 40))
            got[interval] = [list(ev.tokens.token_ids) for ev in events if ev.WhichOneof("event") == "tokens"]
            assert events[-1].WhichOneof("event") == "finish"
        finally:
            w.stop()
    _, *groups, _ = [len(g) for g in got[4]]
    assert all(n >= 4 for n in groups), got[4]  # none of the events between the first and the last is short
    assert sum(got[4], []) == sum(got[1], []) and len(sum(got[1], [])) == 40
    with pytest.raises(ValueError, match="stream_interval"):
        WorkerConfig(role="decode", stream_interval=0)
