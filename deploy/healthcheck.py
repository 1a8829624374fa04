#!/usr/bin/env python3
"""Container health checks for splitserve processes (there is no grpc_health_probe
binary in the image; this uses grpcio and the package's generated stubs).

    splitserve-healthcheck router [--address 127.0.0.1:50051]
        grpc.health.v1.Health/Check on the router's client port: healthy when the
        router answers SERVING, which it does while at least one decode worker is
        healthy. Sends the API key ($SPLITSERVE_API_KEY) if one is set, although
        the health service does not ask for it.

    splitserve-healthcheck worker --role decode|prefill --address decode:7001
        The control plane's own GetStats call, with the cluster token
        ($SPLITSERVE_CLUSTER_TOKEN) in "x-splitserve-token": healthy when the
        worker has loaded its model, listens, and accepts the token.

Exit status 0 when healthy, 1 when not (Docker and Kubernetes exec probes read
only that). The address defaults to $SPLITSERVE_HEALTH_ADDRESS, else the
router's 127.0.0.1:50051. Every call has a deadline (--timeout).
"""

from __future__ import annotations

import argparse
import os
import sys

TOKEN_KEY = "x-splitserve-token"  # splitserve.workers.common.auth.TOKEN_KEY, kept here so the probe imports little


def check_router(address: str, timeout: float) -> tuple[bool, str]:
    import grpc

    from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc

    key = os.environ.get("SPLITSERVE_API_KEY")
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout, metadata=metadata)
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    return serving, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def check_worker(address: str, role: str, timeout: float) -> tuple[bool, str]:
    import grpc

    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc

    token = os.environ.get("SPLITSERVE_CLUSTER_TOKEN")
    metadata = ((TOKEN_KEY, token),) if token else ()
    with grpc.insecure_channel(address) as channel:
        stub = (wgrpc.DecodeWorkerStub if role == "decode" else wgrpc.PrefillWorkerStub)(channel)
        stats = stub.GetStats(wpb.StatsRequest(), timeout=timeout, metadata=metadata)
    return True, f"{role} worker {stats.worker_id or '?'} free_blocks={stats.free_blocks}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitserve-healthcheck", description="Exit 0 when the splitserve process is healthy."
    )
    sub = p.add_subparsers(dest="target", required=True)
    default = os.environ.get("SPLITSERVE_HEALTH_ADDRESS", "127.0.0.1:50051")
    r = sub.add_parser("router", help="grpc.health.v1 Check on the router")
    r.add_argument("--address", default=default)
    r.add_argument("--timeout", type=float, default=3.0)
    w = sub.add_parser("worker", help="GetStats on a worker, with the cluster token")
    w.add_argument("--role", required=True, choices=["prefill", "decode"])
    w.add_argument("--address", default=default)
    w.add_argument("--timeout", type=float, default=3.0)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.target == "router":
            ok, what = check_router(a.address, a.timeout)
        else:
            ok, what = check_worker(a.address, a.role, a.timeout)
    except Exception as e:  # grpc.RpcError (UNAVAILABLE, UNAUTHENTICATED, DEADLINE_EXCEEDED) or worse
        import grpc  # imported already by the checks; here only for its types

        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else repr(e)
        print(f"unhealthy: {a.target} at {a.address}: {detail}", file=sys.stderr)
        return 1
    print(f"{'healthy' if ok else 'unhealthy'}: {a.target} at {a.address}: {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
