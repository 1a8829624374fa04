"""Hostile input against real processes: a decode and a prefill worker started
with a cluster token (from --cluster-token-file) and a router in front of them.

(a) Every listening port of the workers (both gRPC ports and the decode worker's
KV port; the prefill worker listens on no KV port, it only sends) gets random
bytes, a pickle whose unpickling would create a marker file, an HTTP/2 preface
and junk, oversized frames, and calls with a missing, forged or near-miss
`x-splitserve-token`. Each is refused, the marker never appears, the process
lives, and a call with the right token, then a whole disaggregated generation
through both workers and the KV port, still succeeds.

(b) A bounded fuzz of the public doors (gRPC Generate and the OpenAI HTTP API)
with the case generators of test_e2e_fuzz, here against real workers and a real
model: no gRPC INTERNAL or UNKNOWN, no HTTP 5xx, and afterwards the router
answers a greedy request with the same text as before, with every block free.
"""

from __future__ import annotations

import asyncio
import pickle
import random
import secrets
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from splitserve.engine.weights import load_tokenizer
from splitserve.kv_transfer import frame
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Limits, Listeners, RoutingConfig
from splitserve.router.server import Router
from splitserve.workers.common.auth import TOKEN_KEY
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import ENGINE_FLAGS, stats, wait_all_blocks_free, with_router
from tests.test_e2e_fuzz import fuzz_grpc, fuzz_http, until

pytestmark = pytest.mark.e2e

SEED = 20260111
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FUZZ_CASES = 160  # per door, at most
FUZZ_BUDGET_S = 20.0  # per door: no new batch of cases after this
FUZZ_MIN_CASES = 40  # per door: fewer means the machine was too slow for the test to mean much
CONCURRENCY = 4
# the router's limits for the fuzz: long prompts are refused before they cost a CPU prefill
ROUTER_LIMITS = Limits(max_model_len=1024, max_prompt_tokens=512, max_tokens_cap=64, default_max_tokens=8)
GREEDY = "The capital of France is"


@dataclass
class Cluster:
    decode: WorkerProcess
    prefill: WorkerProcess
    token: str
    tokenizer: Any

    @property
    def workers(self) -> list[WorkerProcess]:
        return [self.decode, self.prefill]

    def assert_healthy(self) -> None:
        """Every process alive and answering a call that carries the token."""
        for w in self.workers:
            assert w.proc.poll() is None, f"{w.role} worker died: {w.log()[-3000:]}"
            assert stats(w, self.token).total_blocks > 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    token = secrets.token_urlsafe(24)
    token_file = tmp_path_factory.mktemp("secrets") / "cluster_token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    flags = (*ENGINE_FLAGS, "--cluster-token-file", str(token_file))
    with ThreadPoolExecutor(3) as pool:  # the loads side by side: they are most of the module's time
        started = {role: pool.submit(spawn_worker, role, *flags) for role in ("decode", "prefill")}
        tokenizer = pool.submit(load_tokenizer, None)
    workers = {role: f.result() for role, f in started.items()}
    try:
        yield Cluster(workers["decode"], workers["prefill"], token, tokenizer.result())
    finally:
        for w in workers.values():
            w.stop()


# ---- (a) the workers' ports


def split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def poke(address: str, payload: bytes, linger_s: float = 0.3) -> bytes:
    """Send raw bytes, then read what comes back until the peer closes or `linger_s` passes."""
    got = b""
    with socket.create_connection(split_address(address), timeout=5) as s:
        try:
            s.sendall(payload)
            s.settimeout(linger_s)
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            pass
    return got


class Boom:
    """Unpickled, it would create `path`: proof that someone ran pickle.loads on our bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.path), "w")


def h2_frame(kind: int, flags: int, stream: int, payload: bytes, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">I", n)[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hostile_bytes(rng: random.Random, marker: Path) -> dict[str, bytes]:
    """What any port gets: nothing here is a valid message of any protocol the workers speak."""
    empty_settings = h2_frame(4, 0, 0, b"")
    return {
        "garbage": rng.randbytes(4096),
        "pickle": pickle.dumps(Boom(marker)),
        "pickle-after-preface": H2_PREFACE + pickle.dumps(Boom(marker)),
        "h2-preface-then-junk": H2_PREFACE + rng.randbytes(2048),
        # a HEADERS frame declaring 16 MiB, far past the 16 KiB frame size HTTP/2 allows by default
        "h2-oversized-frame": H2_PREFACE
        + empty_settings
        + h2_frame(1, 4, 1, rng.randbytes(1024), length=(1 << 24) - 1),
        "h2-data-on-stream-0": H2_PREFACE + empty_settings + h2_frame(0, 0, 0, b"x" * 64),
        "zeros": bytes(1 << 20),
    }


def kv_hostile_bytes(rng: random.Random) -> dict[str, bytes]:
    """Frames that parse as far as their header and are refused there (kv_transfer/frame.py)."""
    ticket = rng.randbytes(16)

    def header(kind: int, length: int, **kw: Any) -> bytes:
        return frame.encode_header(frame.Header(kind, ticket, "hostile", payload_length=length, **kw))

    layout = frame.encode_layout(30, 3, 64, 16, "float32")
    bad_crc = bytearray(header(frame.LAYER, 0))
    bad_crc[100] ^= 0xFF
    return {
        "kv-layer-of-1-TiB": header(frame.LAYER, 1 << 40) + rng.randbytes(4096),
        "kv-oversized-control": header(frame.HANDSHAKE, frame.MAX_CONTROL_PAYLOAD + 1) + rng.randbytes(4096),
        "kv-header-crc-broken": bytes(bad_crc),
        "kv-layer-before-handshake": header(frame.LAYER, 64, layer=0, block_count=1) + bytes(64),
        "kv-bad-magic": b"XXXX" + header(frame.HANDSHAKE, len(layout))[4:] + layout,
    }


def forged_handshake(rng: random.Random) -> bytes:
    layout = frame.encode_layout(30, 3, 64, 16, "float32")
    h = frame.Header(frame.HANDSHAKE, rng.randbytes(16), "forged", payload_length=len(layout))
    return frame.encode_header(h) + layout


def methods(role: str) -> dict[str, bool]:
    """Each internal method of the role's service, and whether its answer is a stream."""
    service = "DecodeWorker" if role == "decode" else "PrefillWorker"
    names = {"GetStats": False, "Cancel": False, "BlockEvents": True}
    names |= {"Decode": True} if role == "decode" else {"Prefill": False}
    return {f"/splitserve.internal.v1.{service}/{m}": stream for m, stream in names.items()}


def call_raw(
    address: str, method: str, stream: bool, body: bytes, metadata: tuple[tuple[str, str | bytes], ...]
) -> str:
    """One call with raw bytes as its message: the status name."""
    with grpc.insecure_channel(address) as ch:
        try:
            if stream:
                streaming: grpc.UnaryStreamMultiCallable[bytes, bytes] = ch.unary_stream(method)
                for _ in streaming(body, timeout=5, metadata=metadata):
                    break  # a first message is enough: the call was let in
                return "OK"
            unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(method)
            unary(body, timeout=5, metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            assert isinstance(e, grpc.Call)  # what a refused call raises is both
            return e.code().name


@pytest.mark.timeout(90)
def test_worker_ports_refuse_hostile_bytes_and_stay_healthy(cluster: Cluster, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    marker = tmp_path / "unpickled"
    assert cluster.decode.kv_endpoint is not None
    ports = {
        "decode grpc": cluster.decode.grpc_address,
        "prefill grpc": cluster.prefill.grpc_address,
        "decode kv": cluster.decode.kv_endpoint,
    }
    for name, address in ports.items():
        payloads = hostile_bytes(rng, marker) | (kv_hostile_bytes(rng) if name.endswith("kv") else {})
        for what, payload in payloads.items():
            poke(address, payload)
            assert not marker.exists(), f"{name}: {what} was unpickled"
        cluster.assert_healthy()

    # a well-formed handshake with a ticket the decode worker never gave out: an error frame, then the close
    reply = poke(cluster.decode.kv_endpoint, forged_handshake(rng), linger_s=2.0)
    assert len(reply) >= frame.HEADER_SIZE, reply
    answer = frame.decode_header(reply[: frame.HEADER_SIZE])
    assert answer.kind == frame.ERROR, answer

    # pickles as gRPC messages, with the right token: refused or read as protobuf, never unpickled
    good = ((TOKEN_KEY, cluster.token),)
    for w in cluster.workers:
        for method, stream in methods(w.role).items():
            call_raw(w.grpc_address, method, stream, pickle.dumps(Boom(marker)), good)
            assert not marker.exists(), f"{method} unpickled its message"
    cluster.assert_healthy()


@pytest.mark.timeout(60)
def test_worker_calls_without_the_right_token_are_unauthenticated(cluster: Cluster) -> None:
    t = cluster.token
    wrong: list[tuple[tuple[str, str | bytes], ...]] = [
        (),
        ((TOKEN_KEY, ""),),
        ((TOKEN_KEY, "forged"),),
        ((TOKEN_KEY, t[:-1]),),  # one character short
        ((TOKEN_KEY, t + "x"),),
        ((TOKEN_KEY, t.upper() if t.upper() != t else t.lower()),),
        ((TOKEN_KEY, " " + t),),
        (("x-splitserve-token-bin", t.encode()),),  # another key
        (("authorization", f"Bearer {t}"),),
    ]
    for w in cluster.workers:
        for method, stream in methods(w.role).items():
            for metadata in wrong:
                got = call_raw(w.grpc_address, method, stream, wpb.StatsRequest().SerializeToString(), metadata)
                assert got == "UNAUTHENTICATED", (method, metadata, got)
        get_stats = next(m for m in methods(w.role) if m.endswith("/GetStats"))
        assert call_raw(w.grpc_address, get_stats, False, b"", ((TOKEN_KEY, t),)) == "OK"  # the token lets it in
    cluster.assert_healthy()


@pytest.mark.timeout(60)
def test_worker_oversized_messages_are_refused(cluster: Cluster) -> None:
    big = bytes(5 << 20)  # past gRPC's default 4 MiB receive limit
    for w in cluster.workers:
        for method, stream in methods(w.role).items():
            with_token = call_raw(w.grpc_address, method, stream, big, ((TOKEN_KEY, cluster.token),))
            assert with_token == "RESOURCE_EXHAUSTED", (method, with_token)
            without = call_raw(w.grpc_address, method, stream, big, ())
            assert without in ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED"), (method, without)
    cluster.assert_healthy()


async def greedy_answers(s: aiohttp.ClientSession, channel: grpc.aio.Channel) -> tuple[str, str]:
    """One greedy request through each door (disaggregated: the prefill worker, the KV port, the decode worker)."""
    async with s.post("/v1/completions", json={"prompt": GREEDY, "max_tokens": 6, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        http_text: str = (await r.json())["choices"][0]["text"]
    stub = pbg.GenerationStub(channel)
    req = pb.GenerateRequest(text=GREEDY, sampling=pb.SamplingParams(max_tokens=6, temperature=0))
    grpc_text = "".join([r.text async for r in stub.Generate(req, timeout=60)])
    assert http_text and grpc_text == http_text
    return http_text, grpc_text


async def through_router(
    c: Cluster, body: Callable[[aiohttp.ClientSession, grpc.aio.Channel, Router], Awaitable[Any]]
) -> Any:
    async def inner(_: pbg.GenerationStub, router: Router) -> Any:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel,
            aiohttp.ClientSession(f"http://127.0.0.1:{router.http_port}") as s,
        ):
            return await body(s, channel, router)

    return await with_router(
        [c.decode],
        [c.prefill],
        c.tokenizer,
        inner,
        routing=RoutingConfig(mode="disaggregated"),
        listeners=Listeners(http_port=0, cluster_token=c.token),
        limits=ROUTER_LIMITS,
    )


@pytest.mark.timeout(60)
def test_after_the_hostile_bytes_a_generation_still_crosses_both_workers(cluster: Cluster) -> None:
    async def body(s: aiohttp.ClientSession, channel: grpc.aio.Channel, router: Router) -> tuple[str, str]:
        return await greedy_answers(s, channel)

    asyncio.run(through_router(cluster, body))
    wait_all_blocks_free(cluster.workers, token=cluster.token)
    cluster.assert_healthy()


# ---- (b) the public doors, fuzzed, in front of real workers


def server_error(status: str) -> bool:
    """A status that blames the server: gRPC INTERNAL or UNKNOWN, an HTTP 5xx (as a status or as a stream's
    error event), or a connection that broke under the client. Client-side timeouts are not."""
    if status in ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS"):
        return True
    code = status.removeprefix("stream-error-")
    if code.isdigit():
        return int(code) >= 500
    return status.startswith("client-") and status not in ("client-gone", "client-TimeoutError")


async def fuzz_door(one: Callable[[int], Awaitable[tuple[str, str]]], counts: Counter[str], bad: list[str]) -> None:
    end = time.monotonic() + FUZZ_BUDGET_S
    for start in range(0, FUZZ_CASES, CONCURRENCY):
        if time.monotonic() > end:
            break
        for status, what in await asyncio.gather(*(one(i) for i in range(start, min(start + CONCURRENCY, FUZZ_CASES)))):
            counts[status] += 1
            if server_error(status):
                bad.append(what)


@pytest.mark.timeout(120)
def test_fuzzed_public_requests_get_no_server_error_and_the_router_still_serves(cluster: Cluster) -> None:
    http: Counter[str] = Counter()
    rpc: Counter[str] = Counter()
    bad: list[str] = []

    async def body(s: aiohttp.ClientSession, channel: grpc.aio.Channel, router: Router) -> None:
        generate: grpc.aio.UnaryStreamMultiCallable[bytes, pb.GenerateResponse] = channel.unary_stream(
            "/splitserve.v1.Generation/Generate",
            request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        before = await greedy_answers(s, channel)
        await fuzz_door(lambda i: fuzz_http(s, i), http, bad)
        await fuzz_door(lambda i: fuzz_grpc(generate, i), rpc, bad)
        await until(lambda: router.generation.inflight == 0, timeout_s=30)
        async with s.get("/health") as r:
            assert r.status == 200
        assert await greedy_answers(s, channel) == before

    t0 = time.monotonic()
    asyncio.run(through_router(cluster, body))
    print(
        f"\nhostile fuzz: {time.monotonic() - t0:.1f}s\n"
        f"  HTTP: {dict(sorted(http.items()))}\n  gRPC: {dict(sorted(rpc.items()))}"
    )
    assert not bad, "\n".join(bad[:10])
    assert sum(http.values()) >= FUZZ_MIN_CASES and sum(rpc.values()) >= FUZZ_MIN_CASES, (http, rpc)
    wait_all_blocks_free(cluster.workers, token=cluster.token)
    cluster.assert_healthy()
