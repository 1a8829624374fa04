"""A router in this process in front of fake workers on real sockets (bench/fake_workers.py), for the
tests of the door: keys, tenants, TLS, faults."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane, FakePrefillWorker
from splitserve.router.config import Deadlines, Listeners, RouterConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

LOCAL = Listeners(host="127.0.0.1", grpc_port=0, http_port=0)


async def with_fake_cluster(
    body: Any,
    script: list[int],
    *,
    token_delay_s: float = 0.0,
    on_decode: Any = None,
    decode_kw: Any = None,
    prefill_kw: Any = None,
    workers: list[Any] | None = None,
    **sections: Any,
) -> Any:
    """`body(router)` against a router over one fake decode and one fake prefill worker that
    answer `script`; `on_decode` is handed the decode worker's `die`; `workers`, given, gets the two
    fakes (decode, prefill); `sections`: RouterConfig's."""
    kv = FakeKVPlane()
    d = FakeDecodeWorker(kv, script, worker_id="d0", token_delay_s=token_delay_s, **(decode_kw or {}))
    p = FakePrefillWorker(kv, script, worker_id="p0", **(prefill_kw or {}))
    await d.start()
    await p.start()
    if on_decode is not None:
        on_decode(d.die)
    if workers is not None:
        workers += [d, p]
    cfg = RouterConfig(**{"deadlines": Deadlines(stats_interval_s=0.05), "listeners": LOCAL, **sections})
    router = Router(cfg, ByteTokenizer(), decode=[d.address], prefill=[p.address], rng=random.Random(0))
    await router.start()
    await router.wait_for_workers()
    try:
        return await body(router)
    finally:
        await router.stop(0)
        await d.stop()
        await p.stop()


async def until_indexed(
    router: Router, hashes: list[bytes], timeout_s: float = 10.0, on: set[str] | None = None
) -> None:
    """Until the router's prefix index holds all of `hashes` on one worker (of `on`, if given: the
    decode workers, say, whose events may come after a prefill worker's for the same prompt)."""
    deadline = time.monotonic() + timeout_s

    def held() -> int:
        return max((n for w, n in router.index.overlap(hashes).items() if on is None or w in on), default=0)

    while held() < len(hashes):
        if time.monotonic() > deadline:
            raise TimeoutError("block events did not reach the router's prefix index")
        await asyncio.sleep(0.005)
