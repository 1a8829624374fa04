"""The router's event loop: uvloop where it is installed, asyncio's own otherwise.

grpc.aio hands every completion from its poller thread to the event loop, so
each message through the router costs a few loop wake-ups; uvloop makes those
(and the loop's own bookkeeping) cheaper. On this project's 2-core CPU machine
the router's added latency against mock workers fell by about a quarter with
it (`splitserve bench router`). Everything the router does is plain asyncio
and runs unchanged on either loop; SPLITSERVE_NO_UVLOOP=1 picks asyncio's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

DISABLE_ENV = "SPLITSERVE_NO_UVLOOP"


def loop_name() -> str:
    """ "uvloop" or "asyncio": the loop `run` will use."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return "asyncio"
    try:
        import uvloop  # noqa: F401 (imported only to see that it imports)
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on uvloop when `loop_name()` says so."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
