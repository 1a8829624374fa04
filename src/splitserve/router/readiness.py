"""Whether the router can take requests: a pure function of its pools and its state.

Ready means every pool the deployment requires has at least one worker that has
answered a stats poll (a worker reports only after loading its model and running
a warm-up step, workers/common/warm_up.py), and the router is not draining for a
shutdown. gRPC health and `GET /health` both answer from here, so a load
balancer, `docker compose`'s healthcheck and `splitserve generate` all see the
router become ready at the same moment, and stop routing to it as it drains.

Health also names the workers that do not answer (router/workers.py's
`unreachable`), ready or not: a mistyped address shows there at once instead
of as requests that wait for a worker that never comes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

READY = "ready"
DRAINING = "draining"
NO_WORKER = "no_ready_worker"


@dataclass(frozen=True)
class Readiness:
    code: str  # READY, DRAINING or NO_WORKER: what health checks and logs key on
    reason: str  # for people: what the router waits for ("" when ready)
    unreachable: tuple[tuple[str, str], ...] = ()  # (address, why) of each worker that does not answer

    @property
    def ready(self) -> bool:
        return self.code == READY

    @property
    def details(self) -> str:
        """For people, in one line: what the router waits for, and which workers do not answer."""
        parts = [self.reason] if self.reason else []
        if self.unreachable:
            parts.append("unreachable: " + ", ".join(f"{address} ({why})" for address, why in self.unreachable))
        return "; ".join(parts)


def readiness(
    ready: Mapping[str, int],
    known: Mapping[str, int],
    required: Sequence[str],
    draining: bool,
    unreachable: Mapping[str, str] | None = None,
) -> Readiness:
    """`ready`/`known`: workers per pool that answer / that the router has been given;
    `unreachable`: address -> why, for the workers whose stats polls keep failing."""
    gone = tuple(sorted((unreachable or {}).items()))
    if draining:
        return Readiness(DRAINING, "the router is shutting down and takes no new requests", gone)
    missing = [
        f"no ready {role} worker ({known.get(role, 0)} starting)" if known.get(role, 0) else f"no {role} worker yet"
        for role in required
        if ready.get(role, 0) == 0
    ]
    if missing:
        return Readiness(NO_WORKER, "; ".join(missing), gone)
    return Readiness(READY, "", gone)
