"""End to end with Ray's autoscaler: the pools' own scaling makes Ray add and remove nodes of one
node type at a time.

The cluster (tests/e2e_helpers/ray_autoscale.py): a head that holds no worker, and the autoscaler
over two node types, `prefill` (custom resource prefill_node; min 1, max 2 nodes) and `decode`
(decode_node; min 0, max 2), each node one CPU, so that one worker fills it. The nodes are Ray's
fake multi-node provider's: real raylets of this machine, added and removed by the autoscaler
(idle ones after 6 s). Each pool is pinned to its node type with custom resources, as `serve
--prefill-resources/--decode-resources` pins them, and the pool manager knows the node types, as
`serve --node-types` tells it.

The pools grow and shrink by load, through the pool manager's own scale loop and the scaling
policy of cluster/scaling.py (thresholds small enough for a test's load, windows of a second or
so), not by a call from the test:
- decode: three concurrent 64-token streams put the decode pool over its target: it starts a
  second worker, for which the autoscaler adds a decode node while the prefill node count stays
  put; idle again, the pool drains a worker, and the autoscaler removes its node;
- prefill: a burst of long prompts queues past the prefill pool's target: the same, for a second
  prefill node, while the decode node count stays put;
- every answer throughout is the single-process engine's greedy text;
- a pool asking for a resource that no node type has is refused at once (PoolManager raises
  Unplaceable before queueing the actor; `serve --node-types` exits 2 before starting any), not
  left pending in Ray for ever; one that a node type has waits, says which type it waits for,
  and gets its node.

At most two worker actors load the model at once: the machine may have two cores.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.cluster.placement import node_types_of_cluster_config
from splitserve.cluster.pool import PoolManager, PoolSpec, Unplaceable
from splitserve.cluster.scaling import ScalingConfig
from splitserve.engine.weights import load_model
from splitserve.router.config import Listeners, RouterConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.router.workers import Role
from splitserve.workers.common.config import WorkerConfig
from tests.e2e_helpers.ray_autoscale import (  # Ray's token auth, before anything imports Ray
    AutoscalingNodes,
    NodeType,
    autoscaling_cluster,
)
from tests.e2e_helpers.ray_pools import (
    CHATS,
    ENGINE,
    Cluster,
    burst_chat,
    counted,
    encode,
    reference,
    start_cluster,
    until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"  # the node types
NODE_TYPES = [
    NodeType(PREFILL, {"CPU": 1.0, "prefill_node": 1.0}, min_workers=1, max_workers=2),
    NodeType(DECODE, {"CPU": 1.0, "decode_node": 1.0}, min_workers=0, max_workers=2),
]
PINNED: dict[Role, dict[str, float]] = {"prefill": {"prefill_node": 1.0}, "decode": {"decode_node": 1.0}}
IDLE_TIMEOUT_MINUTES = 0.1  # an idle node is removed after 6 s
NODE_DEADLINE_S = 120.0  # a node added or removed, a worker on it up (a model load on a busy core)


# Small enough for a test's load, and far apart enough that one phase's load never moves the other
# pool: a decode stream's context (a chat prompt and its 64 tokens, over 64 tokens each) in three
# streams is over 128 per decode worker, while one request at a time is under it; the long prompts'
# burst queues over 1000 prompt tokens at the prefill worker, a chat prompt far under 256.
def scales(metric: str, target: int) -> ScalingConfig:
    return ScalingConfig(
        min_replicas=1,
        max_replicas=2,
        metric=metric,
        target_tokens_per_worker=target,
        low_water_tokens_per_worker=target // 2,
        grow_after_s=0.5,
        shrink_after_s=3.0,
        cooldown_s=2.0,
        interval_s=0.25,
        drain_timeout_s=60.0,
    )


DECODE_SCALES, PREFILL_SCALES = scales("work_tokens", 128), scales("queued_tokens", 256)


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def nodes() -> Iterator[AutoscalingNodes]:
    with autoscaling_cluster(NODE_TYPES, IDLE_TIMEOUT_MINUTES) as n:
        yield n


def node_types(nodes: AutoscalingNodes) -> dict[str, dict[str, float]]:
    """What `serve --node-types` reads from the cluster config."""
    return node_types_of_cluster_config(nodes.config)


async def no_actor_left(nodes: AutoscalingNodes) -> None:
    """Every worker actor gone from Ray (the next pools reuse their names), none pending."""
    await until(lambda: not nodes.actors("ALIVE") and not nodes.actors("PENDING_CREATION"), "no actor left", 60)


def test_a_pool_no_node_type_can_hold_is_refused_at_once(nodes, model, caplog):
    token = "t" * 16
    worker = WorkerConfig(role="decode", engine=ENGINE, host="auto", cluster_token=token, threads=1)
    spec = PoolSpec("decode", 1, worker, resources={"tpu_node": 1.0})

    async def scenario() -> tuple[PoolManager, float]:
        router = Router(
            RouterConfig(listeners=Listeners(grpc_port=0, cluster_token=token)), EngineTokenizer(model.tokenizer)
        )
        pools = PoolManager([spec], router.workers, start_timeout_s=60.0, node_types=node_types(nodes))
        t0 = time.monotonic()
        with pytest.raises(Unplaceable) as refused:
            await asyncio.wait_for(pools.start(), 10.0)
        took = time.monotonic() - t0
        assert "no node of the Ray cluster and no node type of its autoscaler can hold one decode worker" in str(
            refused.value
        )
        assert "tpu_node 1" in str(refused.value) and "decode: CPU 1, decode_node 1" in str(refused.value)
        return pools, took

    pools, took = asyncio.run(scenario())
    print(f"\nautoscale: an ask no node type can hold refused in {took:.2f} s")
    assert took < 5.0
    assert pools.members["decode"] == [] and pools.pending["decode"] == 0
    # never queued: nothing pending in Ray, no node added for it
    assert nodes.actors("PENDING_CREATION") == []
    assert nodes.counts() == {PREFILL: 1, DECODE: 0}


def test_serve_with_the_node_types_refuses_such_a_pool_before_starting_any(nodes):
    """`splitserve serve --node-types` joining the autoscaling cluster: exit 2 with the line, at once."""
    cmd = [
        *("serve", "--ray-address", nodes.cluster.address, "--grpc-port", "0", "--http-port", "-1"),
        *("--prefill-resources", '{"prefill_node": 1}', "--decode-resources", '{"tpu_node": 1}'),
        *("--node-types", json.dumps(node_types(nodes))),
    ]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "splitserve.cli", *cmd], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert (
        "cannot place the workers: no node of the Ray cluster and no node type of its autoscaler can hold one "
        "decode worker (CPU 1, tpu_node 1)" in r.stderr
    )
    assert "prefill worker" not in r.stderr  # the prefill pool fits its node type: no problem
    print(f"\nautoscale: serve refused the pool and exited 2 in {took:.1f} s (its start and Ray's join included)")
    assert nodes.actors("PENDING_CREATION") == [] and nodes.counts() == {PREFILL: 1, DECODE: 0}


def test_the_decode_pool_grows_and_shrinks_and_only_decode_nodes_follow(nodes, model, caplog):
    ids = encode(model, CHATS)
    streams_ids = ids[:3]
    n = 64
    want_streams, want = reference(model, streams_ids, n), reference(model, ids)

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        await nodes.until_counts({PREFILL: 1, DECODE: 0}, "the cluster at its minimum", NODE_DEADLINE_S)
        # the decode pool's first worker waits for the autoscaler to add a decode node
        c = await start_cluster(
            model,
            resources=PINNED,
            worker_host="auto",
            decode_scaling=DECODE_SCALES,
            node_types=node_types(nodes),
        )
        watching = asyncio.ensure_future(nodes.watch())
        try:
            assert nodes.counts() == {PREFILL: 1, DECODE: 1}
            out = await grow_and_shrink(nodes, c, "decode", streams_ids, n, ids)
        finally:
            watching.cancel()
            await c.close()
        await no_actor_left(nodes)
        return out

    with caplog.at_level(logging.INFO, logger="splitserve.cluster.pool"):
        streams, answers = asyncio.run(scenario())
    assert streams == want_streams and answers == want + want
    assert any("waits (up to" in r.getMessage() and "a node of type decode" in r.getMessage() for r in caplog.records)
    assert nodes.seen[PREFILL] == {1}, "the prefill node count moved while the decode pool scaled"
    assert nodes.seen[DECODE] == {1, 2}


def test_the_prefill_pool_grows_and_shrinks_and_only_prefill_nodes_follow(nodes, model):
    ids = encode(model, CHATS)
    burst = encode(model, [burst_chat(i) for i in range(6)])
    want_burst, want = reference(model, burst), reference(model, ids)

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        # the last test's decode node, idle since its pools stopped, goes (min_workers 0)
        await nodes.until_counts({PREFILL: 1, DECODE: 0}, "the cluster back at its minimum", NODE_DEADLINE_S)
        c = await start_cluster(
            model,
            PREFILL_SCALES,
            resources=PINNED,
            worker_host="auto",
            node_types=node_types(nodes),
        )
        nodes.seen.clear()
        watching = asyncio.ensure_future(nodes.watch())
        try:
            assert nodes.counts() == {PREFILL: 1, DECODE: 1}
            out = await grow_and_shrink(nodes, c, "prefill", burst, None, ids)
        finally:
            watching.cancel()
            await c.close()
        await no_actor_left(nodes)
        return out

    burst_out, answers = asyncio.run(scenario())
    assert burst_out == want_burst and answers == want + want
    assert nodes.seen[DECODE] == {1}, "the decode node count moved while the prefill pool scaled"
    assert nodes.seen[PREFILL] == {1, 2}


async def grow_and_shrink(
    nodes: AutoscalingNodes, c: Cluster, role: Role, load: list[list[int]], n: int | None, ids: list[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Load the pool until its scale loop grows it and Ray adds a node of its type; answer `ids`
    with two workers in the pool; then, idle, until the pool drains one and Ray removes its node;
    answer `ids` again. Returns the load's answers (`n` tokens each, or the usual few) and the two
    rounds' answers."""
    node_type = PREFILL if role == "prefill" else DECODE
    decisions = c.router.metrics.scaling_decisions
    t0 = time.monotonic()

    async def one(prompt: list[int]) -> list[int]:
        return (await c.generate(prompt))[0] if n is None else await c.stream(prompt, n, [])

    loaded = asyncio.gather(*(one(p) for p in load))
    await until(lambda: counted(decisions, role=role, action="grow") == 1, f"the {role} pool grows")
    t_grow = time.monotonic() - t0
    await nodes.until_counts({node_type: 2}, f"a second {node_type} node", NODE_DEADLINE_S)
    t_node = time.monotonic() - t0
    load_out = await loaded
    await until(lambda: len(c.pools.members[role]) == 2 and c.pools.pending[role] == 0, f"two {role} workers up")
    await until(lambda: len(c.healthy(role)) == 2, f"both {role} workers healthy")
    t_up = time.monotonic() - t0
    first = [(await c.generate(p))[0] for p in ids]

    # idle: the pool drains a worker after its window, and the autoscaler removes the idle node
    t1 = time.monotonic()
    await until(lambda: counted(decisions, role=role, action="shrink") == 1, f"the {role} pool shrinks", 60)
    await until(lambda: len(c.pools.members[role]) == 1, f"the drained {role} worker stopped", 60)
    t_drained = time.monotonic() - t1
    await nodes.until_counts({node_type: 1}, f"the idle {node_type} node removed", NODE_DEADLINE_S)
    t_removed = time.monotonic() - t1
    second = [(await c.generate(p))[0] for p in ids]
    await c.no_blocks_held()
    assert counted(decisions, role=role, action="grow") == 1 and counted(decisions, role=role, action="shrink") == 1
    print(
        f"\nautoscale {role}: grow decided {t_grow:.1f} s after the load began, node added at {t_node:.1f} s, "
        f"worker up at {t_up:.1f} s; idle: drained {t_drained:.1f} s after, node removed at {t_removed:.1f} s"
    )
    return load_out, first + second
