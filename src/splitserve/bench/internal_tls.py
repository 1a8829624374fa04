"""What the cluster's mutual TLS costs (runtime/tls.py ClusterTLS): plain and TLS side by side in
one run, on this machine's loopback.

    splitserve bench internal-tls [--size 256M] [--rounds 5] [--prompt-tokens 512] [--requests 20]
                                  [--results bench/results/internal-tls-cpu.txt]

- KV plane: a whole KV cache of the 8B shape (32 layers, 8 KV heads of 128, blocks of 16, bf16)
  through kv_transfer over loopback TCP, plain and under TLS, alternating round by round; the
  median GB/s of each and TLS / plain.
- TTFT: the embedded model on two clusters in this process, each a prefill worker, a decode worker
  and a router in disaggregated mode, one in plaintext and one under the cluster's TLS (router to
  workers and the KV plane); a prompt of --prompt-tokens, the requests alternating between the two;
  the median time to first token of each and TLS / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import TYPE_CHECKING

import grpc
import torch

from splitserve.bench.results_file import with_results
from splitserve.bench.transfer_timing import whole_cache_seconds
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer.tcp import TCPTransport
from splitserve.measure.hw import machine_line
from splitserve.runtime.tls import ClusterTLS, make_cluster_tls

if TYPE_CHECKING:
    from splitserve.workers.server import RunningWorker

EIGHT_B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=lambda s: int(s.rstrip("M")) << 20, default=256 << 20, help="KV bytes (e.g. 256M)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the KV figure")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--requests", type=int, default=20, help="requests to each cluster, alternating")
    p.add_argument("--results", default=None, help="also write the output here")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    print(
        f"# splitserve bench internal-tls --size {args.size >> 20}M --rounds {args.rounds} "
        f"--prompt-tokens {args.prompt_tokens} --requests {args.requests}"
    )
    print(f"# {machine_line()}")
    cluster = make_cluster_tls()
    _kv_plane(cluster, args.size, args.rounds)
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
