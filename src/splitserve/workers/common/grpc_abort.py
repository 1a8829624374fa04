"""Ending a gRPC call with a status, typed as what it is: it never returns."""

from __future__ import annotations

from typing import NoReturn

import grpc


def refuse(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort`, which raises; typed NoReturn so the code after it need not guard against None."""
    context.abort(code, message)
    raise AssertionError("grpc's ServicerContext.abort returned")
