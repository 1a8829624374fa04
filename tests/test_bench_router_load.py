"""bench router-load: the cost split into per request and per token, and a short real run."""

from __future__ import annotations

import argparse

import pytest

from splitserve.bench.router_load import Load, parse_loads, per_token_and_request
from tests.cli_helpers import splitserve


def _load(tokens: int, concurrency: int, requests: int, cpu_s: float) -> Load:
    return Load(tokens, concurrency, requests, 1.0, (0.01,) * requests, cpu_s)


def test_per_token_is_the_slope_and_per_request_the_intercept():
    # 100 us a request and 10 us a token: 110 us at 1 token, 740 us at 64
    loads = [_load(1, 16, 1000, 0.110), _load(16, 4, 10, 5.0), _load(64, 16, 500, 0.370)]
    fit = per_token_and_request(loads)
    assert fit is not None
    per_token, per_request = fit
    assert per_token == pytest.approx(10e-6) and per_request == pytest.approx(100e-6)


def test_no_split_without_two_token_counts_at_one_concurrency():
    assert per_token_and_request([_load(1, 16, 10, 0.1), _load(64, 4, 10, 0.1)]) is None
    assert per_token_and_request([_load(16, 16, 10, 0.1)]) is None


def test_loads_parse_and_bad_ones_are_named():
    assert parse_loads("1x16,64x16") == ((1, 16), (64, 16))
    for bad in ("16", "0x4", "65x4", "1x0", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected|tokens 1"):
            parse_loads(bad)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_short_run_loads_the_real_router_and_prints_its_cpu():
    out = splitserve(
        "bench", "router-load", "--seconds", "1", "--warmup-seconds", "0.5", "--loads", "1x2,8x2", timeout=200
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:2] in (["1", "2"], ["8", "2"])]
    assert len(rows) == 2, out.stdout
    for row in rows:
        assert float(row[2]) > 0 and float(row[5]) > 0  # requests finished, and the router spent CPU on them
    assert "router CPU per streamed token" in out.stdout and "per request" in out.stdout


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_short_run_over_mockers_checks_every_token():
    out = splitserve(
        *"bench router-load --fleet mockers --decode-workers 3 --prefill-workers 2".split(),
        *"--seconds 1 --warmup-seconds 0.5 --loads 1x4,8x4".split(),
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:2] in (["1", "4"], ["8", "4"])]
    assert len(rows) == 2, out.stdout
    for row in rows:
        assert float(row[2]) > 0 and row[-1] == "0"  # requests finished, none with a wrong token
    assert "2 prefill + 3 decode mocker workers" in out.stdout and "roofline of llama-3-8b" in out.stdout


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_killed_share_of_the_fleet_loses_no_request_and_no_token():
    out = splitserve(
        *"bench fleet-loss --decode-workers 5 --prefill-workers 2 --kill 0.2 --concurrency".split(),
        *"10 --tokens 96 --seconds 3 --warmup-seconds 0.5".split(),
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 of 5 decode mockers (20%) stopped" in out.stdout
    assert "lost 0 (target 0), wrong tokens 0 (target 0)" in out.stdout
    # ten streams over five workers: the dead one held some, and they moved
    assert "the router moved 0 streams" not in out.stdout, out.stdout


def test_a_kill_share_outside_0_to_1_is_refused():
    out = splitserve("bench", "fleet-loss", "--kill", "1.5", timeout=60)
    assert out.returncode == 2 and "--kill must lie strictly between 0 and 1" in out.stdout


def test_no_split_from_a_load_that_finished_nothing_or_lost_requests():
    starved = Load(64, 16, 0, 1.0, (), 0.4)
    assert per_token_and_request([_load(1, 16, 1000, 0.110), starved]) is None
    lossy = Load(64, 16, 500, 1.0, (0.01,) * 500, 0.370, lost=3)
    assert per_token_and_request([_load(1, 16, 1000, 0.110), lossy]) is None


@pytest.mark.timeout(240)
def test_a_short_run_of_replicas_against_one_router_checks_every_token_and_counts_hits():
    out = splitserve(
        *"bench router-replicas --routers 1,2 --decode-workers 3 --prefill-workers 1 --concurrency 8".split(),
        *"--groups 4 --seconds 1 --warmup-seconds 0.5 --idle-seconds 0.5".split(),
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = [line.split() for line in out.stdout.splitlines() if line.endswith(("0 0", "0      0"))]
    rows = {row[0]: row for row in table if row[0] in ("1", "2")}
    assert set(rows) == {"1", "2"}, out.stdout
    for row in rows.values():
        assert float(row[1]) > 0 and row[-2:] == ["0", "0"]  # requests finished, none lost, none wrong
        assert float(row[-3].rstrip("%")) > 50  # four shared prefixes: most of each prompt found cached
    assert "2 replicas: hit rate" in out.stdout and "of linear" in out.stdout
