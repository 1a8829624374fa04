"""The result table printed after each run, laid out like vLLM's."""

from __future__ import annotations

import math

from splitserve.measure.results import RunResult, Stats

WIDTH = 50


def _row(name: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name:<40} {text:<10}"


def _section(title: str) -> str:
    return title.center(WIDTH, "-")


def _stats(name: str, unit: str, s: Stats) -> list[str]:
    return [
        _row(f"Mean {name} ({unit}):", s.mean),
        _row(f"Median {name} ({unit}):", s.p50),
        _row(f"P90 {name} ({unit}):", s.p90),
        _row(f"P99 {name} ({unit}):", s.p99),
    ]


def format_run(r: RunResult, label: str) -> str:
    rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}"
    lines = [
        f" {label}: rate {rate} req/s ".center(WIDTH, "="),
        _row("Successful requests:", r.completed),
        _row("Failed requests:", r.failed),
        _row("Maximum request concurrency:", r.max_concurrency if r.max_concurrency else "none"),
        _row("Benchmark duration (s):", r.duration_s),
        _row("Total input tokens:", r.total_input_tokens),
        _row("Total generated tokens:", r.total_output_tokens),
        _row("Request throughput (req/s):", r.request_throughput),
        _row("Output token throughput (tok/s):", r.output_throughput),
        _row("Total token throughput (tok/s):", r.total_token_throughput),
    ]
    if r.goodput is not None and r.slo_attainment is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in r.slos.items())
        lines += [_row(f"Request goodput (req/s) [{slos}]:", r.goodput), _row("SLO attainment:", r.slo_attainment)]
    lines += [_section("Time to First Token"), *_stats("TTFT", "ms", r.ttft_ms)]
    lines += [_section("Time per Output Token (excl. 1st token)"), *_stats("TPOT", "ms", r.tpot_ms)]
    lines += [_section("Inter-token Latency"), *_stats("ITL", "ms", r.itl_ms)]
    lines += [_section("End-to-end Latency"), *_stats("E2EL", "ms", r.e2el_ms)]
    if r.burst is not None:
        b = r.burst
        lines += [
            _section("Steady ITL: bursts over quiet"),
            _row("Quiet ITL p50 / p99 (ms):", f"{b.quiet_itl_ms.p50:.2f} / {b.quiet_itl_ms.p99:.2f}"),
            _row("Burst ITL p50 / p99 (ms):", f"{b.burst_itl_ms.p50:.2f} / {b.burst_itl_ms.p99:.2f}"),
            _row("Ratio p50 / p99:", f"{b.ratio_p50:.2f}x / {b.ratio_p99:.2f}x"),
            _row("Burst TTFT p50 / p99 (ms):", f"{b.burst_ttft_ms.p50:.2f} / {b.burst_ttft_ms.p99:.2f}"),
        ]
    errors = sorted({str(q.error) for q in r.requests if q.error is not None})
    if errors:
        lines.append(_section("Errors"))
        lines += [f"  {e[:200]}" for e in errors[:5]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)
