"""What the cluster's mutual TLS costs (runtime/tls.py ClusterTLS): plain and TLS side by side in
one run, on this machine's loopback.

    splitserve bench internal-tls [--size 256M] [--rounds 5] [--prompt-tokens 512] [--requests 20]
                                  [--netns-gbps 1.0] [--results bench/results/internal-tls-cpu.txt]

- KV plane: a whole KV cache of the 8B shape (32 layers, 8 KV heads of 128, blocks of 16, bf16)
  through kv_transfer over loopback TCP, plain and under TLS, alternating round by round; the
  median GB/s of each and TLS / plain.
- KV plane across a throttled link (bench/transfer_link.py: a network namespace behind a veth
  pair shaped with tc, root only; skipped and said so without it): a sender process inside the
  namespace moves --size over the cluster's TCP transport, plain and sealed, to a receiver here,
  alternating round by round; the median Gb/s of each against the link's rate.
- TTFT: the embedded model on two clusters in this process, each a prefill worker, a decode worker
  and a router in disaggregated mode, one in plaintext and one under the cluster's TLS (router to
  workers and the KV plane); a prompt of --prompt-tokens, the requests alternating between the two;
  the median time to first token of each and TLS / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import grpc
import torch

from splitserve.bench.results_file import with_results
from splitserve.bench.transfer_timing import whole_cache_seconds
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Connection
from splitserve.measure.hw import machine_line
from splitserve.runtime.tls import ClusterTLS, make_cluster_tls, save_cluster_tls

if TYPE_CHECKING:
    from splitserve.bench.transfer_link import ThrottledLink
    from splitserve.workers.server import RunningWorker

EIGHT_B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=lambda s: int(s.rstrip("M")) << 20, default=256 << 20, help="KV bytes (e.g. 256M)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the KV figure")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--requests", type=int, default=20, help="requests to each cluster, alternating")
    p.add_argument("--netns-gbps", type=float, default=1.0, help="the throttled link's rate (0: skip it)")
    p.add_argument("--results", default=None, help="also write the output here")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    print(
        f"# splitserve bench internal-tls --size {args.size >> 20}M --rounds {args.rounds} "
        f"--prompt-tokens {args.prompt_tokens} --requests {args.requests} --netns-gbps {args.netns_gbps:g}"
    )
    print(f"# {machine_line()}")
    cluster = make_cluster_tls()
    _kv_plane(cluster, args.size, args.rounds)
    if args.netns_gbps:
        _kv_link(cluster, args.netns_gbps, args.size, args.rounds)
    asyncio.run(_ttft(cluster, args.prompt_tokens, args.requests))
    return 0


def _kv_plane(cluster: ClusterTLS, size: int, rounds: int) -> None:
    blocks = max(1, size // (EIGHT_B.bytes_per_block * EIGHT_B.num_layers))  # bytes_per_block: one layer's
    src, dst = KVCache(EIGHT_B, blocks), KVCache(EIGHT_B, blocks)
    src.tensor.copy_(torch.randn(src.tensor.shape).to(src.tensor.dtype))
    tls = (
        TCPTransport(server_tls=cluster.ssl_context(server_side=True)),
        TCPTransport(client_tls=cluster.ssl_context(server_side=False)),
    )
    gbs: dict[str, list[float]] = {"plain": [], "tls": []}
    for _ in range(rounds):  # as the workers run each: plain with the frame checksum, TLS (GCM's tag) without
        for name, tcp, checksum in (("plain", None, "lanesum"), ("tls", tls, "none")):
            gbs[name].append(src.nbytes / whole_cache_seconds("tcp", src, dst, checksum, tcp) / 1e9)
    plain, enc = statistics.median(gbs["plain"]), statistics.median(gbs["tls"])
    print(f"\n## KV plane: {src.nbytes / 2**20:.0f} MiB of the 8B shape over loopback TCP, {rounds} rounds")
    print(f"plain {plain:.2f} GB/s, TLS {enc:.2f} GB/s: TLS / plain {enc / plain:.2f} (target >= 0.8)")


# The sender inside the namespace: its arguments host, port, size, TLS folder ("": plain) and buffer
# bytes; it sends size bytes in buffers of that size over the cluster's TCP transport
# (sealed when given the cluster's files), then it waits for the receiver's one-byte ack.
_LINK_SENDER = """
import sys
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.kv_transfer.transport import Connection
from splitserve.runtime.tls import load_cluster_tls
host, port, size, tls_dir, buffer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
tls = load_cluster_tls(tls_dir).ssl_context(server_side=False) if tls_dir else None
conn = TCPTransport(client_tls=tls).connect(host, port, 30)
buf = bytearray(buffer)
for _ in range(size // len(buf)):
    conn.send([buf])
conn.recv_into(bytearray(1))
conn.close()
"""
LINK_BUFFER = 8 << 20


def _kv_link(cluster: ClusterTLS, gbps: float, size: int, rounds: int) -> None:
    from splitserve.bench.transfer_link import LinkError, ThrottledLink, net_admin_refusal

    print(
        f"\n## KV plane across a link shaped to {gbps:g} Gb/s (a network namespace), {size >> 20} MiB, {rounds} rounds"
    )
    refusal = net_admin_refusal()
    if refusal is not None:
        print(f"skipped: {refusal}")
        return
    size -= size % LINK_BUFFER
    got: dict[str, list[float]] = {"plain": [], "tls": []}
    with tempfile.TemporaryDirectory(prefix="splitserve-tls-link-") as tls_dir:
        save_cluster_tls(cluster, tls_dir)
        try:
            with ThrottledLink(gbps) as link:
                for _ in range(rounds):
                    for name in ("plain", "tls"):
                        tls = cluster.ssl_context(server_side=True) if name == "tls" else None
                        got[name].append(_link_round(link, tls, tls_dir if name == "tls" else "", size))
        except LinkError as e:
            print(f"skipped: {e}")
            return
    plain, enc = statistics.median(got["plain"]), statistics.median(got["tls"])
    print(f"plain {plain:.3f} Gb/s, TLS {enc:.3f} Gb/s ({enc / gbps:.2f} of the link): TLS / plain {enc / plain:.2f}")


def _link_round(link: ThrottledLink, tls: ssl.SSLContext | None, tls_dir: str, size: int) -> float:
    """One transfer from inside the namespace to here: Gb/s from the connection's first byte to its last."""
    done: queue.Queue[float | BaseException] = queue.Queue()

    def receive(conn: Connection) -> None:
        try:
            buf = bytearray(LINK_BUFFER)
            conn.recv_into(buf)
            t = time.perf_counter()
            for _ in range(size // LINK_BUFFER - 1):
                conn.recv_into(buf)
            done.put(time.perf_counter() - t)
            conn.send([b"k"])
        except BaseException as e:
            done.put(e)

    listener = TCPTransport(server_tls=tls).listen(link.outer_host, 0, receive)
    cmd = [*link.exec_prefix, sys.executable, "-c", _LINK_SENDER, link.outer_host, str(listener.port), str(size)]
    sender = subprocess.run([*cmd, tls_dir, str(LINK_BUFFER)], capture_output=True, text=True, timeout=600)
    listener.close()
    if sender.returncode:
        raise RuntimeError(f"the sender inside the namespace failed: {sender.stderr[-2000:]}")
    seconds = done.get(timeout=60)
    if isinstance(seconds, BaseException):
        raise seconds
    return (size - LINK_BUFFER) * 8 / seconds / 1e9


async def _ttft(cluster: ClusterTLS, prompt_tokens: int, requests: int) -> None:
    from splitserve.engine.weights import load_tokenizer
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as gpb_grpc
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router

    tokenizer = load_tokenizer(None)
    prompt = list(range(1000, 1000 + prompt_tokens))
    routers, workers = {}, []
    for name, tls in (("plain", None), ("tls", cluster)):
        d, p = _worker("decode", tls), _worker("prefill", tls)
        workers += [d, p]
        cfg = RouterConfig(
            listeners=Listeners(grpc_port=0, internal_tls=tls), routing=RoutingConfig(mode="disaggregated")
        )
        router = Router(cfg, EngineTokenizer(tokenizer), decode=[d.grpc_address], prefill=[p.grpc_address])
        await router.start()
        await router.wait_for_workers(60)
        routers[name] = router
    ttft: dict[str, list[float]] = {"plain": [], "tls": []}
    try:
        for i in range(requests + 1):  # the first round warms both up and is not counted
            for name, router in routers.items():
                async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                    stub = gpb_grpc.GenerationStub(ch)
                    req = pb.GenerateRequest(request_id=f"{name}-{i}", token_ids=pb.TokenIds(ids=prompt))
                    req.sampling.max_tokens = 2
                    t = time.perf_counter()
                    call = stub.Generate(req)
                    await call.read()
                    if i:
                        ttft[name].append(time.perf_counter() - t)
                    call.cancel()
    finally:
        for router in routers.values():
            await router.stop()
        for w in workers:
            w.stop()
    plain, enc = statistics.median(ttft["plain"]), statistics.median(ttft["tls"])
    print(f"\n## TTFT: the embedded model, a {prompt_tokens}-token prompt prefilled remotely, {requests} each")
    print(f"plain {plain * 1e3:.0f} ms, TLS {enc * 1e3:.0f} ms: TLS / plain {enc / plain:.3f} (target <= 1.05)")


def _worker(role: str, tls: ClusterTLS | None) -> RunningWorker:
    from splitserve.engine.config import EngineConfig
    from splitserve.workers.common.config import WorkerConfig
    from splitserve.workers.server import start_worker

    engine = EngineConfig(dtype="float32", num_blocks=256, max_num_batched_tokens=512)
    return start_worker(WorkerConfig(role=role, engine=engine, internal_tls=tls, threads=1))
