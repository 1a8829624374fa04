"""A client that reads its stream a byte at a time: backpressure holds its answer in bounded
buffers (the router's socket, gRPC's flow-control window, the worker's per-request queue of at
most max_tokens tokens), the router's memory stays flat, and the other streams on the same decode
worker finish with their exact greedy answers while the slow one has read almost nothing."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
from typing import Any

import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Listeners, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS, expected, wait_all_blocks_free, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_a_client_reading_a_byte_at_a_time_neither_grows_the_router_nor_slows_the_others() -> None:
    model = load_model(None, torch.float32, progress=False)
    tok = EngineTokenizer(model.tokenizer)
    others = [tok.encode_chat([("user", f"Describe the number {i}.")]) for i in range(3)]
    n = 32
    want = expected(model, others, n)
    d = spawn_worker("decode", *FLAGS)
    try:

        async def slow_client(port: int, read: list[int], stop: asyncio.Event) -> None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel buffers little
            sock.connect(("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = json.dumps(
                {"prompt": "Write a very long story.", "stream": True, "max_tokens": 1000, "ignore_eos": True}
            ).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            while not stop.is_set():
                if await reader.read(1):
                    read[0] += 1
                await asyncio.sleep(0.02)  # the client's pace: this is what is being tested, not a wait
            writer.close()

        async def body(stub: Any, router: Any) -> tuple[list[list[int]], int, float]:
            read, stop = [0], asyncio.Event()
            slow = asyncio.ensure_future(slow_client(router.http_port, read, stop))
            while read[0] < 200:  # the slow stream is flowing (its headers and first events)
                await asyncio.sleep(0.05)
            before = rss_mb()

            async def one(ids: list[int]) -> list[int]:
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                )
                return [t async for r in stub.Generate(req, timeout=120) for t in r.token_ids]

            outs = await asyncio.gather(*(one(ids) for ids in others))
            read_when_done = read[0]
            await asyncio.sleep(3.0)  # the slow stream's tokens keep coming meanwhile: memory must not follow
            grew = rss_mb() - before
            stop.set()
            await slow
            return outs, read_when_done, grew

        outs, read_when_done, grew = asyncio.run(
            with_router(
                [d],
                [],
                model.tokenizer,
                body,
                routing=RoutingConfig(mode="colocated"),
                listeners=Listeners(http_port=0),
            )
        )
        print(f"slow consumer: others done when it had read {read_when_done} bytes; router RSS grew {grew:.1f} MB")
        assert outs == want
        assert read_when_done < 4000  # the others did not wait for the slow client's stream
        assert grew < 32.0
        wait_all_blocks_free([d])  # its disconnect cancelled it
    finally:
        d.stop()
