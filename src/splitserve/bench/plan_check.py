"""`splitserve bench plan-check`: the simulator behind `splitserve plan --simulate`
against real runs on this machine.

1. Calibrate: this project's engine step costs measured here (plan/calibrate.py),
   pinned to one core with one torch thread as each benchmark worker runs, fitted
   into a profile (saved beside the run's JSON files). `--profile` reuses one.
   On each system, started once for this before its loads, the serving overhead (what a
   served token costs beyond the engine step: plan/calibrate.py's
   `serving_point`) and how much a served prefill slows while other requests
   decode (`prefill_load_points`) are measured and fitted into that system's
   copy of the profile (`profile-SYSTEM.json`), unless the profile has them for
   that system already. Both depend on the system: a client's gap between
   tokens is 7 ms over the engine step colocated here (both cores run a worker,
   so the router and the client take their cycles from the decode steps) and 1 ms
   disaggregated (the prefill worker's core is idle between prompts).
2. Measure: each system (colocated: one worker per core behind a router;
   disaggregated: a prefill and a decode worker on a core each) is started as
   `bench peer` starts it (bench/peer/servers.py) and loaded by `bench serve` on
   ShareGPT, one short run per Poisson rate, each rate with its own prompts (a
   prompt seen before would be a prefix-cache hit). Every load runs `--repeats`
   times, each repeat on a system started afresh with the same prompts and send
   times (see `_check_mode`).
3. Also bench serve's burst load (steady streams, bursts of long prompts), unless --no-burst.
4. Simulate the same requests (each run's own send times and the prompt and output
   lengths the server counted, the chat template's opening blocks cached as the
   workers' prefix cache holds them: `chat_prefix_cached_tokens`) on a cluster of
   the same shape with the profile's costs and its measured spread of decode
   steps, and print the simulated median of TTFT and ITL p50 and p90 beside the
   measured median and min..max over the repeats, each row within 25%, within the
   machine's noise or a miss (bench/plan_check_rows.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from splitserve.bench.plan_check_rows import Pair, format_table, rows_of, summary_line

if TYPE_CHECKING:
    from splitserve.bench.peer.main import Load
    from splitserve.bench.peer.servers import RunningSystem, SystemSpec
    from splitserve.plan.sim.simulate import ClusterSpec

DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "plan-check")
MODES = ("colocated", "disaggregated")
SERVE_ALONE_RUNS = 3  # one request decoding alone, this many times (the median taken)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES), help="comma list of colocated, disaggregated")
    p.add_argument("--rates", default="0.5,1,1.5", help="Poisson request rates (req/s), one run each")
    p.add_argument("--num-prompts", type=int, default=32, help="ShareGPT requests per run")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of every request (EOS ignored)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest ShareGPT prompt kept")
    p.add_argument("--dtype", default="float32", help="the workers' dtype, and the calibration's")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--profile", default=None, help="a saved profile JSON instead of calibrating now")
    p.add_argument("--cores", default=None, help="cores to pin to, e.g. 0,1 (default: all usable)")
    p.add_argument(
        "--no-burst", action="store_true", help="skip bench serve's burst load (steady streams, long prompts)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of each load, each on a fresh start of its system (min..max)"
    )
    p.add_argument("--seed", type=int, default=10, help="the first load's prompt seed (each load adds one)")
    p.add_argument("--out", default=DEFAULT_OUT, help="profile, bench serve JSON files and logs")
    p.add_argument("--load-timeout", type=float, default=900.0, help="seconds for one bench serve run")


def run(args: argparse.Namespace) -> int:
    import datetime

    from splitserve.bench.peer.hf_export import export_hf_dir
    from splitserve.bench.peer.main import SERVED_MODEL_NAME, parse_cores
    from splitserve.bench.peer.servers import LaunchContext
    from splitserve.measure.hw import cpu_flags
    from splitserve.plan.calibrate import CalibrationConfig, SpeedProbe, calibrate
    from splitserve.plan.profile import load_profile, save_profile

    now = datetime.datetime.now(datetime.UTC)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"$ splitserve {shlex.join(sys.argv[1:])}   # at {_commit()}, {now:%Y-%m-%dT%H:%MZ}, {os.cpu_count()} CPU "
        f"cores (flags {cpu_flags()}), load average {load} at start",
        flush=True,
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not modes or any(m not in MODES for m in modes) or not rates or min(rates) <= 0 or args.repeats < 1:
        print(
            f"bench plan-check: --modes from {', '.join(MODES)}, --rates positive, --repeats 1 or more", file=sys.stderr
        )
        return 2
    cores = parse_cores(args.cores)
    out = os.path.abspath(args.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    cal = CalibrationConfig(model=args.model, dtype=args.dtype, threads=1, core=cores[0] if cores else None)
    if args.profile:
        profile = load_profile(args.profile)
        print(f"profile: {args.profile}")
    else:
        t0 = time.monotonic()
        profile = calibrate(cal, log=lambda s: print("  " + s, flush=True))
        path = os.path.join(out, "profile.json")
        save_profile(profile, path)
        print(f"profile: calibrated in {time.monotonic() - t0:.0f}s, saved to {path}")
    _print_profile(profile)
    model_dir = export_hf_dir(args.model, os.path.join(os.path.dirname(DEFAULT_OUT), "peer", "model"))
    # Each worker pinned to its own core, as the profile was calibrated and as the simulator models a
    # cluster: core lending (a step borrowing a neighbour's idle core) is outside the simulator's model.
    ctx = LaunchContext(
        model_dir=model_dir, served_model_name=SERVED_MODEL_NAME, workdir=logs, cores=cores, lend_cores=False
    )
    speed = Speed(SpeedProbe(cal), profile.probe_s) if profile.probe_s > 0 else Speed(None, 0.0)
    pairs: list[Pair] = []
    failed = False
    for mode in modes:
        try:
            pairs += _check_mode(mode, rates, args, ctx, out, profile, speed)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"[{mode}] ERROR: {e}", flush=True)
            failed = True
    rows = rows_of(pairs)
    print()
    print(format_table(rows))
    print(f"\n{summary_line(rows, args.repeats)}")
    return 1 if failed or not rows else 0


class Speed:
    """The machine's time now over the calibration's (plan/calibrate.py's SpeedProbe), taken before
    each measurement: the measured figures are compared with a simulation of the machine as it was
    while they were taken. 1.0 when the profile has no probe reading."""

    def __init__(self, probe: Any, calibrated_s: float) -> None:
        self.probe, self.calibrated_s = probe, calibrated_s

    def factor(self, label: str) -> float:
        if self.probe is None:
            return 1.0
        f: float = self.probe.seconds() / self.calibrated_s
        print(f"[{label}] speed probe: the machine takes {f:.2f}x the calibration's time", flush=True)
        return f

    def around(self, label: str, before: float) -> float:
        """The factor a load is simulated at: the lower of the readings before and after it. A
        reading is only ever pushed up, by work that shares the core with the probe for a moment;
        the probe right after a 58 s ShareGPT load read 1.17x to 1.30x in 3 of 6 runs while the
        load after it measured the same ITL as ever (issue 33: the one miss of the 3-repeat run, a
        simulated ITL 1.26x the measured, was this: simulated at 1.00x, the readings around it, it was
        0.97x). A machine slow all through a load reads slow on both sides."""
        if self.probe is None:
            return 1.0
        f = min(before, self.factor(f"{label}, after"))
        print(f"[{label}] simulated at {f:.2f}x, the lower of the readings before and after", flush=True)
        return f


class _System(NamedTuple):
    """One system as plan-check starts it and as the simulator models it."""

    mode: str
    spec: SystemSpec
    cluster: ClusterSpec
    decode: int  # workers
    prefill: int
    cached: int  # the prompt tokens every worker's prefix cache holds (`chat_prefix_cached_tokens`)


def _check_mode(
    mode: str, rates: list[float], args: argparse.Namespace, ctx: Any, out: str, profile: Any, speed: Speed
) -> list[Pair]:
    """The figures of one system, each load `args.repeats` times, simulated with the profile's engine
    costs and this system's serving overhead and prefill slowdown (measured here unless the profile
    has them for it).

    Every repeat sends the same prompts at the same times (the same seeds) to a system started
    afresh. The same prompts: the spread over the repeats is to be the machine's noise, and another
    draw of prompts and Poisson send times is another load (which prompts are long, how they bunch),
    whose figures move on their own; their spread would pass the workload's variance off as noise.
    A fresh start: a prompt the system has served is a prefix-cache hit (the KV tiers, the host's
    in the worker processes, go with them; these systems keep none on disk), so a second repeat on
    the same system would prefill almost nothing. The serving overhead is measured on a start of
    its own for the same reason: every repeat begins in the same state, started and warmed up."""
    system = _system(mode, ctx, args)
    missing = _missing(profile, system)
    if missing:
        with _started(system, ctx, "to measure its serving") as running:
            profile = _measure_system(running, system, missing, ctx, out, profile, args, speed)
    pairs: list[Pair] = []
    for repeat in range(args.repeats):
        with _started(system, ctx, f"repeat {repeat + 1} of {args.repeats}") as running:
            for label, load in _loads(rates, args, repeat):
                pairs += _load_pairs(running, system, label, load, ctx, out, profile, args, speed)
    return pairs


def _system(mode: str, ctx: Any, args: argparse.Namespace) -> _System:
    from splitserve.bench.peer.servers import SystemSpec, placement
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.tokenizer import Tokenizer
    from splitserve.plan.sim.simulate import ClusterSpec, Mode
    from splitserve.router.engine_tokenizer import EngineTokenizer

    where = placement(mode, ctx.cores)
    decode, prefill = len(where.cores_of("decode")), len(where.cores_of("prefill"))
    sim_mode: Mode = "colocated" if mode == "colocated" else "disaggregated"
    cluster = ClusterSpec(sim_mode, decode_workers=decode, prefill_workers=prefill)
    # every worker at the simulated chunk (a prefill worker's own default is larger: engine/tuned.py)
    chunk = ("--max-num-batched-tokens", str(cluster.max_num_batched_tokens))
    spec = SystemSpec(mode, flags=("--dtype", args.dtype, *chunk))
    chat = EngineTokenizer(Tokenizer.from_hf_dir(ctx.model_dir))
    cached = chat_prefix_cached_tokens(chat.encode_chat, EngineConfig().block_size)
    print(
        f"[{mode}] simulated as {decode} decode and {prefill} prefill worker(s), max_num_seqs "
        f"{cluster.max_num_seqs}, chunk {cluster.max_num_batched_tokens}, the first {cached} tokens of every "
        f"prompt (the chat template's opening, whole blocks) cached",
        flush=True,
    )
    return _System(mode, spec, cluster, decode, prefill, cached)


def _started(system: _System, ctx: Any, why: str) -> RunningSystem:
    """The system started and warmed up (RuntimeError if it did not start)."""
    from splitserve.bench.peer.main import warmup
    from splitserve.bench.peer.servers import ServerError, start_system

    try:
        running = start_system(system.spec, ctx)
    except ServerError as e:
        raise RuntimeError(f"did not start: {e}") from None
    try:
        print(f"[{system.mode}] serving at {running.base_url} after {running.start_s:.1f}s, {why}", flush=True)
        warmup(running.base_url, ctx.served_model_name)
    except BaseException:
        running.stop()
        raise
    return running


def _missing(profile: Any, system: _System) -> list[str]:
    """What the profile lacks for this system, in the order `_measure_system` measures it. Each is
    independent of the others: measuring one leaves the others as they were."""
    from splitserve.plan.profile import prefill_slowdown

    missing = []
    if not profile.serve_system.startswith(f"{system.mode},"):  # measured on this system: colocated here is 7x
        missing.append("serving")  # disaggregated's (see the note)
    if system.prefill and not profile.serve_prefill_points:
        missing.append("serving beside prefill")
    if prefill_slowdown(profile, system.mode) is None:
        missing.append("prefill under load")
    return missing


def _measure_system(
    running: RunningSystem,
    system: _System,
    missing: list[str],
    ctx: Any,
    out: str,
    profile: Any,
    args: argparse.Namespace,
    speed: Speed,
) -> Any:
    """The profile with what it lacked for this system (`_missing`) measured on it."""
    decode = system.decode
    for what in missing:
        f = speed.factor(f"{system.mode} {what}")
        if what == "serving":
            profile = _measure_serving(running, ctx, out, profile, decode, args, f)
        elif what == "serving beside prefill":
            profile = _measure_serving_beside_prefill(running, ctx, out, profile, decode, args, f)
        else:
            profile = _measure_prefill_load(running, ctx, out, profile, decode, system.prefill, system.cached, args, f)
    return profile


def _loads(rates: list[float], args: argparse.Namespace, repeat: int) -> list[tuple[str, Load]]:
    """(label, load) of each load of one repeat: a ShareGPT run per rate, then the burst load. The
    seeds are the same in every repeat (see `_check_mode`); the names differ, so that every repeat
    keeps its JSON file and log."""
    from splitserve.bench.peer.main import Load

    def name(label: str) -> str:
        return label if args.repeats == 1 else f"{label}-r{repeat + 1}"

    def sharegpt(rate: float, seed: int) -> tuple[str, ...]:
        lengths = ("--sharegpt-output-len", str(args.output_len), "--sharegpt-max-input-len", str(args.max_input_len))
        rate_flags = ("--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:g}")
        return ("--dataset", "sharegpt", *rate_flags, *lengths, "--ignore-eos", "--seed", str(seed))

    loads = [(f"sharegpt@{rate:g}", sharegpt(rate, args.seed + i)) for i, rate in enumerate(rates)]
    if not args.no_burst:  # bench serve's own burst schedule and defaults
        loads.append(("burst", ("--dataset", "burst", "--seed", str(args.seed + len(rates)))))
    return [(label, Load(name(label), flags, args.load_timeout)) for label, flags in loads]


def _load_pairs(
    running: RunningSystem,
    system: _System,
    label: str,
    load: Load,
    ctx: Any,
    out: str,
    profile: Any,
    args: argparse.Namespace,
    speed: Speed,
) -> list[Pair]:
    """One run of the load, measured and simulated on its own requests."""
    from splitserve.plan.calibrate import at_calibration_speed
    from splitserve.plan.profile import ProfileCosts, prefill_slowdown, serving_beside_prefill, serving_by_busy
    from splitserve.plan.sim.simulate import simulate
    from splitserve.plan.sim.sweep import requests_from_run

    f = speed.factor(f"{system.mode} {load.name}")
    print(f"[{system.mode}] load {load.name}: bench serve {' '.join(load.flags)}", flush=True)
    measured = _run(running, load, ctx, out)
    f = speed.around(f"{system.mode} {load.name}", f)
    # the simulated machine at the probed speed: every cost x f is the same timeline as the
    # calibrated costs over arrivals / f, its times then x f
    replayed = dataclasses.replace(measured, requests=at_calibration_speed(measured.requests, f))
    sim = simulate(
        requests_from_run(replayed, system.cached),
        system.cluster,
        ProfileCosts(profile),
        random.Random(args.seed),
        spread=profile.step_spread(),
        prefill_slowdown=prefill_slowdown(profile, system.mode),
        serve_by_busy=serving_by_busy(profile),
        serve_beside_prefill=serving_beside_prefill(profile),
    )
    return compare(system.mode, label, measured, sim, f)


def _run(system: Any, load: Any, ctx: Any, out: str) -> Any:
    """One bench serve run of `load` against the running system: its RunResult (RuntimeError if it failed)."""
    from splitserve.bench.peer.main import run_load
    from splitserve.measure.results import RunResult

    data = run_load(system, load, ctx, out, "openai-chat")
    if "error" in data:
        raise RuntimeError(f"{load.name}: {data['error']}")
    return RunResult.from_dict(data["runs"][0])


def chat_prefix_cached_tokens(encode_chat: Callable[[Sequence[tuple[str, str]]], list[int]], block_size: int) -> int:
    """What a worker's prefix cache holds of every chat prompt: the tokens the chat template puts
    before any user's words (SmolLM2's default system prompt: 24), in whole blocks (16 of them at
    block size 16). The first request on a worker (plan-check's warm-up) caches them."""
    a = encode_chat([("user", "Hello there.")])
    b = encode_chat([("user", "What is the capital of France?")])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // block_size * block_size


def _measure_serving(
    system: Any, ctx: Any, out: str, profile: Any, workers: int, args: argparse.Namespace, speed: float = 1.0
) -> Any:
    """The serving overhead on this running system (plan/calibrate.py's `serving_point`, one bench
    serve run per batch), fitted into the profile, which is saved again."""
    from splitserve.bench.peer.main import Load
    from splitserve.measure.metrics import percentile
    from splitserve.plan.calibrate import (
        SERVE_BATCHES,
        at_calibration_speed,
        serving_gap_ratios,
        serving_load_flags,
        serving_point,
    )
    from splitserve.plan.profile import save_profile, with_serving

    name = system.spec.name
    points, ratios = [], []
    for i, batch in enumerate(SERVE_BATCHES):
        load = Load(f"serving-b{batch}", serving_load_flags(batch, workers, args.seed + 100 + i), args.load_timeout)
        records = at_calibration_speed(_run(system, load, ctx, out).requests, speed)
        try:
            b, context, engine_s, served_s = serving_point(records, workers, profile)
            gaps = [r for _, r in serving_gap_ratios(records, workers, profile)]
        except ValueError as e:  # the requests did not all decode together (routing uneven, a late prefill)
            print(f"[{name}] serving: batch {batch} per worker not measured: {e}", flush=True)
            continue
        print(
            f"[{name}] serving: batch {b} per worker, context {context}: engine step {engine_s * 1e3:.1f} ms, "
            f"served gap {served_s * 1e3:.1f} ms; gaps / model p10 {percentile(gaps, 10):.3f} "
            f"p50 {percentile(gaps, 50):.3f} p90 {percentile(gaps, 90):.3f}",
            flush=True,
        )
        points.append((b, context, engine_s, served_s))
        ratios += [(b, r) for r in gaps]
    if not points:
        raise RuntimeError("the serving overhead: no batch measured")
    profile = with_serving(profile, points, f"{name}, {workers} worker(s)", ratios)
    if workers > 1:
        profile = _measure_serving_alone(system, ctx, out, profile, workers, args, speed)
    save_profile(profile, os.path.join(out, f"profile-{name}.json"))
    print(
        f"[{name}] serving overhead = {profile.serve_step_s * 1e3:.2f} ms/step + "
        f"{profile.serve_s_per_seq * 1e3:.3f} ms/token with all {workers} worker(s) busy, "
        f"{profile.serve_s_per_busy * 1e3:.2f} ms/step less for each idle one; saved to the profile",
        flush=True,
    )
    return profile


def _measure_serving_alone(
    system: Any, ctx: Any, out: str, profile: Any, workers: int, args: argparse.Namespace, speed: float
) -> Any:
    """The serving overhead with one worker of `workers` busy (one request decoding alone, the
    others idle), fitted into the profile as the overhead by workers busy (plan/profile.py's
    `with_serving_alone`)."""
    from splitserve.bench.peer.main import Load
    from splitserve.plan.calibrate import at_calibration_speed, serving_load_flags, serving_point
    from splitserve.plan.profile import with_serving_alone

    name = system.spec.name
    points = []
    for i in range(SERVE_ALONE_RUNS):
        load = Load(f"serving-alone-{i}", serving_load_flags(1, 1, args.seed + 200 + i), args.load_timeout)
        records = at_calibration_speed(_run(system, load, ctx, out).requests, speed)
        b, context, engine_s, served_s = serving_point(records, 1, profile)
        print(
            f"[{name}] serving: one request alone, context {context}: engine step {engine_s * 1e3:.1f} ms, "
            f"served gap {served_s * 1e3:.1f} ms",
            flush=True,
        )
        points.append((b, context, engine_s, served_s))
    return with_serving_alone(profile, points, workers)


def _measure_serving_beside_prefill(
    system: Any, ctx: Any, out: str, profile: Any, workers: int, args: argparse.Namespace, speed: float = 1.0
) -> Any:
    """The serving overhead while prompts keep the prefill workers computing (plan/calibrate.py's
    `serving_point` again, beside bench/prefilling_prompts.py), fitted into the profile
    (plan/profile.py's `with_serving_beside_prefill`), which is saved again."""
    from splitserve.bench.peer.main import Load
    from splitserve.bench.prefilling_prompts import PrefillingPrompts
    from splitserve.plan.calibrate import SERVE_BATCHES, at_calibration_speed, serving_load_flags, serving_point
    from splitserve.plan.profile import save_profile, with_serving_beside_prefill

    name = system.spec.name
    points = []
    for i, batch in enumerate(SERVE_BATCHES):
        load = Load(
            f"serving-beside-prefill-b{batch}",
            serving_load_flags(batch, workers, args.seed + 300 + i),
            args.load_timeout,
        )
        with PrefillingPrompts(system.base_url, ctx.served_model_name, seed=args.seed + 300 + 10 * i) as prompts:
            prompts.wait_prefilling()
            records = at_calibration_speed(_run(system, load, ctx, out).requests, speed)
        try:
            b, context, engine_s, served_s = serving_point(records, workers, profile)
        except ValueError as e:
            print(f"[{name}] serving beside prefill: batch {batch} not measured: {e}", flush=True)
            continue
        print(
            f"[{name}] serving beside busy prefill workers: batch {b} per worker, context {context}: engine step "
            f"{engine_s * 1e3:.1f} ms, served gap {served_s * 1e3:.1f} ms ({prompts.sent} prompts beside)",
            flush=True,
        )
        points.append((b, context, engine_s, served_s))
    if not points:
        raise RuntimeError("the serving overhead beside busy prefill workers: no batch measured")
    profile = with_serving_beside_prefill(profile, points)
    save_profile(profile, os.path.join(out, f"profile-{name}.json"))
    print(f"[{name}] {serving_beside_prefill_line(profile)}; saved to the profile", flush=True)
    return profile


def serving_beside_prefill_line(p: Any) -> str:
    return (
        f"beside busy prefill workers a decode step costs {p.serve_prefill_step_s * 1e3:.2f} ms/step + "
        f"{p.serve_prefill_s_per_seq * 1e3:.3f} ms/token more"
    )


def _measure_prefill_load(
    system: Any,
    ctx: Any,
    out: str,
    profile: Any,
    decode: int,
    prefill: int,
    cached: int,
    args: argparse.Namespace,
    speed: float = 1.0,
) -> Any:
    """How a served prefill slows beside decoding requests, on this running system (plan/calibrate.py's
    `prefill_load_points`), fitted into the profile for it, which is saved again."""
    from splitserve.bench.decoding_streams import DecodingStreams
    from splitserve.bench.peer.main import Load
    from splitserve.plan.calibrate import (
        PREFILL_LOAD_STREAMS,
        at_calibration_speed,
        prefill_load_flags,
        prefill_load_points,
    )
    from splitserve.plan.profile import save_profile, with_prefill_load

    name = system.spec.name
    points = []
    for i, n in enumerate(PREFILL_LOAD_STREAMS):
        load = Load(f"prefill-beside-{n}", prefill_load_flags(args.seed + 200 + i), args.load_timeout)
        with DecodingStreams(system.base_url, ctx.served_model_name, n, max_tokens=2000) as streams:
            streams.wait_decoding()
            records = at_calibration_speed(_run(system, load, ctx, out).requests, speed)
            context = 40 + sum(streams.tokens) // max(n, 1) // 2  # the chat prompt, and about half what they made
        batch = 0 if prefill else -(-n // decode)  # on a prefill worker nothing else runs in its steps
        got = prefill_load_points(records, n, batch, context, cached, profile)
        ratios = sorted(s / e for _, e, s in got)
        print(
            f"[{name}] prefill beside {n} decoding: {len(got)} prompts, measured / model median "
            f"{ratios[len(ratios) // 2]:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})",
            flush=True,
        )
        points += got
    profile = with_prefill_load(profile, name, points)
    save_profile(profile, os.path.join(out, f"profile-{name}.json"))
    fit = next(f for f in profile.prefill_load_fits if f[0] == name)
    print(f"[{name}] {prefill_load_line(fit)}, saved to the profile", flush=True)
    return profile


def compare(mode: str, load: str, measured: Any, sim: Any, time_scale: float = 1.0) -> list[Pair]:
    """TTFT and ITL p50 and p90, measured (a bench serve RunResult, ms) against simulated (a SimResult,
    s, on a timeline `time_scale` times shorter than the measured one: see `Speed`)."""
    n, ms = measured.completed, 1e3 * time_scale
    return [
        Pair(mode, load, n, "TTFT p50", measured.ttft_ms.p50, sim.ttft.p50 * ms),
        Pair(mode, load, n, "TTFT p90", measured.ttft_ms.p90, sim.ttft.p90 * ms),
        Pair(mode, load, n, "ITL p50", measured.itl_ms.p50, sim.itl.p50 * ms),
        Pair(mode, load, n, "ITL p90", measured.itl_ms.p90, sim.itl.p90 * ms),
    ]


def _print_profile(p: Any) -> None:
    print(
        f"profile of {p.description}: chunk {p.max_num_batched_tokens}, {p.num_layers} layers, "
        f"KV {p.kv_bytes_per_token} B/token"
    )
    print(
        "  prefill (ms): "
        + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in p.prefill_points)
        + f"; + {p.prefill_s_per_token_ctx * 1e9:.1f} ns per new token per cached token"
    )
    print(
        f"  decode step = {p.decode_base_s * 1e3:.2f} ms + {p.decode_s_per_seq * 1e3:.3f} ms/request "
        f"+ {p.decode_s_per_ctx_token * 1e6:.2f} us/context token"
    )
    print(f"  KV transfer = {p.transfer_base_s * 1e3:.2f} ms + {p.transfer_s_per_byte * 1e9:.3f} ms/MB whole")
    if p.serve_points:
        print(
            f"  serving overhead ({p.serve_system}) = {p.serve_step_s * 1e3:.2f} ms/step + "
            f"{p.serve_s_per_seq * 1e3:.3f} ms/token"
            + (f", {p.serve_s_per_busy * 1e3:.2f} ms/step less per idle worker" if p.serve_s_per_busy else "")
        )
    if p.serve_prefill_points:
        print(f"  {serving_beside_prefill_line(p)}")
    print("  " + spread_line(p))
    for fit in p.prefill_load_fits:
        print(f"  {prefill_load_line(fit)}")


def prefill_load_line(fit: tuple[str, float, float, float, float]) -> str:
    """A system's fitted prefill under load (plan/profile.py's `Profile.prefill_load_fits`), N the
    requests decoding in the cluster."""
    system, scale, scale_per, fixed, fixed_per = fit
    return (
        f"prefill under load ({system}) = model x ({scale:.3f} + {scale_per:.4f} N) + "
        f"({fixed * 1e3:.1f} + {fixed_per * 1e3:.2f} N) ms"
    )


def spread_line(p: Any) -> str:
    """The decode steps' spread around the model, per batch: p10/p50/p90 of measured / modelled."""

    def at(ratios: tuple[float, ...], q: float) -> float:
        return ratios[min(range(len(p.spread_levels)), key=lambda i: abs(p.spread_levels[i] - q))]

    def table(t: Any) -> str:
        return ", ".join(f"b{b} {at(r, 0.1):.2f}/{at(r, 0.5):.2f}/{at(r, 0.9):.2f}" for b, r in t) or "not measured"

    return (
        f"step spread, p10/p50/p90 of measured / model: engine {table(p.decode_spread)}; "
        f"served gaps {table(p.serve_spread)}"
    )


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here
        )
        return done.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"
