"""End to end on several raylets of one machine: Ray's own multi-node test cluster
(`ray.cluster_utils.Cluster`, real GCS and raylet processes), the PoolManager's pools pinned
by node type, the real Router serving gRPC in this test's event loop.

The nodes: a head that holds no worker (no CPU: the driver's node, as a cluster's head often
is), two prefill nodes and two decode nodes (one of each type to lose), each with one CPU, the
custom resource of its type, and a loopback address of its own (127.0.0.2 to .5; the head keeps
the machine's).
The workers run with `--worker-host auto`, so each advertises its own node's address, and a
KV transfer from the prefill node to a decode node goes between two different addresses.

- each pool lands on its node type (read back from the GCS's actor table), the KV cache crosses
  nodes, and greedy output equals the single-process engine's;
- the decode node is killed whole (raylet and workers) under concurrent streams: its worker
  is replaced on the other decode node, every stream completes with the undisturbed greedy
  text, and no block is left held on any worker;
- the prefill node is killed whole while long prompts are being prefilled there: the decode
  worker prefills what was lost, the prefill worker is replaced on the other prefill node and
  serves the next requests, every answer the greedy one and no block held;
- a pool asking for a node type that no node has is reported at once, with what the cluster
  has, and its actor is not left pending after the start gives up.

At most two worker actors load the model at once: the machine may have two cores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from splitserve.cluster.placement import CPU, PoolAsk, placement_problems
from splitserve.cluster.pool import PoolManager, PoolSpec
from splitserve.engine.weights import load_model
from splitserve.router.config import Listeners, RouterConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.router.workers import Role
from splitserve.workers.common.config import WorkerConfig
from tests.e2e_helpers.ray_pools import (  # turns on Ray's token auth, before anything imports Ray
    CHATS,
    ENGINE,
    Cluster,
    Running,
    burst_chat,
    counted,
    encode,
    reference,
    start_cluster,
    until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PREFILL_NODE, DECODE_NODE = "prefill_node", "decode_node"
# two nodes of each type: one to lose, one for the lost one's worker to move to
NODE_TYPES = {"127.0.0.2": PREFILL_NODE, "127.0.0.3": PREFILL_NODE, "127.0.0.4": DECODE_NODE, "127.0.0.5": DECODE_NODE}
# The GCS declares a killed node dead after missed health checks: 3 of 1 s each here, as in Ray's
# own node-failure tests, rather than the default 5 of 3 s (which the streams would wait out).
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


@dataclass
class Nodes:
    """The test cluster: Ray (connected to it) and each node by its address."""

    ray: Any
    cluster: Any  # ray.cluster_utils.Cluster
    by_ip: dict[str, Any]  # ray._private.node.Node

    def alive(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n["Alive"]]

    def ip_of_node(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes()}

    def actors(self, state: str) -> list[dict[str, Any]]:
        """The GCS's actor table, Ray's own record of where each actor was placed: what
        `ray.util.state.list_actors` reads, without the dashboard that it needs (and that the
        minimal `ray` package lacks)."""
        from ray._private.state import actors

        return list(actors(actor_state_name=state).values())

    def actor_ips(self) -> dict[str, str]:
        """Each live actor's node address by the actor's name (the PoolManager names an actor by
        its worker id)."""
        ips = self.ip_of_node()
        return {a["Name"]: ips[a["Address"]["NodeID"]] for a in self.actors("ALIVE")}


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray.cluster_utils import Cluster as RayCluster

    # The head keeps the machine's own address: Ray turns a loopback bootstrap address into that
    # one before connecting (`ray.init(address="127.0.0.1:...")` dials the machine's IP), so a GCS
    # listening on 127.0.0.1 alone is never reached.
    head_args = {"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH}
    cluster = RayCluster(initialize_head=True, head_node_args=head_args)
    try:
        head: Any = cluster.head_node
        by_ip = {head.node_ip_address: head}
        for ip, node_type in NODE_TYPES.items():
            by_ip[ip] = cluster.add_node(num_cpus=1, resources={node_type: 1}, node_ip_address=ip)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        assert is_token_auth_enabled(), "Ray was imported before this module could turn token auth on"
        yield Nodes(ray, cluster, by_ip)
    finally:
        ray.shutdown()
        cluster.shutdown()


def host(address: str) -> str:
    return address.rsplit(":", 1)[0]


@pytest.fixture(scope="class")
def pinned(nodes, model):
    """One prefill worker on the prefill node, one decode worker on a decode node."""
    loop = asyncio.new_event_loop()
    resources: dict[Role, dict[str, float]] = {"prefill": {PREFILL_NODE: 1.0}, "decode": {DECODE_NODE: 1.0}}
    cluster = loop.run_until_complete(start_cluster(model, resources=resources, worker_host="auto"))
    try:
        yield Running(loop, cluster)
    finally:
        loop.run_until_complete(cluster.close())
        loop.close()


class TestPoolsPinnedByNodeType:
    def test_each_pool_on_its_node_type_and_the_kv_crosses_nodes_greedy_unchanged(self, pinned, nodes, model):
        ids = encode(model, CHATS)
        expected = reference(model, ids)
        pools = pinned.cluster.pools
        ((prefill,), (decode,)) = pools.members["prefill"], pools.members["decode"]

        # placed by node type, as Ray's state API sees the actors
        on = nodes.actor_ips()
        assert NODE_TYPES[on[prefill.worker_id]] == PREFILL_NODE
        assert NODE_TYPES[on[decode.worker_id]] == DECODE_NODE
        # each advertises its own node's address: the KV goes from the prefill node's to the decode node's
        assert host(prefill.grpc_address) == on[prefill.worker_id]
        assert host(decode.grpc_address) == host(decode.kv_endpoint or "") == on[decode.worker_id]

        async def scenario(c: Cluster) -> list[list[int]]:
            out = [await c.generate(p) for p in ids]
            await c.no_blocks_held()
            return [got for got, _ in out]

        assert pinned.run(scenario) == expected
        # every request through the prefill node's worker, its KV into the decode node's blocks
        assert counted(pinned.cluster.router.metrics.decisions, mode="remote") == len(ids)

    def test_the_decode_node_killed_under_load_streams_complete_on_the_spare_node(self, pinned, nodes, model):
        ids = encode(model, CHATS[:3])
        n = 64
        want = reference(model, ids, n)

        async def scenario(c: Cluster) -> list[list[int]]:
            (old,) = c.pools.members["decode"]
            lost = nodes.actor_ips()[old.worker_id]
            (survivor,) = [ip for ip, t in NODE_TYPES.items() if t == DECODE_NODE and ip != lost]
            progress: list[list[int]] = [[] for _ in ids]
            streams = [asyncio.ensure_future(c.stream(p, n, got)) for p, got in zip(ids, progress, strict=True)]
            await until(lambda: all(len(g) >= 2 for g in progress), "every stream decoding")
            t0 = time.monotonic()
            # the whole node at once, raylet and worker processes, without a graceful exit
            nodes.cluster.remove_node(nodes.by_ip[lost], allow_graceful=False)
            assert not any(s.done() for s in streams), "a stream ended before its node was lost"
            out = await asyncio.gather(*streams)
            logging.getLogger(__name__).info("streams done %.1f s after the node loss", time.monotonic() - t0)

            (new,) = c.pools.members["decode"]
            assert new.worker_id != old.worker_id
            assert nodes.actor_ips()[new.worker_id] == survivor == host(new.grpc_address)
            assert lost not in {n["NodeManagerAddress"] for n in nodes.alive()}
            await c.no_blocks_held()  # the survivors: the prefill worker and the new decode worker
            assert len(c.pools.members["decode"]) == 1 and c.pools.pending["decode"] == 0
            return out

        assert pinned.run(scenario) == want
        metrics = pinned.cluster.router.metrics
        assert counted(metrics.migrations) >= 1
        assert counted(metrics.scaling_decisions, role="decode", action="replace") == 1
        assert counted(metrics.scaling_decisions, role="prefill", action="replace") == 0

    def test_the_prefill_node_killed_mid_prefill_requests_complete_and_it_moves(self, pinned, nodes, model):
        ids = encode(model, [burst_chat(i) for i in range(3)])  # a few chunks of prefill each
        after = encode(model, CHATS[2:])
        want = reference(model, ids + after)
        metrics = pinned.cluster.router.metrics

        async def scenario(c: Cluster) -> list[list[int]]:
            (old,) = c.pools.members["prefill"]
            lost = nodes.actor_ips()[old.worker_id]
            (survivor,) = [ip for ip, t in NODE_TYPES.items() if t == PREFILL_NODE and ip != lost]
            remote, local = counted(metrics.decisions, mode="remote"), counted(metrics.decisions, mode="local")
            requests = [asyncio.ensure_future(c.generate(p)) for p in ids]
            # every request routed to the prefill worker, its Prefill call under way: lose the node
            await until(lambda: counted(metrics.decisions, mode="remote") >= remote + len(ids), "routed remote")
            nodes.cluster.remove_node(nodes.by_ip[lost], allow_graceful=False)
            out = [got for got, _ in await asyncio.gather(*requests)]
            # a Prefill lost with its node: the decode worker prefilled that request itself
            assert counted(metrics.decisions, mode="local") > local, "the node went after every prefill had finished"

            await until(
                lambda: [m.worker_id for m in c.pools.members["prefill"]] not in ([], [old.worker_id]),
                "a new prefill worker registered",
            )
            (new,) = c.pools.members["prefill"]
            await until(lambda: c.healthy("prefill") == [new.grpc_address], "the new prefill worker is healthy")
            assert new.worker_id != old.worker_id
            assert nodes.actor_ips()[new.worker_id] == survivor == host(new.grpc_address)
            # the next requests go through the new prefill node's worker again
            remote = counted(metrics.decisions, mode="remote")
            out += [(await c.generate(p))[0] for p in after]
            assert counted(metrics.decisions, mode="remote") == remote + len(after)
            await c.no_blocks_held()
            return out

        assert pinned.run(scenario) == want
        assert counted(metrics.scaling_decisions, role="prefill", action="replace") == 1


def test_a_pool_asking_for_a_node_type_no_node_has_is_reported_at_once(nodes, model, caplog):
    missing = {"tpu_node": 1.0}
    alive = [n["Resources"] for n in nodes.alive()]
    problems = placement_problems([PoolAsk("decode", 1, {CPU: 1.0, **missing})], alive)
    assert any(p.startswith("tpu_node: the pools ask for 1 (1 decode x 1), the Ray cluster has 0") for p in problems)

    token = "t" * 16
    worker = WorkerConfig(role="decode", engine=ENGINE, host="auto", cluster_token=token, threads=1)
    spec = PoolSpec("decode", 1, worker, resources=missing)

    async def scenario() -> tuple[PoolManager, float]:
        router = Router(
            RouterConfig(listeners=Listeners(grpc_port=0, cluster_token=token)), EngineTokenizer(model.tokenizer)
        )
        pools = PoolManager([spec], router.workers, start_timeout_s=8.0)
        t0 = time.monotonic()
        starting = asyncio.ensure_future(pools.start())
        await until(lambda: any("tpu_node" in r.getMessage() for r in caplog.records), "the report", 5.0)
        reported = time.monotonic() - t0
        # Ray holds the actor pending, for want of the node, until the start gives up
        await until(lambda: bool(nodes.actors("PENDING_CREATION")), "the actor pending in Ray", 5.0)
        with pytest.raises(asyncio.TimeoutError):
            await starting
        return pools, reported

    with caplog.at_level(logging.WARNING, logger="splitserve.cluster.pool"):
        pools, reported = asyncio.run(scenario())
    assert reported < 5.0
    (line,) = {r.getMessage() for r in caplog.records if "tpu_node: " in r.getMessage()}
    assert "decode worker decode-1 waits (up to 8 s) for a node that can hold it" in line
    assert "the Ray cluster has 0" in line and "--resources" in line
    assert "decode_node " in line and "prefill_node " in line  # what the cluster does have
    assert pools.members["decode"] == [] and pools.pending["decode"] == 0
    # the start that gave up took its actor away: nothing stays queued in Ray for ever
    end = time.monotonic() + 30
    while nodes.actors("PENDING_CREATION"):
        assert time.monotonic() < end, "the unplaceable actor is still pending"
        time.sleep(0.2)
