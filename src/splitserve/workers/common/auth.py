"""The control plane's only credential: the cluster token in call metadata."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from typing import Any

import grpc

TOKEN_KEY = "x-splitserve-token"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def cluster_token_refusal(token: str | None, insecure: bool, host: str) -> str | None:
    """Why a worker must not start with these settings, or None. Without a token anyone who
    reaches the port can reserve blocks, start prefills and read streams, so that is allowed
    only when asked for by name and only on a loopback address."""
    give = "give --cluster-token-file, $SPLITSERVE_CLUSTER_TOKEN or --cluster-token"
    if token:
        return None
    if not insecure:
        return f"no cluster token: {give} (or --insecure-no-cluster-token with a loopback --host)"
    if not is_loopback(host):
        return f"--insecure-no-cluster-token is only accepted with a loopback --host, not {host!r}: {give}"
    return None


class ClusterTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the cluster token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_KEY}")

        self._deny_unary: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._token):
            return continuation(details)
        handler = continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
