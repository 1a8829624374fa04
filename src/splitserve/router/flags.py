"""The router's command-line flags and the RouterConfig built from them, in one
place for both commands that run a router: `splitserve serve` (router plus Ray
pools) and `splitserve router` (the router alone), so the two cannot drift.

`--block-size` is not here: `serve` has it among the engine's flags (one value
for the workers and the router), `router` adds its own.
"""

from __future__ import annotations

import argparse

from splitserve.engine.tuned import fill_tuned, tuned_for
from splitserve.router.config import MODES, Limits, Listeners, RouterConfig, RoutingConfig
from splitserve.router.tenants import Tenant, load_tenants
from splitserve.runtime.credentials import add_secret_argument
from splitserve.runtime.tls import TLSFiles, add_internal_tls_argument, load_cluster_tls
from splitserve.runtime.tracing import add_tracing_argument

_DEFAULTS = RouterConfig()


def add_router_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """The router's flags; the parser must also have --block-size."""
    p.add_argument(
        "--host",
        default=_DEFAULTS.listeners.host,
        help="address the router's ports listen on: loopback by default, reachable from this machine only; "
        "0.0.0.0 (or an interface's address) opens them to the network, so give --api-key or --tenants-file too",
    )
    _add_port_arguments(p)
    p.add_argument(
        "--mode",
        default=None,
        choices=MODES,
        help="prefill on a prefill worker (disaggregated), on the decode worker (colocated), or per request (auto) "
        "(default: tuned)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=_DEFAULTS.routing.local_prefill_max_tokens,
        help="mode auto: prefill on the decode worker when the uncached suffix is this short",
    )
    p.add_argument(
        "--prefill-backlog-tokens",
        type=int,
        default=None,
        help="mode auto: prefill on the decode worker when every prefill worker has at least this many prompt "
        "tokens queued and the decode worker would finish the prompt before the pool could start it (default: "
        "tuned)",
    )
    p.add_argument(
        "--decode-stall-weight",
        type=float,
        default=_DEFAULTS.routing.decode_stall_weight,
        help="mode auto: a backed-up prompt prefills on the decode worker only while the TTFT it saves outweighs "
        "this times the stall it puts on that worker's running streams (prompt tokens x streams; 0: ignore them)",
    )
    p.add_argument(
        "--tier-blind-routing",
        action="store_true",
        help="count the KV blocks behind a worker's prefix cache (its --kv-host-tier-mib, --kv-disk-tier-mib) as "
        "uncached when routing: the baseline for tier-aware routing, which prices them in load seconds",
    )
    _add_capacity_arguments(p)
    _add_key_arguments(p)
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: health turns NOT_SERVING, new requests are refused, and those in flight "
        "run on for up to this long before the router stops (a second signal cuts it short)",
    )
    _add_tls_arguments(p)
    add_internal_tls_argument(p)
    add_tracing_argument(p)


def _add_capacity_arguments(p: argparse._ActionsContainer) -> None:
    """How much the front door takes at once, and over how many router processes."""
    p.add_argument(
        "--max-inflight",
        type=int,
        default=_DEFAULTS.limits.max_inflight,
        help="requests in flight at once; beyond it a request is refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=_DEFAULTS.listeners.replicas,
        help="router processes behind the one address (SO_REUSEPORT: the kernel spreads client connections over "
        "them): one relays a few thousand streamed tokens a second per core, so give one per core the front door "
        "should use; each watches the workers itself, and the limits (--max-inflight, --max-running-requests, each "
        "tenant's) are split over them (router/replicas.py)",
    )


def _add_port_arguments(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--grpc-port", type=int, default=_DEFAULTS.listeners.grpc_port, help="the gRPC API (splitserve.v1.Generation)"
    )
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API (-1: off)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_DEFAULTS.listeners.metrics_port,
        help="Prometheus endpoint of the router (0: off)",
    )


def _add_key_arguments(p: argparse._ActionsContainer) -> None:
    """Who may use the router, and how much: the keys, the tenants, the seats, /metrics' key."""
    add_secret_argument(p, "--api-key", "SPLITSERVE_API_KEY", "the key clients must send as a bearer token")
    p.add_argument(
        "--tenants-file",
        type=_tenants_file,
        default=(),
        metavar="PATH",
        help="API keys by tenant, each with its own limits, share and priority (TOML; router/tenants.py)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=_DEFAULTS.limits.max_running,
        help="requests running on the workers at once; beyond, they wait in the router and the seats go to the "
        "tenants in fair shares by token cost, higher priority first, and a tenant within its share runs beyond "
        "the limit rather than wait for a seat lent to one over it. Tenants sharing a cluster want it: with no "
        "limit a noisy tenant's requests all reach the workers, and a quiet tenant's TTFT p99 rose 3.6x in "
        "bench/results/tenants-cpu.txt, against 1.07x with 8 (default: no limit, no waiting)",
    )
    add_secret_argument(
        p,
        "--metrics-key",
        "SPLITSERVE_METRICS_KEY",
        "a key /metrics accepts besides the API keys, for a scraper that should have no tenant's rights "
        "('' opens /metrics to anyone who reaches the port)",
    )


def _add_tls_arguments(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PATH",
        help="serve both doors over TLS with this certificate chain (PEM; HTTPS and gRPC over TLS); read again "
        "when it changes, so a rotated certificate reaches new connections and drops no stream",
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the private key of --ssl-certfile (PEM)")
    p.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PATH",
        help="require every client to present a certificate this CA signed (mutual TLS)",
    )


def tls_from_args(a: argparse.Namespace) -> TLSFiles | None:
    """The front door's TLS files, or None; ValueError naming the flag when they do not go together."""
    if a.ssl_certfile is None and a.ssl_keyfile is None:
        if a.ssl_ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if a.ssl_certfile is None or a.ssl_keyfile is None:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    return TLSFiles(a.ssl_certfile, a.ssl_keyfile, a.ssl_ca_certs)


def router_config_from_args(a: argparse.Namespace, cluster_token: str | None) -> RouterConfig:
    """The RouterConfig the flags of add_router_arguments (and --block-size) describe; a tuned flag
    not given takes the machine's tuned choice (engine/tuned.py), as `serve` filled it already.
    `cluster_token`: the control plane's credential, which each command gets its own way."""
    # `splitserve router` has no --device: it reads the CPU's choices (the router's are the same on a GPU)
    a = fill_tuned(a, tuned_for(getattr(a, "device", "cpu")))
    routing = RoutingConfig(
        mode=a.mode,
        block_size=a.block_size,
        local_prefill_max_tokens=a.local_prefill_max_tokens,
        prefill_backlog_tokens=a.prefill_backlog_tokens,
        decode_stall_weight=a.decode_stall_weight,
        tier_aware=not a.tier_blind_routing,
    )
    listeners = Listeners(
        host=a.host,
        grpc_port=a.grpc_port,
        metrics_port=a.metrics_port,
        http_port=None if a.http_port < 0 else a.http_port,
        api_key=a.api_key,
        metrics_key=a.metrics_key,
        cluster_token=cluster_token,
        tls=tls_from_args(a),
        internal_tls=load_cluster_tls(a.internal_tls_dir) if a.internal_tls_dir else None,
        replicas=a.routers,
    )
    limits = Limits(max_inflight=a.max_inflight, max_running=a.max_running_requests)
    return RouterConfig(routing=routing, limits=limits, listeners=listeners, tenants=a.tenants_file)


def _tenants_file(path: str) -> tuple[Tenant, ...]:
    try:
        return load_tenants(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
