"""`splitserve bench mocker`: a fleet of mocker workers in this process, for a router to stand before.

    splitserve bench mocker --prefill 4 --decode 12 [--profile FILE | --model-shape llama-3-8b --gpu h100-sxm]

prints each worker's address, and the `splitserve router` command that fronts them,
then serves until interrupted. The step costs are a profile measured on this
machine (`--profile`, plan/calibrate.py's JSON), else the roofline of one
`--gpu` running `--model-shape` (plan/deployment.py).
"""

from __future__ import annotations

import argparse
import sys

from splitserve.bench.mocker.fleet import MockerSpec, start_fleet
from splitserve.plan.costs import CostModel
from splitserve.workers.server import wait_for_stop_signal, write_ready_file

ROOFLINE_SHAPE = "llama-3-8b"
ROOFLINE_GPU = "h100-sxm"


def add_costs_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that price a mocker's steps, for every command that starts mockers."""
    g = p.add_argument_group("mocker step costs")
    g.add_argument("--profile", default=None, help="a measured profile JSON (plan/calibrate.py) for the step costs")
    g.add_argument("--model-shape", default=ROOFLINE_SHAPE, help="without --profile: the modelled model's shape")
    g.add_argument("--gpu", default=ROOFLINE_GPU, help="without --profile: the modelled accelerator")
    g.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens per mocker")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running requests per mocker at most")
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="decode mockers send a stream's tokens in groups of at least this many",
    )


def mocker_spec(a: argparse.Namespace, cluster_token: str | None = None) -> MockerSpec:
    """The fleet the flags of `add_costs_arguments` describe (ValueError if they cannot be)."""
    costs, what, kv_bytes, chunk = _costs(a)
    return MockerSpec(
        costs,
        what,
        kv_bytes,
        num_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=chunk,
        cluster_token=cluster_token,
        stream_interval=a.stream_interval,
    )


def _costs(a: argparse.Namespace) -> tuple[CostModel, str, float, int]:
    """The cost model, where it comes from, the modelled KV bytes per token, and the step's token
    budget (a profile's: the chunk its engine ran with)."""
    if a.profile:
        from splitserve.plan.profile import ProfileCosts, load_profile

        profile = load_profile(a.profile)
        what = f"the profile {a.profile} ({profile.description})"
        return ProfileCosts(profile), what, profile.kv_bytes_per_token, profile.max_num_batched_tokens
    from splitserve.plan.deployment import Deployment, DeploymentCosts
    from splitserve.plan.hardware import Network, accelerator
    from splitserve.plan.shapes import load_shape

    dep = Deployment(load_shape(a.model_shape), accelerator(a.gpu), 1, 1, Network.of(100.0, True))
    what = f"the roofline of {a.model_shape} (bf16) on one {dep.gpu.name}"
    return DeploymentCosts(dep), what, dep.kv_bytes_per_token_per_gpu, MockerSpec.max_num_batched_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill mockers")
    p.add_argument("--decode", type=int, default=1, help="decode mockers")
    p.add_argument("--ready-file", default=None, help="write the addresses here once listening, one per line")
    add_costs_arguments(p)


def run(a: argparse.Namespace) -> int:
    if a.prefill < 0 or a.decode < 1:
        print("splitserve bench mocker: --decode must be at least 1 and --prefill at least 0", file=sys.stderr)
        return 2
    try:
        spec = mocker_spec(a)
    except ValueError as e:
        print(f"splitserve bench mocker: {e}", file=sys.stderr)
        return 2
    fleet = start_fleet(spec, a.prefill, a.decode)
    print(
        f"{a.prefill} prefill and {a.decode} decode mockers, steps timed by {spec.costs_what}; KV moved at 1/"
        f"{fleet.kv_scale:.0f} of its modelled bytes",
        flush=True,
    )
    flags = [f"--prefill {w.grpc_address}" for w in fleet.prefill] + [
        f"--decode {w.grpc_address}" for w in fleet.decode
    ]
    print("splitserve router " + " ".join(flags), flush=True)
    if a.ready_file:
        write_ready_file(a.ready_file, [f"{w.cfg.role} {w.grpc_address}" for w in fleet.workers])
    wait_for_stop_signal()
    fleet.stop()
    return 0
