"""Load or recompute, in seconds: the pure arithmetic behind the KV tiers (engine/kv_tiers.py) and
the router's view of them (router/policy.py). Torch-free, so the router imports it cheaply.

A block in a tier costs `overhead + bytes_per_block / bandwidth` seconds to load into the pool; it
costs `block_size / prefill_tokens_per_s` to recompute. The bandwidths and the prefill speed are
what the worker measured (a probe at start, then running averages over its loads and its prefill
steps); every function here takes them as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def plan_load(
    tiers: Sequence[str],
    bytes_per_block: int,
    block_size: int,
    bandwidth: dict[str, float],
    prefill_tokens_per_s: float | None,
    overhead_s: dict[str, float] | None = None,
) -> int:
    """How many of the leading blocks (each in `tiers[i]`) to load rather than recompute.

    Loading block i costs `overhead_s[tier] + bytes_per_block / bandwidth[tier]` seconds,
    recomputing it `block_size / prefill_tokens_per_s`. Loads must form a prefix (each
    block's KV depends on the ones before), so the answer is the prefix length with the
    largest total saving; 0 when no prefix saves time. Without a measured prefill speed
    every block is loaded (a tier read is never slower than a model's prefill by default).
    """
    if not tiers:
        return 0
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return len(tiers)
    recompute = block_size / prefill_tokens_per_s
    best, best_n, saved = 0.0, 0, 0.0
    for i, tier in enumerate(tiers):
        saved += recompute - load_seconds(tier, bytes_per_block, bandwidth, overhead_s)
        if saved > best:
            best, best_n = saved, i + 1
    return best_n


def load_seconds(
    tier: str, bytes_per_block: int, bandwidth: dict[str, float], overhead_s: dict[str, float] | None = None
) -> float:
    """Seconds to load one block from `tier` into the pool: the one place a tier block is priced (the
    worker's load-or-recompute plan and the router's view of a worker both come here). A tier without
    a measured bandwidth never loads (infinity)."""
    bw = bandwidth.get(tier, 0.0)
    return (overhead_s or {}).get(tier, 0.0) + (bytes_per_block / bw if bw > 0 else float("inf"))


def expected_seconds(
    tiers: Sequence[str],
    bytes_per_block: int,
    block_size: int,
    bandwidth: dict[str, float],
    prefill_tokens_per_s: float | None,
) -> float:
    """Seconds until blocks in `tiers` are in the pool: the cheaper of loading and recomputing each
    (the router's view of a tier hit; a pooled block costs nothing)."""
    total = 0.0
    recompute = block_size / prefill_tokens_per_s if prefill_tokens_per_s else float("inf")
    for tier in tiers:
        if tier != "pool":
            total += min(load_seconds(tier, bytes_per_block, bandwidth), recompute)
    return total


class TierSpeed(NamedTuple):
    """One tier's measured load bandwidth, as a worker reports it."""

    name: str
    bytes_per_s: float  # 0: not measured


class TierSpeeds(NamedTuple):
    """What a worker measured and reports (WorkerStats): its prefill speed and its tiers' load bandwidths,
    the tiers in the order it looks in them (fastest first)."""

    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    block_bytes: int = 0  # one block's KV, every layer
    tiers: tuple[TierSpeed, ...] = ()

    @property
    def bandwidth(self) -> dict[str, float]:
        return {t.name: t.bytes_per_s for t in self.tiers}

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)


class PrefixCost(NamedTuple):
    """How a worker gets a context's KV into its pool, and in how many seconds."""

    pool_blocks: int  # leading blocks in its pool already
    loaded_blocks: int  # blocks after them it would load from a tier (loading beats recomputing)
    load_seconds: float  # expected seconds of those loads
    compute_tokens: int  # context tokens left to prefill: past the pool and the loaded blocks

    def seconds(self, prefill_tokens_per_s: float) -> float:
        """Expected seconds until the whole context is in the pool (the prefill at the measured speed)."""
        return self.load_seconds + (self.compute_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 0.0)

    def equivalent_tokens(self, prefill_tokens_per_s: float) -> float:
        """Those seconds in tokens of prefill at the worker's speed: what the router's token cost weighs
        (a tier hit is neither free nor a full recompute, but its load time)."""
        return self.compute_tokens + self.load_seconds * prefill_tokens_per_s


def prefix_cost(
    tiers: Sequence[str], num_tokens: int, block_size: int, speeds: TierSpeeds, tier_aware: bool = True
) -> PrefixCost:
    """`tiers`: where each leading block of the context is on one worker ("pool" or a tier's name; the run
    stops at its first block held nowhere). The pooled head is free; the tier run after it is loaded as
    far as `plan_load` says loading beats recomputing (with the worker's own measurements: without a
    measured prefill speed or bandwidth nothing is counted as loadable, as a tier-blind router would);
    the rest is prefilled. `tier_aware` False: the tier run counts as uncached (the tier-blind baseline)."""
    pool = 0
    while pool < len(tiers) and tiers[pool] == "pool":
        pool += 1
    run: list[str] = []
    for t in tiers[pool:] if tier_aware else ():
        if t == "pool":
            break
        run.append(t)
    n = 0
    load = 0.0
    if speeds.prefill_tokens_per_s > 0 and speeds.block_bytes > 0 and run:
        bw = speeds.bandwidth
        n = plan_load(run, speeds.block_bytes, block_size, bw, speeds.prefill_tokens_per_s)
        load = sum(load_seconds(t, speeds.block_bytes, bw) for t in run[:n])
    compute = max(0, num_tokens - (pool + n) * block_size)
    return PrefixCost(pool, n, load, compute)
