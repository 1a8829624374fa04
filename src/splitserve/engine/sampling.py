"""Per-request sampling parameters.

Validated once at construction so that a bad value is rejected at the door
(the router turns the ValueError into INVALID_ARGUMENT naming the field) and
never reaches a running batch where it could cost other requests their step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by
# 1e-38 overflows fp32 to infinity, and such a request is greedy in all but name.
GREEDY_TEMPERATURE_EPS = 1e-5


class InvalidSamplingParam(ValueError):
    """A sampling field out of range; `field` names it (no one has to parse the message)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} {why}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None  # output token i draws from (seed, sample index, i) alone; None: the engine's generator
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: matched by whoever detokenizes
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token

    def __post_init__(self) -> None:
        bad = InvalidSamplingParam

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad("seed", f"must be in [0, 2^63), got {self.seed!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not math.isfinite(v) or not (-2.0 <= v <= 2.0):
                raise bad(f, f"must be in [-2, 2], got {v!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise bad("stop", "entries must be non-empty strings")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
