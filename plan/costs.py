"""What a step costs: the interface the simulator prices every step with, and
the roofline implementation that needs nothing measured.

Three numbers price everything the simulator does:

    prefill_s(tokens, cached_tokens)         a prefill of `tokens` new tokens after `cached_tokens`
                                             already in the cache (their attention is paid, their
                                             projections are not)
    decode_step_s(batch, context_tokens)     one decode step: one token for each of `batch` requests
                                             whose contexts hold `context_tokens` in all; batch 0 is a
                                             step's fixed part (weights read, launch overhead)
    transfer_s(tokens)                       the KV transfer of `tokens` that is left after the prefill's
                                             last layer (layers are pushed as they finish, so only what
                                             the link could not hide behind compute remains)

A colocated step that carries a prefill chunk and decodes at once is priced by
`mixed_step_s`: the chunk's prefill plus the decode's cost above the fixed part
both share (the weights are read once).

The measured implementation is `plan/profile.py`'s `ProfileCosts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CostModel(Protocol):
    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float: ...

    def transfer_s(self, tokens: int) -> float: ...


def mixed_step_s(costs: CostModel, prefill_tokens: int, prefill_cached: int, batch: int, context_tokens: int) -> float:
    """One engine step: a prefill chunk of `prefill_tokens` (after `prefill_cached` tokens of its own
    context; for several chunks, the token-weighted mean) and `batch` decodes over `context_tokens`."""
    if prefill_tokens <= 0:
        return costs.decode_step_s(batch, context_tokens) if batch > 0 else 0.0
    t = costs.prefill_s(prefill_tokens, prefill_cached)
    if batch > 0:
        t += max(0.0, costs.decode_step_s(batch, context_tokens) - costs.decode_step_s(0, 0))
    return t


def pipelined_tail_s(whole_s: float, compute_s: float, num_layers: int) -> float:
    """What is left of a transfer of `whole_s` after the last of `num_layers` layers computed in
    `compute_s` in all, each layer sent as it finishes: the last layer's share when the link keeps
    up, else the backlog (the first layer goes after one layer's compute, the link busy from then)."""
    per_layer = whole_s / num_layers
    return max(per_layer, whole_s - compute_s * (num_layers - 1) / num_layers)


@dataclass(frozen=True)
class RooflineCosts:
    """Each step takes the longer of its memory traffic over the bandwidth and its FLOPs over the
    peak, each at an achievable share of the datasheet figure. Plain numbers, so the capacity
    arithmetic of any model shape and GPU can feed it. Per worker: a tensor-parallel group is one
    worker with its bandwidth and FLOP/s summed and its weights split."""

    weights_bytes: float  # read once per step (the whole group's)
    kv_bytes_per_token: float  # all layers, K and V
    flops_per_token: float  # the dense part: 2 x parameters (active ones for a MoE)
    hbm_bytes_per_s: float
    peak_flops: float
    link_bytes_per_s: float  # the KV path between a prefill and a decode worker
    num_layers: int = 1
    attn_flops_per_token_ctx: float = 0.0  # attention FLOPs per query token per context token: 4 x layers x q width
    bandwidth_efficiency: float = 0.8  # share of the datasheet bandwidth a decode step reaches
    flops_efficiency: float = 0.6  # share of the peak a prefill reaches
    step_overhead_s: float = 0.0  # per step: launches, scheduling, sampling
    link_latency_s: float = 0.0  # per transfer: the round trip of the last frame and its confirmation

    def __post_init__(self) -> None:
        if min(self.hbm_bytes_per_s, self.peak_flops, self.link_bytes_per_s) <= 0 or self.num_layers < 1:
            raise ValueError("bandwidths, FLOP/s and layers must be positive")
        if not (0 < self.bandwidth_efficiency <= 1 and 0 < self.flops_efficiency <= 1):
            raise ValueError("efficiencies must be in (0, 1]")

    @property
    def _bw(self) -> float:
        return self.hbm_bytes_per_s * self.bandwidth_efficiency

    @property
    def _flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        if tokens <= 0:
            return 0.0
        flops = tokens * self.flops_per_token + self.attn_flops_per_token_ctx * tokens * (cached_tokens + tokens / 2)
        memory = self.weights_bytes + self.kv_bytes_per_token * (cached_tokens + tokens)
        return max(flops / self._flops, memory / self._bw) + self.step_overhead_s

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        memory = self.weights_bytes + self.kv_bytes_per_token * context_tokens_total
        flops = batch * self.flops_per_token + self.attn_flops_per_token_ctx * context_tokens_total
        return max(memory / self._bw, flops / self._flops) + self.step_overhead_s

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        whole = tokens * self.kv_bytes_per_token / self.link_bytes_per_s
        compute = self.prefill_s(tokens) - self.step_overhead_s
        return pipelined_tail_s(whole, compute, self.num_layers) + self.link_latency_s
