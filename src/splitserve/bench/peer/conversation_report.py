"""What `splitserve bench conversation` prints after its runs: per system the serving figures and the
TTFT by prefix source, then the issue's ratios, each with its target and whether it was met."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from splitserve.bench.peer import prefix_sources as ps

TARGET_GOODPUT = 1.5  # tier-aware over tier-blind
TARGET_HOST, TARGET_DISK = 0.3, 0.6  # a hit's TTFT over recomputing's


def system_lines(label: str, res: dict[str, Any]) -> list[str]:
    if "error" in res:
        return [f"{label}: ERROR {str(res['error'])[:400]}"]
    r = res["runs"][0]
    lines = [
        f"{label}: {r['completed']} of {r['num_prompts']} requests in {r['duration_s']:.1f} s; goodput "
        f"{r['goodput']:.3f} req/s (SLO attainment {r['slo_attainment']:.2f}); throughput {r['request_throughput']:.3f}"
        f" req/s; TTFT p50 / p90 / p99 {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p90']:.0f} / "
        f"{r['ttft_ms']['p99']:.0f} ms; TPOT p50 / p99 {r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} ms"
    ]
    split = ps.split(r["requests"], res["sources"])
    for source, s in split.items():
        lines.append(
            f"  prefix from {source:<9} {s.requests:>4} requests: TTFT p50 {s.ttft_p50_ms:>7.0f} ms, mean "
            f"{s.ttft_mean_ms:>7.0f}, p90 {s.ttft_p90_ms:>7.0f}; prompt {s.prompt_mean:.0f} tokens on average"
        )
    if res.get("unjoined"):
        lines.append(
            f"  {res['unjoined']} requests not joined to their worker's prefix line ({res['ambiguous']} of them "
            "with two candidates)"
        )
    return lines


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _slower(hit_ms: float, recompute_ms: float) -> str:
    return "not slower" if hit_ms <= recompute_ms else "SLOWER"


def _throughput_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Requests served per second, whether or not they met the objective: tier-aware over the others."""
    thr = {k: float(r["runs"][0]["request_throughput"]) for k, r in results.items() if "runs" in r}
    if not thr.get("tier-aware"):
        return []
    return [
        f"throughput tier-aware / {k}: {thr['tier-aware'] / v:.2f}x ({thr['tier-aware']:.3f} against {v:.3f} req/s)"
        for k, v in thr.items()
        if k != "tier-aware" and v > 0
    ]


def ratio_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's ratios: goodput aware/blind, host and disk hits' TTFT p50 over recompute's (both
    splitserve systems' requests together: the same workers and tiers), and against vLLM."""

    def good(label: str) -> float | None:
        res = results.get(label, {})
        return None if "error" in res or "runs" not in res else float(res["runs"][0]["goodput"])

    out = []
    aware, blind, vllm = good("tier-aware"), good("tier-blind"), good("vllm")
    if aware is not None and blind:
        out.append(
            f"goodput tier-aware / tier-blind: {aware / blind:.2f}x (target >= {TARGET_GOODPUT}x: "
            f"{_verdict(aware / blind >= TARGET_GOODPUT)})"
        )
    elif aware is not None and blind is not None:  # a ratio over nothing says nothing: the figures instead
        out.append(f"goodput tier-aware {aware:.3f} req/s against tier-blind 0: no ratio (target NOT met)")
    if aware is not None and vllm:
        out.append(f"goodput tier-aware / vLLM: {aware / vllm:.2f}x")
    out += _throughput_lines(results)
    records: list[dict[str, Any]] = []
    sources: list[str | None] = []
    for label in ("tier-aware", "tier-blind"):
        res = results.get(label, {})
        if "runs" in res:
            records += res["runs"][0]["requests"]
            sources += res["sources"]
    split = ps.split(records, sources)
    # a returning turn recomputed is what a tier saves; without any, a session's first turn stands in
    base_name = "recompute" if "recompute" in split else "first turn"
    base = split.get(base_name)
    for tier, target in (("host", TARGET_HOST), ("disk", TARGET_DISK)):
        hit = split.get(tier)
        if base is None or hit is None:
            out.append(f"{tier} hit / recompute TTFT: no {tier if hit is None else 'recompute'} requests to compare")
            continue
        r = hit.ttft_p50_ms / base.ttft_p50_ms
        out.append(
            f"{tier} hit / {base_name} TTFT p50 (splitserve, both routings): {r:.2f}x over {hit.requests} and "
            f"{base.requests} requests (target <= {target}x: {_verdict(r <= target)}; hit p90 "
            f"{hit.ttft_p90_ms:.0f} ms against {base_name} p50 {base.ttft_p50_ms:.0f} ms: "
            f"{_slower(hit.ttft_p90_ms, base.ttft_p50_ms)})"
        )
    return out


def summarize(results: dict[str, dict[str, Any]], a: argparse.Namespace, out: Callable[[str], None]) -> None:
    out("")
    for label, res in results.items():
        for line in system_lines(label, res):
            out(line)
    out("")
    for line in ratio_lines(results):
        out(line)
