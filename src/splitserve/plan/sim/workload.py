"""The traffic a plan is for: prompt and output lengths, prefix reuse, rate, objectives.

Given on the command line (a mean, or `mean:std`) or read from a `bench serve` JSON
result, whose per-request prompt and output lengths are what that run's server saw.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from splitserve.measure.results import BenchResult, load_result


@dataclass(frozen=True)
class Length:
    mean: float
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.mean <= 0 or self.std < 0:
            raise ValueError(f"a length needs mean > 0 and std >= 0, got {self.mean}:{self.std}")

    @staticmethod
    def parse(text: str) -> Length:
        """`512` or `512:128` (mean:std, in tokens)."""
        mean, _, std = text.partition(":")
        try:
            return Length(float(mean), float(std) if std else 0.0)
        except ValueError as e:
            raise ValueError(f"expected MEAN or MEAN:STD in tokens, got {text!r} ({e})") from None

    def __str__(self) -> str:
        return f"{self.mean:.0f}" + (f" +- {self.std:.0f}" if self.std else "")


@dataclass(frozen=True)
class Workload:
    prompt: Length  # tokens
    output: Length  # tokens
    prefix_reuse: float  # share of prompt tokens found in a prefix cache
    rate: float  # requests/s arriving at the whole cluster
    ttft_slo_s: float
    tpot_slo_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.prefix_reuse < 1:
            raise ValueError("prefix_reuse must be in [0, 1)")
        if self.rate <= 0 or math.isinf(self.rate):
            raise ValueError("rate must be a positive, finite number of requests/s")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("the TTFT and TPOT objectives must be positive")

    @property
    def uncached_prompt(self) -> int:
        """Mean prompt tokens a prefill computes (what the prefix cache does not hold)."""
        return max(1, round(self.prompt.mean * (1 - self.prefix_reuse)))

    @property
    def cached_prompt(self) -> int:
        return round(self.prompt.mean) - self.uncached_prompt if self.prompt.mean > self.uncached_prompt else 0


def lengths_from_result(path: str) -> tuple[Length, Length, float | None]:
    """Prompt and output lengths of a `bench serve --json` file's completed requests (every
    run of it), and the request rate of its first finite-rate run."""
    result = BenchResult.from_dict(load_result(path))
    prompts: list[float] = []
    outputs: list[float] = []
    rates = [run.request_rate for run in result.runs if math.isfinite(run.request_rate)]
    for run in result.runs:
        for req in run.requests:
            if req.ok and req.output_len > 0:
                prompts.append(float(req.prompt_len))
                outputs.append(float(req.output_len))
    if not prompts:
        raise ValueError(f"{path}: no completed request with per-request lengths (run bench serve with --json)")

    def of(xs: list[float]) -> Length:
        return Length(statistics.fmean(xs), statistics.pstdev(xs))

    return of(prompts), of(outputs), (rates[0] if rates else None)
