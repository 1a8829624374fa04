"""PNG charts of results (matplotlib, Agg: no display needed).

`plot_run` draws one run's latency distributions as CDFs (TTFT, TPOT, ITL);
`plot_sweep` draws goodput and SLO attainment against the request rate, one
line per system label, from any number of result files (the peer harness
passes several systems' results); `plot_compare` draws several systems' CDFs
of one load on the same axes; `plot_burst` the steady streams' inter-token
gaps over time with the burst windows shaded, one panel per system. All take
the JSON shape as plain dicts. `save_figure` is the one save step (plan/sim_plots.py's
charts go through it too).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless machine has no display

import matplotlib.pyplot as plt


def _rate_name(rate: Any) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{float(rate):g}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "run"


def _cdf(ax: Any, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post")
    ax.set_ylim(0, 1.02)


def save_figure(fig: Any, out_dir: str | os.PathLike[str], name: str) -> str:
    """Write the figure as out_dir/name (the folder made if missing), free it, return the path."""
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _latencies_ms(run: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """TTFT, TPOT and ITL samples of a run's successful requests, in ms."""
    ok = [r for r in run["requests"] if r["error"] is None]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    tpot = [
        (r["latency_s"] - r["ttft_s"]) * 1000 / (r["output_len"] - 1) for r in ok if r["output_len"] > 1
    ]  # the same definition as metrics.tpot_s
    itl = [g * 1000 for r in ok for g in r["itl_s"]]
    return ttft, tpot, itl


def plot_run(run: dict[str, Any], out_dir: str | os.PathLike[str], label: str) -> str:
    """One run's TTFT, TPOT and ITL CDFs side by side; returns the PNG's path."""
    ttft, tpot, itl = _latencies_ms(run)
    rate = _rate_name(run["request_rate"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, values, title in zip(axes, (ttft, tpot, itl), ("TTFT", "TPOT", "ITL"), strict=True):
        _cdf(ax, values, f"{title} ({len(values)} samples)")
    fig.suptitle(f"{label}: request rate {rate} req/s, {run['completed']} completed, {run['failed']} failed")
    return save_figure(fig, out_dir, f"{_safe(label)}-rate-{_safe(rate)}-latency-cdf.png")


def plot_sweep(results: list[dict[str, Any]], out_dir: str | os.PathLike[str]) -> str:
    """Goodput (req/s) and SLO attainment against the request rate, one line per result's label.

    An infinite rate is drawn at the right end, one step past the largest finite
    rate, and labelled "inf". Runs without --goodput have no point.
    """
    finite = [float(r["request_rate"]) for res in results for r in res["runs"] if r["request_rate"] != "inf"]
    inf_x = (max(finite) * 1.25) if finite else 1.0
    fig, (ax_good, ax_att) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        points = sorted(
            (inf_x if r["request_rate"] == "inf" else float(r["request_rate"]), r["goodput"], r["slo_attainment"])
            for r in res["runs"]
            if r["goodput"] is not None
        )
        if not points:
            continue
        xs = [p[0] for p in points]
        ax_good.plot(xs, [p[1] for p in points], marker="o", label=res["label"])
        ax_att.plot(xs, [p[2] for p in points], marker="o", label=res["label"])
    slos: dict[str, float] = next((r["slos"] for res in results for r in res["runs"] if r["slos"]), {})
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) or "no SLO given"
    for ax, ylabel in ((ax_good, "goodput (req/s)"), (ax_att, "SLO attainment")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(r["request_rate"] == "inf" for res in results for r in res["runs"]):
            ticks = sorted(set(finite)) + [inf_x]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["inf"])
        if ax.lines:
            ax.legend()
    ax_good.set_ylim(bottom=0)
    ax_att.set_ylim(0, 1.05)
    fig.suptitle(f"goodput against load ({slo_text})")
    return save_figure(fig, out_dir, "sweep-goodput.png")


def plot_compare(results: list[dict[str, Any]], out_dir: str | os.PathLike[str], name: str) -> str:
    """Each result's first run as TTFT, TPOT and ITL CDFs, one line per result's label, on shared
    axes (ITL on a log scale: the stalls that matter are orders of magnitude past the median)."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    slos: dict[str, float] = {}
    for res in results:
        run = res["runs"][0]
        slos = slos or (run.get("slos") or {})
        for ax, values in zip(axes, _latencies_ms(run), strict=True):
            if values:
                xs = sorted(values)
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=res["label"])
    for ax, title in zip(axes, ("TTFT", "TPOT", "ITL"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms" + (" (log scale)" if title == "ITL" else ""))
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        slo = slos.get(title.lower())
        if slo is not None:
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1)
        if ax.lines:
            ax.legend(loc="lower right")
    axes[2].set_xscale("log")
    fig.suptitle(f"{name}: latency distributions per system (dashed: the SLO)")
    return save_figure(fig, out_dir, f"{_safe(name)}-latency-cdf.png")


def plot_burst(results: list[dict[str, Any]], out_dir: str | os.PathLike[str]) -> str:
    """Per system, every inter-token gap of the steady streams at the time it ended, the burst
    windows (sent until the last burst prompt's first token) shaded: the interference scenario."""
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.6 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        run = res["runs"][0]
        for start, end in (run.get("burst") or {}).get("windows_s", []):
            ax.axvspan(start, end, color="tab:red", alpha=0.15, linewidth=0)
        xs: list[float] = []
        ys: list[float] = []
        for r in run["requests"]:
            if r["tag"] != "steady" or r["error"] is not None:
                continue
            t = r["start_s"] + r["ttft_s"]
            for gap in r["itl_s"]:
                t += gap
                xs.append(t)
                ys.append(gap * 1000)
        ax.scatter(xs, ys, s=3)
        ax.set_yscale("log")
        ax.set_ylabel("ITL ms")
        ax.grid(alpha=0.3)
        ax.set_title(res["label"], loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("s since the run started (shaded: burst prefills in flight)")
    fig.suptitle("steady streams' inter-token gaps while long prompts arrive in bursts")
    return save_figure(fig, out_dir, "burst-itl-timeline.png")
