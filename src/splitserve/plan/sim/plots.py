"""PNG charts of `splitserve plan --simulate --plot DIR`, in bench serve's style and through
its save step (bench/serve/plots.py: matplotlib on Agg, no display needed).

`plot_rates` draws goodput and SLO attainment against the request rate, one line
per mode; `plot_split` draws them against the prefill:decode split of the GPU
budget that `--sim-split` searched, the best split marked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from splitserve.measure.plots import save_figure  # first: it puts matplotlib on Agg
from splitserve.plan.sim.simulate import SimResult, Slo
from splitserve.plan.sim.sweep import SplitSearch


def _slo_text(slo: Slo) -> str:
    return f"TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms"


def plot_rates(results: Sequence[SimResult], slo: Slo, out_dir: str | os.PathLike[str]) -> str:
    """Goodput (req/s) and SLO attainment against the offered rate, one line per mode."""
    import matplotlib.pyplot as plt

    fig, (ax_good, ax_att) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r.mode for r in results):
        points = sorted((r.rate, r.goodput, r.slo_attainment) for r in results if r.mode == mode)
        xs = [p[0] for p in points]
        ax_good.plot(xs, [p[1] for p in points], marker="o", label=mode)
        ax_att.plot(xs, [p[2] for p in points], marker="o", label=mode)
    for ax, ylabel in ((ax_good, "goodput (req/s)"), (ax_att, "SLO attainment")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    ax_good.set_ylim(bottom=0)
    ax_att.set_ylim(0, 1.05)
    fig.suptitle(f"simulated goodput against load per mode ({_slo_text(slo)})")
    return save_figure(fig, out_dir, "sim-goodput-vs-rate.png")


def plot_split(search: SplitSearch, rate: float, slo: Slo, out_dir: str | os.PathLike[str]) -> str:
    """Goodput and SLO attainment against the prefill GPUs of each split simulated (the rest
    decode), the best one marked."""
    import matplotlib.pyplot as plt

    pts = search.points
    xs = [p.prefill_gpus for p in pts]
    fig, (ax_good, ax_att) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_good.plot(xs, [p.result.goodput for p in pts], marker="o")
    ax_att.plot(xs, [p.result.slo_attainment for p in pts], marker="o")
    best = search.best
    ax_good.plot(
        [best.prefill_gpus],
        [best.result.goodput],
        marker="*",
        markersize=14,
        linestyle="",
        label=f"best: {best.prefill_gpus}:{best.decode_gpus}",
    )
    ax_att.plot([best.prefill_gpus], [best.result.slo_attainment], marker="*", markersize=14, linestyle="")
    total = best.prefill_gpus + best.decode_gpus
    for ax, ylabel in ((ax_good, "goodput (req/s)"), (ax_att, "SLO attainment")):
        ax.set_xlabel(f"prefill GPUs (of {total}; the rest decode)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_good.legend()
    ax_good.set_ylim(bottom=0)
    ax_att.set_ylim(0, 1.05)
    fig.suptitle(f"prefill:decode split at {rate:g} req/s, disaggregated ({_slo_text(slo)})")
    return save_figure(fig, out_dir, "sim-goodput-vs-split.png")
