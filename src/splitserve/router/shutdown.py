"""A router's graceful stop, for both commands that run one (`serve` and `router`).

On the first SIGTERM or SIGINT: health turns NOT_SERVING (a load balancer stops
sending), new requests are refused at once with UNAVAILABLE, and the requests
in flight run on for up to a grace period. A second signal cuts the wait short.
Only then do the ports close, and after them the workers stop.
"""

from __future__ import annotations

import asyncio
import signal

from splitserve.router.server import Router


async def drain(router: Router, grace_s: float, loop: asyncio.AbstractEventLoop, log_prefix: str) -> bool:
    """Drain `router` (see the module doc); whether every request in flight finished."""
    router.drain()
    n = router.generation.inflight
    print(f"{log_prefix}: draining: health NOT_SERVING, {n} request(s) in flight, up to {grace_s:g} s", flush=True)
    again = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, again.set)
    drained = asyncio.ensure_future(router.drained(grace_s))
    forced = asyncio.ensure_future(again.wait())
    await asyncio.wait({drained, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if drained.done() and drained.result():
        return True
    drained.cancel()
    left = router.generation.inflight
    print(f"{log_prefix}: {left} request(s) still in flight after the grace period; cutting them", flush=True)
    return False
