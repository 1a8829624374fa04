"""The cluster simulator on toy cost models whose answers can be worked out by hand,
its invariants (every request finishes once, every worker ends empty, a seed
decides everything), the split search, and a 256-worker cluster."""

from __future__ import annotations

import math
import random
import time

import pytest

from splitserve.measure.results import RequestRecord, RunResult, Stats
from splitserve.plan.costs import mixed_step_s, pipelined_tail_s
from splitserve.plan.deployment import Deployment, DeploymentCosts
from splitserve.plan.hardware import GPUS, Network
from splitserve.plan.shapes import BUILTIN
from splitserve.plan.sim.simulate import ClusterSpec, Mode, Request, Slo, percentile, simulate, weighted_percentiles
from splitserve.plan.sim.sweep import best_split, poisson_requests, requests_from_run, sweep_rates
from splitserve.router.config import RoutingConfig

pytestmark = pytest.mark.timeout(120)


class Toy:
    """Prefill: `per_token` s a token; a decode step: `step` s whatever the batch; transfer: `transfer` s."""

    def __init__(self, per_token: float = 0.001, step: float = 0.01, transfer: float = 0.05) -> None:
        self.per_token, self.step, self.transfer = per_token, step, transfer

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        return self.per_token * tokens

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        return self.step if batch > 0 else 0.0

    def transfer_s(self, tokens: int) -> float:
        return self.transfer


def one(mode: Mode, prompt: int = 100, output: int = 5, costs: Toy | None = None):
    spec = ClusterSpec(mode, decode_workers=1, prefill_workers=1)
    return simulate([Request(2.0, prompt, output)], spec, costs or Toy(), random.Random(0)).outcomes[0]


def test_one_request_colocated_ttft_is_its_prefill_and_tpot_a_decode_step():
    o = one("colocated")
    assert o.ttft_s == pytest.approx(0.1)  # 100 tokens x 1 ms, one step
    assert o.tpot_s == pytest.approx(0.01)
    assert o.finish_s == pytest.approx(2.0 + 0.1 + 4 * 0.01)
    assert not o.remote


def test_one_request_disaggregated_first_token_from_the_prefill_worker_then_the_transfer():
    """The prefill worker's first token goes to the user at once (as the router streams it); the
    decode worker's first step waits for the KV's last layers."""
    o = one("disaggregated")
    assert o.remote
    assert o.ttft_s == pytest.approx(0.1)
    assert o.finish_s == pytest.approx(2.0 + 0.1 + 0.05 + 4 * 0.01)
    assert o.tpot_s == pytest.approx((0.05 + 4 * 0.01) / 4)


def test_a_long_prompt_is_prefilled_in_chunks():
    spec = ClusterSpec("colocated", decode_workers=1, max_num_batched_tokens=64)
    o = simulate([Request(0.0, 200, 1)], spec, Toy(), random.Random(0)).outcomes[0]
    assert o.ttft_s == pytest.approx(0.2)  # 64 + 64 + 64 + 8 tokens, 4 steps at 1 ms a token
    assert o.finish_s == pytest.approx(0.2)  # one output token: done with the first


def test_a_queue_on_one_prefill_worker_gives_k_times_the_prefill():
    """Prompts that fill the step's budget one at a time: the k-th waits for the k - 1 before it."""
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1, max_num_batched_tokens=100)
    reqs = [Request(0.0, 100, 2) for _ in range(6)]
    result = simulate(reqs, spec, Toy(), random.Random(0))
    assert [o.ttft_s for o in result.outcomes] == pytest.approx([0.1 * k for k in range(1, 7)])


def test_colocated_steps_mix_decodes_with_a_prefill_chunk():
    """The second request's prefill shares a step with the first one's decode: that step costs the
    chunk plus the decode above its fixed part (here all of it)."""
    spec = ClusterSpec("colocated", decode_workers=1)
    reqs = [Request(0.0, 100, 3), Request(0.05, 50, 2)]
    a, b = simulate(reqs, spec, Toy(), random.Random(0)).outcomes
    assert a.ttft_s == pytest.approx(0.1)
    # the worker is busy until 0.1; then one step: a's decode (10 ms) + b's 50 tokens (50 ms)
    assert b.ttft_s == pytest.approx(0.1 + 0.06 - 0.05)
    assert a.finish_s == pytest.approx(0.1 + 0.06 + 0.01)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "auto"])
def test_every_request_finishes_once_and_every_worker_ends_empty(mode):
    """simulate raises when a request is left or a worker still holds seats, KV or tokens."""
    rng = random.Random(7)
    lengths = [(rng.randint(1, 3000), rng.randint(1, 300)) for _ in range(3000)]
    reqs = poisson_requests(40.0, lengths, random.Random(1), cached_tokens=32)
    spec = ClusterSpec(mode, decode_workers=3, prefill_workers=2, max_num_seqs=16, kv_capacity_tokens=20000)
    result = simulate(reqs, spec, Toy(0.0001, 0.02, 0.01), random.Random(0), Slo(1.0, 0.05), 40.0)
    assert result.completed == len(reqs) == len(result.outcomes)
    assert all(o.finish_s >= o.arrival_s + o.ttft_s > o.arrival_s for o in result.outcomes)
    assert result.remote_share == {"colocated": 0.0, "disaggregated": 1.0}.get(mode, result.remote_share)


def test_the_same_seed_gives_the_same_result():
    lengths = [(random.Random(i).randint(10, 900), 20) for i in range(500)]
    spec = ClusterSpec("auto", decode_workers=4, prefill_workers=2)

    def run(seed: int):
        return simulate(poisson_requests(30.0, lengths, random.Random(seed)), spec, Toy(), random.Random(seed))

    assert run(3) == run(3)


def test_a_step_costs_less_overhead_while_the_other_worker_is_idle():
    """The serving overhead was measured with both workers busy; each idle one takes 3 ms off a step."""
    by_busy = {1: -0.003, 2: 0.0}.__getitem__
    spec = ClusterSpec("colocated", decode_workers=2)
    alone = simulate([Request(0.0, 100, 5)], spec, Toy(), random.Random(0), serve_by_busy=by_busy).outcomes[0]
    assert alone.ttft_s == pytest.approx(0.1 - 0.003)
    assert alone.tpot_s == pytest.approx(0.01 - 0.003)
    both = [Request(0.0, 100, 5), Request(0.0, 100, 5)]  # one on each worker, stepping together
    for o in simulate(both, spec, Toy(), random.Random(0), serve_by_busy=by_busy).outcomes:
        assert o.tpot_s == pytest.approx(0.01)


def test_a_decode_step_costs_more_while_the_prefill_worker_computes():
    """A decodes its 10 steps while B's 1,000-token prompt keeps the prefill worker busy: each step
    costs the model's 10 ms and the measured 4 ms beside a busy prefill worker; alone, 10 ms."""
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1)
    a, b = Request(0.0, 10, 11), Request(0.0, 1000, 2)
    beside = {1: 0.004}.__getitem__  # what a batch-1 step costs more

    def finish_of_a(reqs: list[Request]) -> float:
        result = simulate(reqs, spec, Toy(), random.Random(0), serve_beside_prefill=beside)
        return next(o.finish_s for o in result.outcomes if o.output_tokens == a.output_tokens)

    first_step = 0.01 + 0.05  # A's prefill, then its KV's transfer
    assert finish_of_a([a]) == pytest.approx(first_step + 10 * 0.01)
    assert finish_of_a([a, b]) == pytest.approx(first_step + 10 * (0.01 + 0.004))


@pytest.mark.parametrize(("threshold", "short_ttft"), [(256, 0.924), (0, 2.0)])
def test_a_short_prompt_goes_before_a_long_prefill_in_progress(threshold, short_ttft):
    """As the engine's scheduler with --long-prefill-token-threshold: a 2,000-token prompt prefills in
    512-token chunks of 1 ms a token; a 100-token prompt arriving 0.1 s in takes the next step beside
    the long one's 412 (threshold 256), or waits out its chunks and starts in the last one's leftover
    48 tokens (0: off)."""
    spec = ClusterSpec("colocated", decode_workers=1, long_prefill_token_threshold=threshold)
    reqs = [Request(0.0, 2000, 1), Request(0.1, 100, 1)]
    short = next(o for o in simulate(reqs, spec, Toy(), random.Random(0)).outcomes if o.arrival_s > 0)
    assert short.ttft_s == pytest.approx(short_ttft)


def test_auto_prefills_short_prompts_locally_and_long_ones_remotely():
    # the length rule alone: the backlog rule (on by default since issue 22) is pushed out of reach
    routing = RoutingConfig(local_prefill_max_tokens=256, prefill_backlog_tokens=10**9)
    spec = ClusterSpec("auto", decode_workers=2, prefill_workers=1, routing=routing)
    short = simulate(poisson_requests(5.0, [(200, 4)] * 50, random.Random(0)), spec, Toy(), random.Random(0))
    long = simulate(poisson_requests(5.0, [(300, 4)] * 50, random.Random(0)), spec, Toy(), random.Random(0))
    assert short.remote_share == 0.0
    assert long.remote_share == 1.0


def test_auto_with_the_default_backlog_takes_some_long_prompts_local_when_the_prefill_pool_backs_up():
    spec = ClusterSpec("auto", decode_workers=2, prefill_workers=1, routing=RoutingConfig(local_prefill_max_tokens=256))
    long = simulate(poisson_requests(5.0, [(300, 4)] * 50, random.Random(0)), spec, Toy(), random.Random(0))
    assert 0.0 < long.remote_share < 1.0


def test_a_decode_worker_without_a_seat_holds_back_the_remote_prefill():
    """One seat: the second request's prefill starts only when the first one's decode ends."""
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1, max_num_seqs=1)
    a, b = simulate([Request(0.0, 100, 3), Request(0.0, 100, 3)], spec, Toy(), random.Random(0)).outcomes
    a_done = 0.1 + 0.05 + 2 * 0.01
    assert a.finish_s == pytest.approx(a_done)
    assert b.ttft_s == pytest.approx(a_done + 0.1)


def test_goodput_counts_the_requests_that_meet_both_slos():
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1, max_num_batched_tokens=100)
    reqs = [Request(0.0, 100, 2) for _ in range(4)]  # TTFTs 0.1, 0.2, 0.3, 0.4
    r = simulate(reqs, spec, Toy(), random.Random(0), Slo(ttft_s=0.25, tpot_s=1.0))
    assert r.slo_attainment == 0.5
    assert r.goodput == pytest.approx(2 / r.duration_s)


def test_weighted_percentiles_are_those_of_the_expanded_list():
    samples = [(0.3, 2), (0.1, 5), (0.2, 1), (0.9, 1)]
    expanded = [v for v, c in samples for _ in range(c)]
    assert weighted_percentiles(samples, (50, 90, 99)) == pytest.approx([percentile(expanded, q) for q in (50, 90, 99)])


def test_a_rate_sweep_gets_worse_with_the_rate():
    spec = ClusterSpec("colocated", decode_workers=1)
    low, high = sweep_rates([1.0, 20.0], [(200, 20)] * 200, spec, Toy(), Slo(0.5, 0.05), seed=0)
    assert (low.rate, high.rate) == (1.0, 20.0)
    assert low.ttft.p90 < high.ttft.p90


def split_case(rate: float, n: int) -> tuple[Toy, ClusterSpec, list[Request]]:
    """A prefill worker serves 10 req/s (100 ms a prompt, one a step). A decode worker holds 6 seats,
    each taken from routing to the last token: the 100 ms prefill, then 10 steps of 50 ms: at most
    6 / 0.6 = 10 req/s, a little less once prefills queue."""
    costs = Toy(per_token=0.001, step=0.05, transfer=0.0)
    spec = ClusterSpec("disaggregated", decode_workers=1, prefill_workers=1, max_num_seqs=6, max_num_batched_tokens=100)
    return costs, spec, poisson_requests(rate, [(100, 11)] * n, random.Random(0))


def test_the_split_search_finds_the_balanced_split():
    """10 GPUs at 44 req/s: 4 prefill workers serve 40, 4 decode workers under 40; only 5 and 5 keep up."""
    costs, spec, reqs = split_case(44.0, 1500)
    search = best_split(reqs, 10, spec, costs, Slo(ttft_s=1.0, tpot_s=0.2), seed=0)
    assert (search.best.prefill_gpus, search.best.decode_gpus) == (5, 5)
    assert [p.prefill_gpus for p in search.points] == list(range(1, 10))  # a small budget: every split


def test_the_split_search_refines_a_coarse_grid_on_a_large_budget():
    """90 GPUs at 420 req/s: 43 prefill workers or more (430 req/s), 45 decode workers or more."""
    costs, spec, reqs = split_case(420.0, 6000)
    search = best_split(reqs, 90, spec, costs, Slo(ttft_s=1.0, tpot_s=0.2), seed=0)
    assert search.best.prefill_gpus in (43, 44, 45)
    assert len(search.points) < 30  # not one simulation per split


def llama_8b_on_h100s(gpus: int = 256) -> Deployment:
    return Deployment(BUILTIN["llama-3-8b"], GPUS["h100-sxm"], gpus, 1, Network.of(400.0, True))


def test_a_deployments_roofline_as_the_simulators_cost_model():
    dep = llama_8b_on_h100s()
    c = DeploymentCosts(dep)
    assert c.prefill_s(4096) == dep.prefill_s(4096) and c.prefill_s(0) == 0.0
    # the simulator passes a step's total context; the deployment prices each request's
    assert c.decode_step_s(4, 4 * 1000) == dep.decode_step_s(4, 1000)
    assert c.decode_step_s(1, 0) < c.decode_step_s(64, 64 * 4096)  # more KV read, more time
    # of the KV transfer, what the layers sent during the prefill leave after it
    whole, compute = dep.transfer_s(4096), dep.prefill_s(4096)
    assert c.transfer_s(4096) == pytest.approx(pipelined_tail_s(whole, compute, 32)) and c.transfer_s(0) == 0.0
    assert c.transfer_s(4096) < whole
    assert mixed_step_s(c, 0, 0, 0, 0) == 0.0
    assert pipelined_tail_s(1.0, 10.0, 4) == 0.25  # the link keeps up: the last layer's share
    assert pipelined_tail_s(1.0, 0.4, 4) == pytest.approx(1.0 - 0.3)  # it does not: the backlog


def test_requests_from_a_bench_serve_run_replay_its_arrivals_and_lengths():
    s = Stats(0.0, 0.0, 0.0, 0.0)
    records = [
        RequestRecord("plain", 120, 64, 0.5, 0.2, [0.03], 2.0, None),
        RequestRecord("plain", 80, 32, 1.25, 0.1, [], 1.0, None),
    ]
    run = RunResult(1.0, 1.0, None, 2, 3.0, 2, 0, 0.6, 32.0, 72.0, 200, 96, s, s, s, s, None, None, {}, None, records)
    assert requests_from_run(run) == [Request(0.5, 120, 64), Request(1.25, 80, 32)]
    # the chat template's cached opening: at most all of a prompt but its last token
    assert requests_from_run(run, 16)[0] == Request(0.5, 120, 64, 16)
    assert requests_from_run(run, 100)[1] == Request(1.25, 80, 32, 79)


@pytest.mark.timeout(300)
def test_a_256_worker_cluster_with_10000_requests(capsys):
    """An 8B-like model on 256 single-GPU workers (64 prefill, 192 decode) at 300 req/s."""
    costs = DeploymentCosts(llama_8b_on_h100s())
    rng = random.Random(0)
    lengths = [(rng.randint(100, 4000), rng.randint(20, 400)) for _ in range(10000)]
    reqs = poisson_requests(300.0, lengths, random.Random(1))
    spec = ClusterSpec(
        "disaggregated", decode_workers=192, prefill_workers=64, max_num_seqs=128, max_num_batched_tokens=8192
    )
    t = time.perf_counter()
    r = simulate(reqs, spec, costs, random.Random(0), Slo(2.0, 0.1), 300.0)
    took = time.perf_counter() - t
    with capsys.disabled():
        print(
            f"\n256 workers, {len(reqs)} requests, {r.steps} steps simulated in {took:.1f}s; "
            f"goodput {r.goodput:.0f} req/s, TTFT p90 {r.ttft.p90 * 1e3:.0f} ms, "
            f"ITL p50 {r.itl.p50 * 1e3:.1f} ms"
        )
    assert r.completed == 10000
    assert not math.isnan(r.goodput)
