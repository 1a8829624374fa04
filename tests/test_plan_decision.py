"""The disaggregate-or-not decision of `splitserve plan`: the known shape (no for short prompts
on few GPUs over TCP, yes for long prompts at scale over RDMA), each check on its own, the split,
the local-prefill threshold, a `bench serve` file as the workload, and the command itself."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from splitserve.measure import metrics
from splitserve.measure.results import BenchResult, RequestRecord, save_result
from splitserve.plan import decision
from splitserve.plan.decision import best_split, decide
from splitserve.plan.deployment import Deployment, smallest_fitting_tp, tp_sizes
from splitserve.plan.hardware import GPUS, Network, accelerator, cpu_from_profile
from splitserve.plan.shapes import BUILTIN
from splitserve.plan.sim.workload import Length, Workload, lengths_from_result


def deployment(model="llama-3-8b", gpus=2, tp=1, gbps=25.0, rdma=False, gpu="h100-sxm") -> Deployment:
    return Deployment(BUILTIN[model], GPUS[gpu], gpus, tp, Network.of(gbps, rdma))


def workload(prompt=200, output=100, reuse=0.0, rate=5.0, ttft_ms=1000.0, tpot_ms=100.0) -> Workload:
    return Workload(Length(prompt), Length(output), reuse, rate, ttft_ms / 1e3, tpot_ms / 1e3)


def verdicts(plan: decision.Plan) -> dict[str, str]:
    return {c.key: c.verdict for c in plan.checks}


@pytest.mark.timeout(30)
def test_short_prompts_and_outputs_on_two_gpus_over_tcp_stay_colocated():
    plan = decide(deployment(), workload())
    rec = plan.recommendation
    assert not rec.disaggregate
    assert (rec.prefill_replicas, rec.decode_replicas, rec.local_prefill_max_tokens) == (0, 2, None)
    v = verdicts(plan)
    assert v["gpu_count"] == v["network"] == v["transfer"] == "against"
    assert any("keep prefill where the KV is used" in r for r in rec.reasons)


@pytest.mark.timeout(30)
def test_long_prompts_on_64_h100s_over_400_gbps_rdma_disaggregate():
    dep = deployment("llama-3-70b", gpus=64, tp=8, gbps=400, rdma=True)
    plan = decide(dep, workload(prompt=8192, output=256, rate=10, ttft_ms=2000))
    rec = plan.recommendation
    assert rec.disaggregate
    assert set(verdicts(plan).values()) == {"for"}
    assert rec.prefill_replicas + rec.decode_replicas == 8
    assert rec.prefill_replicas > rec.decode_replicas  # 8K prompts against 256-token outputs: prefill-heavy
    assert rec.local_prefill_max_tokens is not None
    assert 0 < rec.local_prefill_max_tokens < 8192  # short uncached suffixes still prefill locally
    # the honest part: the split buys latency, not throughput
    assert rec.capacity_rps <= rec.colocated_rps


@pytest.mark.timeout(30)
def test_high_prefix_reuse_keeps_prefill_where_the_prefix_is_cached_even_when_other_checks_say_yes():
    dep = deployment(gpus=8, gbps=100, rdma=True)
    fresh = decide(dep, workload(prompt=4096, output=256, reuse=0.0, rate=20))
    reused = decide(dep, workload(prompt=4096, output=256, reuse=0.8, rate=20))
    assert fresh.recommendation.disaggregate
    assert verdicts(reused)["prefix_reuse"] == "against"
    assert not reused.recommendation.disaggregate
    assert any("already cached" in r for r in reused.recommendation.reasons)


@pytest.mark.timeout(30)
def test_high_prefix_reuse_argues_against_and_low_reuse_for():
    assert decision.check_prefix_reuse(workload(reuse=0.8)).verdict == "against"
    assert decision.check_prefix_reuse(workload(reuse=0.3)).verdict == "neutral"
    assert decision.check_prefix_reuse(workload(reuse=0.1)).verdict == "for"


@pytest.mark.timeout(30)
def test_the_network_check_wants_rdma_at_100_gbps_or_more():
    assert decision.check_network(deployment(gbps=400, rdma=True)).verdict == "for"
    assert decision.check_network(deployment(gbps=400, rdma=False)).verdict == "neutral"
    assert decision.check_network(deployment(gbps=25, rdma=False)).verdict == "against"
    assert decision.check_network(deployment(gbps=10, rdma=True)).verdict == "against"


@pytest.mark.timeout(30)
def test_the_transfer_check_compares_the_kv_stream_with_prefill_and_the_ttft_objective():
    long_prompts = workload(prompt=8192, output=256, ttft_ms=2000)
    slow = deployment("llama-3-70b", gpus=16, tp=8, gbps=5, rdma=False)  # 1.1 s of KV per 0.4 s prefill
    fast = deployment("llama-3-70b", gpus=16, tp=8, gbps=400, rdma=True)
    assert decision.decide(slow, long_prompts).checks[1].verdict == "against"
    check = decision.decide(fast, long_prompts).checks[1]
    assert check.verdict == "for"
    assert check.value < 5  # ms left after prefill: one layer's share plus the control hops


@pytest.mark.timeout(30)
def test_a_split_is_balanced_by_work_and_what_rounding_strands_is_reported():
    assert best_split(8, 0.5) == (4, 0.0)
    assert best_split(10, 0.3) == (3, pytest.approx(0.0))
    p, idle = best_split(2, 0.3)  # one replica each: the decode side is the bottleneck
    assert p == 1 and idle == pytest.approx(1 - (1 / 0.7) / 2)
    assert decision.check_gpu_count(deployment(gpus=2), decide(deployment(), workload()).costs).verdict == "against"


@pytest.mark.timeout(30)
def test_the_local_prefill_threshold_is_where_local_compute_overtakes_the_remote_path():
    dep = deployment("llama-3-70b", gpus=64, tp=8, gbps=400, rdma=True)
    wl = workload(prompt=8192, output=256, rate=10, ttft_ms=2000)
    costs = decide(dep, wl).costs
    n = decision.local_prefill_threshold(dep, wl, costs, queue_wait_s=0.0)
    slack = wl.tpot_slo_s - costs.decode_step_s
    remote = dep.exposed_transfer_s(n + 1) + decision.CONTROL_RPC_S
    assert dep.prefill_compute_s(n) <= min(slack, dep.exposed_transfer_s(n) + decision.CONTROL_RPC_S)
    assert dep.prefill_compute_s(n + 1) > min(slack, remote)
    # a queue at the prefill pool makes more prompts worth prefilling locally, up to the TPOT slack
    assert decision.local_prefill_threshold(dep, wl, costs, queue_wait_s=0.05) >= n
    assert decision.prefill_queue_wait_s(10, 0.2, 1) == math.inf  # 2 s of prefill per second: saturated


@pytest.mark.timeout(30)
def test_cpu_here_comes_from_a_measured_profile():
    cpu = cpu_from_profile({"memory_bytes_per_s": 20e9, "matmul_flops": 1e11}, memory_bytes=64e9)
    assert (cpu.hbm_bytes_per_s, cpu.bf16_flops, cpu.memory_bytes) == (20e9, 1e11, 64e9)
    assert accelerator("cpu-here", {"memory_bytes_per_s": 1e9, "matmul_flops": 1e9}).name == "cpu-here"
    with pytest.raises(ValueError, match="matmul_flops"):
        cpu_from_profile({"memory_bytes_per_s": 1e9})


@pytest.mark.timeout(30)
def test_a_bench_serve_result_gives_the_workloads_lengths_and_rate(tmp_path):
    def rec(prompt: int, output: int, error: str | None = None) -> RequestRecord:
        return RequestRecord("plain", prompt, output, 0.0, 0.1, [0.02] * 3, 0.2, error)

    records = [rec(100, 10), rec(300, 30), rec(5000, 0, error="HTTP 500")]
    runs = [
        metrics.summarize(records, 1.0, rate, 1.0, None, {}, None) for rate in (math.inf, 2.0)
    ]  # an all-at-once run first: the first finite rate is the one taken
    path = tmp_path / "bench.json"
    save_result(BenchResult("x", "openai-chat", "http://x", "random", {}, runs), path)
    prompt, output, rate = lengths_from_result(str(path))
    assert (prompt.mean, prompt.std, output.mean, rate) == (200.0, 100.0, 20.0, 2.0)


def run_plan(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "plan", *flags], capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(180)
def test_the_command_prints_every_section_and_its_answer():
    out = run_plan(
        "--model",
        "llama-3-70b",
        "--gpu",
        "h100-sxm",
        "--gpus",
        "64",
        "--tp",
        "8",
        "--network-gbps",
        "400",
        "--rdma",
        "--prompt-len",
        "8192",
        "--output-len",
        "256:64",
        "--rate",
        "10",
        "--ttft-slo-ms",
        "2000",
    )
    assert out.returncode == 0, out.stderr
    for section in ("Memory", "KV transfer", "Roofline", "Checks", "Recommendation"):
        assert f"\n{section}" in out.stdout
    assert "KV per token              327,680 B" in out.stdout
    assert "DISAGGREGATE: " in out.stdout
    no = run_plan(
        "--model",
        "llama-3-8b",
        "--gpus",
        "2",
        "--prompt-len",
        "200",
        "--output-len",
        "100",
        "--network-gbps",
        "25",
        "--tcp",
    )
    assert no.returncode == 0, no.stderr
    assert "COLOCATE: all 2 GPUs" in no.stdout


@pytest.mark.timeout(180)
def test_without_tp_the_plan_takes_the_smallest_size_that_fits_and_says_so():
    out = run_plan("--model", "llama-3-70b")  # 141 GB of bf16 weights: not on one 80 GB H100
    assert out.returncode == 0, out.stdout
    assert "--tp not given: TP 2, the smallest tensor-parallel size" in out.stdout
    assert "TP 2 = 4 replicas" in out.stdout
    small = run_plan("--model", "llama-3-8b")
    assert small.returncode == 0 and "--tp not given" not in small.stdout and "TP 1 = 8 replicas" in small.stdout
    none = run_plan("--model", "llama-3.1-405b", "--gpu", "a100-80gb", "--gpus", "4")
    assert none.returncode == 2
    assert "no tensor-parallel size up to --gpus 4 fits (at TP 4" in none.stdout and "raise --gpus" in none.stdout


def test_tp_sizes_split_the_heads_within_the_budget():
    llama = BUILTIN["llama-3-70b"]  # 64 heads
    assert tp_sizes(llama, 8) == [1, 2, 4, 8] and tp_sizes(llama, 6) == [1, 2, 4]
    dep = deployment("llama-3-70b", gpus=8)
    fitting = smallest_fitting_tp(dep, 1280)
    assert fitting is not None and fitting.tp == 2 and fitting.does_not_fit(1280) is None
    assert dep.does_not_fit(1280) is not None
    assert smallest_fitting_tp(deployment("llama-3-70b", gpus=1), 1280) is None


@pytest.mark.timeout(180)
def test_the_command_says_why_a_model_does_not_fit():
    out = run_plan("--model", "llama-3.1-405b", "--gpu", "a100-80gb", "--gpus", "8", "--tp", "2")
    assert out.returncode == 2
    assert "do not fit" in out.stdout and "raise --tp" in out.stdout
    bad = run_plan("--model", "no-such-model")
    assert bad.returncode == 2 and "neither a built-in model" in bad.stdout
