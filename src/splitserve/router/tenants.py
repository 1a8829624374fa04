"""Who is asking: the API keys a router accepts, each the key of a named tenant with its own
limits, share and priority.

The tenant is found from the key alone. Nothing a client writes in a request (a header, the
`user` field) can name another tenant, so no client can spend another's limits or take its share.

A tenants file is TOML, one table per tenant:

    [tenants.search]
    keys = ["sk-search-1", "sk-search-2"]   # several, so a key can be rotated without a gap
    max_concurrent = 32          # requests in flight at once (default: no limit of its own)
    tokens_per_minute = 400000   # prompt and generated tokens (default: no limit)
    weight = 2                   # its share of the router's seats against the others' (default 1)
    priority = "high"            # "high", "normal" (default) or "low": the highest band it may use

`--api-key` alone is one tenant, "default", with no limits of its own.
"""

from __future__ import annotations

import hmac
import tomllib
from dataclasses import dataclass, field

PRIORITIES = ("high", "normal", "low")  # band 0 is served first
# a request may ask, in this header or gRPC metadata key, for a lower band than its key's, never a higher
PRIORITY_KEY = "x-splitserve-priority"
_FIELDS = {"keys", "max_concurrent", "tokens_per_minute", "weight", "priority"}
ANONYMOUS = "anonymous"  # the one tenant of a router without keys


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = field(default=(), repr=False)  # never logged
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0
    priority: str = "normal"

    def __post_init__(self) -> None:
        if not self.name or not self.name.isprintable() or len(self.name) > 64:
            raise ValueError(f"tenant name {self.name[:64]!r}: must be 1 to 64 printable characters")
        for what in ("max_concurrent", "tokens_per_minute"):
            value = getattr(self, what)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"tenant {self.name!r}: {what} must be a positive integer, got {value!r}")
        if not isinstance(self.weight, int | float) or not 0.01 <= self.weight <= 1000:
            raise ValueError(f"tenant {self.name!r}: weight must be a number in [0.01, 1000], got {self.weight!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"tenant {self.name!r}: priority must be one of {PRIORITIES}, got {self.priority!r}")

    @property
    def band(self) -> int:
        """Its priority as a band index: 0 (high) is served first."""
        return PRIORITIES.index(self.priority)


def priority_band(tenant: Tenant, asked: str | None) -> int:
    """The band a request runs in: its key's, or a lower one it asks for by name (ValueError
    for a name that is not a band)."""
    if not asked:
        return tenant.band
    if asked not in PRIORITIES:
        raise ValueError(f"{PRIORITY_KEY}: must be one of {PRIORITIES}, got {asked[:16]!r}")
    return max(tenant.band, PRIORITIES.index(asked))


def parse_tenants(text: str) -> tuple[Tenant, ...]:
    """The tenants of a tenants file's text; ValueError naming the tenant and field that are wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML: {e}") from None
    unknown = set(doc) - {"tenants"}
    if unknown:
        raise ValueError(f"unknown top-level key(s) {sorted(unknown)}: tenants go under [tenants.NAME]")
    tables = doc.get("tenants", {})
    if not tables:
        raise ValueError("no tenants: add a [tenants.NAME] table with keys = [...]")
    tenants = []
    seen: dict[str, str] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"tenants.{name}: must be a table")
        extra = set(table) - _FIELDS
        if extra:
            raise ValueError(f"tenants.{name}: unknown field(s) {sorted(extra)}")
        keys = table.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"tenants.{name}.keys: must be a non-empty list of non-empty strings")
        for k in keys:
            if k in seen:
                raise ValueError(f"tenants.{name}.keys: a key of tenant {seen[k]!r} too; each key names one tenant")
            seen[k] = name
        tenants.append(Tenant(name, tuple(keys), **{k: v for k, v in table.items() if k != "keys"}))
    return tuple(tenants)


def load_tenants(path: str) -> tuple[Tenant, ...]:
    """The tenants file at `path`; ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    try:
        return parse_tenants(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


class KeyRing:
    """The tenant a bearer token names. Every key is compared, in constant time, whatever matches
    first: neither which key matched nor how much of one did shows in the time taken."""

    def __init__(self, tenants: tuple[Tenant, ...]) -> None:
        self.tenants = tenants
        self._keys = [(f"Bearer {k}".encode(), t) for t in tenants for k in t.keys]
        self.anonymous = Tenant(ANONYMOUS) if not self._keys else None

    @property
    def required(self) -> bool:
        return self.anonymous is None

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key `authorization` ("Bearer <key>") carries; the anonymous tenant when
        no keys are set; None when it carries no known key."""
        if self.anonymous is not None:
            return self.anonymous
        sent = (authorization or "").encode()
        found = None
        for bearer, t in self._keys:
            if hmac.compare_digest(sent, bearer) and found is None:
                found = t
        return found
