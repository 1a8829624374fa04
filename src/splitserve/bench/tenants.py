"""Tenants sharing one cluster: a noisy tenant at ten times the others' token rate against three
quiet ones, and the quiet tenants' TTFT beside their run alone, in one run.

    splitserve bench tenants [--duration 40] [--seats 8] [--quiet-rate 0.3] [--prompt-tokens 256]
                             [--max-tokens 16] [--results bench/results/tenants-cpu.txt]

Two topologies, each with a router in this process holding four tenants of equal weight (q1, q2,
q3 and noisy, each its own key) and --seats seats (`--max-running-requests`), the client this
process too, over gRPC:

- disaggregated, as `serve` runs by default: a prefill and a decode worker process (the embedded
  model in bfloat16, one thread each, pinned to a core each), the router in mode auto;
- colocated: one decode worker process on both cores, prefilling every prompt itself.
 Each quiet tenant sends a
prompt of --prompt-tokens every 1 / --quiet-rate s on average (Poisson; random token ids, so no
prefix-cache hit) asking --max-tokens tokens; the noisy tenant sends ten times their tokens, in
one of two shapes: prompts ten times as long at the same rate ("long": each holds a seat for
seconds) or prompts as long at ten times the rate ("many"). Every phase runs --duration s from
the same seeded arrivals:

- alone: the quiet tenants only;
- noisy long, noisy many: the four tenants on the seats;
- noisy long, no seat limit: every request straight to the worker, whose own queue orders them
  (shortest prefill first): what the seats add.

Per phase: the quiet tenants' TTFT p50 and p99 (from the request's scheduled send to its first
token, so a wait in the router counts), and their p99 against alone; Jain's index of the four
tenants' served tokens, each as a share of its max-min fair allocation (what it asked, or an equal
cut of what was served if it asked more); and the most requests running at once. Quiet requests
still running at the end of a phase finish; the noisy tenant's backlog is cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from splitserve.bench.cluster import LocalCluster, WorkerArgs, WorkerProcess, usable_cores
from splitserve.bench.results_file import with_results
from splitserve.measure.hw import machine_line

if TYPE_CHECKING:
    from splitserve.router.engine_tokenizer import EngineTokenizer

QUIET = ("q1", "q2", "q3")
NOISY = "noisy"
PHASES = (("alone", None, True), ("noisy long", "long", True), ("noisy many", "many", True))
CONTROL = ("noisy long, no seat limit", "long", False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per phase")
    p.add_argument("--seats", type=int, default=8, help="the router's --max-running-requests")
    p.add_argument("--quiet-rate", type=float, default=0.3, help="requests per second of each quiet tenant")
    p.add_argument("--prompt-tokens", type=int, default=256, help="a quiet request's prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="also write the output here")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds into the phase
    tenant: str
    prompt: list[int]


@dataclass
class Phase:
    ttft: dict[str, list[float]] = field(default_factory=dict)  # quiet tenants' TTFTs
    asked: dict[str, int] = field(default_factory=dict)  # tokens asked: prompt + max_tokens
    served: dict[str, int] = field(default_factory=dict)  # prompt tokens once prefilled, tokens generated
    peak_running: int = 0


def arrivals(shape: str | None, args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """The phase's requests, seeded: the same quiet arrivals in every phase."""
    out = []
    for tenant in (*QUIET, *([NOISY] if shape else [])):
        rng = random.Random(f"{args.seed}-{tenant}")
        rate, tokens = args.quiet_rate, args.prompt_tokens
        if tenant == NOISY:
            rate, tokens = (rate, 10 * tokens) if shape == "long" else (10 * rate, tokens)
        t = rng.expovariate(rate)
        while t < args.duration:
            out.append(Arrival(t, tenant, [rng.randrange(100, vocab) for _ in range(tokens)]))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: a.at)


def max_min_fair(asked: dict[str, int], total: float) -> dict[str, float]:
    """Water-filling: each tenant gets what it asked or an equal cut of what is left, whichever
    is less, the cut growing as the small askers are filled."""
    fair: dict[str, float] = {}
    left, open_ = total, sorted(asked, key=asked.__getitem__)
    while open_:
        cut = left / len(open_)
        t = open_[0]
        if asked[t] <= cut:
            fair[t] = asked[t]
            left -= asked[t]
            open_.pop(0)
        else:
            for t in open_:
                fair[t] = cut
            break
    return fair


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _run(args: argparse.Namespace) -> int:
    print(
        f"# splitserve bench tenants --duration {args.duration:g} --seats {args.seats} "
        f"--quiet-rate {args.quiet_rate:g} --prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens} "
        f"--seed {args.seed}"
    )
    print(f"# {machine_line()}")
    results: dict[str, dict[str, Phase]] = {}
    for topology in ("disaggregated", "colocated"):
        print(f"... {topology}", flush=True)
        results[topology] = _on(topology, args)
    for topology, phases in results.items():
        _report(topology, phases, args)
    return 0


def _on(topology: str, args: argparse.Namespace) -> dict[str, Phase]:
    """The phases against a fresh cluster of `topology`."""
    engine = WorkerArgs(dtype="bfloat16", num_blocks=2048)
    if topology == "colocated":
        with tempfile.TemporaryDirectory(prefix="splitserve-bench-tenants-") as tmp:
            worker = WorkerProcess("decode", None, replace(engine, threads=2), tmp)
            try:
                deadline = time.monotonic() + 300
                while not worker.poll_ready():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the decode worker was not ready in 300 s:\n{worker.log_tail()}")
                    time.sleep(0.1)
                return asyncio.run(_phases([worker.grpc_address], [], args))
            finally:
                worker.kill()
    cores = usable_cores()
    with LocalCluster(engine, cores=(cores[0], cores[-1]) if len(cores) > 1 else None) as cluster:
        return asyncio.run(_phases([cluster.decode.grpc_address], [cluster.prefill.grpc_address], args))


async def _phases(decode: list[str], prefill: list[str], args: argparse.Namespace) -> dict[str, Phase]:
    from splitserve.engine.weights import load_tokenizer
    from splitserve.router.engine_tokenizer import EngineTokenizer

    tokenizer = EngineTokenizer(load_tokenizer(None))
    vocab = min(tokenizer.vocab_size, 32000)
    await _phase(decode, prefill, args, tokenizer, arrivals(None, args, vocab)[:8], seats=True)  # warm-up
    out = {}
    for name, shape, seated in (*PHASES, CONTROL):
        print(f"... {name}", flush=True)
        out[name] = await _phase(decode, prefill, args, tokenizer, arrivals(shape, args, vocab), seated)
    return out


async def _phase(
    decode: list[str],
    prefill: list[str],
    args: argparse.Namespace,
    tokenizer: EngineTokenizer,
    requests: list[Arrival],
    seats: bool,
) -> Phase:
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as gpb_grpc
    from splitserve.router.config import Limits, Listeners, RouterConfig
    from splitserve.router.server import Router
    from splitserve.router.tenants import Tenant

    tenants = tuple(Tenant(t, (f"sk-{t}",)) for t in (*QUIET, NOISY))
    cfg = RouterConfig(
        listeners=Listeners(grpc_port=0), limits=Limits(max_running=args.seats if seats else None), tenants=tenants
    )
    router = Router(cfg, tokenizer, decode=decode, prefill=prefill)
    await router.start()
    await router.wait_for_workers(60)
    phase = Phase()
    start = time.perf_counter() + 0.2

    async def one(a: Arrival, stub: gpb_grpc.GenerationStub) -> None:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=a.prompt))
        req.sampling.max_tokens = args.max_tokens
        req.sampling.ignore_eos = True
        phase.asked[a.tenant] = phase.asked.get(a.tenant, 0) + len(a.prompt) + args.max_tokens
        await asyncio.sleep(max(0.0, start + a.at - time.perf_counter()))
        first = True
        async for msg in stub.Generate(req, metadata=(("authorization", f"Bearer sk-{a.tenant}"),)):
            if time.perf_counter() > start + args.duration and a.tenant == NOISY:
                break  # the phase is over: what it serves now is not counted
            if first:
                first = False
                phase.served[a.tenant] = phase.served.get(a.tenant, 0) + len(a.prompt)
                if a.tenant != NOISY:
                    phase.ttft.setdefault(a.tenant, []).append(time.perf_counter() - start - a.at)
            phase.served[a.tenant] += len(msg.token_ids)

    async def watch() -> None:
        while True:
            g = router.generation
            phase.peak_running = max(phase.peak_running, g.seats.taken if seats else g.inflight)
            await asyncio.sleep(0.02)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = gpb_grpc.GenerationStub(ch)
            watcher = asyncio.create_task(watch())
            quiet = [asyncio.create_task(one(a, stub)) for a in requests if a.tenant != NOISY]
            noisy = [asyncio.create_task(one(a, stub)) for a in requests if a.tenant == NOISY]
            await asyncio.sleep(args.duration + 0.2)
            await asyncio.wait_for(asyncio.gather(*quiet), 120)
            for t in noisy:
                t.cancel()
            await asyncio.gather(*noisy, return_exceptions=True)
            watcher.cancel()
    finally:
        await router.stop()
    return phase


def _report(topology: str, results: dict[str, Phase], args: argparse.Namespace) -> None:
    alone = [x for q in QUIET for x in results["alone"].ttft.get(q, [])]
    alone_p99 = pct(alone, 0.99)
    print(
        f"\n## {topology}: the quiet tenants' TTFT (ms), {len(alone)} quiet requests a phase; "
        "Jain's index of served tokens"
    )
    print(
        "phase                       | quiet p50 | quiet p99 | p99 / alone | per tenant p99      | Jain | peak running"
    )
    for name, phase in results.items():
        quiet = [x for q in QUIET for x in phase.ttft.get(q, [])]
        per = " ".join(f"{pct(phase.ttft[q], 0.99) * 1e3:5.0f}" for q in QUIET if phase.ttft.get(q))
        fair = max_min_fair(phase.asked, sum(phase.served.values()))
        index = jain([phase.served.get(t, 0) / fair[t] for t in phase.asked if fair[t]])
        print(
            f"{name:27} | {statistics.median(quiet) * 1e3:9.0f} | {pct(quiet, 0.99) * 1e3:9.0f} | "
            f"{pct(quiet, 0.99) / alone_p99:11.2f} | {per:19} | {index:4.2f} | {phase.peak_running}"
        )
    print(f"(targets: quiet p99 within 1.5x of alone, Jain >= 0.9; seats: {args.seats})")
