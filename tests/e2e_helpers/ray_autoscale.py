"""An autoscaling Ray cluster on one machine for the end-to-end tests: the head's autoscaler (Ray's
v1 monitor process) with Ray's fake multi-node provider (`ray.autoscaler._private.fake_multi_node`),
which starts each node it adds as a real raylet process of this machine and stops it when the
autoscaler removes the node.

Not `ray.cluster_utils.AutoscalingCluster`, which drives the same provider: it runs `ray stop
--force` before and after (every Ray process of the machine, other tests' included), its fake nodes
dial the GCS on the fixed port 6379, and it reads an example.yaml that the installed wheel lacks.
Here the head is a `ray.cluster_utils.Cluster` head on a free port, given the autoscaling config;
the processes its autoscaler starts are stopped by their ids at the end.

Importing this module (through ray_pools) sets Ray's auth environment: import it before Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import tests.e2e_helpers.ray_pools  # noqa: F401  (Ray's token auth, before anything imports Ray)

HEAD_TYPE = "ray.head.default"
MB = 1024 * 1024
NODE_STORE_BYTES = 80 * MB  # each node's object store: the workers pass no objects through it


@dataclass(frozen=True)
class NodeType:
    """One worker node type of the autoscaling config: what a node of it has, how many there may be."""

    name: str
    resources: Mapping[str, float]  # CPU, GPU and custom resources of one node
    min_workers: int = 0
    max_workers: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"node type {self.name}: needs 0 <= min_workers <= max_workers")


def autoscaling_config(
    node_types: list[NodeType], gcs_address: str, idle_timeout_minutes: float, head_cpus: float = 0.0
) -> dict[str, Any]:
    """A cluster launcher config for the fake multi-node provider: the fields its example.yaml has,
    the head of `head_cpus`, and `node_types` as the worker node types."""
    types: dict[str, Any] = {
        HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
    }
    for t in node_types:
        types[t.name] = {
            "resources": {**t.resources, "object_store_memory": NODE_STORE_BYTES},
            "node_config": {},
            "min_workers": t.min_workers,
            "max_workers": t.max_workers,
        }
    return {
        "cluster_name": "splitserve-autoscale-test",
        "max_workers": sum(t.max_workers for t in node_types),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,  # the provider's default is the fixed port 6379
        },
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclass
class AutoscalingNodes:
    """The running cluster: Ray (connected to it), its autoscaling config, and node counts by type."""

    ray: Any
    cluster: Any  # ray.cluster_utils.Cluster: the head alone; the autoscaler adds the rest
    config: dict[str, Any]
    node_types: list[NodeType]
    seen: dict[str, set[int]] = field(default_factory=dict)  # node counts observed per type, by watch()

    def counts(self) -> dict[str, int]:
        """Alive nodes per node type, told apart by the custom resource each type carries (as Ray's
        own state, `ray.nodes()`, reports each node's resources)."""
        alive = [n["Resources"] for n in self.ray.nodes() if n["Alive"]]
        return {t.name: sum(1 for r in alive if _marker(t) in r) for t in self.node_types}

    def actors(self, state: str) -> list[dict[str, Any]]:
        """The GCS's actor table in one state (ALIVE, PENDING_CREATION, ...)."""
        from ray._private.state import actors

        return list(actors(actor_state_name=state).values())

    async def until_counts(self, want: Mapping[str, int], what: str, timeout_s: float) -> None:
        """Poll Ray's node table until the counts of the types in `want` are those."""
        end = time.monotonic() + timeout_s
        while True:
            now = self.counts()
            if all(now[t] == n for t, n in want.items()):
                return
            assert time.monotonic() < end, f"not within {timeout_s:.0f} s: {what} (nodes now {now})"
            await asyncio.sleep(0.2)

    async def watch(self, interval_s: float = 0.2) -> None:
        """Record every node count seen per type into `seen`, until cancelled: the counts between two
        looks are what 'stays put' is checked against."""
        while True:
            for t, n in self.counts().items():
                self.seen.setdefault(t, set()).add(n)
            await asyncio.sleep(interval_s)


def _marker(t: NodeType) -> str:
    """The custom resource that tells a node of this type (one only it carries)."""
    custom = [r for r in t.resources if r not in ("CPU", "GPU")]
    if len(custom) != 1:
        raise ValueError(f"node type {t.name}: give it exactly one custom resource to tell its nodes by")
    return custom[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def autoscaling_cluster(node_types: list[NodeType], idle_timeout_minutes: float) -> Iterator[AutoscalingNodes]:
    """Start the head with an autoscaler over `node_types`, connect Ray, and wait for the min_workers
    nodes; at the end, disconnect, stop the head, and stop whatever the autoscaler left behind."""
    import ray
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.cluster_utils import Cluster

    port = _free_port()
    ip = ray._private.services.get_node_ip_address()
    config = autoscaling_config(node_types, f"{ip}:{port}", idle_timeout_minutes)
    fd, path = tempfile.mkstemp(prefix="splitserve-autoscaling-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    before = _descendants(os.getpid())
    # The autoscaler (a child of the head) reads these when it starts: the fake provider refuses to
    # run without RAY_FAKE_CLUSTER, and one second between updates instead of five.
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cluster = None
    try:
        head_args = {
            "num_cpus": 0,
            "include_dashboard": False,
            "autoscaling_config": path,
            "gcs_server_port": port,
            "object_store_memory": NODE_STORE_BYTES,
            # the provider knows the head by this id, as `ray start --head` names it under RAY_FAKE_CLUSTER
            "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        }
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        nodes = AutoscalingNodes(ray, cluster, config, node_types)
        asyncio.run(nodes.until_counts({t.name: t.min_workers for t in node_types}, "the min_workers nodes", 120))
        yield nodes
    finally:
        # the autoscaler's nodes, found while their parent (the autoscaler) still lives
        ours = _descendants(os.getpid()) - before
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        _stop_leftovers(ours)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.unlink(path)


def _descendants(pid: int) -> set[int]:
    """The process ids below `pid`, from /proc (each process's parent is its stat's fourth field)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
                children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _stop_leftovers(pids: set[int]) -> None:
    """The processes this cluster started that its shutdown did not stop (an autoscaler killed
    before it stopped its nodes leaves their raylets behind): terminated by id, then killed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        end = time.monotonic() + 10
        while (alive := {p for p in pids if _running(p)}) and time.monotonic() < end:
            time.sleep(0.1)  # a process's exit has nothing to wait on but its /proc entry
        if not alive:
            return
        logging.getLogger(__name__).warning(
            "sending %s to %d process(es) the cluster left behind", sig.name, len(alive)
        )
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
