"""Start workers as separate processes (`python -m splitserve.workers`) and wait
until they listen: what end-to-end tests and benchmarks use when they want
real processes without Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen[bytes]
    grpc_address: str
    kv_endpoint: str | None
    log_path: str

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def spawn_worker(role: str, *args: str, cpu: int | None = None, timeout: float = 120.0) -> WorkerProcess:
    """Start one worker; `args` are extra `python -m splitserve.workers` flags; `cpu` pins it to a core."""
    tmp = tempfile.mkdtemp(prefix=f"splitserve-{role}-")
    ready = os.path.join(tmp, "ready")
    log_path = os.path.join(tmp, "log")
    cmd = [sys.executable, "-m", "splitserve.workers", "--role", role, "--ready-file", ready, *args]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{role} worker did not start: {f.read()[-2000:]}")
        time.sleep(0.05)
    grpc_address, kv = open(ready).read().split()
    return WorkerProcess(role, proc, grpc_address, None if kv == "-" else kv, log_path)
