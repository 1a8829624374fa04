"""The simulator routes with the router's own code (router/policy.py's `route`, its chooser and
RoutingConfig, a PrefixIndex fed by the simulated decode workers' stored blocks), so a cached
prefix draws a request as it does in the real router; and the synthetic prompts' block hashes
are engine/block_hash.py's chain."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.plan.sim.simulate import ClusterSpec, PromptChains, Request, simulate
from splitserve.router.config import RoutingConfig

pytestmark = pytest.mark.timeout(60)


class Toy:
    """Prefill: 1 ms a token; a decode step: 10 ms whatever the batch; transfer: 50 ms."""

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        return 0.001 * tokens

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        return 0.01 if batch > 0 else 0.0

    def transfer_s(self, tokens: int) -> float:
        return 0.05


def prefix_case(r2_at: float = 1.0) -> list[Request]:
    """r0 (a 512-token prefix of group 1) and r1 (no shared prefix) start at once, one on each
    worker (the second sees the first's queued prompt). At t=1 the worker A that ran r0 holds the
    prefix and decodes a context of about 600 + 40 tokens; B about 500 + 50: A is the more
    loaded. r2, of group 1, arrives then."""
    return [
        Request(0.0, 600, 100, prefix_tokens=512, prefix_group=1),
        Request(0.0, 500, 100),
        Request(r2_at, 600, 100, prefix_tokens=512, prefix_group=1),
    ]


def test_a_cached_prefix_draws_the_request_where_the_routers_chooser_sends_it():
    """The router's cost (4 x 88 uncached + ~640 on A against 4 x 600 + ~550 on B) sends r2 to the
    more loaded worker that holds its prefix; the old least-loaded rule (the same chooser with
    no weight on the prefill: load alone) sends it to the other."""
    spec = ClusterSpec("colocated", decode_workers=2, max_num_batched_tokens=1024)
    r0, r1, r2 = simulate(prefix_case(), spec, Toy(), random.Random(0)).outcomes
    assert r0.decode_worker != r1.decode_worker
    assert r2.decode_worker == r0.decode_worker
    assert r2.ttft_s < 0.2  # 88 tokens prefilled (the rest was cached), not 600

    load_only = ClusterSpec(
        "colocated", decode_workers=2, max_num_batched_tokens=1024, routing=RoutingConfig(prefill_weight=0.0)
    )
    r0, r1, r2 = simulate(prefix_case(), load_only, Toy(), random.Random(0)).outcomes
    assert r2.decode_worker == r1.decode_worker
    assert r2.ttft_s >= 0.6


def test_in_mode_auto_a_prefix_hit_makes_the_prefill_local():
    """Of r2's 600 tokens, 512 are on r0's decode worker (stored when r0's KV arrived there, at
    1.07 s: the prefill worker's 512-token steps took r0 whole and r1's first 424 tokens by 1.02):
    88 uncached tokens are under the 256 of local_prefill_max_tokens, so it prefills there."""
    spec = ClusterSpec("auto", decode_workers=2, prefill_workers=1, routing=RoutingConfig(local_prefill_max_tokens=256))
    r0, r1, r2 = simulate(prefix_case(r2_at=1.5), spec, Toy(), random.Random(0)).outcomes
    assert r0.remote and r1.remote and not r2.remote
    assert r2.decode_worker == r0.decode_worker


def test_the_specs_routing_section_selects_the_routers_chooser():
    spec = ClusterSpec("colocated", decode_workers=2, routing=RoutingConfig(decode_policy="round_robin"))
    result = simulate([Request(0.01 * i, 100, 2) for i in range(4)], spec, Toy(), random.Random(0))
    assert [o.decode_worker for o in result.outcomes] == ["decode0", "decode1", "decode0", "decode1"]
    assert spec.routing.mode == "colocated"  # the cluster's shape decides the mode


def test_prompt_chains_are_the_engines_block_hashes_of_synthetic_prompts():
    chains = PromptChains(16)
    # 16 tokens every prompt shares (token id 0), then group 2's own (token id 3) up to 48
    grouped = chains.hashes(Request(0.0, 100, 1, cached_tokens=16, prefix_tokens=48, prefix_group=2))
    assert grouped == tuple(block_hashes([0] * 16 + [3] * 32, 16))
    everywhere = chains.hashes(Request(0.0, 100, 1, cached_tokens=40))  # its two full blocks
    assert everywhere == chains.everywhere(40) == tuple(block_hashes([0] * 32, 16))
    assert everywhere[0] == grouped[0]
    other = chains.hashes(Request(0.0, 100, 1, cached_tokens=16, prefix_tokens=48, prefix_group=5))
    assert other[0] == grouped[0] and other[1:] != grouped[1:]
    assert chains.hashes(Request(0.0, 100, 1)) == ()


def test_a_shared_prefix_no_shorter_than_the_prompt_is_refused():
    spec = ClusterSpec("colocated", decode_workers=1)
    with pytest.raises(ValueError, match="shared prefix"):
        simulate([Request(0.0, 100, 1, prefix_tokens=100)], spec, Toy(), random.Random(0))


class ToyWire(Toy):
    """Toy, with a transfer of 1 ms a token sent: what the decode worker already holds is not sent."""

    def transfer_s(self, tokens: int) -> float:
        return 0.001 * tokens


def _grouped(at: float, group: int = 1) -> Request:
    return Request(at, 600, 2, prefix_tokens=512, prefix_group=group)


def test_a_remote_prefill_computes_what_its_own_cache_lacks_and_sends_what_the_decode_worker_lacks():
    """r1 shares r0's 512-token prefix; both prefill remotely. One step per prompt (a big chunk):
    a prompt of n uncached tokens takes n ms to prefill, n ms to send, then one 10 ms decode step."""
    big = 100_000
    # one prefill worker, one decode worker: both hold the prefix when r1 comes
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1, max_num_batched_tokens=big)
    _, r1 = simulate([_grouped(0.0), _grouped(2.0)], spec, ToyWire(), random.Random(0)).outcomes
    assert r1.ttft_s == pytest.approx(0.088) and r1.finish_s - 2.0 - r1.ttft_s == pytest.approx(0.088 + 0.01)
    _, other = simulate([_grouped(0.0), _grouped(2.0, group=2)], spec, ToyWire(), random.Random(0)).outcomes
    assert other.ttft_s == pytest.approx(0.6) and other.finish_s - 2.0 - other.ttft_s == pytest.approx(0.61)

    # r1 on the other decode worker (round robin), the same prefill worker: computed 88, all 600 sent
    two_decode = ClusterSpec(
        "disaggregated",
        decode_workers=2,
        prefill_workers=1,
        max_num_batched_tokens=big,
        routing=RoutingConfig(decode_policy="round_robin"),
    )
    r0, r1 = simulate([_grouped(0.0), _grouped(2.0)], two_decode, ToyWire(), random.Random(0)).outcomes
    assert r0.decode_worker != r1.decode_worker
    assert r1.ttft_s == pytest.approx(0.088) and r1.finish_s - 2.0 - r1.ttft_s == pytest.approx(0.61)

    # the same decode worker, the other prefill worker: the decode worker's hit spares the transfer
    # only. A 5000-token prompt holds one prefill worker from 0 to 5 s, so r0 goes to the other,
    # which a 10000-token prompt then holds from 0.7 s: at 2 s the first has fewer tokens queued
    two_prefill = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=2, max_num_batched_tokens=big)
    reqs = [Request(0.0, 5000, 2), _grouped(0.0), Request(0.7, 10_000, 2), _grouped(2.0)]
    *_, r1 = simulate(reqs, two_prefill, ToyWire(), random.Random(0)).outcomes
    assert r1.ttft_s == pytest.approx(5.6 - 2.0)  # waits for the 5000, then computes all 600 tokens
    assert r1.finish_s == pytest.approx(5.6 + 0.088 + 0.01)  # but sends only the 88 the decode worker lacks
