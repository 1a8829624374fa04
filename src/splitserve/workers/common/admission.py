"""Bounded admission: a worker takes a request only while its waiting queue has room.

A request that cannot start at once waits in the engine's queue for a seat
(`max_num_seqs`) or for KV blocks. Past a short queue, waiting only turns
overload into missed deadlines for everyone queued, so the worker refuses at
once (RESOURCE_EXHAUSTED); the router tries another worker, and answers the
client 429 when every one is full (router/request.py). Runs on the engine
thread, in the same call that would queue the request, so the count is exact.
"""

from __future__ import annotations

from splitserve.engine.engine import Engine


class QueueFull(Exception):
    """The worker's waiting queue is at its limit: RESOURCE_EXHAUSTED, try elsewhere or later."""


def check_room(engine: Engine, limit: int) -> None:
    """Raise QueueFull when `limit` requests already wait on this engine for a seat. Requests
    queued since the last step that free seats will take at the next one are not waiting."""
    s = engine.scheduler
    free_seats = max(0, engine.cfg.max_num_seqs - len(s.running) - len(s.reserved))
    waiting = len(s.waiting) - free_seats
    if waiting >= limit:
        raise QueueFull(f"{waiting} requests already wait for a seat on this worker (limit {limit}); retry later")
