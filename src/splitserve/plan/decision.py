"""Disaggregate or not: five checks, each a number and a verdict with its reason, and the
recommendation they add up to.

Disaggregation pays when prefill and decode both take real GPU time (so that,
colocated, each prompt stalls a busy decode batch), the KV crosses the network
faster than the prompt is computed (so layer pipelining hides it), prefixes are
mostly new, there are enough replicas to split without stranding one pool, and
the network is RDMA-class. Each check's thresholds are named constants here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from splitserve.plan.deployment import Deployment, RequestCosts, request_costs
from splitserve.plan.sim.workload import Workload

Verdict = Literal["for", "against", "neutral"]
CheckKey = Literal["decode_share", "transfer", "prefix_reuse", "gpu_count", "network"]
# An "against" from these is a cost the split adds to every request, so it decides alone;
# the others are votes.
VETOES: tuple[CheckKey, ...] = ("transfer", "prefix_reuse")

MIN_PHASE_SHARE = 0.10  # each phase at least this share of GPU time for them to interfere
TRANSFER_HIDDEN_TTFT = 0.10  # exposed transfer at most this share of the TTFT objective: hidden
TRANSFER_COSTLY_TTFT = 0.25  # more than this share of the TTFT objective: costly
HIGH_REUSE, LOW_REUSE = 0.5, 0.2  # prefix-cache hit rates
FEW_REPLICAS, MANY_REPLICAS = 4, 8
STRANDED_OK, STRANDED_COSTLY = 0.05, 0.15  # share of the budget an integer split leaves idle
FAST_LINK_GBPS, SLOW_LINK_GBPS = 100.0, 25.0
CONTROL_RPC_S = 1e-3  # router -> prefill worker -> decode worker: the extra hops of a remote prefill
LONGEST_PROMPT = 1 << 20  # the threshold search's end


@dataclass(frozen=True)
class Check:
    key: CheckKey
    name: str
    value: float
    unit: str
    verdict: Verdict
    reason: str


def check_decode_share(c: RequestCosts) -> Check:
    share = c.decode_share
    if min(share, 1 - share) >= MIN_PHASE_SHARE:
        verdict: Verdict = "for"
        why = "both phases take real GPU time, so colocated each prompt's prefill stalls a busy decode batch"
    elif share < MIN_PHASE_SHARE:
        verdict, why = "against", "decode is a small share: there is little decode for prefill to disturb"
    else:
        verdict = "against"
        why = "prefill is a small share: prompts rarely interrupt decode, chunked prefill absorbs them"
    return Check(
        "decode_share",
        "decode share of GPU time",
        share,
        "share",
        verdict,
        f"prefill {c.prefill_s * 1e3:.1f} ms vs decode {c.decode_s * 1e3:.1f} ms per request "
        f"(batch {c.decode_batch}); {why}",
    )


def check_transfer(c: RequestCosts, wl: Workload) -> Check:
    exposed = c.transfer_exposed_s + CONTROL_RPC_S
    share = exposed / wl.ttft_slo_s
    keeps_up = c.transfer_s <= c.prefill_s
    if keeps_up and share <= TRANSFER_HIDDEN_TTFT:
        verdict: Verdict = "for"
        why = "the link keeps up with prefill, so layer pipelining leaves only the last layer to send"
    elif share > TRANSFER_COSTLY_TTFT or c.transfer_s > 2 * c.prefill_s:
        verdict = "against"
        why = "the KV takes longer to send than to compute; what is left after prefill adds to TTFT"
    else:
        verdict, why = "neutral", "the transfer is partly hidden"
    return Check(
        "transfer",
        "KV transfer against the network",
        exposed * 1e3,
        "ms exposed",
        verdict,
        f"{c.kv_bytes / 1e6:,.1f} MB per prompt: {c.transfer_s * 1e3:.1f} ms whole vs {c.prefill_s * 1e3:.1f} ms "
        f"prefill, {exposed * 1e3:.1f} ms left after prefill ({share:.0%} of the {wl.ttft_slo_s * 1e3:.0f} ms "
        f"TTFT objective); {why}",
    )


def check_prefix_reuse(wl: Workload) -> Check:
    r = wl.prefix_reuse
    if r >= HIGH_REUSE:
        verdict: Verdict = "against"
        why = "most of each prompt is cached where it will be decoded; the rest is short to prefill locally"
    elif r <= LOW_REUSE:
        verdict, why = "for", "prompts are mostly new, so every one needs a full prefill somewhere"
    else:
        verdict, why = "neutral", "some reuse: route by prefix overlap either way"
    reason = f"{r:.0%} of prompt tokens cached; {why}"
    return Check("prefix_reuse", "prefix-cache hit rate", r, "share", verdict, reason)


def best_split(replicas: int, prefill_share: float) -> tuple[int, float]:
    """The number of prefill replicas (1 .. replicas-1) that serves the most requests/s when a
    request takes `prefill_share` of its replica-time in prefill, and the share of the budget
    that split leaves idle (0: the pools are balanced exactly)."""
    best, served = 1, 0.0
    for p in range(1, replicas):
        rate = min(p / prefill_share, (replicas - p) / (1 - prefill_share))
        if rate > served:
            best, served = p, rate
    return best, 1 - served / replicas


def check_gpu_count(dep: Deployment, c: RequestCosts) -> Check:
    n = dep.replicas
    if n < 2:
        reason = f"{dep.gpus} GPUs at TP {dep.tp}: one replica, no split"
        return Check("gpu_count", "GPU count", n, "replicas", "against", reason)
    p, idle = best_split(n, 1 - c.decode_share)
    if n < FEW_REPLICAS or idle > STRANDED_COSTLY:
        verdict: Verdict = "against"
        why = "too few to split: the pool that finishes first waits on the other"
    elif n >= MANY_REPLICAS and idle <= STRANDED_OK:
        verdict, why = "for", "enough replicas to size each pool to its load"
    else:
        verdict, why = "neutral", "a split is possible but coarse"
    return Check(
        "gpu_count",
        "GPU count",
        n,
        "replicas",
        verdict,
        f"{dep.gpus} GPUs at TP {dep.tp} = {n} replicas; best split {p}P:{n - p}D leaves {idle:.0%} idle; {why}",
    )


def check_network(dep: Deployment) -> Check:
    net = dep.network
    kind = "RDMA" if net.rdma else "TCP"
    if net.rdma and net.gbps >= FAST_LINK_GBPS:
        verdict: Verdict = "for"
        why = "RDMA writes the KV straight into the decode GPU"
    elif net.gbps < SLOW_LINK_GBPS or (not net.rdma and net.gbps < FAST_LINK_GBPS):
        verdict = "against"
        why = "a slow link, or TCP through the host, copies every KV byte twice and shares the CPU"
    else:
        verdict, why = "neutral", "usable, not fast"
    return Check(
        "network",
        "network",
        net.gbps,
        "Gb/s",
        verdict,
        f"{net.gbps:.0f} Gb/s {kind}, {net.efficiency:.0%} of line rate assumed "
        f"({net.gbps * net.efficiency:.0f} Gb/s), {net.latency_s * 1e6:.0f} us per message; {why}",
    )


def five_checks(dep: Deployment, wl: Workload, c: RequestCosts) -> list[Check]:
    return [
        check_decode_share(c),
        check_transfer(c, wl),
        check_prefix_reuse(wl),
        check_gpu_count(dep, c),
        check_network(dep),
    ]


def prefill_queue_wait_s(rate: float, prefill_s: float, prefill_replicas: int) -> float:
    """Mean wait at the prefill pool, as an M/D/1 queue per replica: rho / (2 (1 - rho)) x service."""
    rho = rate * prefill_s / prefill_replicas
    return math.inf if rho >= 1 else rho / (2 * (1 - rho)) * prefill_s


def local_prefill_threshold(dep: Deployment, wl: Workload, c: RequestCosts, queue_wait_s: float) -> int:
    """The longest uncached prompt to prefill on the decode worker. Local prefill rides along in a
    decode step (whose weights that step reads anyway), so it costs the prompt's compute, and it
    must fit in the step's slack under the TPOT objective; remote prefill costs the extra hops,
    the queue at the prefill pool and the KV left to send after prefill. Local wins while it is
    both cheaper and within the slack. 0: no prompt is worth prefilling locally."""
    slack = wl.tpot_slo_s - c.decode_step_s

    def local_wins(n: int) -> bool:
        local = dep.prefill_compute_s(n)
        exposed = dep.exposed_transfer_s(n)
        return local <= slack and local <= exposed + queue_wait_s + CONTROL_RPC_S

    if not local_wins(1):
        return 0
    lo, hi = 1, 2  # local wins at lo; find where it stops, then bisect
    while local_wins(hi):
        if hi >= LONGEST_PROMPT:
            return LONGEST_PROMPT
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if local_wins(mid) else (lo, mid)
    return lo


class Recommendation(NamedTuple):
    disaggregate: bool
    prefill_replicas: int  # 0 when colocated
    decode_replicas: int  # every replica when colocated
    capacity_rps: float  # requests/s the budget serves in the recommended mode (roofline)
    colocated_rps: float  # requests/s the budget serves colocated, for comparison
    local_prefill_max_tokens: int | None  # the router's --local-prefill-max-tokens; None: colocated, all local
    reasons: list[str]


def recommend(dep: Deployment, wl: Workload, c: RequestCosts, checks: list[Check]) -> Recommendation:
    n = dep.replicas
    per_request = c.prefill_s + c.decode_s
    colocated = n / per_request
    fors = [ch.name for ch in checks if ch.verdict == "for"]
    againsts = [ch.name for ch in checks if ch.verdict == "against"]
    vetoed = {ch.key for ch in checks if ch.key in VETOES and ch.verdict == "against"}
    reasons = [f"for: {', '.join(fors) or 'none'}; against: {', '.join(againsts) or 'none'}"]
    yes = n >= 2 and len(fors) > len(againsts) and not vetoed
    if not yes:
        if "transfer" in vetoed:
            reasons.append("the KV transfer would add to every TTFT: keep prefill where the KV is used")
        if "prefix_reuse" in vetoed:
            reasons.append("most of each prompt is already cached on a decode worker: prefill the rest there")
        reasons.append(f"colocated, {n} replicas serve about {colocated:.1f} requests/s")
        if wl.rate > colocated:
            reasons.append(f"the rate {wl.rate:g}/s needs about {math.ceil(wl.rate * per_request) * dep.tp} GPUs")
        return Recommendation(False, 0, n, colocated, colocated, None, reasons)
    p, idle = best_split(n, 1 - c.decode_share)
    d = n - p
    served = min(p / c.prefill_s, d / c.decode_s)
    reasons.append(
        f"{p} prefill x TP {dep.tp} = {p * dep.tp} GPUs and {d} decode x TP {dep.tp} = {d * dep.tp} GPUs balance "
        f"{c.prefill_s * 1e3:.1f} ms of prefill against {c.decode_s * 1e3:.1f} ms of decode per request "
        f"({idle:.0%} left idle by rounding): about {served:.1f} requests/s"
    )
    reasons.append(
        f"disaggregation buys TPOT free of prefill stalls, not throughput: colocated the same GPUs serve "
        f"about {colocated:.1f} requests/s by the same roofline"
    )
    if wl.rate > served:
        reasons.append(
            f"the rate {wl.rate:g}/s is more than this budget serves: "
            f"about {math.ceil(wl.rate * c.prefill_s) + math.ceil(wl.rate * c.decode_s)} replicas needed"
        )
    threshold = local_prefill_threshold(dep, wl, c, prefill_queue_wait_s(wl.rate, c.prefill_s, p))
    if threshold == 0:
        reasons.append("no prompt fits the decode step's slack under the TPOT objective: prefill every prompt remotely")
    elif threshold >= LONGEST_PROMPT:
        reasons.append("the prefill pool is saturated at this rate: prefill locally until it is grown")
    else:
        reasons.append(
            f"prompts of at most {threshold} uncached tokens cost less to prefill on the decode worker than "
            "to queue, prefill remotely and send (router flag --local-prefill-max-tokens)"
        )
    return Recommendation(True, p, d, served, colocated, threshold, reasons)


@dataclass(frozen=True)
class Plan:
    """Everything `splitserve plan` answers for one deployment and workload."""

    deployment: Deployment
    workload: Workload
    costs: RequestCosts
    checks: list[Check]
    recommendation: Recommendation


def decide(dep: Deployment, wl: Workload) -> Plan:
    costs = request_costs(dep, wl)
    checks = five_checks(dep, wl, costs)
    return Plan(dep, wl, costs, checks, recommend(dep, wl, costs, checks))
