"""`splitserve plan --simulate`: the plan's deployment and workload, simulated.

plan/main.py calls `add_arguments` and `run_simulation`; this module sits on top of
the simulator (simulate.py, sweep.py), which never imports it.
The cost model is the plan's own roofline (`roofline`: plan/main.py passes
plan/deployment.py's `DeploymentCosts`, so that plan/sim/ stands below the rest
of plan/ and never imports it), or a profile measured here with
`--sim-profile` (plan/calibrate.py). Each mode runs at each rate on Poisson
arrivals of the workload's lengths; `--sim-split` searches the prefill:decode
split of the GPU budget at the highest rate. `--plot DIR` draws both as PNGs
(plan/sim/plots.py).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any, NamedTuple

from splitserve.plan.costs import CostModel, StepSpread
from splitserve.plan.sim.simulate import MODES, ClusterSpec, Mode, Request, SimResult, Slo, simulate
from splitserve.plan.sim.sweep import best_split, poisson_requests
from splitserve.router.config import RoutingConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (--simulate)")
    g.add_argument("--simulate", action="store_true", help="simulate the cluster in each mode at the rate(s)")
    g.add_argument("--sim-rates", default=None, help="comma list of req/s (default: the workload's rate)")
    g.add_argument("--sim-modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    g.add_argument("--sim-requests", type=int, default=5000, help="requests per simulation")
    g.add_argument("--sim-split", action="store_true", help="search the prefill:decode split at the highest rate")
    g.add_argument("--sim-profile", default=None, help="a measured profile JSON (plan/calibrate.py) for the costs")
    g.add_argument("--sim-max-batched-tokens", type=int, default=8192, help="tokens per engine step (the chunk)")
    g.add_argument("--sim-seed", type=int, default=0)
    charts = "PNG charts here: goodput against rate per mode, and against the split with --sim-split"
    g.add_argument("--plot", default=None, metavar="DIR", help=charts)


class _Costs(NamedTuple):
    """What the simulation is priced on: the model, its decode spread, the step's token budget, KV room."""

    model: CostModel
    spread: StepSpread | None
    chunk: int  # tokens per engine step
    kv_tokens: int | None  # KV room per worker; None: never the limit
    what: str  # where the figures come from, for the header


def _costs(args: argparse.Namespace, dep: Any, roofline: CostModel) -> _Costs:
    """A measured profile with `--sim-profile`, else the plan's roofline."""
    if args.sim_profile:
        from splitserve.plan.profile import ProfileCosts, load_profile

        profile = load_profile(args.sim_profile)
        what = f"the profile {args.sim_profile} ({profile.description})"
        return _Costs(ProfileCosts(profile), profile.step_spread(), profile.max_num_batched_tokens, None, what)
    kv_tokens = max(1, int(dep.max_batch(1)))
    return _Costs(roofline, None, args.sim_max_batched_tokens, kv_tokens, f"the roofline of {dep.gpu.name}")


def run_simulation(args: argparse.Namespace, plan: Any, roofline: CostModel) -> int:
    """`plan`: plan/decision.py's Plan; `roofline`: its deployment's step times as a cost model."""
    if not args.simulate:
        return 0
    dep, wl = plan.deployment, plan.workload
    c = _costs(args, dep, roofline)
    rates = [float(r) for r in args.sim_rates.split(",")] if args.sim_rates else [wl.rate]
    modes: list[Mode] = [m for m in MODES if m in args.sim_modes.split(",")]
    replicas = dep.replicas
    if replicas < 2:
        modes = [m for m in modes if m == "colocated"]
    rec = plan.recommendation
    p = rec.prefill_replicas if rec.disaggregate else _proportional_split(replicas, plan.costs)
    slo = Slo(wl.ttft_slo_s, wl.tpot_slo_s)
    lengths = _lengths(args, wl, random.Random(args.sim_seed), args.sim_requests)
    print(
        f"\nsimulation: {len(lengths)} requests per run, {replicas} replicas of {dep.tp} GPU(s), costs from {c.what}; "
        f"disaggregated and auto as {p} prefill + {replicas - p} decode replicas, auto prefilling locally up to "
        f"{rec.local_prefill_max_tokens or 256} uncached tokens"
    )
    print(
        f"{'mode':14s} {'rate':>6s} {'goodput':>8s} {'SLO met':>7s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} "
        f"{'TPOT p50':>9s} {'p90':>7s} {'ITL p50':>8s} {'p99':>7s} {'wall':>6s}"
    )
    results = []
    for rate in rates:
        reqs = _requests(rate, lengths, wl.prefix_reuse, args.sim_seed)
        for mode in modes:
            spec = _spec(mode, replicas, p, dep, c.chunk, c.kv_tokens, rec.local_prefill_max_tokens)
            t = time.perf_counter()
            r = simulate(reqs, spec, c.model, random.Random(args.sim_seed), slo, rate, spread=c.spread)
            results.append(r)
            print(_row(r, time.perf_counter() - t))
    charts = []
    if args.plot:
        from splitserve.plan.sim.plots import plot_rates

        charts.append(plot_rates(results, slo, args.plot))
    if args.sim_split and replicas >= 2:
        reqs = _requests(max(rates), lengths, wl.prefix_reuse, args.sim_seed)
        charts += _split_search(args, reqs, max(rates), dep, c, slo)
    for path in charts:
        print(f"chart: {path}")
    return 0


def _split_search(
    args: argparse.Namespace, reqs: list[Request], rate: float, dep: Any, c: _Costs, slo: Slo
) -> list[str]:
    """Print the prefill:decode splits simulated at `rate`, disaggregated; the chart drawn, if any."""
    t = time.perf_counter()
    spec = _spec("disaggregated", dep.replicas, 1, dep, c.chunk, c.kv_tokens)
    search = best_split(reqs, dep.gpus, spec, c.model, slo, args.sim_seed, spread=c.spread)
    print(
        f"\nprefill:decode split of {dep.gpus} GPUs at {rate:g} req/s, disaggregated "
        f"({len(search.points)} splits simulated in {time.perf_counter() - t:.1f}s):"
    )
    for pt in search.points:
        mark = "  <- best" if pt is search.best else ""
        r = pt.result
        print(
            f"  {pt.prefill_gpus:4d} prefill : {pt.decode_gpus:4d} decode GPUs  goodput {r.goodput:8.2f} "
            f"req/s  SLO met {r.slo_attainment:6.1%}  TTFT p90 {_ms(r.ttft.p90)}{mark}"
        )
    if not args.plot:
        return []
    from splitserve.plan.sim.plots import plot_split

    return [plot_split(search, rate, slo, args.plot)]


def _spec(
    mode: Mode, replicas: int, p: int, dep: Any, chunk: int, kv_tokens: int | None, local_max: int | None = None
) -> ClusterSpec:
    decode, prefill = (replicas, 0) if mode == "colocated" else (replicas - p, p)
    return ClusterSpec(
        mode,
        decode_workers=decode,
        prefill_workers=prefill,
        max_num_seqs=dep.max_num_seqs,
        max_num_batched_tokens=chunk,
        kv_capacity_tokens=kv_tokens,
        gpus_per_worker=dep.tp,
        routing=RoutingConfig(local_prefill_max_tokens=local_max if local_max is not None else 256),
    )


def _proportional_split(replicas: int, c: Any) -> int:
    """Prefill replicas in proportion to the replica-seconds a request spends in prefill."""
    share = c.prefill_s / (c.prefill_s + c.decode_s) if c.prefill_s + c.decode_s > 0 else 0.5
    return min(max(1, round(replicas * share)), max(1, replicas - 1))


def _lengths(args: argparse.Namespace, wl: Any, rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(prompt, output) per request: a bench serve run's own, cycled, or drawn from the workload's
    mean and spread (normal, at least one token, at most four means)."""
    if getattr(args, "workload", None):
        from splitserve.measure.results import BenchResult, load_result

        records = [r for run in BenchResult.from_dict(load_result(args.workload)).runs for r in run.requests]
        if records:
            return [
                (max(1, records[i % len(records)].prompt_len), max(1, records[i % len(records)].output_len))
                for i in range(n)
            ]

    def draw(mean: float, std: float) -> int:
        return int(min(max(1.0, rng.gauss(mean, std) if std > 0 else mean), 4 * mean))

    return [(draw(wl.prompt.mean, wl.prompt.std), draw(wl.output.mean, wl.output.std)) for _ in range(n)]


def _requests(rate: float, lengths: list[tuple[int, int]], reuse: float, seed: int) -> list[Request]:
    reqs = poisson_requests(rate, lengths, random.Random(seed))
    if reuse <= 0:
        return reqs
    return [r._replace(cached_tokens=min(int(reuse * r.prompt_tokens), r.prompt_tokens - 1)) for r in reqs]


def _ms(s: float) -> str:
    return f"{s * 1e3:7.0f}ms" if s < 10 else f"{s:7.1f}s "


def _row(r: SimResult, wall_s: float) -> str:
    return (
        f"{r.mode:14s} {r.rate:6g} {r.goodput:8.2f} {r.slo_attainment:7.1%} {_ms(r.ttft.p50):>9s} "
        f"{_ms(r.ttft.p90):>8s} {_ms(r.ttft.p99):>8s} {r.tpot.p50 * 1e3:7.1f}ms {r.tpot.p90 * 1e3:5.1f}ms "
        f"{r.itl.p50 * 1e3:6.1f}ms {r.itl.p99 * 1e3:5.1f}ms {wall_s:5.1f}s"
    )
