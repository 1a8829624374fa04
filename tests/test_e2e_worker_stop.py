"""SIGTERM of a worker process in the middle of its work: it exits promptly (its gRPC grace
period, then the engine aborts what is left), not after its longest call deadline (a plain prefill
worker once took 203 s); the router's requests move on, and the decode worker keeps no block."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import FLAGS, wait_all_blocks_free, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LONG = "Tell me everything you know about the history of the printing press, in detail. " * 20


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sigterm_mid_request_exits_within_the_grace_period(role: str) -> None:
    model = load_model(None, torch.float32, progress=False)
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", LONG)])
    d, p = spawn_worker("decode", *FLAGS), spawn_worker("prefill", *FLAGS)
    victim, survivor = (p, d) if role == "prefill" else (d, p)

    async def body(stub: Any, router: Any) -> float:
        calls = [
            stub.Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids + [i]),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                ),
                timeout=300,
            )
            for i in range(3)
        ]
        reads = [asyncio.ensure_future(c.read()) for c in calls]
        if role == "decode":
            await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)  # decoding has begun
        else:
            await asyncio.to_thread(_until_busy, victim)  # prefill is computing
        t = time.monotonic()
        os.killpg(victim.proc.pid, signal.SIGTERM)
        await asyncio.to_thread(victim.proc.wait, 120)
        took = time.monotonic() - t
        for c in calls:
            c.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        return took

    try:
        took = asyncio.run(with_router([d], [p], model.tokenizer, body, routing=RoutingConfig(mode="disaggregated")))
        print(f"{role} worker exited {took:.2f} s after SIGTERM")
        assert victim.proc.returncode == 0, victim.log()[-2000:]
        log = victim.log()  # the warm-up step ran before the worker listened (and so before it could be ready)
        assert log.index("warm-up step done") < log.index("listening on"), log[-2000:]
        assert took < 15.0, victim.log()[-2000:]  # the grace period and an engine step, not a call deadline
        if survivor is d:
            wait_all_blocks_free([d])
    finally:
        d.stop()
        p.stop()


def _until_busy(w: WorkerProcess, timeout_s: float = 60.0) -> None:
    """Until the worker reports queued or running prompt work (its stats)."""
    from tests.e2e_helpers.cluster import stats

    end = time.monotonic() + timeout_s
    while True:
        st = stats(w)
        if st.queued_tokens or st.running_requests:
            return
        assert time.monotonic() < end, "the prefill worker never got the requests"
        time.sleep(0.02)
