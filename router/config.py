"""The router's one frozen configuration: routing weights, the local-or-remote
prefill threshold, request limits, deadlines of every internal call, ports.

Validated once in `__post_init__`, never mutated; pass it to whatever needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MODES = ("auto", "disaggregated", "colocated")
DECODE_POLICIES = ("kv_aware", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    # --- the model, as far as the router needs it
    block_size: int = 16  # tokens per KV block; must equal every worker's
    max_model_len: int = 8192  # prompt + generated tokens

    # --- routing: cost = load_weight * load_score - overlap_weight * overlap_score
    decode_policy: str = "kv_aware"  # "round_robin": the baseline that ignores caches and load
    overlap_weight: float = 1.0
    load_weight: float = 1.0
    # load_score's parts: tokens of work over this scale, plus the used-block fraction
    load_token_scale: float = 16384.0
    token_load_weight: float = 1.0
    block_load_weight: float = 1.0
    # 0: always the cheapest worker (ties broken by the RNG); > 0: softmax over -cost/T
    temperature: float = 0.0

    # --- local or remote prefill (per request, mode "auto")
    mode: str = "auto"  # "auto" | "disaggregated" (always remote) | "colocated" (always local)
    local_prefill_max_tokens: int = 256  # uncached suffix this short (or shorter): prefill locally
    prefill_backlog_tokens: int = 8192  # prefill pool this backed up ...
    decode_idle_tokens: int = 0  # ... while the decode worker has at most this much work: local

    # --- client request limits
    max_prompt_tokens: int = 7936
    max_prompt_chars: int = 262144  # checked before tokenizing, so tokenizing stays cheap
    max_tokens_cap: int = 4096
    default_max_tokens: int = 256
    max_stop_strings: int = 8
    max_stop_string_chars: int = 64
    max_stop_token_ids: int = 32
    max_chat_messages: int = 256
    allow_logprobs: bool = True
    max_request_id_chars: int = 128

    # --- overload
    max_inflight: int = 1024  # requests in flight at once; beyond: RESOURCE_EXHAUSTED at once

    # --- deadlines of internal calls, seconds. Sized for CPU workers, where one engine step with a
    # 512-token chunk takes seconds and an 8K-token prefill minutes: a deadline that fires on a
    # healthy worker marks it failed and redoes the work elsewhere, doubling the cost.
    admit_timeout_s: float = 30.0  # Decode call to its first event
    token_timeout_s: float = 300.0  # between two Decode events (a stalled worker is treated as dead)
    prefill_timeout_s: float = 300.0  # one Prefill call
    request_timeout_s: float = 600.0  # a whole Decode call (and the longest a client stream lives)
    lease_ms: int = 300_000  # asked of the decode worker for REMOTE reservations
    cancel_timeout_s: float = 1.0
    stats_timeout_s: float = 1.0
    stats_interval_s: float = 0.5
    block_events_timeout_s: float = 3600.0  # a subscription is re-opened after this (fresh snapshot)
    reconnect_backoff_s: float = 0.5
    unhealthy_after_failures: int = 2  # stats polls failed in a row

    # --- retries
    max_migrations: int = 2  # decode workers a request may move to after the first dies
    max_prefill_attempts: int = 2  # prefill workers tried for one reservation
    # a request that failed on this many workers for an unclear reason (INTERNAL, an aborted finish)
    # is not tried on another: one poisonous request must not walk through the whole pool
    max_request_faults: int = 2

    # --- ports and auth
    host: str = "0.0.0.0"
    grpc_port: int = 50051
    metrics_port: int = 0  # 0: no HTTP metrics endpoint
    http_port: int | None = None  # the OpenAI-compatible HTTP front door; None: off, 0: any free port
    model_name: str = "splitserve"  # what /v1/models reports
    api_key: str | None = None  # clients send "authorization: Bearer <key>"
    cluster_token: str | None = None  # sent to workers as "x-splitserve-token"

    def __post_init__(self) -> None:
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"RouterConfig.decode_policy must be one of {DECODE_POLICIES}, got {self.decode_policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"RouterConfig.mode must be one of {MODES}, got {self.mode!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"RouterConfig.{f.name} must be finite, got {v!r}")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"RouterConfig.{f.name} must be >= 0, got {v!r}")
        for name in ("block_size", "max_model_len", "max_prompt_tokens", "max_tokens_cap",
                     "default_max_tokens", "max_inflight", "load_token_scale", "max_request_faults"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be positive")
        if self.max_prompt_tokens >= self.max_model_len:
            raise ValueError("RouterConfig.max_prompt_tokens must be below max_model_len")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("RouterConfig.default_max_tokens must not exceed max_tokens_cap")

    @property
    def auth_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata the router attaches to every worker call."""
        return (("x-splitserve-token", self.cluster_token),) if self.cluster_token else ()
