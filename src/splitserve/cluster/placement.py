"""Can the pools' Ray actors be placed? The asks against the cluster's nodes, before any starts.

Ray queues an actor whose resources no node has, silently and for ever: `serve
--decode-workers 2` on a 2-CPU machine used to wait with one worker up and no
word why. Checked here first, every shortfall comes out as a `Problem` (the type
engine/preflight.py's checks return) with the numbers (asked, available) and the
flag to change. Pure: the caller reads the nodes (`ray.nodes()`, or this machine's
cores before a local Ray starts) and decides what a shortfall means (a local
cluster stops; one joined with --ray-address may have an autoscaler that adds nodes).

With an autoscaler whose node types are known (`serve --node-types`), a worker
that no alive node can hold but some node type can is pending, not a problem:
the autoscaler adds that node. One that no node type can hold either would be
queued by Ray for ever, and is reported at once. (Ray's own autoscaler knows
this too, but says it only as a line of its event log; v1 keeps the node types
in its own process, and only v2 publishes infeasible requests in the GCS.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.problems import Check, Problem

CPU, GPU = "CPU", "GPU"
_FLAG = {CPU: "--cpus-per-worker", GPU: "--gpus-per-worker"}
_RESOURCE_FLAGS = "--prefill-resources/--decode-resources, --cpus-per-worker, --gpus-per-worker"


@dataclass(frozen=True)
class PoolAsk:
    """One pool's initial workers and what each asks Ray for."""

    role: str  # "prefill" or "decode"
    replicas: int
    per_worker: Mapping[str, float] = field(default_factory=dict)  # CPU, GPU and custom resources

    @classmethod
    def of(cls, role: str, replicas: int, cpus: float, gpus: float, resources: Mapping[str, float]) -> PoolAsk:
        """What a pool's actors ask Ray for (a PoolSpec's num_cpus, num_gpus and custom resources)."""
        return cls(role, replicas, {CPU: cpus, GPU: gpus, **resources})

    def total(self, resource: str) -> float:
        return self.replicas * self.per_worker.get(resource, 0.0)


def alive_nodes(ray_nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, float]]:
    """Each alive node's total resources, from what `ray.nodes()` returns."""
    return [n.get("Resources", {}) for n in ray_nodes if n.get("Alive")]


NodeTypes = Mapping[str, Mapping[str, float]]  # an autoscaler's node types: name -> resources of one node


def placement_problems(
    asks: Sequence[PoolAsk], nodes: Sequence[Mapping[str, float]], node_types: NodeTypes | None = None
) -> list[str]:
    """What cannot be placed, a line each ([] when every worker fits): placement_shortfalls, said."""
    return [p.line() for p in placement_shortfalls(asks, nodes, node_types)]


def placement_shortfalls(
    asks: Sequence[PoolAsk], nodes: Sequence[Mapping[str, float]], node_types: NodeTypes | None = None
) -> list[Problem]:
    """What cannot be placed ([] when every worker fits). `nodes`: each alive node's total
    resources, as Ray reports them (or as this machine has them, before a local Ray starts).
    `node_types`: the autoscaler's, when the cluster has one; then only a worker that neither an
    alive node nor any node type can hold is a problem (the sums do not matter: the autoscaler
    adds nodes)."""
    if node_types is not None:
        return [_never_placed(a, node_types) for a in asks if a.replicas and not _placeable(a, nodes, node_types)]
    return sum_shortfalls(asks, nodes) + node_shortfalls(asks, nodes)


def sum_shortfalls(asks: Sequence[PoolAsk], nodes: Sequence[Mapping[str, float]]) -> list[Problem]:
    """Each resource the pools ask more of than the nodes have in all. On one node (a local
    cluster) these are all the problems there are: a worker it cannot hold shows in a sum."""
    problems = []
    resources = sorted({r for a in asks for r, v in a.per_worker.items() if v > 0})
    for r in resources:
        asked = sum(a.total(r) for a in asks)
        have = sum(n.get(r, 0.0) for n in nodes)
        if asked > have + 1e-9:
            parts = " + ".join(f"{a.replicas} {a.role} x {a.per_worker.get(r, 0.0):g}" for a in asks if a.total(r))
            what = f"{r}: the pools ask for {asked:g} ({parts}), the Ray cluster has {have:g}"
            problems.append(Problem(Check.PLACEMENT, what, _fix(r, asks, have)))
    return problems


def node_shortfalls(asks: Sequence[PoolAsk], nodes: Sequence[Mapping[str, float]]) -> list[Problem]:
    """Each pool whose worker no node can hold: a worker is placed whole on one node, so the sums
    can fit while no node does."""
    return [
        Problem(
            Check.PLACEMENT,
            f"no node of the Ray cluster can hold one {a.role} worker ({_want(a)})",
            f"ask less per worker ({_RESOURCE_FLAGS}), or add a node that has it",
        )
        for a in asks
        if a.replicas and not any(_holds(n, a) for n in nodes)
    ]


def node_types_to_add(ask: PoolAsk, nodes: Sequence[Mapping[str, float]], node_types: NodeTypes) -> list[str]:
    """The node types that the autoscaler could add for one worker of `ask`, sorted; [] when an
    alive node can hold it already (or none can: see placement_problems)."""
    if any(_holds(n, ask) for n in nodes):
        return []
    return sorted(name for name, resources in node_types.items() if _holds(resources, ask))


def node_types_of_cluster_config(config: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The node types of a Ray cluster launcher config (`available_node_types`, each one's
    `resources`), as `serve --node-types` takes them."""
    types = config.get("available_node_types")
    if not isinstance(types, Mapping) or not types:
        raise ValueError("the cluster config has no available_node_types")
    return {name: {r: float(v) for r, v in (t.get("resources") or {}).items()} for name, t in types.items()}


def _holds(node: Mapping[str, float], ask: PoolAsk) -> bool:
    """Can this node (total resources) hold one worker of the ask? A worker is placed whole."""
    return all(node.get(r, 0.0) + 1e-9 >= v for r, v in ask.per_worker.items())


def _placeable(ask: PoolAsk, nodes: Sequence[Mapping[str, float]], node_types: NodeTypes) -> bool:
    return any(_holds(n, ask) for n in nodes) or any(_holds(t, ask) for t in node_types.values())


def _want(ask: PoolAsk) -> str:
    return ", ".join(f"{r} {v:g}" for r, v in sorted(ask.per_worker.items()) if v > 0)


def _never_placed(ask: PoolAsk, node_types: NodeTypes) -> Problem:
    have = "; ".join(
        f"{name}: " + (", ".join(f"{r} {v:g}" for r, v in sorted(t.items()) if not _ray_bookkeeping(r)) or "nothing")
        for name, t in sorted(node_types.items())
    )
    return Problem(
        Check.PLACEMENT,
        f"no node of the Ray cluster and no node type of its autoscaler can hold one {ask.role} worker "
        f"({_want(ask)}): the node types have {have}",
        f"add a node type that has it, or change the pool's resources ({_RESOURCE_FLAGS})",
    )


def describe_nodes(nodes: Sequence[Mapping[str, float]]) -> str:
    """What the cluster has, for a line beside a problem: "3 nodes: CPU 3, decode_node 2, prefill_node 1".
    Ray's own bookkeeping resources (memory, object store, each node's IP and ID) are left out."""
    totals: dict[str, float] = {}
    for n in nodes:
        for r, v in n.items():
            if not _ray_bookkeeping(r):
                totals[r] = totals.get(r, 0.0) + v
    have = ", ".join(f"{r} {v:g}" for r, v in sorted(totals.items())) or "nothing"
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {have}"


def _ray_bookkeeping(resource: str) -> bool:
    return resource in ("memory", "object_store_memory") or resource.startswith(("node:", "accelerator_type:"))


def _fix(resource: str, asks: Sequence[PoolAsk], have: float) -> str:
    workers = sum(a.replicas for a in asks if a.total(resource))
    if resource in _FLAG:
        fits = int(have / workers * 100) / 100 if workers and have > 0 else 0.0
        lower = f"set {_FLAG[resource]} to {fits:g} or less, " if fits > 0 else f"set {_FLAG[resource]} to 0, "
        return f"{lower}start fewer workers (--prefill-workers, --decode-workers), or add nodes"
    return (
        f"start a node with --resources '{{\"{resource}\": N}}', or drop it from --prefill-resources/--decode-resources"
    )


def fractional_cpus(asks: Sequence[PoolAsk], cluster_cpus: float) -> float:
    """CPUs per worker that fit every initial worker on `cluster_cpus` (at most 1): the default on a
    machine with fewer cores than workers, said out loud by the caller."""
    workers = sum(a.replicas for a in asks)
    if workers == 0 or cluster_cpus >= workers:
        return 1.0
    return int(cluster_cpus / workers * 100) / 100
