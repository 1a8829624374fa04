"""One frozen config per worker process."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.config import EngineConfig
from splitserve.kv_transfer.reservation import TRANSPORT_NAMES, TransportName

ROLES = ("prefill", "decode")
TRANSPORTS: tuple[TransportName, ...] = TRANSPORT_NAMES


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    worker_id: str = "worker-0"
    model: str | None = None  # GGUF file or HF directory; None: the embedded SmolLM2
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # the address others reach this worker at ("auto" under Ray: the node's IP)
    grpc_port: int = 0  # 0: any free port
    kv_port: int = 0  # decode role: the kv_transfer receiver's port
    kv_transport: TransportName = "tcp"
    cluster_token: str | None = None  # required in "x-splitserve-token" when set
    lease_ms: int = 300_000  # default lease of a REMOTE reservation (the router normally sends its own)
    admit_timeout_s: float = 30.0  # an engine call from a gRPC handler (waits for the current step)
    request_timeout_s: float = 600.0  # the longest one Decode stream may live
    prefill_timeout_s: float = 300.0  # a Prefill call, KV confirmed included
    max_concurrent_rpcs: int = 512  # beyond: RESOURCE_EXHAUSTED from gRPC itself
    # Requests admitted but not yet running (waiting for a seat or blocks) beyond which new ones are
    # refused at once (RESOURCE_EXHAUSTED, the router tries another worker or answers 429): a deep
    # queue only turns overload into missed deadlines. 0: twice the engine's max_num_seqs.
    max_waiting_requests: int = 0
    warm_up: bool = True  # one short request through the engine before listening (workers/common/warm_up.py)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces go here (tracing.py); None: off
    threads: int = 0  # torch intra-op threads; 0: torch's default

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        for f in ("grpc_port", "kv_port"):
            if not 0 <= getattr(self, f) < 65536:
                raise ValueError(f"{f} must be a port number")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0 (0: twice max_num_seqs)")
        if self.lease_ms <= 0 or self.admit_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("lease_ms and timeouts must be positive")

    @property
    def waiting_limit(self) -> int:
        """Requests that may wait for a seat at once (max_waiting_requests, or its default)."""
        return self.max_waiting_requests or 2 * self.engine.max_num_seqs
