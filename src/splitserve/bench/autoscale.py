"""`splitserve bench autoscale`: pools under a 1x to 4x burst, each scaling policy against the
SLOs it costs: fixed pools, today's queue-depth policy (each pool on its own queue), and the joint
controller with standby workers (cluster/joint.py, cluster/pool.py).

The control plane is the real one: the Router and the PoolManager, its watch, its scale loops or
its joint controller, in this process on one core. The workers are mockers (bench/mocker/: the
real worker services, steps timed by the planner's roofline of a deployment, by default
llama-3-70b on H100s), all started at once in a fleet process on the other core, and handed out
by a launcher (cluster/launcher.py's interface) that makes every start after the first wait
`--cold-start-s` (a process start and a model load, modelled: measured here, SmolLM2 took 4 s and
an 8B Q4 file 56 s on two CPU cores; llm-d reports pods starting in about 100 s). A standby
worker was started before the load, so the pool takes it at once. The client, a third process
sharing the fleet's core, sends an open-loop load: Poisson arrivals at `--rate` requests a
second, `--burst-factor` times that for the burst phase, then back (`--phases` seconds each);
`--arrivals gamma` draws the gaps from a Gamma distribution of shape `--gamma-shape` instead (below
1: burstier than Poisson; BurstGPT, arXiv 2401.17644, models its Azure OpenAI traces' arrivals
with Gamma distributions).

For each policy: SLO attainment (requests whose TTFT and mean inter-token time both meet the
SLOs), the worker-seconds it paid (routed, starting and standby workers, sampled every 0.5 s),
and how long after the burst began the SLOs held again (the first moment from which every
`RECOVERY_WINDOW_S` of arrivals meets them for 90% of requests).

    splitserve bench autoscale [--policies fixed,queue,joint] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from splitserve.bench.autoscale_plan import (
    RECOVERED_SHARE,
    RECOVERY_WINDOW_S,
    SAMPLE_S,
    Outcome,
    Record,
    Role,
    pool_plan,
)
from splitserve.bench.mocker.cluster import serve_mockers
from splitserve.bench.mocker.main import add_costs_arguments
from splitserve.bench.mocker_fidelity import Request, token_times
from splitserve.bench.results_file import with_results
from splitserve.bench.router import STARTUP_TIMEOUT_S, pct, start_process
from splitserve.bench.router_load import own_channels

POLICIES = ("fixed", "queue", "joint")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}, comma-separated")
    p.add_argument("--prefill-workers", type=int, default=3, help="prefill workers at start (every policy)")
    p.add_argument("--decode-workers", type=int, default=1, help="decode workers at start (every policy)")
    p.add_argument("--prefill-max", type=int, default=96, help="prefill mockers in the fleet: the pool's most")
    p.add_argument("--decode-max", type=int, default=32, help="decode mockers in the fleet: the pool's most")
    p.add_argument("--standby", default="6:1", help="joint: PREFILL:DECODE workers on standby")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=80.0)
    p.add_argument("--rate", type=float, default=6.0, help="requests a second outside the burst")
    p.add_argument("--burst-factor", type=float, default=4.0)
    p.add_argument("--phases", default="20,40,20", help="seconds before, during and after the burst")
    p.add_argument("--arrivals", default="poisson", choices=("poisson", "gamma"))
    p.add_argument("--gamma-shape", type=float, default=0.5, help="--arrivals gamma: the gaps' shape (CV 1/sqrt)")
    p.add_argument("--prompt-tokens", default="512:1536", help="LO:HI, uniform")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--cold-start-s", type=float, default=30.0, help="a worker's start that no standby covers")
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")
    p.add_argument(
        "--fleet",
        default="mockers",
        choices=("mockers", "sim"),
        help="mockers: the real control plane over mocker workers; sim: the plan simulator (plan/sim/), "
        "the same policies' arithmetic, at fleet sizes one machine cannot host",
    )
    add_costs_arguments(p)
    p.set_defaults(model_shape="llama-3-70b", max_num_seqs=128)


def arrivals(args: argparse.Namespace) -> list[Request]:
    """The load: its phases' rates, Poisson or Gamma gaps, uniform prompt lengths."""
    lo, hi = (int(x) for x in args.prompt_tokens.split(":"))
    phases = [float(x) for x in args.phases.split(",")]
    rates = [args.rate, args.rate * args.burst_factor, args.rate]
    rng = random.Random(args.seed)
    out, start = [], 0.0
    for length, rate in zip(phases, rates, strict=True):
        t = start
        while True:
            if args.arrivals == "gamma":
                t += rng.gammavariate(args.gamma_shape, 1.0 / (rate * args.gamma_shape))
            else:
                t += rng.expovariate(rate)
            if t >= start + length:
                break
            out.append(Request(t, [rng.randrange(256) for _ in range(rng.randint(lo, hi))]))
        start += length
    return out


def client(conn: Any, address: str, requests: list[Request], output_tokens: int, cpu: int | None) -> None:
    """The client's process: every request at its time; sends back a Record each."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    conn.send(asyncio.run(_drive(address, requests, output_tokens)))


async def _drive(address: str, requests: Sequence[Request], output_tokens: int) -> list[Record]:
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc

    channels = own_channels(address, 8)
    stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
    start = time.monotonic()

    async def one(i: int, r: Request) -> Record:
        await asyncio.sleep(max(0.0, start + r.at_s - time.monotonic()))
        sent = time.monotonic()
        try:
            stamps = await token_times(stubs[i % len(stubs)], r.prompt, output_tokens, 600)
        except grpc.aio.AioRpcError as e:
            print(f"autoscale client: request at {r.at_s:.1f} s failed: {e.code().name} {e.details()}", flush=True)
            return Record(r.at_s, math.inf, math.inf)
        if len(stamps) < 2:
            return Record(r.at_s, math.inf, math.inf)
        return Record(r.at_s, stamps[0] - sent, (stamps[-1] - stamps[0]) / (len(stamps) - 1))

    out = list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
    for c in channels:
        await c.close()
    return out


class MockerLauncher:
    """Hands the pool manager mocker workers from a started fleet: each start after `warm()` waits
    the modelled cold start first."""

    def __init__(self, fleet: dict[str, list[str]]) -> None:
        self.idle = {role: list(fleet[role]) for role in ("prefill", "decode")}
        self._role_of = {address: role for role in ("prefill", "decode") for address in fleet[role]}
        self.cold_start_s = 0.0

    async def start(self, spec: Any, cfg: Any, timeout_s: float) -> tuple[Any, str, str | None]:
        await asyncio.sleep(self.cold_start_s)
        if not self.idle[spec.role]:
            raise RuntimeError(f"no {spec.role} mocker left in the fleet")
        address = self.idle[spec.role].pop(0)
        return address, address, None

    async def ping(self, handle: Any) -> None:
        return None

    async def stop(self, handle: Any) -> None:
        return None

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        return None  # the fleet is all started

    def kill(self, handle: Any) -> None:
        """Back to the fleet's idle ones (a drained mocker, or one whose start was cancelled)."""
        idle = self.idle[self._role_of[handle]]
        if handle not in idle:
            idle.append(handle)


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    if not set(policies) <= set(POLICIES):
        print(f"splitserve bench autoscale: --policies takes {', '.join(POLICIES)}", flush=True)
        return 2
    requests = arrivals(args)
    if args.fleet == "sim":
        from splitserve.bench.autoscale_sim import simulated

        outcomes, line = simulated(args, policies, requests)
    else:
        outcomes, line = [], ""
        for policy in policies:
            outcome, line = _one(args, policy, requests)
            outcomes.append(outcome)
    print_report(args, outcomes, requests, line)
    return 0


def _one(args: argparse.Namespace, policy: str, requests: list[Request]) -> tuple[Outcome, str]:
    cpus = sorted(os.sched_getaffinity(0))
    here, there = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    ns = argparse.Namespace(**{**vars(args), "prefill_workers": args.prefill_max, "decode_workers": args.decode_max})
    fleet_proc, fleet_conn = start_process(serve_mockers, ns, there)
    try:
        if not fleet_conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the mocker fleet did not start")
        fleet = fleet_conn.recv()
        if here is not None:
            os.sched_setaffinity(0, {here})
        try:
            return asyncio.run(_control(args, policy, requests, fleet, there)), fleet["line"]
        finally:
            os.sched_setaffinity(0, set(cpus))
    finally:
        fleet_conn.send("done")
        fleet_proc.join(10)
        if fleet_proc.is_alive():
            fleet_proc.kill()


async def _control(
    args: argparse.Namespace, policy: str, requests: list[Request], fleet: dict, client_cpu: int | None
) -> Outcome:
    """The Router and the PoolManager of `policy` over the fleet, the load driven at them."""
    import logging

    from splitserve.cluster.pool import PoolManager, PoolSpec
    from splitserve.engine.config import EngineConfig
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.server import Router
    from splitserve.router.tokenizer import ByteTokenizer
    from splitserve.workers.common.config import WorkerConfig

    logging.disable(logging.WARNING)
    cfg = RouterConfig(routing=RoutingConfig(mode="disaggregated"), listeners=Listeners(grpc_port=0))
    router = Router(cfg, ByteTokenizer(), rng=random.Random(0))
    port = await router.start()
    launcher = MockerLauncher(fleet)
    plan = pool_plan(args, policy)

    def spec(role: Role) -> PoolSpec:
        worker = WorkerConfig(role=role, engine=EngineConfig())
        return PoolSpec(role, plan.starts[role], worker, scaling=plan.scaling[role], standby=plan.standby[role])

    pools = PoolManager(
        [spec("prefill"), spec("decode")],
        router.workers,
        metrics=router.metrics,
        controller=plan.controller,
        launcher=launcher,
        watch_interval_s=5.0,
    )
    await pools.start()
    await router.wait_for_workers(60)
    launcher.cold_start_s = args.cold_start_s
    proc, conn = start_process(client, f"127.0.0.1:{port}", requests, args.output_tokens, client_cpu)
    peak = [0, 0]
    paid = 0.0
    loop = asyncio.get_running_loop()
    try:
        while not conn.poll():
            await asyncio.sleep(SAMPLE_S)
            routed = [sum(not m.draining for m in pools.members[r]) for r in ("prefill", "decode")]
            peak = [max(a, b) for a, b in zip(peak, routed, strict=True)]
            held = sum(len(pools.members[r]) + pools.pending[r] + len(pools.standby[r]) for r in ("prefill", "decode"))
            paid += held * SAMPLE_S
        records = await loop.run_in_executor(None, conn.recv)
    finally:
        proc.join(10)
        await pools.stop()
        await router.stop(0)
    burst_at = float(args.phases.split(",")[0])
    return Outcome(policy, records, paid, (peak[0], peak[1]), burst_at, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)


def print_report(args: argparse.Namespace, outcomes: list[Outcome], requests: list[Request], fleet_line: str) -> None:
    from splitserve.measure.hw import machine_line

    phases = [float(x) for x in args.phases.split(",")]
    gaps = (
        f"Gamma gaps of shape {args.gamma_shape:g} (the model BurstGPT, arXiv 2401.17644, fits to Azure OpenAI traces)"
        if args.arrivals == "gamma"
        else "Poisson arrivals"
    )
    plane = (
        "the policies' own arithmetic (cluster/scaling.py, cluster/joint.py) in simulated time"
        if args.fleet == "sim"
        else "the real Router and PoolManager (one core)"
    )
    print(machine_line())
    print(
        f"autoscale: {plane} over a fleet of {fleet_line.removeprefix('over ')}; "
        f"{len(requests)} requests, {gaps}: {args.rate:g} req/s for {phases[0]:g} s, {args.rate * args.burst_factor:g} "
        f"req/s ({args.burst_factor:g}x) for {phases[1]:g} s, {args.rate:g} req/s for {phases[2]:g} s; prompts "
        f"{args.prompt_tokens} tokens, {args.output_tokens} out; pools start at {args.prefill_workers} prefill + "
        f"{args.decode_workers} decode; a start that no standby covers waits {args.cold_start_s:g} s (modelled); "
        f"SLOs TTFT {args.slo_ttft_ms:g} ms and mean ITL {args.slo_itl_ms:g} ms"
    )
    print(
        "policies: fixed (the start's pools throughout); queue (today's: each pool on its own queue, "
        "grow after 5 s over target, 30 s cooldown, no standby); joint (cluster/joint.py with "
        f"{args.standby.replace(':', ' prefill + ')} decode workers on standby)"
    )
    print()
    print(
        f"{'policy':>7} {'SLO met':>8} {'worker-s':>9} {'peak P:D':>9} {'recovered':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'failed':>7}"
    )
    for o in outcomes:
        ttft = [r.ttft_s for r in o.records if math.isfinite(r.ttft_s)]
        itl = [r.itl_s for r in o.records if math.isfinite(r.itl_s)]
        back = o.recovered_after_s
        print(
            f"{o.policy:>7} {o.attainment:>8.1%} {o.worker_seconds:>9.0f} {o.peak[0]:>5}:{o.peak[1]:<3} "
            f"{'never' if back is None else f'{back:.1f} s':>10} {pct(ttft, 50) * 1e3:>7.0f}ms "
            f"{pct(ttft, 99) * 1e3:>7.0f}ms {pct(itl, 50) * 1e3:>6.1f}ms "
            f"{sum(not math.isfinite(r.ttft_s) for r in o.records):>7}"
        )
    print()
    print(
        "SLO met: requests with TTFT and mean ITL within the SLOs; worker-s: routed, starting and standby workers "
        f"over time; recovered: from the burst's start until every {RECOVERY_WINDOW_S:g} s of arrivals met the SLOs "
        f"for {RECOVERED_SHARE:.0%} of its requests"
    )
