"""router/event_loop.py: the router runs on uvloop when it is installed (it is a
dependency on Linux), on asyncio's loop when SPLITSERVE_NO_UVLOOP is set, and a
gRPC round trip works on the loop it picks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from splitserve.router import event_loop

pytestmark = pytest.mark.timeout(60)


async def _health_round_trip() -> tuple[str, int]:
    class Health(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):  # noqa: N802
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        await server.stop(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0], r.status


def test_uvloop_by_default_and_grpc_runs_on_it(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv(event_loop.DISABLE_ENV, raising=False)
    assert event_loop.loop_name() == "uvloop"
    loop_module, status = event_loop.run(_health_round_trip())
    assert loop_module == "uvloop"
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_env_switch_picks_asyncios_loop(monkeypatch):
    monkeypatch.setenv(event_loop.DISABLE_ENV, "1")
    assert event_loop.loop_name() == "asyncio"
    loop_module, status = event_loop.run(_health_round_trip())
    assert loop_module == "asyncio"
    assert status == health_pb2.HealthCheckResponse.SERVING
