"""Figures from request records: pure functions, no clock, no I/O.

Definitions follow vLLM's `bench serve`: throughput over the run's duration,
counting completed requests only; TTFT and E2EL per completed request; TPOT per
completed request with more than one output token, (e2e - ttft) / (output - 1);
ITL every gap between two chunks of output. Goodput counts the completed
requests that meet every SLO given; failed requests are never good.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from splitserve.measure.results import BurstSummary, Quantiles, RequestRecord, RunResult, Stats

GOODPUT_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); 0.0 for no samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_ms(xs_s: Sequence[float]) -> Stats:
    ms = [x * 1000.0 for x in xs_s]
    mean = sum(ms) / len(ms) if ms else 0.0
    return Stats(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first; None for a request of one token (it has none)."""
    if r.output_len <= 1:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_len - 1)


def parse_goodput(words: Sequence[str]) -> dict[str, float]:
    """`ttft:200 tpot:50` -> {"ttft": 200.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for word in words:
        name, sep, value = word.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {word!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"--goodput {word!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a request meets every SLO given (ms).

    vLLM's goodput knows ttft, tpot and e2el; for itl it has no definition, and
    ours is the request's largest gap: an ITL SLO is a promise about every pause
    the user sees, which a mean (that is TPOT) or a p99 over a short answer
    (almost its max anyway) would not keep.
    """
    if not r.ok:
        return False
    measured = {
        "ttft": r.ttft_s,
        "tpot": tpot_s(r) or 0.0,  # one token: nothing after the first to be slow
        "itl": max(r.itl_s, default=0.0),
        "e2el": r.latency_s,
    }
    return all(measured[name] * 1000.0 <= ms for name, ms in slos.items())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    slos: Mapping[str, float],
    burst: BurstSummary | None = None,
) -> RunResult:
    ok = [r for r in records if r.ok]
    failed = len(records) - len(ok)
    d = duration_s if duration_s > 0 else math.inf  # no time: every rate is 0, not a division by zero
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    good = sum(meets_slos(r, slos) for r in ok) if slos else None
    return RunResult(
        request_rate=rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        num_prompts=len(records),
        duration_s=duration_s,
        completed=len(ok),
        failed=failed,
        request_throughput=len(ok) / d,
        output_throughput=total_out / d,
        total_token_throughput=(total_in + total_out) / d,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        ttft_ms=stats_ms([r.ttft_s for r in ok]),
        tpot_ms=stats_ms([t for r in ok if (t := tpot_s(r)) is not None]),
        itl_ms=stats_ms([g for r in ok for g in r.itl_s]),
        e2el_ms=stats_ms([r.latency_s for r in ok]),
        goodput=None if good is None else good / d,
        slo_attainment=None if good is None else (good / len(records) if records else 0.0),
        slos=dict(slos),
        burst=burst,
        requests=list(records),
    )


# ---- the burst scenario -------------------------------------------------------------------


def token_gaps(r: RequestRecord) -> list[tuple[float, float]]:
    """(arrival time from the run's start, gap) for every ITL sample of a request."""
    t = r.start_s + r.ttft_s
    out = []
    for gap in r.itl_s:
        t += gap
        out.append((t, gap))
    return out


def burst_summary(records: Sequence[RequestRecord], windows_s: Sequence[tuple[float, float]]) -> BurstSummary:
    """The steady streams' gaps filed by when they arrived: inside a burst window, or in a quiet spell.

    A window runs from sending a burst until its last request's first token,
    i.e. while its prefill runs; the burst requests' own decoding after that is
    decode load, not prefill interference, and is filed as quiet.
    """
    quiet: list[float] = []
    busy: list[float] = []
    for r in records:
        if not r.ok or r.tag != "steady":
            continue
        for t, gap in token_gaps(r):
            (busy if any(a <= t <= b for a, b in windows_s) else quiet).append(gap * 1000.0)
    q = Quantiles(percentile(quiet, 50), percentile(quiet, 99))
    b = Quantiles(percentile(busy, 50), percentile(busy, 99))
    ttft = [r.ttft_s * 1000.0 for r in records if r.ok and r.tag == "burst"]
    return BurstSummary(
        quiet_itl_ms=q,
        burst_itl_ms=b,
        ratio_p50=_ratio(b.p50, q.p50),
        ratio_p99=_ratio(b.p99, q.p99),
        burst_ttft_ms=Quantiles(percentile(ttft, 50), percentile(ttft, 99)),
        windows_s=[(float(a), float(b_)) for a, b_ in windows_s],
    )


def _ratio(a: float, b: float) -> float:
    return a / b if a > 0 and b > 0 else 0.0
