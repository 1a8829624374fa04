"""`splitserve plan`: should this model, on these GPUs and this network, with this traffic,
be served disaggregated, and how?

    splitserve plan --model llama-3-70b --gpu h100-sxm --gpus 64 --tp 8 \\
        --network-gbps 400 --rdma --prompt-len 8192 --output-len 256 --rate 10

Prints the capacity arithmetic, the KV transfer, roofline step times, the five
checks and the recommendation. The simulator's flags (`--simulate`, ...: plan/sim/cli.py)
join these, and with `--simulate` it runs after the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from splitserve.plan.decision import Plan, decide
from splitserve.plan.deployment import Deployment, DeploymentCosts, smallest_fitting_tp, tp_sizes
from splitserve.plan.hardware import CPU_HERE, GPUS, Network, accelerator
from splitserve.plan.report import format_plan
from splitserve.plan.roofline import Efficiency
from splitserve.plan.shapes import BUILTIN, dtype_bytes, load_shape
from splitserve.plan.sim import cli as sim_cli
from splitserve.plan.sim.workload import Length, Workload, lengths_from_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", required=True, help=f"a built-in shape ({', '.join(BUILTIN)}), a config.json or a .gguf")
    g.add_argument("--gpu", default="h100-sxm", choices=[*GPUS, CPU_HERE], help="accelerator (datasheet peaks)")
    g.add_argument(
        "--cpu-profile",
        default=None,
        help="with --gpu cpu-here: a JSON file with measured memory_bytes_per_s and matmul_flops (else measured now)",
    )
    g.add_argument("--gpus", type=int, default=8, help="the whole GPU budget")
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size of one replica (default: the smallest power of two, up to --gpus and dividing "
        "the heads, at which the weights and one request's KV fit; the plan says which it took)",
    )
    g.add_argument(
        "--weight-dtype", default="bf16", help="bf16, fp8, int4, or a GGUF block format: q4_0, q4_k, q8_0, ..."
    )
    g.add_argument("--kv-dtype", default="bf16", help="bf16, fp8, ...")
    g.add_argument("--reserve", type=float, default=0.10, help="share of GPU memory kept for activations")
    g.add_argument("--max-num-seqs", type=int, default=256, help="the engine's cap on a decode batch")
    g.add_argument("--compute-efficiency", type=float, default=Efficiency().compute, help="share of peak FLOP/s")
    g.add_argument("--memory-efficiency", type=float, default=Efficiency().memory, help="share of HBM bandwidth")
    n = p.add_argument_group("network")
    n.add_argument("--network-gbps", type=float, default=100.0, help="link rate per GPU, Gb/s")
    kind = n.add_mutually_exclusive_group()
    kind.add_argument("--rdma", dest="rdma", action="store_true", help="RDMA (GPUDirect)")
    kind.add_argument("--tcp", dest="rdma", action="store_false", help="TCP through the host (the default)")
    n.add_argument("--network-efficiency", type=float, default=None, help="share of line rate (RDMA 0.9, TCP 0.5)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=None, help="a `bench serve --json` result: its prompt and output lengths")
    w.add_argument("--prompt-len", default="1024", help="tokens: MEAN or MEAN:STD")
    w.add_argument("--output-len", default="256", help="tokens: MEAN or MEAN:STD")
    w.add_argument("--prefix-reuse", type=float, default=0.0, help="share of prompt tokens found in a prefix cache")
    w.add_argument("--rate", type=float, default=None, help="requests/s (default: the --workload run's, else 1)")
    w.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    w.add_argument("--tpot-slo-ms", type=float, default=100.0)
    w.add_argument("--concurrency", type=int, default=0, help="report the longest context at this many requests")
    sim_cli.add_arguments(p)


def build(args: argparse.Namespace) -> tuple[Deployment, Workload]:
    """The deployment and workload the flags describe (ValueError on a bad one)."""
    profile = None
    if args.cpu_profile:
        with open(args.cpu_profile, encoding="utf-8") as f:
            profile = json.load(f)
    dep = Deployment(
        shape=load_shape(args.model),
        gpu=accelerator(args.gpu, profile),
        gpus=args.gpus,
        tp=args.tp or 1,  # without --tp: 1 here, then the smallest that fits (`_run`)
        network=Network.of(args.network_gbps, args.rdma, args.network_efficiency),
        weight_dtype_bytes=dtype_bytes(args.weight_dtype),
        kv_dtype_bytes=dtype_bytes(args.kv_dtype),
        eff=Efficiency(args.compute_efficiency, args.memory_efficiency),
        reserve=args.reserve,
        max_num_seqs=args.max_num_seqs,
    )
    prompt, output, rate = Length.parse(args.prompt_len), Length.parse(args.output_len), None
    if args.workload:
        prompt, output, rate = lengths_from_result(args.workload)
    wl = Workload(
        prompt=prompt,
        output=output,
        prefix_reuse=args.prefix_reuse,
        rate=args.rate if args.rate is not None else (rate or 1.0),
        ttft_slo_s=args.ttft_slo_ms / 1e3,
        tpot_slo_s=args.tpot_slo_ms / 1e3,
    )
    return dep, wl


def run(args: argparse.Namespace) -> int:
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader gone early shows here, inside the try, not at the exit's flush
        return code
    except BrokenPipeError:
        # the reader stopped reading (`splitserve plan ... | head`): it has what it wanted; no
        # traceback, and nothing more to a closed pipe at exit (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _smallest_tp(dep: Deployment, context: int) -> Deployment | None:
    """Without --tp: the smallest size that fits, said when it is not 1; None (said why) when none does."""
    fitting = smallest_fitting_tp(dep, context)
    if fitting is None:
        largest = replace(dep, tp=tp_sizes(dep.shape, dep.gpus)[-1])
        print(
            f"splitserve plan: no tensor-parallel size up to --gpus {dep.gpus} fits (at TP {largest.tp}, "
            f"{largest.shortfall(context)}): raise --gpus or lower --weight-dtype"
        )
    elif fitting.tp > 1:
        smaller = replace(dep, tp=fitting.tp // 2)
        print(
            f"splitserve plan: --tp not given: TP {fitting.tp}, the smallest tensor-parallel size at which "
            f"the weights and a {context:,}-token request's KV fit (at TP {smaller.tp}, {smaller.shortfall(context)})\n"
        )
    return fitting


def _run(args: argparse.Namespace) -> int:
    try:
        dep, wl = build(args)
    except (ValueError, OSError) as e:
        print(f"splitserve plan: {e}")
        return 2
    context = round(wl.prompt.mean) + round(wl.output.mean)
    if args.tp is None:
        fitting = _smallest_tp(dep, context)
        if fitting is None:
            return 2
        dep = fitting
    why = dep.does_not_fit(context)
    if why:
        print(f"splitserve plan: {why}")
        return 2
    plan: Plan = decide(dep, wl)
    print(format_plan(plan, args.concurrency))
    return sim_cli.run_simulation(args, plan, DeploymentCosts(dep))
