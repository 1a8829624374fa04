"""The `splitserve` console command: one subcommand per job.

Each subcommand lives in its own module and is imported only when run, so
`splitserve generate` does not pay for Ray and `splitserve serve` does not pay
for transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from splitserve.runtime.grpc_fork import disable_grpc_fork_handlers

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


if __name__ == "__main__":
    sys.exit(main())
