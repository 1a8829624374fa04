"""bench plan-check's rows: a load's figure (TTFT or ITL p50 or p90) measured in each of N repeats
of the load and simulated on each repeat's own requests, gathered into one row with the measured
median and spread, and a class that tells the simulator's misses from the machine's noise.

- "within": the simulated median is within TOLERANCE of the measured median;
- "within noise": it is not, but it lies inside the measured min..max, or within TOLERANCE of it
  (the measured figures moved that far from one repeat to the next on their own);
- "miss": outside both.

With one repeat min..max is the figure itself and no row is "within noise". Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal, NamedTuple

TOLERANCE = 0.25  # |simulated / measured - 1| at most this
Verdict = Literal["within", "within noise", "miss"]
VERDICTS: tuple[Verdict, ...] = ("within", "within noise", "miss")


class Pair(NamedTuple):
    """One figure of one repeat: measured in its run (ms) and simulated on that run's requests (ms)."""

    mode: str
    load: str  # "sharegpt@RATE" or "burst"
    requests: int  # the run's completed requests
    metric: str  # "TTFT p50", ...
    measured_ms: float
    simulated_ms: float


def _ratio(simulated: float, measured: float) -> float:
    return simulated / measured if measured > 0 else float("nan")


def _close(simulated: float, measured: float) -> bool:
    return abs(_ratio(simulated, measured) - 1.0) <= TOLERANCE  # nan (nothing measured): never


def classify(simulated: float, median: float, low: float, high: float) -> Verdict:
    """The simulated figure against the measured median and min..max of the repeats."""
    if _close(simulated, median):
        return "within"
    nearest = min(max(simulated, low), high)  # the simulated figure itself when inside low..high
    return "within noise" if _close(simulated, nearest) else "miss"


class Row(NamedTuple):
    """One figure of one load over its repeats, in the order the repeats ran."""

    mode: str
    load: str
    metric: str
    requests: tuple[int, ...]
    measured_ms: tuple[float, ...]
    simulated_ms: tuple[float, ...]

    @property
    def measured_median(self) -> float:
        return statistics.median(self.measured_ms)

    @property
    def simulated_median(self) -> float:
        return statistics.median(self.simulated_ms)

    @property
    def spread(self) -> float:
        """The measured max - min, as a fraction of the measured median (nan when that is 0)."""
        median = self.measured_median
        return (max(self.measured_ms) - min(self.measured_ms)) / median if median > 0 else float("nan")

    @property
    def ratio(self) -> float:
        return _ratio(self.simulated_median, self.measured_median)

    @property
    def verdict(self) -> Verdict:
        return classify(self.simulated_median, self.measured_median, min(self.measured_ms), max(self.measured_ms))


def rows_of(pairs: Sequence[Pair]) -> list[Row]:
    """The repeats' pairs gathered by mode, load and metric, in the order each first appears."""
    groups: dict[tuple[str, str, str], list[Pair]] = {}
    for p in pairs:
        groups.setdefault((p.mode, p.load, p.metric), []).append(p)
    return [
        Row(
            mode,
            load,
            metric,
            tuple(p.requests for p in got),
            tuple(p.measured_ms for p in got),
            tuple(p.simulated_ms for p in got),
        )
        for (mode, load, metric), got in groups.items()
    ]


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        f"{'mode':14s} {'load':13s} {'n':>5s}  {'metric':9s} {'simulated':>10s} {'measured':>10s} "
        f"{'min..max (ms)':>17s} {'spread':>6s} {'sim/meas':>8s}  class (median; {TOLERANCE:.0%})"
    ]
    for r in rows:
        n = f"{min(r.requests)}" if min(r.requests) == max(r.requests) else f"{min(r.requests)}-{max(r.requests)}"
        span = f"{min(r.measured_ms):.1f}..{max(r.measured_ms):.1f}"
        spread = "-" if math.isnan(r.spread) else f"{r.spread:.0%}"
        lines.append(
            f"{r.mode:14s} {r.load:13s} {n:>5s}  {r.metric:9s} {r.simulated_median:8.1f}ms "
            f"{r.measured_median:8.1f}ms {span:>17s} {spread:>6s} {r.ratio:8.2f}  {r.verdict}"
        )
    return "\n".join(lines)


def summary_line(rows: Sequence[Row], repeats: int) -> str:
    """The count of each class. Its opening ("N of M simulated figures within 25%") is the one
    runs before the repeats printed, which BENCHMARKS.md quotes (bench/comparisons.py)."""
    count = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    misses = count["miss"]
    return (
        f"{count['within']} of {len(rows)} simulated figures within {TOLERANCE:.0%} of the measured median, "
        f"{count['within noise']} more within noise, {misses} miss{'' if misses == 1 else 'es'} "
        f"(medians of {repeats} repeat(s) of each load; noise: inside the measured min..max, or within "
        f"{TOLERANCE:.0%} of it)"
    )
