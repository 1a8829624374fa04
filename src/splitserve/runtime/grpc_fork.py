"""gRPC's fork handlers, turned off in every splitserve process before gRPC starts.

With them on (gRPC's default), a child forked while other threads are inside gRPC runs gRPC's
post-fork handler before it execs, and that handler sometimes aborts it (SIGABRT: 22 of 2,000
`subprocess.Popen(..., preexec_fn=...)` children of a process serving gRPC calls, none with the
handlers off). Ray starts its GCS server and raylet exactly that way, so a Ray start could time out
with no log at all. No splitserve process forks to keep using gRPC in the child: every child execs,
so the handlers can only do harm. Children inherit the setting through the environment.
"""

from __future__ import annotations

import os


def disable_grpc_fork_handlers() -> None:
    """Call before gRPC is imported (it reads the variable then); an operator's own value wins."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
