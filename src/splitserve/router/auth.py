"""Every route behind the key, on both doors, but health.

The gRPC door refuses, in an interceptor, every call but grpc.health.v1.Health's that carries no
known key (UNAUTHENTICATED), whatever method it names: a method added later is covered without a
line here. The HTTP door does the same in a middleware (router/openai/door.py). The request path then
finds the tenant from the key again (router/tenants.py): the interceptor only keeps strangers out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from splitserve.router.tenants import KeyRing

OPEN_GRPC_SERVICES = ("/grpc.health.v1.Health/",)  # a load balancer's probe carries no key
OPEN_HTTP_PATHS = frozenset({"/health"})
UNAUTHENTICATED = "missing or wrong API key (authorization: Bearer <key>)"


class KeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
            yield  # an async generator: the streaming handler's shape

        self._deny_unary: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if not self.keys.required or str(details.method).startswith(OPEN_GRPC_SERVICES):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization")
        if isinstance(sent, str) and self.keys.tenant(sent) is not None:
            return handler
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
