"""`splitserve generate` against a router that is not up yet: it says what it waits for (nothing
listening, then pools not ready), waits through both, and streams the answer once the router's
health turns SERVING: a real subprocess against a real router on a real port."""

from __future__ import annotations

import asyncio
import random
import socket
import sys

import pytest

from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane
from splitserve.router.config import Deadlines, Listeners, RouterConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(90)

ANSWER = "ready and answering"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def read_until(stream: asyncio.StreamReader, needle: str, timeout_s: float = 30.0) -> str:
    seen = ""
    while needle not in seen:
        line = await asyncio.wait_for(stream.readline(), timeout_s)
        assert line, f"stream ended before {needle!r}; saw {seen!r}"
        seen += line.decode()
    return seen


def test_generate_waits_for_the_router_and_its_pools_then_answers() -> None:
    async def scenario() -> None:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "splitserve.cli",
            "generate",
            "--raw",
            "--address",
            f"127.0.0.1:{port}",
            "--wait-s",
            "60",
            "--max-tokens",
            "64",
            "hello",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        router = d = None
        try:
            await read_until(proc.stderr, "nothing listening there yet")
            cfg = RouterConfig(
                deadlines=Deadlines(stats_interval_s=0.05), listeners=Listeners(host="127.0.0.1", grpc_port=port)
            )
            router = Router(cfg, ByteTokenizer(), rng=random.Random(0))
            await router.start()
            await read_until(proc.stderr, "not ready yet (health NOT_SERVING)")
            assert proc.returncode is None  # still waiting, not failed
            d = FakeDecodeWorker(FakeKVPlane(), list(ANSWER.encode()), worker_id="d0")
            await d.start()
            router.workers.add(d.address, "decode")
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()
            assert out.decode().strip() == ANSWER
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if router is not None:
                await router.stop(0)
            if d is not None:
                await d.stop()

    asyncio.run(scenario())


def test_generate_gives_up_after_its_wait_naming_why() -> None:
    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "splitserve.cli",
            "generate",
            "--raw",
            "--address",
            f"127.0.0.1:{free_port()}",
            "--wait-s",
            "1",
            "hello",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1
        assert "was not ready within 1 s (nothing listening there yet)" in err.decode()

    asyncio.run(scenario())
