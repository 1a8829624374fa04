"""`splitserve bench ray-nodes`: the pools on a real multi-node Ray cluster, grown under a burst from
standby and then short of a whole node, with the KV crossing a shaped link between network
namespaces.

The cluster (bench/ray_netns.py): a head holding no worker, two prefill nodes inside a network
namespace and two decode nodes outside it, each node a `ray start` of its own with an address of
its own; the veth pair between the namespace and the rest is shaped to `--gbps` both ways, so every
prompt's KV (prefill node to decode node) crosses it. The real Router (disaggregated: every prompt
prefilled remotely) and PoolManager run in this process with the joint controller
(cluster/joint.py) for `--slo-ttft-ms` and `--slo-itl-ms`, each pool between 1 and 2 routed
workers, with one standby worker each; the workers (Ray actors, `--worker-host auto`) run the
embedded SmolLM2 in float32 on one torch thread each.

The client, in this process too, sends distinct random prompts open-loop: Poisson arrivals at
`--rate` a second, `--burst-factor` times that during the burst, then back (`--phases`). At
`--kill-at-s` the prefill node of a routed prefill worker is killed whole (its raylet and every
worker on it, SIGKILL). Reported:

- the growth: when each pool first had two routed workers, counted from the burst's start, and
  how many of its grows came from standby;
- the loss: requests that failed (target 0) and answers that differ from the single-process
  engine's greedy tokens (target 0); the time until the prefill pool had two routed workers
  again; after the load, the time until every worker's KV pool was whole (target under 1 s);
- the link: its bytes while the load ran.

    sudo splitserve bench ray-nodes [--gbps 1] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from splitserve.bench.autoscale import arrivals
from splitserve.bench.mocker_fidelity import Request
from splitserve.bench.results_file import with_results

log = logging.getLogger(__name__)

TARGET_BLOCKS_BACK_S = 1.0
# an answer that parts from the single-process engine's where the engine's two best tokens are this
# close is a near tie turned by float32 rounding, not a token lost or garbled on the way
NEAR_TIE_NATS = 0.01
NUM_BLOCKS = 1024
BLOCKS_TIMEOUT_S = 30.0
START_TIMEOUT_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gbps", type=float, default=1.0, help="the shaped link between the namespaces, Gb/s")
    p.add_argument("--rate", type=float, default=0.1, help="requests a second outside the burst")
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--phases", default="20,30,20", help="seconds before, during and after the burst")
    p.add_argument("--kill-at-s", type=float, default=45.0, help="when the prefill node is killed, from the start")
    p.add_argument("--prompt-tokens", default="100:300", help="LO:HI, uniform")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-itl-ms", type=float, default=60.0)
    p.add_argument(
        "--decode-tokens-per-worker",
        type=int,
        default=1024,
        help="the joint controller's first guess of a decode worker's context",
    )
    p.add_argument("--interval-s", type=float, default=2.0, help="the joint controller's reading interval")
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    p.set_defaults(arrivals="poisson", gamma_shape=0.5)


@dataclass
class Answer:
    at_s: float
    tokens: list[int]
    error: str | None = None


@dataclass
class Watch:
    """What the pools did, each moment noted from the load's start."""

    two: dict[str, float] = field(default_factory=dict)  # role -> first moment with two routed workers
    killed_at: float | None = None
    killed: str = ""  # the node, and the workers on it
    lost_addresses: set[str] = field(default_factory=set)  # the killed node's workers
    back_at: float | None = None  # the prefill pool routed two workers again
    standby_grows: dict[str, int] = field(default_factory=dict)
    link_bytes: int = 0
    blocks_back_s: float | None = None


def run(args: argparse.Namespace) -> int:
    from splitserve.bench.transfer_link import net_admin_refusal

    refusal = net_admin_refusal()
    if refusal is not None:
        print(f"splitserve bench ray-nodes: {refusal}", flush=True)
        return 2
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's own plane under token auth, as serve starts it
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from splitserve.bench.ray_netns import NetnsRayCluster

    requests = arrivals(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for name in ("splitserve.cluster.pool", __name__):
        logging.getLogger(name).setLevel(logging.INFO)  # each grow, switch and replacement, and why
    with NetnsRayCluster(args.gbps) as c:
        for name, inside, node_type in (
            ("prefill-a", True, "prefill_node"),
            ("prefill-b", True, "prefill_node"),
            ("decode-a", False, "decode_node"),
            ("decode-b", False, "decode_node"),
        ):
            c.add(name, inside, cpus=2, resources={node_type: 2})
        answers, watch = asyncio.run(_scenario(args, c, requests))
    wrong = _wrong(requests, answers, args.output_tokens)
    _report(args, c, answers, watch, wrong)
    lost = sum(a.error is not None for a in answers)
    ok = (
        lost == 0
        and all(x.margin < NEAR_TIE_NATS for x in wrong)
        and watch.blocks_back_s is not None
        and watch.blocks_back_s < TARGET_BLOCKS_BACK_S
    )
    return 0 if ok and len(watch.two) == 2 else 1


async def _scenario(args: argparse.Namespace, c: Any, requests: list[Request]) -> tuple[list[Answer], Watch]:
    router, port, pools = await _start_pools(args)
    watch = Watch()
    try:
        rx = _link_bytes(c)
        start = time.monotonic()
        burst_at = float(args.phases.split(",")[0])
        watcher = asyncio.ensure_future(_watch_pools(pools, router, start, burst_at, watch))
        killer = asyncio.ensure_future(_kill_prefill_node(args.kill_at_s, c, pools, start, watch))
        answers = await _drive(port, requests, args.output_tokens, start)
        last_end = time.monotonic()
        await killer
        watcher.cancel()
        log.info(
            "at the end: prefill %s routable, %s lost",
            [w.address for w in router.workers.healthy("prefill")],
            sorted(watch.lost_addresses),
        )
        watch.link_bytes = _link_bytes(c) - rx
        watch.blocks_back_s = await _blocks_back(router, last_end)
        watch.standby_grows = {role: len(pools.activations[role]) for role in ("prefill", "decode")}
        return answers, watch
    finally:
        await pools.stop()
        await router.stop(0)


async def _start_pools(args: argparse.Namespace) -> tuple[Any, int, Any]:
    from splitserve.cluster.joint import JointConfig
    from splitserve.cluster.pool import PoolManager, PoolSpec
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router
    from splitserve.workers.common.config import WorkerConfig

    token = secrets.token_urlsafe(16)
    engine = EngineConfig(dtype="float32", num_blocks=NUM_BLOCKS)

    def spec(role: Any, node_type: str) -> PoolSpec:
        # raw KV on the wire: "auto" turns the lossy int8 codec on for a slow link, and the answers
        # are checked token for token against the single-process engine
        worker = WorkerConfig(
            role=role, engine=engine, host="auto", cluster_token=token, threads=1, kv_wire_codec="raw"
        )
        return PoolSpec(role, 1, worker, 1.0, resources={node_type: 1.0}, standby=1)

    cfg = RouterConfig(
        routing=RoutingConfig(mode="disaggregated"),
        listeners=Listeners(host="127.0.0.1", grpc_port=0, cluster_token=token),
    )
    router = Router(cfg, EngineTokenizer(load_tokenizer(None)))
    port = await router.start()
    controller = JointConfig(
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_itl_s=args.slo_itl_ms / 1e3,
        prefill_max=2,
        decode_max=2,
        decode_tokens_per_worker=args.decode_tokens_per_worker,
        interval_s=args.interval_s,
    )
    specs = [spec("prefill", "prefill_node"), spec("decode", "decode_node")]
    pools = PoolManager(specs, router.workers, START_TIMEOUT_S, metrics=router.metrics, controller=controller)
    try:
        await pools.start()
        await router.wait_for_workers(START_TIMEOUT_S)
    except BaseException:
        await pools.stop()
        await router.stop(0)
        raise
    return router, port, pools


async def _drive(port: int, requests: list[Request], output_tokens: int, start: float) -> list[Answer]:
    """Every request at its moment, greedy; its tokens or its error."""
    import grpc

    from splitserve.bench.router_load import generated, own_channels
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg

    channels = own_channels(f"127.0.0.1:{port}", 4)
    stubs = [pbg.GenerationStub(ch) for ch in channels]

    async def one(i: int, r: Request) -> Answer:
        await asyncio.sleep(max(0.0, start + r.at_s - time.monotonic()))
        try:
            tokens = await generated(stubs[i % len(stubs)], f"ray-nodes-{i}", r.prompt, output_tokens, timeout_s=300)
        except grpc.aio.AioRpcError as e:
            return Answer(r.at_s, [], f"{e.code().name}: {e.details()}")
        return Answer(r.at_s, tokens)

    try:
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
    finally:
        for ch in channels:
            await ch.close()


async def _watch_pools(pools: Any, router: Any, start: float, burst_at: float, watch: Watch) -> None:
    """Every 50 ms: when each pool first routes two workers (from the burst's start), and when the
    prefill pool routes two again after the kill."""
    while True:
        now = time.monotonic() - start
        for role in ("prefill", "decode"):
            if len(router.workers.healthy(role)) >= 2:
                watch.two.setdefault(role, now - burst_at)
        if watch.killed_at is not None and watch.back_at is None:
            alive = [w for w in router.workers.healthy("prefill") if w.address not in watch.lost_addresses]
            if len(alive) >= 2:
                watch.back_at = now - watch.killed_at
        await asyncio.sleep(0.05)


async def _kill_prefill_node(at_s: float, c: Any, pools: Any, start: float, watch: Watch) -> None:
    """At `at_s`, the node of the first routed prefill worker, whole."""
    await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
    (first, *_) = [m for m in pools.members["prefill"] if not m.draining]
    node = c.node_of_ip(first.grpc_address.rsplit(":", 1)[0])
    on = [
        m
        for ms in (*pools.members.values(), *pools.standby.values())
        for m in ms
        if m.grpc_address.startswith(node.ip + ":")
    ]
    watch.lost_addresses = {m.grpc_address for m in on}
    watch.killed_at = time.monotonic() - start
    c.kill(node.name)
    watch.killed = f"{node.name} ({node.ip}), holding {', '.join(m.worker_id for m in on)}"


async def _blocks_back(router: Any, since: float) -> float | None:
    """Seconds from `since` until every routed worker reports its whole KV pool free (None: not within
    BLOCKS_TIMEOUT_S). Asked of the workers themselves, not the router's last poll."""
    import grpc

    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc

    metadata = router.cfg.listeners.auth_metadata
    while time.monotonic() - since < BLOCKS_TIMEOUT_S:
        whole = True
        for w in router.workers.all():
            async with grpc.aio.insecure_channel(w.address) as ch:
                stub = wgrpc.DecodeWorkerStub(ch) if w.role == "decode" else wgrpc.PrefillWorkerStub(ch)
                st = await stub.GetStats(wpb.StatsRequest(), timeout=5, metadata=metadata)
            whole = whole and st.free_blocks == st.total_blocks
        if whole:
            return time.monotonic() - since
        await asyncio.sleep(0.02)
    return None


def _link_bytes(c: Any) -> int:
    """Bytes through the link's outer end, both ways (the kernel's counters)."""
    base = f"/sys/class/net/{c.link.outer_dev}/statistics"
    return sum(int(open(f"{base}/{d}_bytes").read()) for d in ("rx", "tx"))


class Wrong(NamedTuple):
    request: int  # its index
    want: list[int]  # the single-process engine's tokens
    margin: float  # at the first difference, the engine's top token's logprob over the answer's (nats)


def _wrong(requests: list[Request], answers: list[Answer], output_tokens: int) -> list[Wrong]:
    """The answered requests whose tokens are not the single-process engine's greedy ones, each with
    the margin by which the engine preferred its own token where they part: float32 sums taken in
    another order (another batch, another chunking) can turn a near tie the other way."""
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.sampling import SamplingParams
    from splitserve.engine.weights import load_model

    model = load_model(None, torch.float32, progress=False)
    engine = Engine(model.config, model.weights, EngineConfig(dtype="float32", num_blocks=NUM_BLOCKS * 4))
    answered = [i for i, a in enumerate(answers) if a.error is None]
    want = engine.generate(
        [requests[i].prompt for i in answered], SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    )
    out = []
    for i, w in zip(answered, want, strict=True):
        got = answers[i].tokens
        if got != w:
            k = next((j for j, (x, y) in enumerate(zip(got, w, strict=False)) if x != y), min(len(got), len(w)))
            margin = _margin(engine, requests[i].prompt + got[:k], got[k]) if k < len(got) else math.inf
            out.append(Wrong(i, w, margin))
    return out


def _margin(engine: Any, context: list[int], token: int) -> float:
    """How many nats the engine's most likely next token after `context` is above `token` (inf: not
    among its 5 most likely)."""
    from splitserve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5)
    engine.add_request("margin", context, params)
    outs = [o for _ in range(10_000) if engine.has_work for o in engine.step()]
    (lp,) = [o.logprob for o in outs if o.logprob is not None]
    top = dict(lp.top)
    return lp.top[0][1] - top[token] if token in top else math.inf


def _report(args: argparse.Namespace, c: Any, answers: list[Answer], watch: Watch, wrong: list[Wrong]) -> None:
    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        f"ray-nodes: a Ray cluster of 5 nodes on this machine (a head; 2 prefill nodes in a network namespace, "
        f"2 decode nodes outside; the link between shaped to {args.gbps:g} Gb/s both ways), the real Router and "
        f"PoolManager (joint controller, each pool 1 to 2 workers, 1 standby each), the embedded SmolLM2 "
        f"(float32, one thread a worker); {len(answers)} requests, Poisson {args.rate:g}/s, x{args.burst_factor:g} "
        f"during the burst (phases {args.phases} s), {args.prompt_tokens} prompt tokens, {args.output_tokens} out"
    )
    print()
    for role in ("prefill", "decode"):
        at = watch.two.get(role)
        when = f"{at:.1f} s after the burst began" if at is not None else "never"
        print(f"{role} pool at 2 workers: {when} ({watch.standby_grows.get(role, 0)} grows from standby)")
    print(f"node killed at {watch.killed_at or 0:.1f} s: {watch.killed}")
    back = f"{watch.back_at:.1f} s" if watch.back_at is not None else "never"
    print(f"prefill pool at 2 workers again after {back}")
    lost = sum(a.error is not None for a in answers)
    for a in [a for a in answers if a.error is not None][:5]:
        print(f"  failed, sent at {a.at_s:.1f} s: {a.error}")
    blocks = f"{watch.blocks_back_s:.2f} s" if watch.blocks_back_s is not None else f"not within {BLOCKS_TIMEOUT_S:g} s"
    print(f"KV across the link: {watch.link_bytes / 2**20:.0f} MiB")
    for x in wrong[:5]:
        print(
            f"  differs, sent at {answers[x.request].at_s:.1f} s: {answers[x.request].tokens}, the engine's {x.want}: "
            f"the engine's token {x.margin:.4f} nats above the answer's where they part"
        )
    print()
    ties = sum(x.margin < NEAR_TIE_NATS for x in wrong)
    print(
        f"lost {lost} of {len(answers)} requests, {len(wrong) - ties} wrong answers (against the single-process "
        f"engine; {ties} more differ at a near tie, under {NEAR_TIE_NATS:g} nats), blocks back {blocks} after the "
        f"last answer (target under {TARGET_BLOCKS_BACK_S:g} s)"
    )
