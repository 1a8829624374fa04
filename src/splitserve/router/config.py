"""The router's frozen configuration, one section per concern:

- `RoutingConfig`: the routing policy's numbers (block size, decode-worker cost
  weights, the local-or-remote prefill thresholds);
- `Limits`: what one client request may ask for, and how many may be in flight;
- `Deadlines`: every internal wait, in seconds (and the reservation lease);
- `Retries`: how far a failing request, or a failing worker, is given another try;
- `Listeners`: where the router listens and the credentials on both sides of it;

and `RouterConfig`, the whole process's, which holds the sections and the pools
readiness waits for. Each section is validated once in its own `__post_init__`,
never mutated; pass a function the section (or the numbers) it uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal, get_args

from splitserve.engine.tuned import PREFILL_BACKLOG_TOKENS
from splitserve.router.tenants import Tenant
from splitserve.runtime.tls import ClusterTLS, TLSFiles

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Mode = Literal["auto", "disaggregated", "colocated"]
DecodePolicy = Literal["kv_aware", "round_robin"]
MODES: tuple[Mode, ...] = get_args(Mode)
DECODE_POLICIES: tuple[DecodePolicy, ...] = get_args(DecodePolicy)


def _check_numbers(section: DataclassInstance, positive: tuple[str, ...] = ()) -> None:
    """Every number of a config section finite and >= 0; the ones named in `positive` > 0."""
    name = type(section).__name__
    for f in fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name}.{f.name} must be finite, got {v!r}")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ValueError(f"{name}.{f.name} must be >= 0, got {v!r}")
    for p in positive:
        if getattr(section, p) <= 0:
            raise ValueError(f"{name}.{p} must be positive")


@dataclass(frozen=True)
class RoutingConfig:
    """Which decode worker, and local or remote prefill for it. Every cost is in tokens:

        cost(w) = prefill_weight * uncached prefill tokens(w) + queued and running tokens(w)
                  + KV shortfall tokens(w)

    (the terms are in router/policy.py)."""

    block_size: int = 16  # tokens per KV block; must equal every worker's
    decode_policy: DecodePolicy = "kv_aware"  # "round_robin": the baseline that ignores caches and load
    # What one token the worker must prefill costs, in tokens of work it already has (queued or
    # running): higher favours prefix-cache hits (TTFT), lower spreading the load (ITL). Not Dynamo's 1
    # because the load the router sees lags: tokens routed to a worker stay counted until its next
    # stats poll, however soon the request finished, and a cache hit must outweigh that phantom
    # load (at 1, a short prompt's 48 cached tokens lost to the 59 of the request that cached them).
    prefill_weight: float = 4.0
    # Price a worker's tier blocks (host RAM, disk behind its prefix cache) by their load seconds at its
    # measured speeds; False: count them as uncached, the tier-blind baseline
    tier_aware: bool = True
    # 0: always the cheapest worker (ties broken by the RNG); > 0: softmax over -cost/T, T in tokens
    temperature: float = 0.0

    # --- local or remote prefill (per request, mode "auto")
    mode: Mode = "auto"  # "auto" | "disaggregated" (always remote) | "colocated" (always local)
    local_prefill_max_tokens: int = 256  # uncached suffix this short (or shorter): prefill locally
    # Or local when the prefill pool is backed up: its least-queued worker has at least this many
    # prompt tokens to prefill before it could start this one, and the decode worker would finish
    # this prompt (after its own queued prefill) no later than that. Tokens, not seconds: both sides
    # prefill at about the same rate on one kind of hardware, so the comparison needs no clock.
    # Size it to the TTFT you would give up waiting for. 700 is what the peer sweeps found best on
    # a 2-core CPU (issue 10); the commands and this default both read engine/tuned.py's
    prefill_backlog_tokens: int = PREFILL_BACKLOG_TOKENS
    # ...and only while the TTFT that saves (in prefill tokens) is at least this weight times the stall
    # it puts on the decode worker's running streams (the prompt's tokens times the streams): 1 holds
    # a stream's stalled second as dear as the new request's waited one; 0 ignores the streams.
    decode_stall_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"RoutingConfig.decode_policy must be one of {DECODE_POLICIES}, got {self.decode_policy!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"RoutingConfig.mode must be one of {MODES}, got {self.mode!r}")
        _check_numbers(self, positive=("block_size",))


@dataclass(frozen=True)
class Limits:
    """What one client request may ask for (checked by router/validation.py before anything runs),
    and how many requests may be in flight at once."""

    max_model_len: int = 8192  # prompt + generated tokens
    max_prompt_tokens: int = 7936
    max_prompt_chars: int = 262144  # checked before tokenizing, so tokenizing stays cheap
    max_tokens_cap: int = 4096
    default_max_tokens: int = 256
    max_stop_strings: int = 8
    max_stop_string_chars: int = 64
    max_stop_token_ids: int = 32
    max_chat_messages: int = 256
    allow_logprobs: bool = True
    # samples of one request (sampling.n): each holds a decode slot and its own blocks past the shared
    # prompt, so one request must not take a worker's whole batch
    max_n: int = 16
    max_request_id_chars: int = 128
    max_inflight: int = 1024  # requests in flight at once, waiting for a seat or running; beyond: refused at once
    # requests running on the workers at once; beyond, they wait in the router for a seat, in the
    # tenants' fair order (router/seats.py). None: every admitted request runs at once
    max_running: int | None = None

    def __post_init__(self) -> None:
        _check_numbers(
            self,
            positive=(
                "max_model_len",
                "max_prompt_tokens",
                "max_tokens_cap",
                "default_max_tokens",
                "max_inflight",
                "max_n",
            ),
        )
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"Limits.max_running must be >= 1 (or None), got {self.max_running}")
        if self.max_prompt_tokens >= self.max_model_len:
            raise ValueError("Limits.max_prompt_tokens must be below max_model_len")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("Limits.default_max_tokens must not exceed max_tokens_cap")


@dataclass(frozen=True)
class Deadlines:
    """Every internal wait, in seconds. Sized for CPU workers, where one engine step with a 512-token
    chunk takes seconds and an 8K-token prefill minutes: a deadline that fires on a healthy worker
    marks it failed and redoes the work elsewhere, doubling the cost."""

    admit_timeout_s: float = 30.0  # Decode call to its first event
    token_timeout_s: float = 300.0  # between two Decode events (a stalled worker is treated as dead)
    prefill_timeout_s: float = 300.0  # one Prefill call
    request_timeout_s: float = 600.0  # a whole Decode call (and the longest a client stream lives)
    lease_ms: int = 300_000  # asked of the decode worker for REMOTE reservations
    stats_timeout_s: float = 1.0  # one GetStats poll
    stats_interval_s: float = 0.5  # between two GetStats polls of a worker
    # ... of a draining worker: the first at once, then this often, so that an idle worker is known
    # drained (two idle polls) in a fraction of a second: a role switch and a scale-down wait for it
    drain_poll_interval_s: float = 0.1
    block_events_timeout_s: float = 3600.0  # a subscription is re-opened after this (fresh snapshot)
    reconnect_backoff_s: float = 0.5  # before re-opening a BlockEvents subscription that ended
    # With no decode worker healthy at all (the last one died, the pool is starting), a request waits
    # for one and goes on there: while the pool manager says one is starting (WorkerSet.expect: a
    # replacement may load for a minute or more on a CPU), up to the request's own deadline; while
    # none is coming, this long (a worker run by hand may come back).
    no_decode_wait_s: float = 60.0

    def __post_init__(self) -> None:
        _check_numbers(self)


@dataclass(frozen=True)
class Retries:
    """How far a failure is given another try: a request on other workers, a worker in routing."""

    max_migrations: int = 2  # decode workers a request may move to after the first dies
    max_prefill_attempts: int = 2  # prefill workers tried for one reservation
    # a request that failed on this many workers for an unclear reason (INTERNAL, an aborted finish)
    # is not tried on another: one poisonous request must not walk through the whole pool
    max_request_faults: int = 2
    unhealthy_after_failures: int = 2  # stats polls failed in a row before a worker leaves routing

    def __post_init__(self) -> None:
        _check_numbers(self, positive=("max_request_faults",))


@dataclass(frozen=True)
class Listeners:
    """Where the router listens, and the credentials on both sides of it: the key clients send,
    the token the router sends to its workers."""

    host: str = "127.0.0.1"  # loopback: another machine reaches the router only when --host says so
    grpc_port: int = 50051
    metrics_port: int = 0  # 0: no HTTP metrics endpoint
    http_port: int | None = None  # the OpenAI-compatible HTTP front door; None: off, 0: any free port
    # router processes sharing these ports (router/replicas.py): more than one binds them with
    # SO_REUSEPORT, so the kernel spreads new connections over the processes; one binds them alone, so a
    # second router started by mistake on the same port fails to start instead of taking half its clients
    replicas: int = 1
    model_name: str = "splitserve"  # what /v1/models reports
    api_key: str | None = None  # clients send "authorization: Bearer <key>"
    # /metrics (on the HTTP port and --metrics-port) answers this key too, with no tenant's rights;
    # "" opens /metrics to anyone who reaches the port (a scraper on a private network)
    metrics_key: str | None = None
    cluster_token: str | None = None  # sent to workers as "x-splitserve-token"
    tls: TLSFiles | None = None  # both doors over TLS (HTTPS, gRPC over TLS); mutual with tls.ca_certs
    internal_tls: ClusterTLS | None = None  # the calls to the workers under the cluster's mutual TLS

    def __post_init__(self) -> None:
        _check_numbers(self, positive=("replicas",))

    @property
    def auth_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata the router attaches to every worker call."""
        return (("x-splitserve-token", self.cluster_token),) if self.cluster_token else ()


@dataclass(frozen=True)
class RouterConfig:
    """The router process's configuration: a section per concern (read as cfg.limits.max_inflight,
    cfg.deadlines.admit_timeout_s, ...), and the pools readiness waits for."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    limits: Limits = field(default_factory=Limits)
    deadlines: Deadlines = field(default_factory=Deadlines)
    retries: Retries = field(default_factory=Retries)
    listeners: Listeners = field(default_factory=Listeners)
    # the API keys and what each may do (router/tenants.py); listeners.api_key is one more, "default"
    tenants: tuple[Tenant, ...] = ()
    # readiness: health is NOT_SERVING until each of these pools has a ready worker
    required_pools: tuple[str, ...] = ("decode",)

    def all_tenants(self) -> tuple[Tenant, ...]:
        """The tenants file's and --api-key's, together."""
        key = self.listeners.api_key
        return self.tenants + ((Tenant("default", (key,)),) if key else ())

    def __post_init__(self) -> None:
        names = [t.name for t in self.all_tenants()]
        if len(set(names)) != len(names):
            raise ValueError(f"RouterConfig.tenants: a name given twice in {names} (--api-key is tenant 'default')")
        if not set(self.required_pools) <= {"decode", "prefill"}:
            raise ValueError(f"RouterConfig.required_pools must name decode and/or prefill, got {self.required_pools}")
