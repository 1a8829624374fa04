"""What a step costs: the interface the simulator prices every step with.

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

A cost model gives one figure per step; the steps of a real worker at a fixed
batch spread around it (a client's gaps at batch 4: p10 24.9, p50 28.5, p90
32.1 ms). `StepSpread` is that spread as measured: the ratio of each measured
decode step to the model's figure, at fixed quantile levels, per batch. The
simulator draws a decode step's ratio from it with its seeded generator.

Two implementations: the roofline of a deployment, which needs nothing measured
(`plan/deployment.py`'s `DeploymentCosts`), and a profile measured on this
project's workers (`plan/profile.py`'s `ProfileCosts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.measure.metrics import percentile

# the quantile levels a spread is kept at: 5% apart, the extremes left out (a few samples decide them)
SPREAD_LEVELS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 20))


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


def spread_quantiles(ratios: Sequence[float], levels: Sequence[float] = SPREAD_LEVELS) -> tuple[float, ...]:
    """The measured ratios (measured step / model's step) at `levels` (`percentile`'s interpolation)."""
    if not ratios:
        raise ValueError("a spread needs at least one measured ratio")
    return tuple(percentile(ratios, 100.0 * q) for q in levels)


@dataclass(frozen=True)
class StepSpread:
    """A decode step's measured time over the cost model's, as quantiles per batch: `by_batch`
    holds (batch, the ratio at each of `levels`), by batch. Between measured batches the quantiles
    are interpolated, outside them the nearest batch's are taken; a draw `u` in [0, 1) is read
    off the piecewise-linear inverse distribution through (level, ratio), flat past the end levels."""

    levels: tuple[float, ...]
    by_batch: tuple[tuple[int, tuple[float, ...]], ...]

    def __post_init__(self) -> None:
        if not self.levels or any(not 0.0 <= q <= 1.0 for q in self.levels):
            raise ValueError("spread levels must lie in [0, 1]")
        if any(a >= b for a, b in zip(self.levels, self.levels[1:], strict=False)):
            raise ValueError("spread levels must increase")
        if any(a[0] >= b[0] for a, b in zip(self.by_batch, self.by_batch[1:], strict=False)):
            raise ValueError("spread batches must be sorted, each once")
        for b, ratios in self.by_batch:
            if b < 1 or len(ratios) != len(self.levels) or min(ratios) <= 0.0:
                raise ValueError(f"spread at batch {b}: one positive ratio per level, batch >= 1")
            if any(x > y for x, y in zip(ratios, ratios[1:], strict=False)):
                raise ValueError(f"spread at batch {b}: ratios must not fall with the level")

    @property
    def is_zero(self) -> bool:
        """Every step the model's figure (to a fit's rounding, 1e-9): nothing to draw."""
        return all(abs(r - 1.0) <= 1e-9 for _, ratios in self.by_batch for r in ratios)

    def quantiles(self, batch: int) -> tuple[float, ...]:
        pts = self.by_batch
        if not pts:
            return tuple(1.0 for _ in self.levels)
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, q0), (b1, q1) in zip(pts, pts[1:], strict=False):
            if batch <= b1:
                f = (batch - b0) / (b1 - b0)
                return tuple(x + (y - x) * f for x, y in zip(q0, q1, strict=True))
        return pts[-1][1]

    def ratio(self, batch: int, u: float) -> float:
        """The step's time over the model's at `batch`, for a uniform draw `u` in [0, 1)."""
        q, levels = self.quantiles(batch), self.levels
        if u <= levels[0]:
            return q[0]
        for i in range(1, len(levels)):
            if u <= levels[i]:
                return q[i - 1] + (q[i] - q[i - 1]) * (u - levels[i - 1]) / (levels[i] - levels[i - 1])
        return q[-1]


def pipelined_tail_s(whole_s: float, compute_s: float, num_layers: int) -> float:
    """What is left of a transfer of `whole_s` after the last of `num_layers` layers computed in
    `compute_s` in all, each layer sent as it finishes: the last layer's share when the link keeps
    up, else the backlog (the first layer goes after one layer's compute, the link busy from then)."""
    per_layer = whole_s / num_layers
    return max(per_layer, whole_s - compute_s * (num_layers - 1) / num_layers)
