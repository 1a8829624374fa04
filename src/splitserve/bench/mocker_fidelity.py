"""`splitserve bench mocker-fidelity`: mocker workers against the real ones, on the same load.

Two clusters, one after the other, each one prefill and one decode worker behind
the real Router (its own process), loaded the same way:

- real: two `splitserve worker` processes running the embedded model, each pinned
  to a core with one torch thread (bench/cluster.py's LocalCluster);
- mocker: one prefill and one decode mocker (bench/mocker/) whose steps are timed
  by a profile of that same engine, measured on this machine just before
  (plan/calibrate.py, the same thread and pinning), unless `--profile` gives one.

The load is open-loop: `--requests` prompts of random byte tokens (lengths drawn
uniformly from `--prompt-tokens`), each asking for `--output-tokens` with EOS
ignored, sent at Poisson arrivals of `--rate` per second; the same prompts and
arrival times for both. The client records each request's TTFT and its TPOT (the
mean gap between its tokens after the first: a worker may send tokens that were
ready together in one message, so single gaps of 0 are not the stream's pace);
the report sets the mocker cluster's p50s against the real cluster's (target:
within 15%, which issue 44 sets for TTFT and ITL). The real workers decode
plainly (`--speculative off`), a token a step, as the mockers model it.

    splitserve bench mocker-fidelity [--requests 60] [--rate 1.5] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from splitserve.bench.cluster import LocalCluster, WorkerArgs
from splitserve.bench.mocker.cluster import serve_mockers, serve_router
from splitserve.bench.results_file import with_results
from splitserve.bench.router import STARTUP_TIMEOUT_S, pct, start_process

TARGET_SHARE = 0.15
MOCKER_BLOCKS = 1024  # per mocker, of 16 tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_load_arguments(p, requests=60, rate=1.5)
    p.add_argument("--save-profile", default=None, help="keep the profile calibrated now here")


def add_load_arguments(p: argparse.ArgumentParser, requests: int, rate: float) -> None:
    """The load (`workload`'s), its profile and its results file: the flags of every benchmark that
    sets mockers against something else on one load."""
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--rate", type=float, default=rate, help="Poisson arrivals, requests/s")
    p.add_argument("--prompt-tokens", default="32:480", help="MIN:MAX, drawn uniformly")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="a measured profile JSON (else calibrated now, ~150 s)")
    p.add_argument("--results", help="also write the output to this file, after a header saying what ran where")


class Request(NamedTuple):
    at_s: float  # arrival, from the load's start
    prompt: list[int]


class Timing(NamedTuple):
    ttft_s: float
    tpot_s: float  # the mean gap between its tokens after the first: (last - first) / (tokens - 1)


def workload(args: argparse.Namespace) -> list[Request]:
    lo, hi = (int(x) for x in args.prompt_tokens.split(":"))
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append(Request(t, [rng.randrange(256) for _ in range(rng.randint(lo, hi))]))
    return out


async def token_times(stub: Any, prompt: list[int], output_tokens: int, timeout_s: float) -> list[float]:
    """When each token of one greedy Generate stream of `prompt` arrived (grpc.aio.AioRpcError if it fails)."""
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True),
    )
    stamps: list[float] = []
    async for resp in stub.Generate(req, timeout=timeout_s):
        stamps.extend([time.monotonic()] * len(resp.token_ids))
    return stamps


async def drive(address: str, requests: Sequence[Request], output_tokens: int) -> list[Timing]:
    """Each request sent at its arrival time; its TTFT and the gaps between its tokens."""
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.monotonic()

        async def one(r: Request) -> Timing:
            await asyncio.sleep(max(0.0, start + r.at_s - time.monotonic()))
            sent = time.monotonic()
            stamps = await token_times(stub, r.prompt, output_tokens, 300)
            if len(stamps) != output_tokens:
                raise RuntimeError(f"a request got {len(stamps)} tokens, not {output_tokens}")
            return Timing(stamps[0] - sent, (stamps[-1] - stamps[0]) / (len(stamps) - 1))

        return list(await asyncio.gather(*(one(r) for r in requests)))


def _through_router(fleet: dict[str, Any], requests: Sequence[Request], output_tokens: int) -> list[Timing]:
    """The load through a Router process (unpinned) in front of `fleet`'s workers."""
    proc, conn = start_process(serve_router, fleet, "disaggregated", 1, None)
    try:
        if not conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the router did not start")
        address = conn.recv()["router"]
        return asyncio.run(drive(address, requests, output_tokens))
    finally:
        conn.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def real_cluster(requests: Sequence[Request], output_tokens: int) -> list[Timing]:
    cores = sorted(os.sched_getaffinity(0))
    # plain decode, a token a step, as the mockers model it: with speculative decoding (the CPU's
    # default) the embedded model's repetitive text on these prompts took two tokens a step
    with LocalCluster(WorkerArgs(speculative="off"), (cores[-1], cores[0]) if len(cores) >= 2 else None) as c:
        fleet = {"decode": [c.decode.grpc_address], "prefill": [c.prefill.grpc_address]}
        return _through_router(fleet, requests, output_tokens)


def mocker_cluster(
    profile: str, requests: Sequence[Request], output_tokens: int, prefill: int = 1, decode: int = 1
) -> tuple[list[Timing], str]:
    """The load through a Router in front of `prefill` + `decode` mockers timed by `profile`: the
    timings, and the line saying what the fleet was."""
    ns = argparse.Namespace(
        profile=profile,
        model_shape="",
        gpu="",
        num_blocks=MOCKER_BLOCKS,
        max_num_seqs=64,
        stream_interval=1,
        prefill_workers=prefill,
        decode_workers=decode,
    )
    proc, conn = start_process(serve_mockers, ns, None)
    try:
        if not conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the mockers did not start")
        fleet = conn.recv()
        return _through_router(fleet, requests, output_tokens), fleet["line"]
    finally:
        conn.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def calibrated(path: str) -> str:
    from splitserve.plan.calibrate import CalibrationConfig, calibrate
    from splitserve.plan.profile import save_profile

    cores = sorted(os.sched_getaffinity(0))
    save_profile(calibrate(CalibrationConfig(core=cores[-1]), log=lambda line: print("  " + line)), path)
    return path


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="splitserve-fidelity-") as tmp:
        profile = args.profile or calibrated(args.save_profile or os.path.join(tmp, "profile.json"))
        real = real_cluster(requests, args.output_tokens)
        mock, line = mocker_cluster(profile, requests, args.output_tokens)

    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        f"mocker fidelity: {args.requests} requests, Poisson at {args.rate:g}/s, prompts of {args.prompt_tokens} "
        f"random byte tokens, {args.output_tokens} tokens out (EOS ignored), the same load through the real Router "
        f"(its own process) to 1 prefill + 1 decode real worker (the embedded model, one torch thread, each pinned to "
        f"a core, --speculative off) and then {line}"
    )
    print()
    worst = 0.0
    for name, field in (("TTFT", 0), ("TPOT", 1)):
        r, m = pct([t[field] for t in real], 50), pct([t[field] for t in mock], 50)
        worst = max(worst, abs(m / r - 1))
        r99, m99 = pct([t[field] for t in real], 99), pct([t[field] for t in mock], 99)
        print(
            f"{name:<5} p50 real {r * 1e3:8.1f} ms  mocker {m * 1e3:8.1f} ms  ratio {m / r:.2f}   "
            f"(p99 real {r99 * 1e3:.1f} ms, mocker {m99 * 1e3:.1f} ms)"
        )
    print()
    verdict = "PASS" if worst <= TARGET_SHARE else "FAIL"
    print(f"target: TTFT and TPOT p50 within {TARGET_SHARE:.0%} of the real cluster's: {verdict} (worst {worst:.0%})")
    return 0
