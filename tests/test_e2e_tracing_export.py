"""Traces leave the process: a worker process started with --otlp-traces-endpoint posts its spans
to an OTLP/HTTP collector (a stand-in that records what it is sent), named for its service."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from aiohttp import web

from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS, free_port, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_worker_process_exports_its_spans_to_the_configured_collector() -> None:
    model = load_model(None, torch.float32, progress=False)
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", "Say hi.")])
    port = free_port()
    posts: list[bytes] = []
    got = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        posts.append(await request.read())
        got.set()
        return web.Response(status=200)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        d = await asyncio.to_thread(
            spawn_worker, "decode", *FLAGS, "--otlp-traces-endpoint", f"http://127.0.0.1:{port}"
        )
        try:

            async def body(stub: Any, router: Any) -> None:
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=4)
                )
                [r async for r in stub.Generate(req, timeout=60)]

            await with_router([d], [], model.tokenizer, body, routing=RoutingConfig(mode="colocated"))
            await asyncio.wait_for(got.wait(), 30)  # the batch exporter's schedule (5 s), or its flush at exit
        finally:
            await asyncio.to_thread(d.stop)
            await runner.cleanup()

    asyncio.run(scenario())
    sent = b"".join(posts)
    assert b"decode.admission" in sent and b"decode.stream" in sent  # span names in the OTLP protobuf
    assert b"decode-worker" in sent  # the service.name resource attribute
