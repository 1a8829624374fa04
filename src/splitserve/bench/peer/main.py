"""`splitserve bench peer`: vLLM's CPU build and llama.cpp's llama-server against splitserve
on this machine, the same model (the GGUF's weights exported as one HF directory that vLLM
and splitserve load; llama-server loads the GGUF itself, and so does splitserve with
--splitserve-on-gguf), the same loads (`splitserve bench serve`, same seeds), one system at
a time:

    for each system in --systems: start it, warm it up, run every load, stop it

then one table in which every figure is also a ratio to the first peer's (vLLM's where it
runs, else llama.cpp's), a line per system with the cores it computed on, the combined
JSON, and the sweep plot where bench serve provides one. vLLM's CPU wheel needs AVX-512:
on a CPU without it the run says so and goes on with llama.cpp.

    splitserve bench peer --systems llamacpp,auto --splitserve-on-gguf \
        --splitserve-flags "--quantization auto" --loads sharegpt

    splitserve bench peer --quick --vllm-venv /work/peer/vllm --skip-install
    splitserve bench peer --splitserve-flags "--dtype bfloat16" --system-flags "auto=--max-num-batched-tokens 256"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from splitserve.bench.peer import report
from splitserve.bench.peer.servers import (
    PEERS,
    SYSTEMS,
    LaunchContext,
    RunningSystem,
    SystemSpec,
    describe_cores,
    system_kind,
)

LOADS = ("sharegpt", "sweep", "burst", "prefill")
DEFAULT_OUT = os.path.join("bench", "results", "peer")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "peer")
SERVED_MODEL_NAME = "smollm2-135m-instruct"
GOODPUT = ("ttft:3000", "tpot:100")


@dataclass(frozen=True)
class Load:
    """One `bench serve` invocation: its name (a key of the results) and its flags."""

    name: str
    flags: tuple[str, ...]
    timeout_s: float


# prompts per prefill probe and concurrency: each load sends this many rounds
PREFILL_ROUNDS = 5


def loads_for(names: list[str], quick: bool, rates: str, timeout_s: float) -> list[Load]:
    """The bench serve invocations of the named loads. Each load has its own seed: both systems
    cache prefixes, and a prompt seen in an earlier load would be a cache hit in a later one."""

    def n(full: int, small: int) -> str:
        return str(small if quick else full)

    out_len = n(128, 16)
    slo = ["--goodput", *GOODPUT]
    prompt_len = n(1000, 200)
    table = {
        "sharegpt": [
            Load(
                "sharegpt",
                (
                    "--dataset",
                    "sharegpt",
                    "--num-prompts",
                    n(40, 4),
                    "--max-concurrency",
                    n(4, 2),
                    "--sharegpt-output-len",
                    out_len,
                    "--ignore-eos",
                    "--seed",
                    "1",
                    *slo,
                ),
                timeout_s,
            )
        ],
        "sweep": [
            Load(
                "sweep",
                (
                    "--dataset",
                    "sharegpt",
                    "--num-prompts",
                    n(20, 3),
                    "--request-rate",
                    "0.5,1" if quick else rates,
                    "--sharegpt-output-len",
                    out_len,
                    "--ignore-eos",
                    "--seed",
                    "2",
                    *slo,
                ),
                timeout_s,
            )
        ],
        # bench serve's burst schedule (steady streams, long prompts at once in between): its own defaults
        "burst": [
            Load(
                "burst",
                (
                    "--dataset",
                    "burst",
                    "--seed",
                    "3",
                    *slo,
                    *(
                        (
                            "--burst-count",
                            "1",
                            "--burst-interval-s",
                            "2",
                            "--burst-input-len",
                            "200",
                            "--burst-steady-output-len",
                            "32",
                        )
                        if quick
                        else ()
                    ),
                ),
                timeout_s,
            )
        ],
        # long prompts one at a time, then two in flight, one output token each: TTFT is the prefill.
        # PREFILL_ROUNDS of each, since one request's TTFT moved by 20% from run to run here
        "prefill": [
            Load(
                f"prefill{k}",
                (
                    "--dataset",
                    "random",
                    "--random-input-len",
                    prompt_len,
                    "--random-output-len",
                    "1",
                    "--num-prompts",
                    str(k * PREFILL_ROUNDS),
                    "--max-concurrency",
                    str(k),
                    "--ignore-eos",
                    "--seed",
                    str(3 + k),
                ),
                timeout_s,
            )
            for k in (1, 2)
        ],
        # one ~1,000-token prompt at a time asking for 32 tokens: a lone prompt's TTFT and batch-1
        # decode (TPOT), two rounds; not in the default set (--loads lone)
        "lone": [
            Load(
                "lone",
                (
                    "--dataset",
                    "random",
                    "--random-input-len",
                    prompt_len,
                    "--random-output-len",
                    n(32, 8),
                    "--num-prompts",
                    "2",
                    "--max-concurrency",
                    "1",
                    "--ignore-eos",
                    "--seed",
                    "9",
                ),
                timeout_s,
            )
        ],
    }
    unknown = [x for x in names if x not in table]
    if unknown:
        raise ValueError(f"unknown load(s) {', '.join(unknown)}; expected some of {', '.join(table)}")
    return [load for x in names for load in table[x]]


def bench_serve_argv(
    load: Load, base_url: str, model: str, tokenizer: str, json_path: str, label: str, backend: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "splitserve.cli",
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        base_url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--no-progress",
        *load.flags,
        "--json",
        json_path,
        "--label",
        label,
    ]


def system_specs(
    systems: list[str],
    splitserve_flags: str,
    vllm_flags: str,
    router_flags: str,
    per_system: list[str],
    llamacpp_flags: str = "",
) -> list[SystemSpec]:
    """--splitserve-flags for every splitserve system, --vllm-flags for vLLM, --llamacpp-flags for
    llama-server, then each `SYSTEM=FLAGS` of --system-flags appended to that system's (later
    flags win)."""
    extra: dict[str, list[str]] = {}
    for item in per_system:
        name, sep, flags = item.partition("=")
        if not sep or (name not in SYSTEMS and name not in systems):
            raise ValueError(f"--system-flags {item!r}: expected SYSTEM=FLAGS with SYSTEM one of {', '.join(SYSTEMS)}")
        extra.setdefault(name, []).extend(shlex.split(flags))
    specs = []
    peer_flags = {"vllm": vllm_flags, "llamacpp": llamacpp_flags}
    for name in systems:
        kind = system_kind(name)
        base = shlex.split(peer_flags.get(kind, splitserve_flags))
        router = () if kind in PEERS else tuple(shlex.split(router_flags))
        specs.append(SystemSpec(name, tuple(base + extra.get(name, [])), router))
    return specs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma list of {', '.join(SYSTEMS)}; KIND:LABEL runs a variant of one beside it (its flags from "
        "--system-flags KIND:LABEL=FLAGS)",
    )
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma list of {', '.join(LOADS)}")
    p.add_argument("--rates", default="0.2,0.4,0.6,0.8", help="the sweep's Poisson request rates (req/s)")
    p.add_argument("--quick", action="store_true", help="tiny loads: a smoke run of the whole harness")
    p.add_argument("--out", default=DEFAULT_OUT, help="results: per-load JSON, logs, peer.json, plots")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-dir", default=None, help="where its HF export goes (default: under ~/.cache)")
    p.add_argument("--vllm-venv", default=None, help="vLLM's venv (default: ~/.cache/splitserve/peer/vllm-venv)")
    p.add_argument("--skip-install", action="store_true", help="use --vllm-venv as it is; fail if vllm does not import")
    p.add_argument("--cores", default=None, help="cores to pin to, e.g. 0,1 (default: all usable; 'none': unpinned)")
    p.add_argument(
        "--splitserve-flags", default="", help='engine flags for every splitserve worker, e.g. "--dtype bfloat16"'
    )
    p.add_argument("--router-flags", default="", help="flags for every splitserve router")
    p.add_argument("--vllm-flags", default="", help="flags appended to vLLM's API server")
    p.add_argument("--llamacpp-flags", default="", help="flags appended to llama-server's")
    p.add_argument(
        "--splitserve-on-gguf",
        action="store_true",
        help="splitserve loads the GGUF file itself (as llama-server does) instead of the HF export",
    )
    p.add_argument("--llamacpp-slots", type=int, default=4, help="llama-server's parallel sequences (--parallel)")
    p.add_argument(
        "--system-flags",
        action="append",
        default=[],
        metavar="SYSTEM=FLAGS",
        help="flags for one system only, appended after the above (repeatable)",
    )
    p.add_argument("--backend", default="openai-chat", choices=["openai-chat", "openai-completions"])
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a system to serve")
    p.add_argument("--load-timeout", type=float, default=3600.0, help="seconds for one bench serve run")
    p.add_argument("--replot", action="store_true", help="only redraw the charts from --out's peer.json")
    p.add_argument(
        "--no-core-lending",
        action="store_true",
        help="pin each splitserve worker to its share of the cores instead of sharing a core lease",
    )
    p.add_argument(
        "--results",
        default=None,
        help="also write everything printed to this file, after a header line: the command, commit, date, "
        "the CPU's flags and the load average (bench/results/peer-*.txt)",
    )


def parse_cores(value: str | None) -> tuple[int, ...] | None:
    if value == "none":
        return None
    if value is None:
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(int(c) for c in value.split(",") if c.strip())


def run(args: argparse.Namespace) -> int:
    from splitserve.bench.results_file import with_results

    return with_results(None if args.replot else args.results, lambda: _run(args))


def _dtype(splitserve_flags: str) -> str:
    """splitserve's dtype: its --dtype flag, else what the machine's tuned default is (engine/tuned.py)."""
    from splitserve.bench.peer.servers import last_flag
    from splitserve.engine.tuned import detect_machine, tuned_defaults

    return last_flag(shlex.split(splitserve_flags), "--dtype") or tuned_defaults(detect_machine()).dtype


def _run(args: argparse.Namespace) -> int:
    if args.replot:
        with open(os.path.join(args.out, "peer.json"), encoding="utf-8") as f:
            plot(json.load(f)["systems"], args.out)
        return 0
    from splitserve.bench.peer.hf_export import export_hf_dir
    from splitserve.bench.peer.vllm_env import DEFAULT_VENV, VllmEnvError, VllmEnvSpec, ensure_vllm_env

    try:
        specs = system_specs(
            _split(args.systems),
            args.splitserve_flags,
            args.vllm_flags,
            args.router_flags,
            args.system_flags,
            args.llamacpp_flags,
        )
        loads = loads_for(_split(args.loads), args.quick, args.rates, args.load_timeout)
    except ValueError as e:
        print(f"splitserve bench peer: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    specs = _runnable(specs)
    if any(s.is_vllm for s in specs) or not args.splitserve_on_gguf:
        model_dir = os.path.abspath(args.model_dir or os.path.join(DEFAULT_CACHE, "model"))
        print(f"model: exporting to {model_dir} (reused when current)", flush=True)
        export_hf_dir(args.model, model_dir)
    else:  # every system loads the GGUF itself (and bench serve reads its tokenizer from it)
        model_dir = _gguf_path(args.model)
    try:
        llama = _llama_server(specs)
    except RuntimeError as e:
        print(f"splitserve bench peer: llama.cpp: {e}", file=sys.stderr)
        return 1
    vllm_python = ""
    if any(s.is_vllm for s in specs):
        try:
            vllm_python = ensure_vllm_env(
                VllmEnvSpec(venv=args.vllm_venv or DEFAULT_VENV),
                args.skip_install,
                log=os.path.join(logs, "vllm-install.log"),
            )
        except VllmEnvError as e:
            print(f"splitserve bench peer: vLLM venv: {e}", file=sys.stderr)
            return 1
    dtype = _dtype(args.splitserve_flags)
    print(f"dtype: {dtype} for both systems (vLLM's --dtype is splitserve's)", flush=True)
    from splitserve.engine.tuned import detect_machine, tuned_defaults

    # what splitserve's workers and router run with where their argv below gives no flag
    print(f"splitserve's defaults on this machine: {tuned_defaults(detect_machine()).line()}", flush=True)
    ctx = LaunchContext(
        dtype=dtype,
        lend_cores=not args.no_core_lending,
        model_dir=model_dir,
        served_model_name=SERVED_MODEL_NAME,
        workdir=logs,
        vllm_python=vllm_python,
        cores=parse_cores(args.cores),
        kv_cache_gib=args.kv_cache_gib,
        start_timeout_s=args.start_timeout,
        gguf=_gguf_path(args.model),
        llama_server=llama or "",
        llamacpp_slots=args.llamacpp_slots,
        splitserve_model=_gguf_path(args.model) if args.splitserve_on_gguf else "",
    )
    for load in loads:  # what each row of the table measured, before any figure
        print(f"load {load.name}: bench serve {' '.join(load.flags)} --backend {args.backend}", flush=True)
    results = {spec.name: run_system(spec, ctx, loads, out, args.backend) for spec in specs}
    return finish(results, [s.name for s in specs], [load.name for load in loads], out, ctx)


def _gguf_path(model: str | None) -> str:
    from splitserve.engine import embedded

    return os.path.realpath(embedded.resolve(model))


def _runnable(specs: list[SystemSpec]) -> list[SystemSpec]:
    """The systems that can run on this CPU: vLLM's CPU wheel needs AVX-512 (on AVX2 it dies with
    "Illegal instruction"), so there it is left out, said so, and the run goes on with the rest."""
    from splitserve.measure.hw import cpu_flags

    if "avx512f" in cpu_flags().split():
        return specs
    if any(s.is_vllm for s in specs):
        print("vllm: left out: its CPU wheel needs AVX-512 and this CPU has not (Illegal instruction)", flush=True)
    return [s for s in specs if not s.is_vllm]


def _llama_server(specs: list[SystemSpec]) -> str | None:
    """llama-server's binary where a system needs it (built once, cached), None where none does;
    RuntimeError (llama_cpp.BuildError) when it cannot be built."""
    if not any(s.kind == "llamacpp" for s in specs):
        return None
    from splitserve.bench.peer.llama_cpp import ensure_llama_server

    print("llamacpp: building llama-server from llama-cpp-python's sources (cached after the first run)", flush=True)
    try:
        info = ensure_llama_server()
    except OSError as e:
        raise RuntimeError(str(e)) from e
    print(f"llamacpp: {info.line()}", flush=True)
    return info.binary


def run_system(spec: SystemSpec, ctx: LaunchContext, loads: list[Load], out: str, backend: str) -> dict[str, Any]:
    """Start the system, run every load against it, stop it; errors are recorded, not raised,
    so that one system failing still leaves the others' figures."""
    from splitserve.bench.peer.servers import ServerError, start_system
    from splitserve.measure.hw import wait_until_quiet

    res: dict[str, Any] = {"flags": list(spec.flags), "router_flags": list(spec.router_flags), "loads": {}}
    # the system before may still be exiting (vLLM frees GiBs): the next must not start beside it
    waited, busy = wait_until_quiet()
    print(f"[{spec.name}] starting (machine quiet after {waited:.0f}s: {busy:.0%} busy)", flush=True)
    try:
        system = start_system(spec, ctx)
    except ServerError as e:
        print(f"[{spec.name}] ERROR: did not start: {e}", file=sys.stderr, flush=True)
        return res | {"error": f"start: {e}"}
    with system:
        res |= {"start_s": system.start_s, "cores": system.cores, "argv": system.argv}
        print(
            f"[{spec.name}] serving at {system.base_url} after {system.start_s:.1f}s; "
            f"{describe_cores(spec.name, system.cores)}",
            flush=True,
        )
        try:
            res["warmup"] = warmup(system.base_url, ctx.served_model_name)
        except OSError as e:
            return res | {"error": f"warmup: {e}"}
        for load in loads:
            res["loads"][load.name] = run_load(system, load, ctx, out, backend)
    return res


def warmup(base_url: str, model: str, timeout_s: float = 300.0) -> str:
    """One short chat request before the loads: first-use costs (kernel builds, graph captures)
    must not land in the first load's figures. Returns the reply's text."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        base_url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        reply = json.load(r)
    return str(reply["choices"][0]["message"]["content"])


def run_load(system: RunningSystem, load: Load, ctx: LaunchContext, out: str, backend: str) -> dict[str, Any]:
    name = system.spec.name
    json_path = os.path.join(out, f"{name}-{load.name}.json")
    if os.path.exists(json_path):
        os.remove(json_path)  # a stale file must not pass for this run's
    argv = bench_serve_argv(load, system.base_url, ctx.served_model_name, ctx.model_dir, json_path, name, backend)
    print(f"[{name}] load {load.name}", flush=True)
    t0 = time.monotonic()
    with open(os.path.join(ctx.workdir, f"{name}-{load.name}.bench.log"), "wb") as log:
        try:
            rc = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=load.timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"bench serve ran past {load.timeout_s:g}s"}
    if rc != 0 or not os.path.exists(json_path):
        return {"error": f"bench serve exited with {rc} (log: {log.name})"}
    with open(json_path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    system.check_alive()
    print(f"[{name}] load {load.name} done in {time.monotonic() - t0:.0f}s", flush=True)
    return data


def finish(
    results: dict[str, dict[str, Any]], systems: list[str], loads: list[str], out: str, ctx: LaunchContext
) -> int:
    rows = report.table_rows(results, loads)
    # a peer, else the first system: the variants of one are held against it
    baseline = next((s for s in systems if s in PEERS), systems[0] if systems else report.BASELINE)
    print()
    print(report.format_table(rows, systems, baseline))
    print()
    for name in systems:
        res = results[name]
        if "cores" in res:
            start = f"started in {res['start_s']:.1f}s"
            print(f"{describe_cores(name, res['cores'])}; {start}; flags: {' '.join(res['flags']) or '-'}")
            for proc, argv in res.get("argv", {}).items():  # what each process ran with, defaults included
                print(f"  {proc}: {shlex.join(argv)}")
        for what, value in [("", res.get("error"))] + [(f" {k}", v.get("error")) for k, v in res["loads"].items()]:
            if value:
                print(f"{name}{what}: ERROR {value}")
    combined = {
        "model_dir": ctx.model_dir,
        "served_model_name": ctx.served_model_name,
        "systems": results,
        "baseline": baseline,
        "table": report.ratios(rows, systems, baseline),
    }
    path = os.path.join(out, "peer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(combined, f, indent=1)
    print(f"\nwrote {path}")
    plot(results, out)
    failed = any(r.get("error") or any(v.get("error") for v in r["loads"].values()) for r in results.values())
    return 1 if failed else 0


def plot(results: dict[str, dict[str, Any]], out: str) -> None:
    """The charts, one line (or panel) per system: goodput and SLO attainment against the rate;
    the ShareGPT load's TTFT, TPOT and ITL distributions; the burst load's ITL over time."""
    from splitserve.measure.plots import plot_burst, plot_compare, plot_sweep

    def of(load: str) -> list[dict[str, Any]]:
        return [r["loads"][load] for r in results.values() if "runs" in r.get("loads", {}).get(load, {})]

    drawn = []
    if of("sweep"):
        drawn.append(plot_sweep(of("sweep"), out))
    if of("sharegpt"):
        drawn.append(plot_compare(of("sharegpt"), out, "sharegpt"))
    if of("burst"):
        drawn.append(plot_burst(of("burst"), out))
    for path in drawn:
        print(f"plot {path}")


def _split(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]
