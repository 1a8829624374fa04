"""bench tenants' arithmetic (the run itself is the benchmark's: bench/results/tenants-cpu.txt): the
max-min fair allocation Jain's index is taken against, and the seeded arrivals every phase shares."""

from __future__ import annotations

import argparse

import pytest

from splitserve.bench.tenants import NOISY, QUIET, arrivals, jain, max_min_fair


def test_max_min_fair_gives_the_small_askers_all_and_splits_the_rest_evenly() -> None:
    # 1,000 served: a and b asked less than an even cut (250), c and d share what is left
    fair = max_min_fair({"a": 100, "b": 200, "c": 5000, "d": 900}, 1000)
    assert fair == pytest.approx({"a": 100, "b": 200, "c": 350, "d": 350})
    assert max_min_fair({"a": 10, "b": 20}, 1000) == {"a": 10, "b": 20}  # everyone got all it asked


def test_jain_is_one_when_even_and_one_over_n_when_one_takes_all() -> None:
    assert jain([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_the_quiet_arrivals_are_the_same_in_every_phase_and_the_noisy_tenant_asks_ten_times_theirs() -> None:
    args = argparse.Namespace(seed=0, quiet_rate=0.5, prompt_tokens=32, duration=400.0)
    alone, long, many = (arrivals(shape, args, 1000) for shape in (None, "long", "many"))
    quiet = [(a.at, a.tenant, a.prompt) for a in alone]
    for phase in (long, many):
        assert [(a.at, a.tenant, a.prompt) for a in phase if a.tenant != NOISY] == quiet
    asked = {t: sum(len(a.prompt) for a in long if a.tenant == t) for t in (*QUIET, NOISY)}
    per_quiet = sum(asked[q] for q in QUIET) / len(QUIET)
    for phase in (long, many):
        noisy = sum(len(a.prompt) for a in phase if a.tenant == NOISY)
        assert 7 < noisy / per_quiet < 13, noisy / per_quiet  # ten times, give or take Poisson's draw
    assert {len(a.prompt) for a in long if a.tenant == NOISY} == {320}
    assert {len(a.prompt) for a in many if a.tenant == NOISY} == {32}
