"""The result file of `splitserve bench serve --json`: its dataclasses, how they
become JSON and come back, and `load_result`.

Other harnesses (the vLLM peer comparison) import this module and read the
file by these keys, so the keys are the contract: add, never rename. A rate of
infinity is written as the string "inf" (JSON has no infinity).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    tag: str  # "plain", "steady", "burst", "turn1", "turn2", ...
    prompt_len: int  # the server's count (usage) when it gave one, else the dataset's
    output_len: int  # the server's count (usage) when it gave one, else what the client counted
    start_s: float  # when it was sent, from the start of the run
    ttft_s: float  # send -> first chunk with output; 0.0 when none came
    itl_s: list[float]  # gaps between chunks with output (one per chunk, as vLLM records them)
    latency_s: float  # send -> the answer's end (e2e)
    error: str | None  # None: completed
    cached_len: int = -1  # prompt tokens the server found in its prefix cache (usage), -1 when it did not say

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RequestRecord:
        return RequestRecord(
            tag=str(d["tag"]),
            prompt_len=int(d["prompt_len"]),
            output_len=int(d["output_len"]),
            start_s=float(d["start_s"]),
            ttft_s=float(d["ttft_s"]),
            itl_s=[float(x) for x in d["itl_s"]],
            latency_s=float(d["latency_s"]),
            error=None if d["error"] is None else str(d["error"]),
            cached_len=int(d.get("cached_len", -1)),
        )


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in ms; all 0.0 when there was no sample (as vLLM prints)."""

    mean: float
    p50: float
    p90: float
    p99: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Stats:
        return Stats(float(d["mean"]), float(d["p50"]), float(d["p90"]), float(d["p99"]))


@dataclass(frozen=True)
class Quantiles:
    """p50 and p99 in ms (the burst scenario's figures)."""

    p50: float
    p99: float

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Quantiles:
        return Quantiles(float(d["p50"]), float(d["p99"]))


@dataclass(frozen=True)
class BurstSummary:
    """The steady streams' ITL inside burst windows against the quiet spells."""

    quiet_itl_ms: Quantiles
    burst_itl_ms: Quantiles
    ratio_p50: float  # burst / quiet; 0.0 when either side had no sample
    ratio_p99: float
    burst_ttft_ms: Quantiles  # the burst requests' own TTFT
    windows_s: list[tuple[float, float]]  # (sent, last first token) per burst, from the run's start

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["windows_s"] = [list(w) for w in self.windows_s]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BurstSummary:
        return BurstSummary(
            quiet_itl_ms=Quantiles.from_dict(d["quiet_itl_ms"]),
            burst_itl_ms=Quantiles.from_dict(d["burst_itl_ms"]),
            ratio_p50=float(d["ratio_p50"]),
            ratio_p99=float(d["ratio_p99"]),
            burst_ttft_ms=Quantiles.from_dict(d["burst_ttft_ms"]),
            windows_s=[(float(a), float(b)) for a, b in d.get("windows_s", [])],
        )


@dataclass(frozen=True)
class RunResult:
    """One load level: a request rate (one point of a sweep)."""

    request_rate: float  # requests/s; math.inf: all at once
    burstiness: float
    max_concurrency: int | None
    num_prompts: int
    duration_s: float
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    goodput: float | None  # good requests/s; None without --goodput
    slo_attainment: float | None  # good / (completed + failed)
    slos: dict[str, float]  # metric -> ms, as given to --goodput
    burst: BurstSummary | None
    requests: list[RequestRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "num_prompts": self.num_prompts,
            "duration_s": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
        }
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d[name] = getattr(self, name).to_dict()
        d["goodput"] = self.goodput
        d["slo_attainment"] = self.slo_attainment
        d["slos"] = dict(self.slos)
        d["burst"] = None if self.burst is None else self.burst.to_dict()
        d["requests"] = [r.to_dict() for r in self.requests]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RunResult:
        rate = d["request_rate"]
        return RunResult(
            request_rate=math.inf if rate == "inf" else float(rate),
            burstiness=float(d["burstiness"]),
            max_concurrency=None if d["max_concurrency"] is None else int(d["max_concurrency"]),
            num_prompts=int(d["num_prompts"]),
            duration_s=float(d["duration_s"]),
            completed=int(d["completed"]),
            failed=int(d["failed"]),
            request_throughput=float(d["request_throughput"]),
            output_throughput=float(d["output_throughput"]),
            total_token_throughput=float(d["total_token_throughput"]),
            total_input_tokens=int(d["total_input_tokens"]),
            total_output_tokens=int(d["total_output_tokens"]),
            ttft_ms=Stats.from_dict(d["ttft_ms"]),
            tpot_ms=Stats.from_dict(d["tpot_ms"]),
            itl_ms=Stats.from_dict(d["itl_ms"]),
            e2el_ms=Stats.from_dict(d["e2el_ms"]),
            goodput=None if d["goodput"] is None else float(d["goodput"]),
            slo_attainment=None if d["slo_attainment"] is None else float(d["slo_attainment"]),
            slos={str(k): float(v) for k, v in d["slos"].items()},
            burst=None if d["burst"] is None else BurstSummary.from_dict(d["burst"]),
            requests=[RequestRecord.from_dict(r) for r in d["requests"]],
        )


@dataclass(frozen=True)
class BenchResult:
    """One invocation: who was measured, how, and one run per request rate."""

    label: str
    backend: str
    base_url: str | None  # None for the gRPC backend
    dataset: str
    args: dict[str, Any]  # every CLI argument, JSON-safe
    runs: list[RunResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "backend": self.backend,
            "base_url": self.base_url,
            "dataset": self.dataset,
            "args": dict(self.args),
            "runs": [r.to_dict() for r in self.runs],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BenchResult:
        return BenchResult(
            label=str(d["label"]),
            backend=str(d["backend"]),
            base_url=d["base_url"],
            dataset=str(d["dataset"]),
            args=dict(d["args"]),
            runs=[RunResult.from_dict(r) for r in d["runs"]],
        )


def json_safe(value: Any) -> Any:
    """An argparse value as JSON can hold it: infinities as "inf", tuples as lists, other objects as str."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def save_result(result: BenchResult, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=1, allow_nan=False)
        f.write("\n")


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file as plain data, checked by a round trip through the dataclasses (a missing key raises)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    BenchResult.from_dict(raw)
    return dict(raw)
