"""The `splitserve` console command: one subcommand per job.

Each subcommand lives in its own module and is imported only when run, so
`splitserve generate` does not pay for Ray and `splitserve serve` does not pay
for transformers.

The flags reference (docs/flags.md) is read from the same parsers:
`python -m splitserve.cli flags-doc > docs/flags.md`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from splitserve.runtime.grpc_fork import disable_grpc_fork_handlers

if TYPE_CHECKING:
    from splitserve.engine.tuned import Tuned

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "serve": ("splitserve.cluster.serve", "start a local cluster: Ray, router, prefill and decode pools"),
    "generate": ("splitserve.generate", "generate text (in-process with --local, else through a router)"),
    "router": ("splitserve.router.main", "run the router alone, in front of workers given by address"),
    "worker": ("splitserve.workers.server", "run one prefill or decode worker as a plain process"),
    "kernels": (
        "splitserve.engine.kernels.prebuild",
        "build the C++ CPU kernels now, not at a worker's first use (make install runs it)",
    ),
    "plan": ("splitserve.plan.main", "disaggregate or not: capacity, roofline, five checks and a recommendation"),
}

# `splitserve bench NAME`: NAME -> module exposing add_arguments(parser) and run(args) -> int.
BENCHMARKS = {
    "engine": ("splitserve.bench.engine", "engine decode throughput against transformers and the hardware limits"),
    "transfer": ("splitserve.bench.transfer", "KV transfer GB/s per transport against the raw link"),
    "internal-tls": ("splitserve.bench.internal_tls", "the cluster's mutual TLS against plaintext: KV GB/s and TTFT"),
    "tenants": ("splitserve.bench.tenants", "a noisy tenant against three quiet ones: their TTFT beside alone, Jain"),
    "router": ("splitserve.bench.router", "router overhead against mock workers: added latency and decisions/s"),
    "router-load": ("splitserve.bench.router_load", "the rate one router carries: its CPU per request and per token"),
    "router-rate": (
        "splitserve.bench.router_rate",
        "the highest open-loop rate one router sustains within +5 ms p99, in front of a mocker fleet",
    ),
    "mocker": ("splitserve.bench.mocker.main", "mocker workers: the real worker services, steps timed by the planner"),
    "mocker-fidelity": ("splitserve.bench.mocker_fidelity", "mocker workers against real ones on one load: TTFT, TPOT"),
    "mocker-sim": (
        "splitserve.bench.mocker_sim",
        "a mocker fleet behind the real router against the simulator",
    ),
    "router-replicas": (
        "splitserve.bench.router_replicas",
        "router replicas against one router: CPU per request, connection spread, prefix-hit rate",
    ),
    "standby": ("splitserve.bench.standby", "a pool grown from a standby worker against a cold start: to first token"),
    "autoscale": (
        "splitserve.bench.autoscale",
        "pools under a 4x burst: fixed, the queue policy, the joint controller with standby; SLOs against cost",
    ),
    "ray-nodes": (
        "splitserve.bench.ray_nodes",
        "a multi-node Ray cluster behind a shaped link: pools grown from standby under a burst, a node killed",
    ),
    "fleet-loss": ("splitserve.bench.fleet_loss", "a share of a mocker fleet killed under load: lost, wrong, blocks"),
    "serving": ("splitserve.bench.serving", "TTFT and ITL, disaggregated against colocated, on real worker processes"),
    "tiers": ("splitserve.bench.tiers", "TTFT of a host-tier and a disk-tier prefix hit against recomputing it"),
    "serve": ("splitserve.bench.serve.main", "load an OpenAI-compatible or gRPC server: goodput, TTFT, TPOT, ITL"),
    "peer": ("splitserve.bench.peer.main", "vLLM's CPU build against splitserve, same model and load, in one run"),
    "conversation": (
        "splitserve.bench.peer.conversation",
        "multi-turn sessions over KV tiers: tier-aware against tier-blind routing and vLLM, TTFT by prefix source",
    ),
    "structured": ("splitserve.bench.structured", "decode step with and without a JSON schema; grammar compile time"),
    "kv-dtype": ("splitserve.bench.kv_dtype", "quantized KV (int8, fp8) against bfloat16: quality, capacity, speed"),
    "windows": (
        "splitserve.bench.windows",
        "a windowed model's cache of pages against whole contexts: capacity, bytes",
    ),
    "quant": (
        "splitserve.bench.quant",
        "a GGUF file's blocks computed in place against the file dequantized: bytes, speed, accuracy",
    ),
    "synthetic-gguf": (
        "splitserve.bench.synthetic_gguf",
        "write a large model's shape (Llama 3 8B) as a GGUF of random blocks with the embedded tokenizer",
    ),
    "start": (
        "splitserve.bench.serve_start",
        "serve a large file with no flag (memory, readiness, one request), or see its start refused",
    ),
    "kernels-isa": ("splitserve.bench.kernels_isa", "the CPU kernels' ISA paths side by side: linear and attention"),
    "spec": ("splitserve.bench.spec", "speculative decoding against plain decode: copying load and ShareGPT"),
    "prefill-profile": (
        "splitserve.bench.prefill_profile",
        "where a lone long prompt's prefill time goes, per thread count",
    ),
    "plan-check": ("splitserve.bench.plan_check", "the plan simulator against measured bench serve runs: TTFT, ITL"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str, chosen: bool) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module)
    if not chosen:  # only the subcommand being run pays for its imports
        return
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=module)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    words = [w for w in argv if not w.startswith("-")][:2]
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        _add(sub, name, module, help_, words[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks that print measured ratios")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_, words == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    disable_grpc_fork_handlers()  # before any subcommand imports gRPC
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"splitserve: {args._missing} is not built yet", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


# ---- the flags reference: docs/flags.md, regenerated from the parsers (tests/test_flags_doc.py)

# the commands that run a cluster or a piece of one, in the reference
REFERENCE_COMMANDS = ("serve", "router", "worker", "generate")
FLAGS_DOC_COMMAND = "python -m splitserve.cli flags-doc > docs/flags.md"


def flags_reference() -> str:
    """docs/flags.md: each command's flags as its parser has them, a table per flag group, and the
    tuned choices behind the defaults marked tuned."""
    lines = [
        "# The flags of splitserve's commands",
        "",
        f"Generated from the commands' own parsers by `{FLAGS_DOC_COMMAND}` (`make flags-doc`);",
        "`tests/test_flags_doc.py` fails when this file and the parsers differ. `splitserve COMMAND --help`",
        "says the same. A default of *tuned* is the machine's tuned choice ([below](#tuned-defaults)),",
        "which `serve` prints at start; a flag given wins.",
    ]
    for name in REFERENCE_COMMANDS:
        lines += _command_reference(name)
    return "\n".join(lines + _tuned_reference()) + "\n"


def _command_reference(name: str) -> list[str]:
    from splitserve.engine.tuned import MACHINE_SHARES, Tuned

    module, help_ = SUBCOMMANDS[name]
    p = argparse.ArgumentParser(prog=f"splitserve {name}")
    importlib.import_module(module).add_arguments(p)
    # only serve, which starts the whole cluster, takes the machine's shares from the table
    tuned = {f.name for f in fields(Tuned)} - (set() if name == "serve" else MACHINE_SHARES)
    lines = ["", f"## splitserve {name}", "", f"{help_[0].upper()}{help_[1:]}."]
    groups = [(g.title or "", _shown(g._group_actions)) for g in p._action_groups]
    groups = [(title, actions) for title, actions in groups if actions]
    for title, actions in groups:
        if len(groups) > 1:
            lines += ["", f"### {title}"]
        lines += ["", "| flag | default | what it does |", "| --- | --- | --- |"]
        lines += [f"| `{_invocation(a)}` | {_default(a, tuned)} | {_help(a)} |" for a in actions]
    return lines


def _shown(actions: list[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def _invocation(a: argparse.Action) -> str:
    names = ", ".join(a.option_strings) or a.dest
    if a.nargs == 0:
        return names
    if a.choices is not None:
        value = "{" + ",".join(str(c) for c in a.choices) + "}"
    elif isinstance(a.metavar, str):
        value = a.metavar
    else:  # a number's name says less than N
        value = "N" if a.type in (int, float) else a.dest.upper()
    return f"{names} {value}" if a.option_strings else value


def _default(a: argparse.Action, tuned: set[str]) -> str:
    """The default as a reader sees it: tuned, the environment variable it is read from (never the
    value this process found there), on or off for a switch, or the parser's own."""
    if a.dest in tuned:
        return "tuned"
    env = re.search(r"\(default: (\$\w+)", a.help or "")
    if env:
        return f"`{env.group(1)}`"
    if a.nargs == 0:
        return "on" if a.default else "off"
    if a.default is None or a.default == argparse.SUPPRESS or a.default in ((), []):
        return ""
    return f"`{a.default!s}`" if a.default != "" else "`''`"


def _help(a: argparse.Action) -> str:
    return " ".join((a.help or "").replace("%%", "%").split()).replace("|", "\\|")


def _tuned_reference() -> list[str]:
    """The tuned choices of three machines, each a row of the flags whose default is tuned."""
    from splitserve.engine.tuned import Machine, Tuned, tuned_defaults

    machines = {
        "a CPU of 2 cores without bf16 arithmetic": Machine("cpu", 2, frozenset({"avx2"})),
        "a CPU of 16 cores with AVX-512 BF16": Machine("cpu", 16, frozenset({"avx2", "avx512f", "avx512_bf16"})),
        "CUDA": Machine("cuda", 16, frozenset()),
    }
    choices = [tuned_defaults(m) for m in machines.values()]
    lines = [
        "",
        "## Tuned defaults",
        "",
        "What the benchmarks found best for the machine (`src/splitserve/engine/tuned.py`, each choice beside the",
        "measurement behind it), chosen from its arithmetic and cores. `serve` applies them all and prints them at",
        "start; a worker or `generate` started alone takes no share of the machine (torch's own threads, no core",
        "lease), and `splitserve router` takes the routing choices. For example:",
        "",
        "| flag | " + " | ".join(machines) + " |",
        "| --- |" + " --- |" * len(machines),
    ]
    for f in fields(Tuned):
        if f.name == "block_kernel":  # said at start, not a flag
            continue
        values = [_tuned_value(t, f.name) for t in choices]
        lines.append(f"| `--{f.name.replace('_', '-')}` | " + " | ".join(values) + " |")
    return lines


def _tuned_value(tuned: Tuned, name: str) -> str:
    if name == "core_lease":
        return "a file in /dev/shm per cluster" if tuned.core_lease else "off"
    value = tuned.flag_values()[name]
    return "torch's own" if name == "threads" and value == 0 else f"`{value}`"


if __name__ == "__main__":
    if sys.argv[1:] == ["flags-doc"]:  # the reference, regenerated: FLAGS_DOC_COMMAND
        sys.stdout.write(flags_reference())
        sys.exit(0)
    sys.exit(main())
