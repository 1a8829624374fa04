"""The tenants' pure parts: the tenants file, the key ring, each tenant's limits on a clock of the
test's own, and the fair order of the seats (deficit round robin by token cost), played out on a
simulated router with one tenant sending ten times the others' tokens."""

from __future__ import annotations

import heapq
import random

import pytest

from splitserve.engine.prefill_order import RecentTokens
from splitserve.router.fair_share import FairShare, may_sit
from splitserve.router.seats import RECENT_S
from splitserve.router.tenant_limits import TenantLimits
from splitserve.router.tenants import KeyRing, Tenant, parse_tenants, priority_band

FILE = """
[tenants.search]
keys = ["sk-s1", "sk-s2"]
max_concurrent = 4
tokens_per_minute = 6000
weight = 2
priority = "high"

[tenants.batch]
keys = ["sk-b"]
priority = "low"
"""


def test_a_tenants_file_names_each_tenant_with_its_keys_and_limits() -> None:
    search, batch = parse_tenants(FILE)
    assert search == Tenant("search", ("sk-s1", "sk-s2"), 4, 6000, 2.0, "high")
    assert batch == Tenant("batch", ("sk-b",), priority="low")
    assert "sk-s1" not in repr(search)  # keys never reach a log line


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[tenants.a]\nkeys = []\n", "tenants.a.keys: must be a non-empty list"),
        ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]\n', "tenants.b.keys: a key of tenant 'a' too"),
        ('[tenants.a]\nkeys = ["k"]\nmax_concurent = 3\n', "tenants.a: unknown field(s) ['max_concurent']"),
        ('[tenants.a]\nkeys = ["k"]\ntokens_per_minute = 0\n', "tokens_per_minute must be a positive integer"),
        ('[tenants.a]\nkeys = ["k"]\npriority = "urgent"\n', "priority must be one of"),
        ('[tenants.a]\nkeys = ["k"]\nweight = 0\n', "weight must be a number in [0.01, 1000]"),
        ('[tenant.a]\nkeys = ["k"]\n', "unknown top-level key(s) ['tenant']"),
        ("keys = [", "not valid TOML"),
        ("", "no tenants"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_tenants(text)
    assert error in str(e.value)


def test_the_key_ring_finds_the_tenant_of_every_key_and_nobody_for_others() -> None:
    search, batch = parse_tenants(FILE)
    ring = KeyRing((search, batch))
    assert ring.required
    assert ring.tenant("Bearer sk-s2") is search and ring.tenant("Bearer sk-b") is batch
    for wrong in (None, "", "sk-s1", "Bearer sk-s", "Bearer sk-s1 ", "bearer sk-s1"):
        assert ring.tenant(wrong) is None, wrong
    open_ring = KeyRing(())
    assert not open_ring.required and open_ring.tenant(None) is open_ring.anonymous


def test_a_request_may_lower_its_band_but_never_raise_it() -> None:
    normal = Tenant("t", ("k",))
    assert [priority_band(normal, p) for p in (None, "", "high", "normal", "low")] == [1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="x-splitserve-priority"):
        priority_band(normal, "urgent")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tokens_per_minute_refill_and_the_retry_after_is_when_the_request_fits() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    t = Tenant("t", ("k",), tokens_per_minute=600)  # 10 a second
    assert limits.admit(t, 400) is None
    refusal = limits.admit(t, 300)  # 200 left
    assert refusal is not None and refusal.retry_after_s == 10  # (300 - 200) / 10 a second
    clock.now = 9.9
    assert limits.admit(t, 300) is not None
    clock.now = 10.0
    assert limits.admit(t, 300) is None
    limits.release(t, unused_tokens=250)  # ended early: most of it back
    limits.release(t, unused_tokens=0)
    assert limits.inflight(t) == 0
    too_big = limits.admit(t, 601)
    assert too_big is not None and too_big.retry_after_s is None and "tokens_per_minute of 600" in too_big.message


def test_the_bucket_holds_at_most_a_minute() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    t = Tenant("t", ("k",), tokens_per_minute=600)
    clock.now = 3600.0  # an idle hour banks one minute, no more
    assert limits.admit(t, 600) is None
    assert limits.admit(t, 1) is not None


def test_concurrency_is_per_tenant() -> None:
    limits = TenantLimits(Clock())
    a, b = Tenant("a", ("ka",), max_concurrent=1), Tenant("b", ("kb",), max_concurrent=1)
    assert limits.admit(a, 10) is None and limits.admit(b, 10) is None
    refusal = limits.admit(a, 10)
    assert refusal is not None and "limit of 1 requests in flight" in refusal.message
    limits.release(a, 0)
    assert limits.admit(a, 10) is None


def test_drr_shares_tokens_by_weight_whatever_the_request_sizes() -> None:
    """Per round "big" earns 100 tokens of credit, "small" (weight 2) 200: every ten rounds one
    1,000-token request of big's and two hundred 10-token ones of small's."""
    share: FairShare[tuple[str, int]] = FairShare(quantum_tokens=100)
    for i in range(3000):
        share.push(("small", i), "small", cost=10, weight=2)
        if i < 50:
            share.push(("big", i), "big", cost=1000)
    served = {"big": 0, "small": 0}
    for _ in range(201 * 10):
        item = share.pop()
        assert item is not None
        served[item[0]] += 1000 if item[0] == "big" else 10
    assert served["small"] / served["big"] == pytest.approx(2.0, rel=0.15)


def test_a_higher_band_is_served_first_and_a_removed_request_is_gone() -> None:
    share: FairShare[str] = FairShare()
    share.push("low", "a", 10, band=2)
    share.push("normal", "a", 10, band=1)
    share.push("high", "b", 10, band=0)
    assert share.remove("normal") and not share.remove("normal")
    assert [share.pop(), share.pop(), share.pop()] == ["high", "low", None]


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


SEATS = 8
TOKENS_PER_S = 1000.0  # a seat serves a request of n tokens in n / 1,000 s
QUIET = ("q1", "q2", "q3")


def workload(noisy: bool) -> list[tuple[float, str, int]]:
    """60 s of arrivals: three quiet tenants sending a 500-token request every 0.4 s (Poisson),
    and a noisy one sending ten times their tokens (a 5,000-token request as often)."""
    rng = random.Random(7)
    arrivals = []
    for tenant, size in (("q1", 500), ("q2", 500), ("q3", 500), ("noisy", 5000)):
        t = rng.uniform(0, 0.4)
        while t < 60:
            arrivals.append((t, tenant, size))
            t += rng.expovariate(1 / 0.4)
    return sorted(a for a in arrivals if noisy or a[1] != "noisy")


def simulate(
    arrivals: list[tuple[float, str, int]], fair: bool, peak: list[int] | None = None
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The seats as router/seats.py runs them (FairShare, may_sit and RecentTokens), or in
    arrival order; each tenant's served tokens (requests started in the first 60 s) and waits for a
    seat. `peak`: given, gets the most requests that ran at once."""
    share: FairShare[tuple[float, str, int]] = FairShare()
    fifo: list[tuple[float, str, int]] = []
    running: dict[str, int] = {}
    asked = RecentTokens()
    seen: dict[str, float] = {}
    ends: list[tuple[float, str]] = []  # a heap of (when a seat frees, whose)
    served: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    pending = list(arrivals)
    now = 0.0
    while pending or ends:
        if pending and (not ends or pending[0][0] <= ends[0][0]):
            now, tenant, size = arrival = pending.pop(0)
            seen[tenant] = now
            share.push(arrival, tenant, size) if fair else fifo.append(arrival)
        else:
            now, tenant = heapq.heappop(ends)
            running[tenant] -= 1
        while True:
            recent = {t for t, when in seen.items() if now - when < RECENT_S}
            if fair:
                item = share.pop(may_sit(SEATS, running, {}, share.waiting(), recent, asked.served(now)))
            else:
                item = fifo.pop(0) if fifo and sum(running.values()) < SEATS else None
            if item is None:
                break
            t, tenant, size = item
            running[tenant] = running.get(tenant, 0) + 1
            asked.started(tenant, size, now)
            if peak is not None:
                peak[0] = max(peak[0], sum(running.values()))
            heapq.heappush(ends, (now + size / TOKENS_PER_S, tenant))
            if now < 60:
                served[tenant] = served.get(tenant, 0.0) + size
                waits.setdefault(tenant, []).append(now - t)
    return served, waits


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


def test_a_noisy_tenant_at_ten_times_the_rate_leaves_the_others_their_share_and_their_waits() -> None:
    """Eight seats, four tenants of equal weight, the noisy one asking ten times the others'
    tokens (together twice what the seats serve). In fair order each quiet tenant is served all it
    asks and the noisy one the rest (max-min fairness), and the seats stay busy. A quiet request
    does not wait for a noisy 5-second request to end but runs beside it, the limit exceeded by at
    most the seats lent; it waits only when the quiet tenants together ask for more than their
    shares at once (6 of the 8 seats; alone they had all 8), and then for about one of their own
    requests (0.5 s). In arrival order the quiet tenants wait half a minute."""
    solo_served, solo_waits = simulate(workload(noisy=False), fair=True)
    peak = [0]
    fair_served, fair_waits = simulate(workload(noisy=True), fair=True, peak=peak)
    fifo_served, fifo_waits = simulate(workload(noisy=True), fair=False)
    asked = {q: sum(size for t, tenant, size in workload(noisy=False) if tenant == q) for q in QUIET}
    for q in QUIET:
        assert fair_served[q] >= 0.95 * asked[q], (q, fair_served[q], asked[q])
        assert fifo_served[q] < 0.8 * asked[q], (q, fifo_served[q], asked[q])  # arrival order starves them
    assert jain([fair_served[q] for q in QUIET]) >= 0.9
    # the seats stay busy: the noisy tenant is lent what the quiet ones leave
    assert sum(fair_served.values()) >= 0.85 * SEATS * TOKENS_PER_S * 60
    for q in QUIET:
        assert p99(fair_waits[q]) <= 0.6, (q, p99(fair_waits[q]))  # about one quiet request: 0.5 s
        assert p99(fifo_waits[q]) > 20, (q, p99(fifo_waits[q]))
    # the noisy tenant's share is 2 seats: it is lent at most 6, and the quiet ones reclaim at most those
    assert SEATS < peak[0] <= 2 * SEATS - 2
    print(
        f"quiet tenants' p99 wait for a seat (s), at most {peak[0]} requests running on {SEATS} seats: "
        + ", ".join(
            f"{q} alone {p99(solo_waits[q]):.2f}, fair {p99(fair_waits[q]):.2f}, arrival order {p99(fifo_waits[q]):.2f}"
            for q in QUIET
        )
    )


def test_who_may_sit_free_seats_to_the_tenants_within_their_share_and_beyond_the_limit_only_them() -> None:
    """Four seats, two tenants (a share of 2 seats each); lately "noisy" asked 3,000 tokens and
    "quiet" 1,000: quiet is within its share (below the even 2,000), noisy over it."""
    asked = {"noisy": 3000.0, "quiet": 1000.0}
    # one seat free, quiet owed it (nothing waiting): noisy may not take it, quiet may
    eligible = may_sit(4, {"noisy": 3}, {}, {"noisy": 1}, {"quiet"}, asked)
    assert not eligible("noisy") and eligible("quiet")
    # two free: noisy may take one, the other stays for quiet
    assert may_sit(4, {"noisy": 2}, {}, {"noisy": 1}, {"quiet"}, asked)("noisy")
    # all four taken, noisy holding one beyond its share: quiet takes one beyond the limit
    eligible = may_sit(4, {"noisy": 3, "quiet": 1}, {}, {"noisy": 2, "quiet": 1}, set(), asked)
    assert eligible("quiet") and not eligible("noisy")
    # ... but not two: one seat lent, one already taken beyond the limit
    assert not may_sit(4, {"noisy": 3, "quiet": 2}, {}, {"quiet": 1}, set(), asked)("quiet")
    # a tenant that asked more than the even cut lately is owed nothing beyond the limit
    assert not may_sit(4, {"noisy": 3, "quiet": 1}, {}, {"quiet": 1}, set(), {"noisy": 1000.0, "quiet": 3000.0})(
        "quiet"
    )
    # weights: noisy at three times quiet's weight asked less than its cut, so quiet is over
    assert not may_sit(4, {"noisy": 3, "quiet": 1}, {"noisy": 3.0}, {"quiet": 1}, set(), asked)("quiet")
    # nothing lent: the limit holds for everyone
    assert not may_sit(4, {"noisy": 2, "quiet": 2}, {}, {"quiet": 1}, set(), asked)("quiet")
