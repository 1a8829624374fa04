"""The handoff record: everything a worker needs to continue a request exactly where another
left off, as plain data (its wire form is proto/convert.py's `handoff_to_proto`).

The prefill worker hands it to the decode worker with the KV (and to the router with the
first tokens); a migration hands it to the replacement decode worker. Nothing else crosses:
a grammar matcher's state is its grammar plus the tokens it accepted, and a seeded draw
depends on (seed, sample index, output position) alone, so the output tokens are the whole
state of a sample (vLLM recomputes the first token on the decode side and Dynamo refuses to
migrate guided requests because they carry less).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.prefill_order import NO_TENANT, Share
from splitserve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities under the raw model distribution."""

    logprob: float  # of the token at this position
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class SampleState:
    """One of a request's n samples, as far as it got."""

    index: int
    output_token_ids: list[int] = field(default_factory=list)
    # with params.logprobs: those of the last len(logprobs) output tokens (a worker reports what it
    # sampled; the router keeps the earlier ones)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Handoff:
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens counts each sample's output in all, handed-over tokens included
    samples: list[SampleState] = field(default_factory=list)  # empty: fresh, every one of n to start
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt token after the first
    share: Share = NO_TENANT  # whose request it is, for the workers' prefill order

    def sample_states(self) -> list[SampleState]:
        """The samples to run: those handed over, or all n fresh."""
        return self.samples or [SampleState(i) for i in range(self.params.n)]
