"""Each tenant's own limits (router/tenants.py): requests in flight at once, and tokens a minute.

Tokens are counted as a token bucket that holds a minute's worth and refills continuously. A
request takes its prompt plus its max_tokens when admitted, and gets back what it did not
generate when it ends. So the bucket only ever rises between two admissions of the tenant, and
the Retry-After of a refusal is honest: a retry after it is admitted unless the same tenant
spent the tokens meanwhile.

Pure: the clock is passed in, nothing here waits or knows about gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.router.tenants import Tenant


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request is not admitted now; `retry_after_s` None: never as it is."""

    message: str
    retry_after_s: float | None


@dataclass
class _Account:
    inflight: int
    level: float  # tokens in the bucket at `stamp`
    stamp: float


class TenantLimits:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._accounts: dict[str, _Account] = {}

    def _account(self, tenant: Tenant) -> _Account:
        now = self.clock()
        a = self._accounts.get(tenant.name)
        if a is None:
            a = self._accounts[tenant.name] = _Account(0, float(tenant.tokens_per_minute or 0), now)
        if tenant.tokens_per_minute is not None:
            a.level = min(float(tenant.tokens_per_minute), a.level + (now - a.stamp) * tenant.tokens_per_minute / 60.0)
        a.stamp = now
        return a

    def admit(self, tenant: Tenant, tokens: int) -> Refusal | None:
        """Take a seat and `tokens` (prompt + max_tokens) for the tenant, or say why not."""
        a = self._account(tenant)
        if tenant.max_concurrent is not None and a.inflight >= tenant.max_concurrent:
            return Refusal(f"tenant {tenant.name!r} has its limit of {tenant.max_concurrent} requests in flight", 1.0)
        tpm = tenant.tokens_per_minute
        if tpm is not None:
            if tokens > tpm:
                return Refusal(
                    f"the request's prompt plus max_tokens ({tokens} tokens) exceed tenant {tenant.name!r}'s "
                    f"tokens_per_minute of {tpm}: lower max_tokens or shorten the prompt",
                    None,
                )
            if a.level < tokens:
                wait = (tokens - a.level) * 60.0 / tpm
                return Refusal(f"tenant {tenant.name!r} is over its {tpm} tokens per minute", math.ceil(wait))
            a.level -= tokens
        a.inflight += 1
        return None

    def release(self, tenant: Tenant, unused_tokens: int) -> None:
        """The request ended: its seat back, and the tokens it took but did not generate."""
        a = self._account(tenant)
        a.inflight -= 1
        if tenant.tokens_per_minute is not None:
            a.level = min(float(tenant.tokens_per_minute), a.level + max(unused_tokens, 0))

    def inflight(self, tenant: Tenant) -> int:
        a = self._accounts.get(tenant.name)
        return a.inflight if a is not None else 0
