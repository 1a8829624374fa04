"""One frozen config per worker process."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from splitserve.engine.config import EngineConfig
from splitserve.kv_transfer.codec import WIRE_CODEC_MODES, WireCodecMode
from splitserve.kv_transfer.reservation import TRANSPORT_NAMES, TransportName
from splitserve.runtime.tls import ClusterTLS

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
    # prefill role: the KV wire codec (kv_transfer/codec.py): "auto" turns int8 on per link where the cost
    # model says it pays, "raw" never, "int8" always (the decode worker accepts what it can decode)
    kv_wire_codec: WireCodecMode = "auto"
    kv_link_gbps: float = 0.0  # prefill role: the link to the decode workers, Gb/s, for that model (0: measured)
    cluster_token: str | None = None  # required in "x-splitserve-token" when set
    # mutual TLS on the control port (router -> worker) and the KV plane (prefill -> decode): every
    # peer holds a certificate of the cluster's CA (runtime/tls.py). None: both in plaintext
    internal_tls: ClusterTLS | None = None
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
    # The machine's lease file (engine/core_lease.py) shared with the other workers on it: a prefill
    # step borrows the cores none of them claims, down to `threads` when they all work. "": off.
    core_lease: str = ""
    lease_cores: int = 0  # the cores the lease shares; 0: the cores this process may run on
    # decode steps borrow idle cores too (a batch-4 SmolLM2 step: 16.9 ms on 1 thread, 12.3 on 2)
    decode_borrows: bool = False
    # Serves both roles (both services, the KV receiver and sender, one engine), so the pool manager
    # may move it between the pools without a new process (workers/common/either_role.py); its
    # engine flags stay its `role`'s.
    switchable: bool = False
    # A decode stream sends its tokens in groups of at least this many (its first event, with what is ready,
    # and its last at once): fewer, larger messages for the router to relay (SGLang's --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if self.internal_tls is not None and self.kv_transport != "tcp":
            raise ValueError(
                f"--kv-transport {self.kv_transport} carries KV outside TLS: use tcp with internal TLS, "
                "or give --insecure-internal"
            )
        if self.kv_wire_codec not in WIRE_CODEC_MODES:
            raise ValueError(f"kv_wire_codec must be one of {WIRE_CODEC_MODES}, got {self.kv_wire_codec!r}")
        if self.kv_link_gbps < 0:
            raise ValueError("kv_link_gbps must be >= 0 (0: measured)")
        for f in ("grpc_port", "kv_port"):
            if not 0 <= getattr(self, f) < 65536:
                raise ValueError(f"{f} must be a port number")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1 (1: every step's tokens at once)")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0 (0: twice max_num_seqs)")
        if self.lease_cores < 0 or self.threads < 0:
            raise ValueError("lease_cores and threads must be >= 0 (0: what this process may run on)")
        if self.lease_ms <= 0 or self.admit_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("lease_ms and timeouts must be positive")

    @property
    def waiting_limit(self) -> int:
        """Requests that may wait for a seat at once (max_waiting_requests, or its default)."""
        return self.max_waiting_requests or 2 * self.engine.max_num_seqs


def add_kv_transport_argument(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    p.add_argument(
        "--kv-transport",
        default="tcp",
        choices=list(TRANSPORTS),
        help="how KV moves from the prefill to the decode worker: tcp (the only one under the cluster's TLS), ucx, "
        "or cuda_ipc (device to device on one GPU)",
    )


def add_wire_codec_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """The KV wire codec's flags (kv_transfer/codec.py); the prefill worker decides, the decode worker accepts."""
    p.add_argument(
        "--kv-wire-codec",
        default="auto",
        choices=list(WIRE_CODEC_MODES),
        help="how a prefill worker sends KV: auto (int8 with per-token-head scales, about 0.53x bfloat16's bytes, "
        "on links where encoding costs less than the bytes it saves: not on loopback, the same host or CUDA IPC), "
        "raw (the cache's own bytes), int8 (always, where the decode worker takes it). int8 is LOSSY, and auto "
        "turns it on by itself across a slow link between hosts: greedy tokens after the first may then differ "
        "from a colocated run; raw keeps the KV exact",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=float,
        default=0.0,
        help="the prefill worker's link to the decode workers in Gb/s, for --kv-wire-codec auto (0: measured on "
        "the streams to each decode worker; the first goes raw)",
    )
