"""`splitserve plan --simulate`: the hook plan/main.py calls, end to end on the roofline."""

from __future__ import annotations

import pytest

from splitserve.cli import main

pytestmark = pytest.mark.timeout(120)


def test_plan_simulate_prints_each_mode_and_the_split(capsys):
    rc = main(
        [
            "plan",
            "--model",
            "llama-3-8b",
            "--gpu",
            "h100-sxm",
            "--gpus",
            "8",
            "--network-gbps",
            "400",
            "--rdma",
            "--prompt-len",
            "2048:512",
            "--output-len",
            "128",
            "--rate",
            "20",
            "--simulate",
            "--sim-requests",
            "300",
            "--sim-split",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "simulation: 300 requests per run, 8 replicas of 1 GPU(s)" in out
    for mode in ("colocated", "disaggregated", "auto"):
        assert f"\n{mode} " in out
    assert "<- best" in out


def test_plan_simulate_on_one_replica_runs_colocated_only(capsys):
    rc = main(
        [
            "plan",
            "--model",
            "llama-3-8b",
            "--gpus",
            "1",
            "--prompt-len",
            "512",
            "--output-len",
            "64",
            "--simulate",
            "--sim-requests",
            "50",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "\ncolocated " in out and "\ndisaggregated " not in out


def test_plan_simulate_plot_writes_the_rate_and_split_charts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    charts = tmp_path / "charts"
    rc = main(
        [
            "plan",
            "--model",
            "llama-3-8b",
            "--gpu",
            "h100-sxm",
            "--gpus",
            "8",
            "--network-gbps",
            "400",
            "--rdma",
            "--prompt-len",
            "2048:512",
            "--output-len",
            "128",
            "--rate",
            "20",
            "--simulate",
            "--sim-requests",
            "200",
            "--sim-rates",
            "10,20",
            "--sim-split",
            "--plot",
            str(charts),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("sim-goodput-vs-rate.png", "sim-goodput-vs-split.png"):
        path = charts / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"chart: {path}" in out


def test_plot_rates_draws_one_line_per_mode_over_the_rates(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from splitserve.plan.sim import plots as sim_plots

    drawn = {}

    def keep(fig, out_dir, name):
        drawn[name] = [[(line.get_label(), list(line.get_xdata())) for line in ax.lines] for ax in fig.axes]
        return str(tmp_path / name)

    monkeypatch.setattr(sim_plots, "save_figure", keep)
    rc = main(
        [
            "plan",
            "--model",
            "llama-3-8b",
            "--gpu",
            "h100-sxm",
            "--gpus",
            "8",
            "--network-gbps",
            "400",
            "--rdma",
            "--prompt-len",
            "2048:512",
            "--output-len",
            "128",
            "--simulate",
            "--sim-requests",
            "100",
            "--sim-rates",
            "20,10",
            "--plot",
            str(tmp_path),
        ]
    )
    assert rc == 0
    goodput_axes = drawn["sim-goodput-vs-rate.png"][0]
    assert goodput_axes == [(m, [10.0, 20.0]) for m in ("colocated", "disaggregated", "auto")]
    assert "sim-goodput-vs-split.png" not in drawn  # no --sim-split, no split chart


def test_plan_piped_into_a_reader_that_stops_exits_quietly():
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "plan", "--model", "llama-3-8b", "--simulate", "--sim-requests", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes before the plan is printed (`| head` after its lines)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=100) == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
