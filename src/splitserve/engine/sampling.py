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


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, as the client wrote it; compiled by engine/grammar.py (once per
    distinct spec: it is its own cache key). `source`: the JSON schema text, the regex, a JSON
    list of choices, a Lark grammar; empty for json_object."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidSamplingParam("grammar", f"kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind != "json_object" and not self.source:
            raise InvalidSamplingParam("grammar", f"a {self.kind} grammar needs a source")


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
    top_logprobs: int = 0  # with logprobs: the this-many most likely tokens at each position too
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the raw logits
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many output tokens
    grammar: GrammarSpec | None = None  # every output token is sampled under it
    n: int = 1  # samples of the request: one prefill, the sequence forked n ways
    prompt_logprobs: int = 0  # 0: off; k: each prompt token's logprob and the k-1 most likely others'

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
        self._check_extras()
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    def _check_extras(self) -> None:
        bad = InvalidSamplingParam
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS + 1:
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS + 1}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"keys must be token ids >= 0, got {token!r}")
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biases_logits(self) -> bool:
        """Whether logit_bias is added, or the end masked until min_tokens (sampler.apply_logit_bias)."""
        return bool(self.logit_bias) or self.min_tokens > 0

    def truncates(self, vocab: int) -> bool:
        """Whether min-p, top-k or top-p drops tokens from a distribution over `vocab` (a top_k of
        the whole vocabulary or more keeps every token)."""
        return self.min_p > 0.0 or 0 < self.top_k < vocab or self.top_p < 1.0

    def temperature_only(self, vocab: int) -> bool:
        """Whether the token is a draw from softmax(logits / temperature) and nothing else. The
        sampler applies each of its processors under one of the properties read here, so a row for
        which this holds takes its batched path with nothing skipped."""
        return not (self.greedy or self.has_penalties or self.biases_logits or self.truncates(vocab))

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but the plain distribution decides the token (so greedy rows cannot
        all share one argmax)."""
        return self.has_penalties or self.biases_logits or self.grammar is not None
