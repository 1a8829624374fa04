"""The pools against the machine, before a local Ray starts: can they be placed, and how
many threads they will run on how many cores.

`serve` used to learn that its pools did not fit from Ray, after starting it (and, before
placement.py, not at all). For a local cluster the machine is the one node `ray.init()`
would start, with the cores and GPUs Ray would count, so the same placement check
(placement.py) runs on it before anything starts. A joined cluster's nodes are known only
once connected; serve checks those then, before any actor starts.

Oversubscription is said, not refused: five decode workers on two cores run, slowly.
Pure but for `machine_resources`, which reads this machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from splitserve.cluster.placement import (
    CPU,
    GPU,
    NodeTypes,
    PoolAsk,
    fractional_cpus,
    placement_shortfalls,
    sum_shortfalls,
)
from splitserve.engine.problems import Problem
from splitserve.router.workers import Role


def machine_resources() -> dict[str, float]:
    """What a local Ray node on this machine has: the cores this process may run on, and its GPUs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    import torch  # already imported by the engine's config; device_count does not initialise CUDA

    gpus = torch.cuda.device_count()
    return {CPU: float(cores), **({GPU: float(gpus)} if gpus else {})}


def pool_asks(
    workers: Mapping[Role, int], cpus: float, gpus: float, resources: Mapping[Role, Mapping[str, float]]
) -> list[PoolAsk]:
    """Each pool's initial workers and what each asks Ray for (role -> count, role -> custom resources)."""
    return [PoolAsk.of(role, n, cpus, gpus, resources.get(role, {})) for role, n in workers.items()]


def worker_cpus(asked: float | None, workers: Mapping[Role, int], cluster_cpus: float | None) -> float:
    """CPUs each worker asks Ray for: --cpus-per-worker, else one, else (on a machine of our own,
    `cluster_cpus` known) the share that fits every initial worker: share its cores rather than
    wait for more."""
    if asked is not None:
        return asked
    if cluster_cpus is None:
        return 1.0
    return fractional_cpus([PoolAsk(role, n, {CPU: 1.0}) for role, n in workers.items()], cluster_cpus)


def machine_problems(
    asks: Sequence[PoolAsk], machine: Mapping[str, float], node_types: NodeTypes | None = None
) -> list[Problem]:
    """Workers that this machine, as a local Ray cluster's one node, cannot hold (with the node
    types, those that neither it nor a node type can)."""
    if node_types is not None:
        return placement_shortfalls(asks, [machine], node_types)
    return sum_shortfalls(asks, [machine])  # one node: the sums say it all, a line per resource


def threads_per_rank(threads_flag: int, cpus_per_worker: float, env: Mapping[str, str]) -> int:
    """The torch threads each rank of a worker actor runs: --threads, else OMP_NUM_THREADS as the
    environment sets it, else what Ray sets it to in an actor (its CPUs, floored, at least one)."""
    if threads_flag > 0:
        return threads_flag
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(math.floor(cpus_per_worker), 1)


def oversubscription(workers: Mapping[Role, int], ranks: Mapping[Role, int], threads: int, cores: float) -> str | None:
    """A warning when the pools' threads outnumber the cores (None when they do not): every
    worker then waits for a core, and the step times, TTFT and ITL say so, not why.
    `ranks`: processes per worker of each role (its tensor-parallel size on a CPU, else one)."""
    total = sum(n * ranks.get(role, 1) * threads for role, n in workers.items())
    if total <= cores:
        return None
    pools = " + ".join(
        f"{n} {role}" + (f" x {ranks[role]} ranks" if ranks.get(role, 1) > 1 else "")
        for role, n in workers.items()
        if n
    )
    return (
        f"{pools} workers x {threads} thread{'s' if threads != 1 else ''} = {total} threads on {cores:g} cores: "
        "oversubscribed, every step waits for a core; start fewer workers (--prefill-workers, "
        "--decode-workers) or fewer --threads"
    )
