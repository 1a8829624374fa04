"""How the door answers a failure: the gRPC status as its HTTP one (INVALID_ARGUMENT 400,
UNAUTHENTICATED 401, ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
DEADLINE_EXCEEDED 504, anything else 500), in an OpenAI-style error body that names what is wrong,
as a whole response or as a streamed answer's last event.
"""

from __future__ import annotations

import math

import grpc
from aiohttp import web

from splitserve.router.openai.json_value import JsonObject
from splitserve.router.request import RequestFailed
from splitserve.router.status import status_details

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def status_of(e: RequestFailed) -> int:
    """The failure's HTTP status."""
    return HTTP_STATUS.get(e.code, 500)


def error_body(status: int, message: str, kind: str) -> JsonObject:
    # json.dumps escapes non-ASCII, so a client's lone surrogate quoted back cannot break the encoding;
    # the length is bounded as gRPC's is, the same message either way
    return {"error": {"message": status_details(message), "type": kind, "code": status}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", retry_after_s: float | None = None
) -> web.Response:
    headers = {"Retry-After": str(math.ceil(retry_after_s))} if retry_after_s is not None else None
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


def failed_response(e: RequestFailed, kind: str = "invalid_request_error") -> web.Response:
    return error_response(status_of(e), str(e), kind, e.retry_after_s)
