"""End to end on real Ray: the PoolManager starts the prefill and decode pools as
Ray actors (token auth on, as `splitserve serve` runs it), the real Router
serves gRPC in this test's event loop, the workers run SmolLM2 in fp32.

- greedy output through the Ray pools equals the single-process engine's;
- a decode actor killed with ray.kill is replaced, and requests succeed after;
- a prefill pool that scales (min 1, max 2) grows under a burst of long prompts
  and shrinks back once idle, every answer right and no block leaked.

At most three worker actors live at once: the machine may have two cores, and
each actor loads the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.request

import pytest
import torch

from splitserve.cluster.launcher import worker_bundle
from splitserve.cluster.scaling import ScalingConfig
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from tests.e2e_helpers.ray_pools import (  # turns on Ray's token auth, before anything imports Ray
    CHATS,
    NEW_TOKENS,
    Cluster,
    Running,
    burst_chat,
    counted,
    encode,
    reference,
    start_cluster,
    until,
    until_actor_dead,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING)
    try:
        assert is_token_auth_enabled(), "Ray was imported before this module could turn token auth on"
        yield ray
    finally:
        ray.shutdown()


# ---- a fixed-size cluster: one prefill and one decode actor, shared by the tests of the class


@pytest.fixture(scope="class")
def fixed(ray_cluster, model):
    loop = asyncio.new_event_loop()
    # a decode worker on standby: warm, not routed to, until a replacement takes it
    cluster = loop.run_until_complete(start_cluster(model, decode_standby=1))
    try:
        yield Running(loop, cluster)
    finally:
        loop.run_until_complete(cluster.close())
        loop.close()


class TestFixedPools:
    def test_greedy_through_the_ray_pools_equals_the_single_process_engine(self, fixed, ray_cluster, model):
        ids = encode(model, CHATS)
        expected = reference(model, ids)

        async def scenario(c: Cluster) -> list[tuple[list[int], pb.Usage]]:
            (ready,) = c.pools.standby["decode"]
            assert c.router.workers.get(ready.grpc_address) is None  # listening, warm, unknown to routing
            looked_up = (await c.stats(ready.grpc_address, "decode")).prefix_cache_queries  # its warm-up's
            first = await c.generate(ids[0])  # the others find the railway system prompt cached
            rest = await asyncio.gather(*[c.generate(p) for p in ids[1:]])
            await c.no_blocks_held()
            assert (await c.stats(ready.grpc_address, "decode")).prefix_cache_queries == looked_up  # no request
            return [first, *rest]

        results = fixed.run(scenario)
        for i, ((got, usage), want) in enumerate(zip(results, expected, strict=True)):
            assert got == want, f"request {i} ({len(ids[i])} prompt tokens) differs"
            assert usage.prompt_tokens == len(ids[i]) and usage.completion_tokens == NEW_TOKENS
        assert sum(u.cached_tokens for _, u in results) > 0
        metrics = fixed.cluster.router.metrics
        assert counted(metrics.decisions, mode="remote") == len(ids)  # all through the prefill actor
        for role in ("prefill", "decode"):
            assert counted(metrics.pool_workers, role=role, state="serving") == 1
            assert counted(metrics.pool_workers, role=role, state="starting") == 0
        assert counted(metrics.pool_workers, role="decode", state="standby") == 1
        # the Ray autoscaler was asked for room for every worker held: 1 prefill, 1 decode, 1 on standby
        from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
        from ray.experimental.internal_kv import _internal_kv_get

        specs = fixed.cluster.pools.specs
        wanted = [worker_bundle(specs["prefill"])] + [worker_bundle(specs["decode"])] * 2
        assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == wanted
        # every actor serves its engine's metrics, as a worker process does
        for role, members in fixed.cluster.pools.members.items():
            (member,) = members
            address = ray_cluster.get(member.actor.metrics.remote(), timeout=30)
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            counter = "prompt_tokens" if role == "prefill" else "generation_tokens"
            served = [line for line in text.splitlines() if line.startswith(f"splitserve:{counter}_total{{")]
            assert served and f'role="{role}"' in served[0] and float(served[0].rsplit(" ", 1)[1]) > 0, served

    def test_a_killed_decode_actor_is_replaced_by_the_standby_one_and_requests_succeed_after(
        self, fixed, ray_cluster, model
    ):
        ids = encode(model, CHATS[2:])
        expected = reference(model, ids)

        async def scenario(c: Cluster) -> list[tuple[list[int], pb.Usage]]:
            (old,) = c.pools.members["decode"]
            (ready,) = c.pools.standby["decode"]
            ray_cluster.kill(old.actor)
            await until(
                lambda: [m.grpc_address for m in c.pools.members["decode"]] not in ([], [old.grpc_address]),
                "a new decode actor registered",
            )
            (new,) = c.pools.members["decode"]
            assert new is ready and c.pools.activations["decode"]  # the standby worker, not a new start
            assert c.router.workers.get(old.grpc_address) is None
            await until(lambda: c.healthy("decode") == [new.grpc_address], "the new decode worker is healthy")
            out = [await c.generate(p) for p in ids]
            await c.no_blocks_held()
            # another takes its place on standby, started in the background
            await until(lambda: len(c.pools.standby["decode"]) == 1, "a new standby worker")
            assert c.pools.standby["decode"][0].worker_id not in (old.worker_id, ready.worker_id)
            # the pool kept its size: one replacement, nothing else starting
            assert len(c.pools.members["decode"]) == 1 and c.pools.pending["decode"] == 0
            return out

        results = fixed.run(scenario)
        assert [got for got, _ in results] == expected
        metrics = fixed.cluster.router.metrics
        assert counted(metrics.scaling_decisions, role="decode", action="replace") == 1
        assert counted(metrics.scaling_decisions, role="decode", action="grow") == 0
        assert counted(metrics.pool_workers, role="decode", state="serving") == 1

    def test_the_only_decode_actor_killed_under_load_every_stream_completes_unchanged(self, fixed, ray_cluster, model):
        """No decode pool for a while is no failure: the streams wait for the pool manager's
        replacement (within their deadlines) and go on there with the undisturbed greedy text."""
        ids = encode(model, CHATS)
        n = 48
        want = reference(model, ids, n)

        async def scenario(c: Cluster) -> list[list[int]]:
            (old,) = c.pools.members["decode"]
            progress: list[list[int]] = [[] for _ in ids]
            streams = [asyncio.ensure_future(c.stream(p, n, got)) for p, got in zip(ids, progress, strict=True)]
            await until(lambda: all(len(g) >= 2 for g in progress), "every stream decoding")
            ray_cluster.kill(old.actor)
            await until(lambda: old.grpc_address not in c.healthy("decode"), "the router sees the decode pool empty")
            assert not any(s.done() for s in streams)  # no stream failed for want of a decode worker
            out = await asyncio.gather(*streams)
            (new,) = c.pools.members["decode"]
            assert new.worker_id != old.worker_id
            await c.no_blocks_held()
            return out

        assert fixed.run(scenario) == want
        assert counted(fixed.cluster.router.metrics.migrations) >= 1


# ---- tensor parallelism inside an actor


def test_a_tensor_parallel_prefill_actor_feeds_a_tp1_decode_actor_greedy_unchanged(ray_cluster, model):
    """The prefill actor runs SmolLM2 at TP 3 (its 3 KV heads one per rank; 9 heads, 1536 of MLP:
    all divide), its ranks processes it spawns inside the actor; the decode actor at TP 1 gets
    each layer's heads re-sharded on the way. Greedy output equals the single-process engine's."""
    ids = encode(model, CHATS[:2])
    expected = reference(model, ids)

    async def scenario() -> list[tuple[list[int], pb.Usage]]:
        c = await start_cluster(model, prefill_tp=3)
        try:
            import ray

            (prefill,) = c.pools.members["prefill"]
            call = prefill.actor.__ray_call__.remote(lambda _: os.getpid())
            pid = int(await asyncio.to_thread(ray.get, call, timeout=30))
            assert len(children(pid)) >= 2, "the TP 3 prefill actor runs two rank processes beside itself"
            out = [await c.generate(p) for p in ids]
            await c.no_blocks_held()
            assert counted(c.router.metrics.decisions, mode="remote") == len(ids)
            return out
        finally:
            await c.close()

    results = asyncio.run(scenario())
    for i, ((got, _), want) in enumerate(zip(results, expected, strict=True)):
        assert got == want, f"request {i} ({len(ids[i])} prompt tokens) differs at TP 3 -> TP 1"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


# ---- a prefill pool that scales on its queue


def requested() -> int:
    """Workers the Ray autoscaler's resource request holds room for (ray.autoscaler.sdk.request_resources)."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    return len(json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)))


def test_prefill_pool_grows_under_a_burst_and_shrinks_back_when_idle(ray_cluster, model):
    wave1 = encode(model, [burst_chat(i) for i in range(8)])
    wave2 = encode(model, [burst_chat(i) for i in range(8, 11)])
    assert all(len(p) > 240 for p in wave1 + wave2)
    expected = reference(model, wave1 + wave2)
    scaling = ScalingConfig(
        min_replicas=1,
        max_replicas=2,
        metric="queued_tokens",
        # eight prompts of ~260 tokens on one worker are far over; the queue of one is not
        target_tokens_per_worker=256,
        low_water_tokens_per_worker=32,
        grow_after_s=0.5,
        shrink_after_s=5.0,
        cooldown_s=1.0,
        interval_s=0.25,
        drain_timeout_s=60.0,
    )

    async def scenario() -> list[tuple[list[int], pb.Usage]]:
        c = await start_cluster(model, prefill_scaling=scaling)
        try:
            metrics = c.router.metrics
            (first,) = c.pools.members["prefill"]
            burst = [asyncio.ensure_future(c.generate(p)) for p in wave1]

            def grown() -> bool:
                return counted(metrics.scaling_decisions, role="prefill", action="grow") > 0

            await until(lambda: grown() or all(f.done() for f in burst), "the prefill pool decided to grow")
            assert grown(), "the burst ended before the pool decided to grow"
            # the new actor boots for longer than the burst lasts; the shrink window waits for it
            await until(lambda: len(c.pools.members["prefill"]) == 2, "the grown prefill worker registered")
            assert requested() == 3  # the autoscaler asked for room for 2 prefill + 1 decode workers
            (second,) = [m for m in c.pools.members["prefill"] if m is not first]
            await until(lambda: second.grpc_address in c.healthy("prefill"), "the new prefill worker is healthy")
            # a second wave while both are up, before the shrink window ends: the new worker takes its share
            more = [asyncio.ensure_future(c.generate(p)) for p in wave2]
            out = await asyncio.gather(*burst, *more)
            admitted = (await c.stats(second.grpc_address, "prefill")).prefix_cache_queries
            assert admitted > 0, "the grown worker never prefilled"

            # idle now: after shrink_after_s one worker is drained and stopped
            await until(lambda: len(c.pools.members["prefill"]) == 1, "the prefill pool shrank back")
            assert requested() == 2  # and the request fell with the drain
            (survivor,) = c.pools.members["prefill"]
            gone = second if survivor is first else first
            assert c.router.workers.get(gone.grpc_address) is None
            assert c.healthy("prefill") == [survivor.grpc_address]
            await until_actor_dead(ray_cluster, gone.actor)
            assert counted(metrics.scaling_decisions, role="prefill", action="shrink") == 1
            assert counted(metrics.scaling_decisions, role="prefill", action="grow") == 1
            assert counted(metrics.scaling_decisions, role="prefill", action="replace") == 0
            assert counted(metrics.pool_workers, role="prefill", state="serving") == 1
            assert counted(metrics.pool_workers, role="prefill", state="draining") == 0
            await c.no_blocks_held()
            return out
        finally:
            await c.close()

    results = asyncio.run(scenario())
    assert requested() == 0  # stopped pools hold no room in the autoscaler
    for i, ((got, usage), want) in enumerate(zip(results, expected, strict=True)):
        assert got == want, f"burst request {i} differs"
        assert usage.completion_tokens == NEW_TOKENS
