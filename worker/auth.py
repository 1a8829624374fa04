"""The control plane's only credential: the cluster token in call metadata."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

TOKEN_KEY = "x-splitserve-token"


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
