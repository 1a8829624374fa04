"""One request's state inside an engine: its tokens, its block table, how far
its KV cache has been computed, and why it finished."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch

from splitserve.engine.prefill_order import Share
from splitserve.engine.sampler import draw_seed
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.stats import RequestTimes

if TYPE_CHECKING:
    from splitserve.engine.lora.adapter import LoraAdapter


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
        "adapter",
        "sample_index",
        "group_id",
        "fork_indices",
        "matcher",
        "first_draws",
        "prompt_logprobs",
        "arrival",
        "prefill_only",
        "max_output_tokens",
        "transfer_id",
        "share",
        "times",
        "speculation",
        "prefix_cacheable",
        "window_held_from",
        "window_held_to",
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
        sample_index: int = 0,
    ) -> None:
        """`prior_output`: output tokens produced elsewhere (the prefill worker's first token, or
        those a migration replays); `sample_index`: which of a request's n samples this is. Its
        outputs carry `group_id` (the request's id; a fork's own `request_id` is unique inside the
        engine)."""
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        self.request_id = request_id
        prior = list(prior_output or ())
        self.token_ids: list[int] = list(prompt_token_ids) + prior  # prompt then output
        self.num_prompt_tokens = len(prompt_token_ids)
        # max_tokens counts every output token, those generated elsewhere before included
        self.max_output_tokens = params.max_tokens
        self.params = params
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.finish_reason: str | None = None
        # one per seeded request, reseeded before each draw (next_draw_generator); None: the engine's
        self.generator = torch.Generator() if params.seed is not None else None
        # the LoRA adapter its rows take (engine/lora/), None: the base model; its id roots the block hashes
        self.adapter: LoraAdapter | None = None
        self.sample_index = sample_index
        self.group_id = request_id
        # the other samples drawn from this sequence's first output position (fresh, n > 1): they
        # fork from it then, sharing its blocks (prefill role: they go into the handoff instead)
        self.fork_indices: list[int] = []
        self.matcher: Any = None  # engine/grammar.py's Matcher, with params.grammar
        # prefill role, n > 1: the fork draws (sample index, token, logprob) for the handoff
        self.first_draws: list[tuple[int, int, Any]] = []
        self.prompt_logprobs: list[Any] = []  # TokenLogprob per prompt position after the first
        self.arrival = arrival  # admission order: preemption takes the newest first
        self.prefill_only = prefill_only  # prefill role: finish after the first token
        self.transfer_id = b""  # decode role, RESERVED: the KV connector's id of the transfer filling it
        self.share = Share()  # whose it is, for the prefill order (engine/prefill_order.py)
        self.times = RequestTimes(arrival_time)  # for metrics (engine/stats.py), on the engine's clock
        # engine/spec/speculator.py's record of this sequence's drafts (acceptance), made at its
        # first decode step; derived from its tokens and steps here, so never handed over
        self.speculation: Any = None
        # whether its full blocks join the prefix cache: not a remote prefill's of a windowed model,
        # whose windowed layers received only the blocks their windows still see
        self.prefix_cacheable = True
        # a grouped cache (engine/kv_groups.py): the blocks whose windowed pages it holds, from
        # `window_held_from` (the blocks before are past every windowed layer's window;
        # BlockManager.release_behind moves it) to `window_held_to` (those after come as its
        # prefill reaches them)
        self.window_held_from = 0
        self.window_held_to = 0

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

    def forked(self, request_id: str, sample_index: int) -> Sequence:
        """Sample `sample_index` of this sequence's request, with the same context so far (no
        blocks yet: the scheduler gives it its parent's) and the grammar state forked."""
        child = Sequence(
            request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.params,
            self.arrival,
            False,
            self.output_token_ids,
            self.times.arrival,
            sample_index,
        )
        child.group_id = self.group_id
        child.max_output_tokens = self.max_output_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.prefix_cacheable = self.prefix_cacheable
        child.share = self.share
        child.adapter = self.adapter
        if self.matcher is not None:
            child.matcher = type(self.matcher)(self.matcher.compiled)
            child.matcher.replay(self.output_token_ids)
        return child

    def draw_generator(self, sample_index: int, ahead: int = 0) -> torch.Generator | None:
        """A fresh generator for sample `sample_index`'s draw at this sequence's next output position
        (a fork's first token), or `ahead` positions past it (a verified draft's rows); None
        without a seed."""
        if self.params.seed is None:
            return None
        return torch.Generator().manual_seed(draw_seed(self.params.seed, sample_index, self.num_output_tokens + ahead))

    def next_draw_generator(self) -> torch.Generator | None:
        """A seeded request's generator, reseeded for drawing its next output token (token i, i
        counting the prior output too) from `draw_seed(seed, sample_index, i)` alone, so the draw
        does not depend on which engine drew the earlier tokens. None without a seed: those draw
        from the engine's generator. (Torch's CPU generator keeps the low 32 bits of the seed.)"""
        if self.generator is None or self.params.seed is None:
            return None
        return self.generator.manual_seed(draw_seed(self.params.seed, self.sample_index, self.num_output_tokens))
