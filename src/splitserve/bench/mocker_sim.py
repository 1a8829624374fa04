"""`splitserve bench mocker-sim`: a mocker fleet behind the real Router against the planner's simulator.

The same open-loop load (bench/mocker_fidelity.py's: byte-token prompts of uniform
lengths, Poisson arrivals) runs twice on one cost model, a profile of the embedded
engine measured here (`--profile`, else calibrated first):

- mockers: `--prefill-workers` + `--decode-workers` mocker workers (one process)
  behind the real Router (its own process), the client timing every stream;
- simulator: plan/sim/'s cluster of the same shape, its router's chooser in its
  loop, every step priced by the same profile.

The report sets the simulator's TTFT and TPOT p50 against the mockers' (target:
within 10%). What the simulator leaves out shows here: the gRPC hops, the router's
and the workers' own cycles, the KV transfers' real time.

    splitserve bench mocker-sim [--decode-workers 48] [--prefill-workers 16] [--rate 6]
"""

from __future__ import annotations

import argparse
import random
import tempfile

from splitserve.bench.mocker_fidelity import MOCKER_BLOCKS, add_load_arguments, calibrated, mocker_cluster, workload
from splitserve.bench.results_file import with_results
from splitserve.bench.router import pct

TARGET_SHARE = 0.10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-workers", type=int, default=48)
    p.add_argument("--prefill-workers", type=int, default=16)
    add_load_arguments(p, requests=200, rate=6.0)


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from splitserve.plan.profile import ProfileCosts, load_profile
    from splitserve.plan.sim.simulate import ClusterSpec, Request, simulate

    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="splitserve-mocker-sim-") as tmp:
        path = args.profile or calibrated(f"{tmp}/profile.json")
        profile = load_profile(path)
        mock, line = mocker_cluster(path, requests, args.output_tokens, args.prefill_workers, args.decode_workers)
    cluster = ClusterSpec(
        "disaggregated",
        args.decode_workers,
        args.prefill_workers,
        max_num_seqs=64,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        kv_capacity_tokens=MOCKER_BLOCKS * 16,
    )
    sim = simulate(
        [Request(r.at_s, len(r.prompt), args.output_tokens) for r in requests],
        cluster,
        ProfileCosts(profile),
        random.Random(args.seed),
    )

    from splitserve.measure.hw import machine_line

    print(machine_line())
    print(
        f"mockers against the simulator: {args.requests} requests, Poisson at {args.rate:g}/s, prompts of "
        f"{args.prompt_tokens} random byte tokens, {args.output_tokens} tokens out (EOS ignored); the real Router (its "
        f"own process) {line}; the simulator (plan/sim/) of the same {args.prefill_workers} + {args.decode_workers} "
        f"workers on the same profile"
    )
    print()
    worst = 0.0
    for name, field, of_sim in (("TTFT", 0, sim.ttft), ("TPOT", 1, sim.tpot)):
        m, m99 = pct([t[field] for t in mock], 50), pct([t[field] for t in mock], 99)
        worst = max(worst, abs(of_sim.p50 / m - 1))
        print(
            f"{name:<5} p50 mockers {m * 1e3:8.1f} ms  simulator {of_sim.p50 * 1e3:8.1f} ms  ratio "
            f"{of_sim.p50 / m:.2f}   (p99 mockers {m99 * 1e3:.1f} ms, simulator {of_sim.p99 * 1e3:.1f} ms)"
        )
    print()
    verdict = "PASS" if worst <= TARGET_SHARE else "FAIL"
    print(
        f"target: the simulator's TTFT and TPOT p50 within {TARGET_SHARE:.0%} of the mockers': {verdict} "
        f"(worst {worst:.0%})"
    )
    return 0
