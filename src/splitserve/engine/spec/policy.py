"""When speculation pays: measured acceptance against measured step costs.

A decode step's cost grows with its rows (a verified draft adds one row per draft token), and
what a draft buys is the expected number of its tokens the target accepts. With each draft
token accepted with probability `a` given the ones before it (the measured rate), a draft of k
tokens emits 1 + a + a^2 + ... + a^k tokens in the step instead of 1. `plan_drafts` chooses every
sequence's draft length together: draft tokens are added in order of their expected gain (the
j-th token of a draft adds a^j), and the prefix of that order with the most expected tokens per
second of step wins, the step's seconds at each row count read from `StepCosts` (measured). A
sequence whose text does not repeat itself gets 0, and the step is plain decode.

Everything here is a pure function of what is passed in, or a small record of measurements.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The weight of a measurement against the ones before it: a sequence that stops copying its
# prompt (a summary's quoted part ends) loses most of its credit within a few steps.
DECAY = 0.8
PRIOR_WEIGHT = 2.0  # draft positions' worth of the engine-wide rate that a new sequence starts with
COST_SMOOTHING = 0.2  # a step time's weight in its row count's running mean


@dataclass
class Acceptance:
    """Draft positions verified and accepted (decayed): one sequence's, or the engine's."""

    verified: float = 0.0
    accepted: float = 0.0

    def record(self, drafted: int, accepted: int, decay: float = DECAY) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` were accepted: the
        positions checked are those accepted and the first mismatch, if there was one."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of a {drafted}-token draft")
        checked = accepted + (accepted < drafted)
        self.verified = self.verified * decay + checked
        self.accepted = self.accepted * decay + accepted

    def rate(self, prior: float, prior_weight: float = PRIOR_WEIGHT) -> float:
        """The chance that a draft token is accepted given the ones before it, `prior` (the
        engine's rate) weighing in as `prior_weight` positions."""
        return (self.accepted + prior * prior_weight) / (self.verified + prior_weight)


@dataclass
class StepCosts:
    """A decode step's measured seconds by its rows (sequences plus draft tokens)."""

    seconds_by_rows: dict[int, float] = field(default_factory=dict)

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds_by_rows.get(rows)
        self.seconds_by_rows[rows] = seconds if old is None else old + COST_SMOOTHING * (seconds - old)

    def seconds(self, rows: int) -> float | None:
        """The step's seconds at `rows`: measured, else interpolated between the nearest measured
        row counts, else extrapolated from the two largest along their slope; None below two
        measured counts with nothing measured at `rows` (nothing known to weigh)."""
        known = self.seconds_by_rows
        if rows in known:
            return known[rows]
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        if len(known) < 2:
            return None
        a, b = sorted(known)[-2:] if below else sorted(known)[:2]
        slope = max(0.0, (known[b] - known[a]) / (b - a))
        edge = b if below else a
        return max(known[edge] + slope * (rows - edge), 0.0)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step emits for a sequence with a k-token draft: 1 + rate + ... + rate^k."""
    return sum(rate**j for j in range(k + 1))


def plan_drafts(
    rates: Sequence[float],
    max_lens: Sequence[int],
    base_rows: int,
    seconds: Callable[[int], float | None],
    max_rows: int,
) -> list[int]:
    """Each candidate's draft length (0: no draft) for a step of `base_rows` sequences.

    `rates[i]`: candidate i's acceptance rate; `max_lens[i]`: the tokens its drafter proposed;
    `seconds(rows)`: the step's measured seconds (None: unknown, counted as the plain step's,
    so that the first steps measure what drafts cost); at most `max_rows` rows in all."""
    gains: list[tuple[float, int, int]] = []  # (-gain, candidate, its j-th draft token)
    for i, (r, k) in enumerate(zip(rates, max_lens, strict=True)):
        if k > 0:
            heapq.heappush(gains, (-r, i, 1))
    base = seconds(base_rows)
    best_rate = base_rows / base if base else None  # expected tokens per second of the best so far
    tokens = float(base_rows)
    best = taken = 0
    order: list[int] = []
    while gains and base_rows + taken < max_rows:
        neg, i, j = heapq.heappop(gains)
        tokens -= neg
        taken += 1
        order.append(i)
        if j < max_lens[i]:
            heapq.heappush(gains, (neg * rates[i], i, j + 1))
        t = seconds(base_rows + taken)
        if not t or best_rate is None:
            best = taken  # nothing measured to weigh: try it, and the step gets measured
            continue
        if tokens / t > best_rate:
            best, best_rate = taken, tokens / t
    lens = [0] * len(rates)
    for i in order[:best]:
        lens[i] += 1
    return lens
