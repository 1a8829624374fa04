"""Router replicas (`--routers N`, router/replicas.py): the limits split over them, the worker set
mirrored to them, and on real processes sharing one port, the connections spread over them and a
replica killed mid-stream costing only its own connections' streams."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve.bench.fake_workers import FakeDecodeWorker
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc
from splitserve.router.config import Limits, Listeners, RouterConfig
from splitserve.router.replicas import Replicas, per_replica
from splitserve.router.server import Router
from splitserve.router.tenants import Tenant
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.router.workers import WorkerSet
from tests.proc_sockets import LISTEN, tcp_sockets
from tests.router_helpers import with_fake_cluster

SCRIPT = list(range(65, 65 + 24))  # every stream's tokens (the fakes' script)
CHANNELS = 36  # client connections: 3 replicas all get one unless the kernel's hash is 1 in 10^5 unlucky


def test_per_replica_splits_the_clusters_limits_rounding_up_and_says_which_are_too_small() -> None:
    cfg = RouterConfig(
        limits=Limits(max_inflight=1000, max_running=10),
        listeners=Listeners(replicas=4),
        tenants=(Tenant("a", ("ka",), max_concurrent=2, tokens_per_minute=4000), Tenant("b", ("kb",))),
    )
    split, notes = per_replica(cfg)
    assert (split.limits.max_inflight, split.limits.max_running) == (250, 3)
    a, b = split.tenants
    assert (a.max_concurrent, a.tokens_per_minute) == (1, 1000)
    assert (b.max_concurrent, b.tokens_per_minute) == (None, None)
    assert notes == ["tenant 'a' max_concurrent 2 is below --routers 4: each router replica allows 1 (4 in all)"]
    assert per_replica(RouterConfig()) == (RouterConfig(), [])


def test_a_replica_set_replays_the_first_ones_membership_and_every_change_after() -> None:
    async def body() -> None:
        first, second = WorkerSet(RouterConfig(), _index()), WorkerSet(RouterConfig(), _index())
        first.add("127.0.0.1:1", "decode")
        first.expect("decode", 2)
        for op in first.membership():  # a replica started now
            second.apply(op)
        first.mirrors.append(second.apply)  # and then told every change
        first.add("127.0.0.1:2", "prefill")
        first.drain("127.0.0.1:1")
        first.remove("127.0.0.1:2")
        first.expect("decode", 0)
        assert [(w.address, w.role, w.draining) for w in second.all()] == [("127.0.0.1:1", "decode", True)]
        assert second.starting("decode") == 0
        assert second.membership() == first.membership()
        with pytest.raises(ValueError, match="not a membership op"):
            second.apply(("rename", "127.0.0.1:1"))
        await first.close()
        await second.close()

    asyncio.run(body())


def _index() -> Any:
    from splitserve.router.prefix_index import PrefixIndex

    return PrefixIndex()


def _served_ports(pid: int, port: int) -> set[int]:
    """The client ports of the connections process `pid` accepted on `port`."""
    return {s.remote_port for s in tcp_sockets([pid]) if s.port == port and s.state != LISTEN}


def _listening(pid: int, port: int) -> bool:
    return any(s.state == LISTEN and s.port == port for s in tcp_sockets([pid]))


async def _generate(stub: Any, rid: str, max_tokens: int, started: asyncio.Event | None = None) -> list[int] | str:
    """The stream's tokens, or its error's code name; `started` is set at its first token."""
    req = pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=list(rid.encode())),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    got: list[int] = []
    try:
        async for r in stub.Generate(req, timeout=60):
            got.extend(r.token_ids)
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as e:
        if started is not None:
            started.set()
        return e.code().name
    return got


@pytest.mark.timeout(180)
def test_replicas_share_the_port_follow_the_workers_and_one_killed_costs_only_its_own_streams() -> None:
    workers: list[Any] = []

    async def body(router: Router) -> None:
        replicas = Replicas(router, ByteTokenizer, shutdown_grace_s=1.0)
        await replicas.start()
        try:
            await _check(router, replicas, workers)
        finally:
            replicas.terminate()
            await replicas.join()
        assert all(p.exitcode is not None for p in replicas.processes.values())

    listeners = Listeners(host="127.0.0.1", grpc_port=0, replicas=3)
    asyncio.run(with_fake_cluster(body, SCRIPT, token_delay_s=0.05, listeners=listeners, workers=workers))


async def _check(router: Router, replicas: Replicas, workers: list[Any]) -> None:
    port = router.port
    pids = [os.getpid(), *replicas.pids()]
    assert all(_listening(pid, port) for pid in pids)
    d0 = workers[0]
    # a decode worker added after the replicas started, and the first drained: every replica
    # must follow the first router's set, or its requests still go to d0
    # on d0's KV plane: the fake prefill worker hands its KV through it
    d1 = FakeDecodeWorker(d0.kv, SCRIPT, worker_id="d1", token_delay_s=0.05)
    await d1.start()
    try:
        router.workers.add(d1.address, "decode")
        await router.wait_for_workers()
        router.workers.drain(d0.address)
        # a channel of its own subchannel pool is a connection of its own (gRPC shares one otherwise)
        own = (("grpc.use_local_subchannel_pool", 1),)
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=own) for _ in range(CHANNELS)]
        stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
        # each connection opened with a short request; the replicas' views settle meanwhile
        first = await asyncio.gather(*(_generate(s, f"open-{k}", 1) for k, s in enumerate(stubs)))
        assert all(f == SCRIPT[:1] for f in first), first
        served = {pid: _served_ports(pid, port) for pid in pids}
        assert sum(len(s) for s in served.values()) == CHANNELS
        assert all(served.values()), f"a replica got no connection: {served}"
        assert len(d1.callers) == 3, "every router process sends to the worker added after the replicas started"
        assert d0.active == {} and not [r for r in d0.requests if r.request_id.startswith("open")]

        # a replica (not the first: it is this process) killed while every stream is mid-way
        victim = pids[1]
        started = [asyncio.Event() for _ in stubs]
        streams = [
            asyncio.ensure_future(_generate(s, f"long-{k}", len(SCRIPT), started[k])) for k, s in enumerate(stubs)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*streams)
        failed = [r for r in results if isinstance(r, str)]
        assert len(failed) == len(served[victim]), (failed, served)
        assert set(failed) <= {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED"}
        assert all(r == SCRIPT for r in results if not isinstance(r, str))

        # the first router starts another in its place, on the same port
        deadline = time.monotonic() + 60
        while not (replicas.restarts == 1 and all(_listening(pid, port) for pid in replicas.pids())):
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            await asyncio.sleep(0.1)
        assert victim not in replicas.pids() and len(replicas.pids()) == 2

        # stopping: every replica drains the streams it holds; telling it twice does not cut them
        # (serve and router both tell it, as their start fails or their signal comes)
        channels += [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=own) for _ in range(CHANNELS)]
        stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
        started = [asyncio.Event() for _ in stubs]
        streams = [
            asyncio.ensure_future(_generate(s, f"last-{k}", len(SCRIPT), started[k])) for k, s in enumerate(stubs)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        replicas.terminate()
        await replicas.draining()  # each has its drain under way: a second signal now would cut it
        replicas.terminate()
        results = await asyncio.gather(*streams)
        assert all(r == SCRIPT for r in results), [r for r in results if r != SCRIPT]
        await replicas.join()
        assert [p.exitcode for p in replicas.processes.values()] == [0, 0]
        for c in channels:
            await c.close()
    finally:
        await d1.stop()


@pytest.mark.timeout(120)
def test_the_router_command_runs_its_replicas_on_one_port_and_stops_them_all_on_sigterm() -> None:
    import subprocess
    import sys

    async def body(router: Router) -> None:
        d, p = router.workers.healthy("decode")[0], router.workers.healthy("prefill")[0]
        argv = ["router", "--decode", d.address, "--prefill", p.address, "--routers", "2", "--grpc-port", "0"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", *argv, "--http-port", "-1", stdout=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert "(2 router processes)" in line, line
            port = int(line.split("listening on 127.0.0.1:")[1].split()[0].rstrip(","))
            pids = [proc.pid, *child_pids(proc.pid)]
            assert len(pids) == 2 and all(_listening(pid, port) for pid in pids), pids
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert await _generate(generate_pb2_grpc.GenerationStub(ch), "cli", 4) == SCRIPT[:4]
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
            assert not [pid for pid in pids[1:] if os.path.exists(f"/proc/{pid}")]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(with_fake_cluster(body, SCRIPT))


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is `pid`, as /proc says (a spawn start's resource tracker left out)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == pid and b"resource_tracker" not in cmdline:
            found.append(int(status.parent.name))
    return found
