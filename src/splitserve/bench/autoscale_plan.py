"""What `bench autoscale` compares, whichever fleet runs it (bench/autoscale.py: mocker workers
behind the real control plane; bench/autoscale_sim.py: the simulator): each policy's pools as
`serve`'s flags would set them, and what a policy's run came to."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from splitserve.cluster.joint import JointConfig
    from splitserve.cluster.scaling import ScalingConfig

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
RECOVERY_WINDOW_S = 5.0
RECOVERED_SHARE = 0.9
SAMPLE_S = 0.5


class Record(NamedTuple):
    at_s: float
    ttft_s: float  # inf: failed
    itl_s: float


@dataclass
class Outcome:
    policy: str
    records: list[Record]
    worker_seconds: float
    peak: tuple[int, int]  # the most routed prefill and decode workers at once
    burst_at_s: float
    slo_ttft_s: float
    slo_itl_s: float

    def met(self, r: Record) -> bool:
        return r.ttft_s <= self.slo_ttft_s and r.itl_s <= self.slo_itl_s

    @property
    def attainment(self) -> float:
        return sum(self.met(r) for r in self.records) / max(1, len(self.records))

    @property
    def recovered_after_s(self) -> float | None:
        """From the burst's start to the first moment after which every window of arrivals meets
        the SLOs for RECOVERED_SHARE of its requests; None if that never came."""
        recs = sorted(self.records)
        end = recs[-1].at_s if recs else 0.0
        starts = [self.burst_at_s + k * SAMPLE_S for k in range(int((end - self.burst_at_s) / SAMPLE_S) + 1)]

        def good(t: float) -> bool:
            window = [r for r in recs if t <= r.at_s < t + RECOVERY_WINDOW_S]
            return not window or sum(self.met(r) for r in window) >= RECOVERED_SHARE * len(window)

        verdicts = [good(t) for t in starts]
        for i in range(len(starts)):
            if all(verdicts[i:]):
                return starts[i] - self.burst_at_s
        return None


class PoolPlan(NamedTuple):
    """A policy's pools, as `serve`'s flags would set them for it."""

    starts: dict[Role, int]
    standby: dict[Role, int]
    scaling: dict[Role, ScalingConfig | None]  # the queue policy's, per pool (None: fixed)
    controller: JointConfig | None  # the joint policy's


def pool_plan(args: argparse.Namespace, policy: str) -> PoolPlan:
    from splitserve.cluster.joint import JointConfig
    from splitserve.cluster.scaling import ScalingConfig

    starts: dict[Role, int] = {"prefill": args.prefill_workers, "decode": args.decode_workers}
    most: dict[Role, int] = {"prefill": args.prefill_max, "decode": args.decode_max}
    given = (int(x) for x in args.standby.split(":"))
    standby: dict[Role, int] = dict(zip(ROLES, given if policy == "joint" else (0, 0), strict=True))
    targets = {"prefill": 4096, "decode": 16384}  # serve's --prefill-target-tokens, --decode-target-tokens
    scaling: dict[Role, ScalingConfig | None] = {
        role: None
        if policy == "fixed"
        else ScalingConfig(
            min_replicas=starts[role],
            max_replicas=most[role] - standby[role],
            metric="work_tokens" if role == "decode" else "queued_tokens",
            target_tokens_per_worker=targets[role],
            low_water_tokens_per_worker=targets[role] // 4,
            min_free_block_fraction=0.1 if role == "decode" else 0.0,
        )
        for role in ROLES
    }
    controller = None
    if policy == "joint":
        controller = JointConfig(
            slo_ttft_s=args.slo_ttft_ms / 1e3,
            slo_itl_s=args.slo_itl_ms / 1e3,
            prefill_min=starts["prefill"],
            prefill_max=most["prefill"] - standby["prefill"],
            decode_min=starts["decode"],
            decode_max=most["decode"] - standby["decode"],
        )
    return PoolPlan(starts, standby, scaling, controller)
