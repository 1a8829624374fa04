"""One request's state inside an engine: its tokens, its block table, how far
its KV cache has been computed, and why it finished."""

from __future__ import annotations

import enum

import torch

from splitserve.engine.sampling import SamplingParams
from splitserve.engine.stats import RequestTimes


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the engine, no blocks yet
    RUNNING = "running"  # holds blocks; prefilling (chunk by chunk) or decoding
    RESERVED = "reserved"  # decode role: holds blocks that a remote prefill fills
    HELD = "held"  # prefill role: finished computing, blocks kept until the KV sender is done
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "status",
        "block_table",
        "num_computed_tokens",
        "num_cached_tokens",
        "finish_reason",
        "generator",
        "arrival",
        "prefill_only",
        "max_output_tokens",
        "transfer_id",
        "times",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
        prefill_only: bool = False,
        prior_output: list[int] | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        prior = list(prior_output or ())
        self.token_ids: list[int] = list(prompt_token_ids) + prior  # prompt then output
        self.num_prompt_tokens = len(prompt_token_ids)
        # output generated elsewhere before a migration counts as output (penalties) but not
        # against this call's max_tokens
        self.max_output_tokens = len(prior) + params.max_tokens
        self.params = params
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.arrival = arrival  # admission order: preemption takes the newest first
        self.prefill_only = prefill_only  # prefill role: finish after the first token
        self.transfer_id = b""  # decode role, RESERVED: the KV connector's id of the transfer filling it
        self.times = RequestTimes(arrival_time)  # for metrics (engine/stats.py), on the engine's clock

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
