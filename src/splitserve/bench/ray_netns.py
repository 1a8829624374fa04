"""A real multi-node Ray cluster on one machine, some of its nodes behind a shaped link.

Every node is a `ray start --block` process of its own (a GCS and a raylet for the head, a raylet
and its workers for the others), each in a process group of its own, so that a node can be killed
whole (raylet and workers at once, no graceful exit: what a lost machine looks like to the
cluster). The nodes "inside" run in the network namespace of a `ThrottledLink`
(bench/transfer_link.py): whatever they exchange with the nodes outside, the KV among it, crosses
the veth pair shaped to the link's rate. Each node has an address of its own on the link's /24
(extra addresses on either end of the pair): Ray tells nodes apart by address, and two raylets
started at once in one namespace were seen to hang, so they start one at a time, each once the
last one has registered.

The head holds no CPU and declares a killed node dead after three missed health checks of one
second (the default, five of three, leaves a dead node's actors listed for 15 s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

from splitserve.bench.transfer_link import ThrottledLink

FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}
NODE_JOIN_TIMEOUT_S = 60.0
OBJECT_STORE_BYTES = 100_000_000  # the workers pass no objects through Ray: keep /dev/shm free


@dataclass
class RayNode:
    name: str
    ip: str
    inside: bool  # in the link's namespace
    resources: dict[str, float]
    process: subprocess.Popen[bytes]


class NetnsRayCluster:
    """`with NetnsRayCluster(gbps) as c: c.add("p1", inside=True, cpus=2, resources={...})`; then
    `ray.init(address=c.address)` is the caller's. `kill(name)` takes a node away whole."""

    def __init__(self, gbps: float, port: int = 6390) -> None:
        self.link = ThrottledLink(gbps)
        self.port = port
        self.nodes: dict[str, RayNode] = {}
        self._logs = tempfile.TemporaryDirectory(prefix="splitserve-ray-nodes-")
        self._net = self.link.outer_host.rsplit(".", 1)[0]
        self._next_host = 3
        # `ray start --head` names its cluster in a file that a later `ray.init()` without an address
        # joins: a test or a `serve` after this bench found our dead cluster there. Put back at close.
        self._address_file = _address_file()
        self._address_file_before = _read(self._address_file)
        try:
            self._start(
                "head", self.link.outer_host, False, 0, {}, ["--head", f"--port={port}", "--include-dashboard=false"]
            )
            self.address = f"{self.link.outer_host}:{port}"
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """This process joins as the cluster's driver, once the head's GCS answers."""
        import ray

        deadline = time.monotonic() + NODE_JOIN_TIMEOUT_S
        while True:
            try:
                # the workers' logs stay in the nodes' log files: forwarded, they buried the figures
                ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
                return
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def add(self, name: str, inside: bool, cpus: int, resources: dict[str, float]) -> RayNode:
        """A node with an address of its own, inside the namespace or outside it, started and joined."""
        ip = f"{self._net}.{self._next_host}"
        self._next_host += 1
        dev = self.link.inner_dev if inside else self.link.outer_dev
        prefix = self.link.exec_prefix if inside else []
        subprocess.run([*prefix, "ip", "addr", "add", f"{ip}/24", "dev", dev], check=True, capture_output=True)
        index = len(self.nodes)
        ports = [  # each node's agents on ports of their own: two nodes of one namespace shared the defaults
            f"--dashboard-agent-listen-port={52400 + index}",
            f"--dashboard-agent-grpc-port={52450 + index}",
            f"--metrics-export-port={52500 + index}",
            f"--runtime-env-agent-port={52550 + index}",
        ]
        args = [f"--address={self.address}", f"--resources={json.dumps(resources)}", *ports]
        node = self._start(name, ip, inside, cpus, resources, args)
        self._until_joined(len(self.nodes))
        return node

    def _start(
        self, name: str, ip: str, inside: bool, cpus: int, resources: dict[str, float], args: list[str]
    ) -> RayNode:
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [
            *(self.link.exec_prefix if inside else []),
            ray,
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
            *args,
        ]
        if name == "head":
            cmd.append(f"--system-config={json.dumps(FAST_NODE_DEATH)}")
        log: IO[bytes] = open(os.path.join(self._logs.name, f"{name}.log"), "wb")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        node = RayNode(name, ip, inside, resources, process)
        self.nodes[name] = node
        return node

    def _until_joined(self, count: int) -> None:
        """Until the GCS lists `count` live nodes (the head's counted)."""
        import ray

        deadline = time.monotonic() + NODE_JOIN_TIMEOUT_S
        while len([n for n in _nodes(ray) if n["Alive"]]) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a Ray node did not join in {NODE_JOIN_TIMEOUT_S:g} s: see {self._logs.name}")
            time.sleep(0.2)

    def node_of_ip(self, ip: str) -> RayNode:
        (node,) = [n for n in self.nodes.values() if n.ip == ip]
        return node

    def kill(self, name: str) -> None:
        """The node's raylet and every process it started, at once (SIGKILL to its process group)."""
        node = self.nodes.pop(name)
        _kill_group(node.process)

    def close(self) -> None:
        import ray

        ray.shutdown()
        for node in reversed(list(self.nodes.values())):
            _kill_group(node.process)
        self.nodes.clear()
        if self._address_file_before is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._address_file)
        else:
            with open(self._address_file, "w") as f:
                f.write(self._address_file_before)
        self.link.close()
        self._logs.cleanup()

    def __enter__(self) -> NetnsRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address_file() -> str:
    from ray._private.utils import get_ray_address_file

    return str(get_ray_address_file(None))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _nodes(ray: Any) -> list[dict[str, Any]]:
    return list(ray.nodes()) if ray.is_initialized() else []


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)
