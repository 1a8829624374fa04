"""bench plan-check's rows (bench/plan_check_rows.py): each figure of a load measured over its
repeats and simulated on each repeat's own requests, gathered into the measured median and
min..max beside the simulated median, and classed within 25%, within the machine's noise, or a
miss; the table and the summary line BENCHMARKS.md quotes, in the runs' format before and after
the repeats."""

from __future__ import annotations

import argparse

import pytest

from splitserve.bench.comparisons import COMPARISONS
from splitserve.bench.plan_check import _loads, add_arguments, compare
from splitserve.bench.plan_check_rows import Pair, Row, classify, format_table, rows_of, summary_line
from splitserve.bench.summary import quote
from splitserve.measure.results import RunResult, Stats
from splitserve.plan.sim.simulate import Percentiles

pytestmark = pytest.mark.timeout(60)


def pairs(load: str, measured: list[float], simulated: list[float], metric: str = "TTFT p90") -> list[Pair]:
    return [Pair("disaggregated", load, 32, metric, m, s) for m, s in zip(measured, simulated, strict=True)]


def test_a_figure_is_within_noise_inside_the_measured_range_or_within_25_percent_of_it():
    assert classify(110.0, median=100.0, low=90.0, high=130.0) == "within"
    assert classify(70.0, median=100.0, low=60.0, high=130.0) == "within noise"  # 0.70x the median, inside
    assert classify(200.0, median=100.0, low=90.0, high=170.0) == "within noise"  # 1.18x the highest
    assert classify(230.0, median=100.0, low=90.0, high=170.0) == "miss"  # 1.35x the highest
    assert classify(40.0, median=100.0, low=60.0, high=130.0) == "miss"  # 0.67x the lowest
    assert classify(1.0, median=0.0, low=0.0, high=0.0) == "miss"  # nothing measured: never within


def test_the_repeats_make_one_row_each_with_its_median_spread_and_class():
    got = rows_of(
        pairs("sharegpt@1", [1000.0, 1200.0, 900.0], [1100.0, 1150.0, 1050.0])  # within: 1100 / 1000
        + pairs("sharegpt@0.5", [1600.0, 900.0, 1000.0], [720.0, 700.0, 740.0])  # within noise: 0.72x, 0.8x of 900
        + pairs("burst", [2300.0, 2100.0, 2400.0], [1300.0, 1400.0, 1372.0])  # a miss: 0.6x, 0.62x of 2100
    )

    assert [(r.load, r.verdict) for r in got] == [
        ("sharegpt@1", "within"),
        ("sharegpt@0.5", "within noise"),
        ("burst", "miss"),
    ]
    within = got[0]
    assert (within.measured_median, within.simulated_median) == (1000.0, 1100.0)
    assert within.ratio == pytest.approx(1.1)
    assert within.spread == pytest.approx(0.3)  # (1200 - 900) / 1000
    assert got[1].measured_ms == (1600.0, 900.0, 1000.0)  # the repeats in the order they ran
    assert got[1].ratio == pytest.approx(0.72)


def test_rows_group_the_repeats_by_mode_load_and_metric_in_order():
    both = [
        Pair("colocated", "burst", 28, "ITL p50", 30.0, 31.0),
        Pair("colocated", "burst", 28, "ITL p90", 40.0, 41.0),
        Pair("colocated", "burst", 29, "ITL p50", 32.0, 30.0),
        Pair("colocated", "burst", 29, "ITL p90", 44.0, 42.0),
    ]
    got = rows_of(both)
    assert [(r.metric, r.requests, r.measured_ms) for r in got] == [
        ("ITL p50", (28, 29), (30.0, 32.0)),
        ("ITL p90", (28, 29), (40.0, 44.0)),
    ]
    assert got[0].measured_median == 31.0  # two repeats: the mean of the two


def test_one_repeat_is_the_comparison_before_the_repeats():
    (row,) = rows_of(pairs("sharegpt@1", [100.0], [130.0]))
    assert (row.ratio, row.spread, row.verdict) == (pytest.approx(1.3), 0.0, "miss")  # no range to be noise in


def test_the_table_shows_the_simulated_median_beside_the_measured_median_and_range():
    rows = rows_of(
        pairs("burst", [2300.0, 2100.0, 2400.0], [1300.0, 1400.0, 1372.0])
        + [Pair("colocated", "burst", n, "ITL p50", 30.0, 30.0) for n in (28, 29, 28)]
    )
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:5] == ["mode", "load", "n", "metric", "simulated"]
    assert lines[1].split() == [
        *("disaggregated", "burst", "32", "TTFT", "p90", "1372.0ms", "2300.0ms"),
        *("2100.0..2400.0", "13%", "0.60", "miss"),
    ]
    assert lines[2].split()[2] == "28-29"  # completed requests differed between the repeats
    assert lines[2].endswith("within")


def test_the_summary_counts_each_class_and_benchmarks_md_quotes_it_in_both_formats():
    rows = rows_of(
        pairs("sharegpt@1", [1000.0, 1200.0, 900.0], [1100.0, 1150.0, 1050.0])
        + pairs("sharegpt@0.5", [1600.0, 900.0, 1000.0], [720.0, 700.0, 740.0])
        + pairs("burst", [2300.0, 2100.0, 2400.0], [1300.0, 1400.0, 1372.0])
        + pairs("sharegpt@1.5", [100.0, 100.0, 100.0], [40.0, 40.0, 40.0])
    )
    line = summary_line(rows, 3)
    assert line.startswith("1 of 4 simulated figures within 25% of the measured median, 1 more within noise, 2 misses")

    (figure,) = next(c for c in COMPARISONS if c.files == "plan-check*.txt").figures
    assert quote(figure, f"table\n\n{line}\n", "plan-check.txt") == "1 of 4 within 25%, 1 more within noise, 2 misses"
    before = "25 of 32 simulated figures within 25% of the measured ones\n"  # a run before --repeats
    assert quote(figure, before, "plan-check.txt") == "25 of 32 within 25%"


def test_compare_puts_each_runs_figures_beside_its_simulation_at_the_probed_speed():
    ms = Stats(0.0, 100.0, 200.0, 300.0)
    itl = Stats(0.0, 20.0, 40.0, 50.0)
    run = RunResult(1.0, 1.0, None, 3, 5.0, 3, 0, 0.6, 1.0, 1.0, 1, 1, ms, ms, itl, ms, None, None, {}, None, [])

    class Sim:
        ttft = Percentiles(0.0, 0.110, 0.300, 0.4)
        itl = Percentiles(0.0, 0.021, 0.040, 0.05)

    got = compare("colocated", "sharegpt@1", run, Sim())
    assert [(p.metric, p.requests, p.measured_ms) for p in got] == [
        ("TTFT p50", 3, 100.0),
        ("TTFT p90", 3, 200.0),
        ("ITL p50", 3, 20.0),
        ("ITL p90", 3, 40.0),
    ]
    assert [p.simulated_ms for p in got] == pytest.approx([110.0, 300.0, 21.0, 40.0])
    assert [r.verdict for r in rows_of(got)] == ["within", "miss", "within", "within"]
    # a run while the machine took 1.5x the calibration's time: the simulated timeline stretched so
    slow = compare("colocated", "sharegpt@1", run, Sim(), time_scale=1.5)
    assert [p.simulated_ms for p in slow] == pytest.approx([165.0, 450.0, 31.5, 60.0])


def test_a_row_of_nothing_measured_is_a_miss_with_no_spread():
    row = Row("x", "burst", "ITL p50", (1,), (0.0,), (1.0,))
    assert row.verdict == "miss"
    assert "-" in format_table([row]).splitlines()[1].split()  # the spread of a zero median: not a number


def test_every_repeat_sends_the_same_prompts_and_keeps_its_own_files():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--rates", "0.5,1"])
    first, second = (_loads([0.5, 1.0], args, repeat) for repeat in (0, 1))

    assert [label for label, _ in first] == ["sharegpt@0.5", "sharegpt@1", "burst"]
    assert [load.flags for _, load in first] == [load.flags for _, load in second]  # the same seeds
    assert [load.name for _, load in second] == ["sharegpt@0.5-r2", "sharegpt@1-r2", "burst-r2"]
    assert [flags[-1] for flags in (load.flags for _, load in first)] == ["10", "11", "12"]  # a seed per load
    once = parser.parse_args(["--repeats", "1"])
    assert [load.name for _, load in _loads([1.0], once, 0)] == ["sharegpt@1", "burst"]  # the names before repeats
