"""The peer run's table: each load's figures per system, every splitserve figure
also as a ratio to vLLM's (the same figure, divided; whether higher is better is
in the metric's name: a TTFT ratio below 1 is splitserve ahead).

Input is what `splitserve bench serve --json` writes, one file per system and
load, gathered by main.py into {system: {load: bench_json}}. Pure functions only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

BASELINE = "vllm"

Run = Mapping[str, Any]


def _pct(key: str, q: str) -> Callable[[Run], float | None]:
    return lambda run: _num((run.get(key) or {}).get(q))


def _burst(key: str, q: str | None = None) -> Callable[[Run], float | None]:
    def read(run: Run) -> float | None:
        got = (run.get("burst") or {}).get(key)
        return _num((got or {}).get(q) if q is not None else got)

    return read


def _field(key: str) -> Callable[[Run], float | None]:
    return lambda run: _num(run.get(key))


def prefill_tokens_per_s(run: Run) -> float | None:
    """Prompt tokens over the run's duration: with one output token per prompt and the server never
    idle between them (a closed loop), that is the prefill rate, the serving path included."""
    duration = _num(run.get("duration_s"))
    tokens = _num(run.get("total_input_tokens"))
    if not duration or tokens is None:
        return None
    return tokens / duration


# (name, how to read it from a run); the name carries the unit and the direction
SERVING_METRICS: tuple[tuple[str, Callable[[Run], float | None]], ...] = (
    ("completed", _field("completed")),
    ("req/s", _field("request_throughput")),
    ("output tok/s", _field("output_throughput")),
    ("goodput req/s", _field("goodput")),
    ("SLO attainment", _field("slo_attainment")),
    ("TTFT p50 ms", _pct("ttft_ms", "p50")),
    ("TTFT p99 ms", _pct("ttft_ms", "p99")),
    ("TPOT p50 ms", _pct("tpot_ms", "p50")),
    ("TPOT p99 ms", _pct("tpot_ms", "p99")),
    ("ITL p50 ms", _pct("itl_ms", "p50")),
    ("ITL p99 ms", _pct("itl_ms", "p99")),
)
BURST_METRICS: tuple[tuple[str, Callable[[Run], float | None]], ...] = (
    ("burst/quiet ITL p50", _burst("ratio_p50")),
    ("burst/quiet ITL p99", _burst("ratio_p99")),
    ("burst prompts TTFT p50 ms", _burst("burst_ttft_ms", "p50")),
    ("burst prompts TTFT p99 ms", _burst("burst_ttft_ms", "p99")),
)


class Row(NamedTuple):
    load: str
    run: str  # which run of the load: its request rate
    metric: str
    values: dict[str, float | None]  # system -> figure


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or math.isnan(x):
        return None
    return float(x)


def run_label(run: Run) -> str:
    rate = run.get("request_rate")
    return "rate inf" if rate in ("inf", None) or rate == math.inf else f"rate {float(rate):g}"


def metrics_of(load: str, run: Run, cores: int) -> list[tuple[str, float | None]]:
    """The figures of one run: prefill probes give prefill rates, every other load the serving figures."""
    if load.startswith("prefill"):
        tps = prefill_tokens_per_s(run)
        per_core = tps / cores if tps is not None and cores > 0 else None
        return [("TTFT p50 ms", _pct("ttft_ms", "p50")(run)), ("prefill tok/s", tps), ("prefill tok/s/core", per_core)]
    figures = [(name, read(run)) for name, read in SERVING_METRICS]
    if run.get("burst"):
        figures += [(name, read(run)) for name, read in BURST_METRICS]
    return figures


def table_rows(results: Mapping[str, Mapping[str, Any]], loads: list[str]) -> list[Row]:
    """results: system -> {"cores": {"total": n, ...}, "loads": {load: bench_json}}; rows in load order,
    then run order, then metric order. A system that has no such run shows None."""
    rows: dict[tuple[str, str, str], Row] = {}
    for system, res in results.items():
        cores = int((res.get("cores") or {}).get("total") or 0)
        for load in loads:
            bench = (res.get("loads") or {}).get(load) or {}
            for run in bench.get("runs") or []:
                label = run_label(run)
                for metric, value in metrics_of(load, run, cores):
                    key = (load, label, metric)
                    if key not in rows:
                        rows[key] = Row(load, label, metric, {})
                    rows[key].values[system] = value
    return list(rows.values())


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def format_cell(value: float | None, base: float | None, is_baseline: bool) -> str:
    if is_baseline:
        return _fmt(value)
    r = ratio(value, base)
    return f"{_fmt(value)} ({r:.2f}x)" if r is not None else _fmt(value)


def format_table(rows: list[Row], systems: list[str], baseline: str = BASELINE) -> str:
    """Fixed-width text; a splitserve cell reads `figure (ratio to vLLM's)`."""
    header = ["load", "run", "metric", *systems]
    body = [
        [r.load, r.run, r.metric]
        + [format_cell(r.values.get(s), r.values.get(baseline), s == baseline) for s in systems]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratios(rows: list[Row], systems: list[str], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """The table as data, for the combined JSON: each row with its figures and (in "ratio") each
    other system's figure over the baseline's."""
    out = []
    for r in rows:
        base = r.values.get(baseline)
        to_base = {s: ratio(r.values.get(s), base) for s in systems if s != baseline}
        out.append({"load": r.load, "run": r.run, "metric": r.metric, "values": dict(r.values), "ratio": to_base})
    return out
