"""`splitserve bench autoscale --fleet sim`: the burst of `bench autoscale`, its three policies, in
the plan simulator (plan/sim/) instead of over mocker processes, so that the fleet can be as large
as a deployment's (1,000 workers and more) where one machine hosts 128 mockers at most.

The policies are the pool manager's own arithmetic on the simulated workers' loads, read every
second of simulated time: cluster/scaling.py's `decide` for each pool (queue), and
cluster/joint.py's `decide` and `resize` for both (joint); fixed pools never change. The workers
are priced by the same flags as the mockers (`--model-shape`, `--gpu` or `--profile`; their KV
room and seats), a start that no standby covers takes `--cold-start-s`, and a standby worker is
routed after the activation `bench standby` measured. A prefill worker's speed, which a real one
measures on its prompt-only steps, is the cost model's for a full chunk.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from splitserve.bench.autoscale_plan import ROLES, Outcome, PoolPlan, Record, pool_plan
from splitserve.bench.mocker.main import mocker_spec
from splitserve.bench.mocker_fidelity import Request
from splitserve.cluster import joint, scaling
from splitserve.plan.sim.scaling import PoolsView, Resize, ScalingPolicy, SimScaling
from splitserve.plan.sim.simulate import ClusterSpec, simulate
from splitserve.plan.sim.simulate import Request as SimRequest

ACTIVATION_S = 0.08  # bench standby: a standby decode worker's activation to its first token


def simulated(args: argparse.Namespace, policies: Sequence[str], requests: list[Request]) -> tuple[list[Outcome], str]:
    """Each policy's outcome on the simulated fleet, and a line saying what the fleet is."""
    spec = mocker_spec(args)
    chunk = spec.max_num_batched_tokens
    speed = chunk / spec.costs.prefill_s(chunk)
    load = [SimRequest(r.at_s, len(r.prompt), args.output_tokens) for r in requests]
    burst_at = float(args.phases.split(",")[0])
    outcomes = []
    for policy in policies:
        plan = pool_plan(args, policy)
        cluster = ClusterSpec(
            "disaggregated",
            plan.starts["decode"],
            plan.starts["prefill"],
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=chunk,
            kv_capacity_tokens=spec.num_blocks * 16,
        )
        resized = SimScaling(
            _policy(plan, speed),
            cold_start_s=args.cold_start_s,
            activation_s=ACTIVATION_S,
            standby=(plan.standby["prefill"], plan.standby["decode"]),
        )
        result = simulate(load, cluster, spec.costs, random.Random(args.seed), scaling=resized)
        assert result.pools is not None
        records = [Record(o.arrival_s, o.ttft_s, o.tpot_s or 0.0) for o in result.outcomes]
        outcomes.append(
            Outcome(
                policy,
                records,
                result.pools.worker_seconds,
                result.pools.peak,
                burst_at,
                args.slo_ttft_ms / 1e3,
                args.slo_itl_ms / 1e3,
            )
        )
    line = (
        f"{args.prefill_max} prefill + {args.decode_max} decode workers at most, simulated (plan/sim/: each step "
        f"priced by {spec.costs_what}; a prefill worker's speed {speed:.0f} tokens/s, the model's for a "
        f"{chunk}-token chunk)"
    )
    return outcomes, line


def _policy(plan: PoolPlan, prefill_speed: float) -> ScalingPolicy:
    if plan.controller is not None:
        return _joint(plan.controller, prefill_speed)
    if any(c is not None for c in plan.scaling.values()):
        return _queue(plan.scaling)
    return lambda view: ()  # fixed pools


def _queue(configs: dict) -> ScalingPolicy:
    """cluster/scaling.py's policy for each pool, on its own queue (the pool manager's scale loop)."""
    states = {role: scaling.ScalerState() for role in ROLES}

    def policy(view: PoolsView) -> list[Resize]:
        out = []
        for role in ROLES:
            d, states[role] = scaling.decide(
                configs[role], view.routable[role], view.starting[role], view.draining[role], view.now, states[role]
            )
            if d.action == "grow":
                out.append(Resize(role, start=d.num_workers))
            elif d.action == "shrink" and d.worker is not None:
                out.append(Resize(role, drain=(d.worker,)))
        return out

    return policy


def _joint(cfg: joint.JointConfig, prefill_speed: float) -> ScalingPolicy:
    """cluster/joint.py's controller over both pools (the pool manager's joint_once)."""
    state = [joint.JointState()]

    def policy(view: PoolsView) -> list[Resize]:
        have = {role: len(view.routable[role]) + view.starting[role] for role in ROLES}
        obs = joint.Observation(
            now=view.now,
            prompt_tokens=view.prompt_tokens,
            requests=view.requests,
            prefill_tokens_per_s=prefill_speed,
            decode_context_tokens=sum(w.work_tokens for w in view.routable["decode"].values()),
            itl_s=view.itl_s,
            prefill_workers=have["prefill"],
            decode_workers=have["decode"],
        )
        decision, state[0] = joint.decide(cfg, obs, state[0])
        out = []
        for role, target in zip(ROLES, (decision.prefill, decision.decode), strict=True):
            grow, victim = joint.resize(target, have[role], view.routable[role])
            if grow or victim is not None:
                out.append(Resize(role, start=grow, drain=(victim,) if victim is not None else ()))
        return out

    return policy
