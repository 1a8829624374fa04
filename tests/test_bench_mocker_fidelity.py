"""bench mocker-fidelity: one load, the same prompts and arrivals, through real workers and mockers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from splitserve.bench.mocker_fidelity import workload
from splitserve.plan.profile import save_profile
from tests.cli_helpers import splitserve
from tests.test_plan_calibrate import synthetic


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(requests=20, rate=2.0, prompt_tokens="32:64", seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_workload_is_the_seeds_and_keeps_to_its_lengths():
    a, b = workload(_args()), workload(_args())
    assert a == b and len(a) == 20
    assert all(32 <= len(r.prompt) <= 64 and all(0 <= t < 256 for t in r.prompt) for r in a)
    assert all(x.at_s < y.at_s for x, y in zip(a, a[1:], strict=False))  # arrivals in order
    assert workload(_args(seed=1)) != a


def _run_on_a_synthetic_profile(tmp_path: Path, *argv: str) -> str:
    """The benchmark's output, its steps priced by a synthetic profile (no calibration)."""
    profile = tmp_path / "profile.json"
    save_profile(synthetic(), str(profile))
    out = splitserve(*argv, "--output-tokens", "6", "--profile", str(profile), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^target: .* (PASS|FAIL) \(worst \d+%\)$", out.stdout, re.M), out.stdout
    return out.stdout


def _p50_lines(stdout: str, first: str, second: str) -> bool:
    return all(
        re.search(rf"^{name}\s+p50 {first}\s+[\d.]+ ms\s+{second}\s+[\d.]+ ms\s+ratio [\d.]+", stdout, re.M)
        for name in ("TTFT", "TPOT")
    )


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_short_run_compares_the_real_cluster_with_mockers(tmp_path: Path):
    argv = "bench mocker-fidelity --requests 4 --rate 4 --prompt-tokens 16:48".split()
    stdout = _run_on_a_synthetic_profile(tmp_path, *argv)
    assert _p50_lines(stdout, "real", "mocker")
    assert "steps timed by the profile" in stdout and "--speculative off" in stdout


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_short_run_sets_the_simulator_against_a_mocker_fleet(tmp_path: Path):
    argv = "bench mocker-sim --decode-workers 3 --prefill-workers 2 --requests 12 --rate 6 --prompt-tokens 16:48"
    stdout = _run_on_a_synthetic_profile(tmp_path, *argv.split())
    assert _p50_lines(stdout, "mockers", "simulator")
    assert "2 prefill + 3 decode mocker workers" in stdout
