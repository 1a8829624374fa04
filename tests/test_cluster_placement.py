"""cluster/placement.py: what the pools ask of Ray against what its nodes have, checked before any
actor is started, each shortfall a line with the numbers and the flag to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.cluster.placement import (
    CPU,
    GPU,
    PoolAsk,
    describe_nodes,
    fractional_cpus,
    node_types_of_cluster_config,
    node_types_to_add,
    placement_problems,
)

TWO_CPUS = [{CPU: 2.0, "memory": 1e10}]


def test_workers_that_fit_have_no_problem() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 1.0}), PoolAsk("decode", 1, {CPU: 1.0})]
    assert placement_problems(asks, TWO_CPUS) == []


def test_too_many_cpus_says_asked_available_and_what_to_change() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 1.0}), PoolAsk("decode", 2, {CPU: 1.0})]
    [p] = placement_problems(asks, TWO_CPUS)
    assert p.startswith("CPU: the pools ask for 3 (1 prefill x 1 + 2 decode x 1), the Ray cluster has 2: ")
    assert "set --cpus-per-worker to 0.66 or less" in p and "--decode-workers" in p


def test_a_missing_gpu_or_custom_resource_is_named() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 0.5, "prefill_node": 1.0}), PoolAsk("decode", 1, {CPU: 0.5, GPU: 1.0})]
    problems = placement_problems(asks, TWO_CPUS)
    assert any(p.startswith("GPU: the pools ask for 1 (1 decode x 1), the Ray cluster has 0") for p in problems)
    assert any("prefill_node" in p and "--resources" in p for p in problems)
    assert any(
        p.startswith("no node of the Ray cluster can hold one decode worker (CPU 0.5, GPU 1): ") for p in problems
    )


def test_enough_in_sum_but_no_node_big_enough() -> None:
    nodes = [{CPU: 2.0}, {CPU: 2.0}]
    [p] = placement_problems([PoolAsk("decode", 1, {CPU: 3.0})], nodes)
    assert p.startswith("no node of the Ray cluster can hold one decode worker (CPU 3): ask less per worker (")
    assert "or add a node that has it" in p


def test_fractional_cpus_share_a_small_machine() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 1.0}), PoolAsk("decode", 2, {CPU: 1.0})]
    assert fractional_cpus(asks, 2.0) == 0.66
    assert placement_problems([PoolAsk(a.role, a.replicas, {CPU: 0.66}) for a in asks], TWO_CPUS) == []
    assert fractional_cpus(asks, 8.0) == 1.0


def test_the_cluster_described_by_its_resources_without_ray_bookkeeping() -> None:
    head = {CPU: 1.0, "memory": 1e9, "object_store_memory": 1e8, "node:127.0.0.1": 1.0, "node:__internal_head__": 1.0}
    prefill = {CPU: 1.0, "prefill_node": 1.0, "node:127.0.0.2": 1.0}
    decode = {CPU: 0.5, "decode_node": 1.0, "accelerator_type:H100": 1.0}
    assert describe_nodes([head, prefill, decode, decode]) == "4 nodes: CPU 3, decode_node 2, prefill_node 1"
    assert describe_nodes([]) == "0 nodes: nothing"


# With an autoscaler: its node types say what can ever be placed.
NODE_TYPES = {
    "ray.head.default": {CPU: 0.0},
    "prefill": {CPU: 8.0, GPU: 2.0, "prefill_node": 1.0},
    "decode": {CPU: 8.0, GPU: 1.0, "decode_node": 1.0, "object_store_memory": 1e9},
}
HEAD_ONLY = [{CPU: 0.0, "memory": 1e10}]


def test_with_node_types_a_worker_a_node_type_can_hold_waits_for_its_node() -> None:
    asks = [PoolAsk("prefill", 2, {CPU: 1.0, GPU: 2.0, "prefill_node": 1.0}), PoolAsk("decode", 4, {GPU: 1.0})]
    assert placement_problems(asks, HEAD_ONLY) != []  # no node has them yet: without the types, a shortfall
    assert placement_problems(asks, HEAD_ONLY, NODE_TYPES) == []
    assert node_types_to_add(asks[0], HEAD_ONLY, NODE_TYPES) == ["prefill"]
    assert node_types_to_add(asks[1], HEAD_ONLY, NODE_TYPES) == ["decode", "prefill"]  # any GPU node would do
    assert node_types_to_add(asks[1], [{CPU: 8.0, GPU: 1.0}], NODE_TYPES) == []  # an alive node holds it


def test_with_node_types_a_worker_no_node_type_can_hold_is_a_problem_at_once() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 1.0, "prefill_node": 1.0}), PoolAsk("decode", 1, {CPU: 1.0, "tpu_node": 1.0})]
    [p] = placement_problems(asks, HEAD_ONLY, NODE_TYPES)
    assert p.startswith("no node of the Ray cluster and no node type of its autoscaler can hold one decode worker ")
    assert "(CPU 1, tpu_node 1)" in p
    assert "decode: CPU 8, GPU 1, decode_node 1; prefill: CPU 8, GPU 2, prefill_node 1" in p
    assert "object_store_memory" not in p
    # too big for every node type counts the same, while an alive node big enough is no problem
    [p] = placement_problems([PoolAsk("decode", 1, {GPU: 4.0})], HEAD_ONLY, NODE_TYPES)
    assert "(GPU 4)" in p
    assert placement_problems([PoolAsk("decode", 1, {GPU: 4.0})], [{GPU: 8.0}], NODE_TYPES) == []


def test_node_types_read_from_a_cluster_launcher_config() -> None:
    config = {
        "available_node_types": {
            "head": {"resources": {"CPU": 0}, "max_workers": 0},
            "decode": {"resources": {"CPU": 8, "GPU": 1, "decode_node": 1}, "min_workers": 0, "max_workers": 2},
            "bare": {"node_config": {}},
        }
    }
    assert node_types_of_cluster_config(config) == {
        "head": {CPU: 0.0},
        "decode": {CPU: 8.0, GPU: 1.0, "decode_node": 1.0},
        "bare": {},
    }
    with pytest.raises(ValueError, match="no available_node_types"):
        node_types_of_cluster_config({"provider": {}})


def test_serve_reads_node_types_from_json_or_a_cluster_launcher_yaml(tmp_path) -> None:
    from splitserve.cluster.serve import parse_node_types

    assert parse_node_types(None) is None
    assert parse_node_types('{"decode": {"GPU": 2, "decode_node": 1}}') == {"decode": {GPU: 2.0, "decode_node": 1.0}}
    launcher = parse_node_types(str(Path(__file__).parents[1] / "deploy" / "ray" / "cluster.yaml"))
    assert launcher is not None and launcher["decode_node"]["decode_node"] > 0
    bad = tmp_path / "cluster.yaml"
    bad.write_text("available_node_types: [unclosed")
    with pytest.raises(ValueError, match="--node-types"):
        parse_node_types(str(bad))
    with pytest.raises(OSError):
        parse_node_types(str(tmp_path / "missing.yaml"))
