"""`splitserve plan --simulate`: the hook plan/main.py calls, end to end on the roofline."""

from __future__ import annotations

import pytest

from splitserve.cli import main
from splitserve.plan.sim_cli import DeploymentCosts

pytestmark = pytest.mark.timeout(120)


def test_plan_simulate_prints_each_mode_and_the_split(capsys):
    rc = main(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--network-gbps", "400",
               "--rdma", "--prompt-len", "2048:512", "--output-len", "128", "--rate", "20", "--simulate",
               "--sim-requests", "300", "--sim-split"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "simulation: 300 requests per run, 8 replicas of 1 GPU(s)" in out
    for mode in ("colocated", "disaggregated", "auto"):
        assert f"\n{mode} " in out
    assert "<- best" in out


def test_plan_simulate_on_one_replica_runs_colocated_only(capsys):
    rc = main(["plan", "--model", "llama-3-8b", "--gpus", "1", "--prompt-len", "512", "--output-len", "64",
               "--simulate", "--sim-requests", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "\ncolocated " in out and "\ndisaggregated " not in out


def test_the_deployment_adapter_passes_per_request_context():
    class Dep:
        def prefill_s(self, tokens: int, cached: int = 0) -> float:
            return tokens + cached / 1000

        def decode_step_s(self, batch: int, context: int) -> float:
            return batch * 10 + context

        def exposed_transfer_s(self, tokens: int) -> float:
            return tokens / 100

    c = DeploymentCosts(Dep())
    assert c.decode_step_s(4, 4000) == 40 + 1000  # 4000 tokens in all: 1000 each
    assert c.decode_step_s(0, 0) == 0
    assert c.prefill_s(5, 1000) == 6
    assert c.transfer_s(200) == 2
    assert c.prefill_s(0) == c.transfer_s(0) == 0
