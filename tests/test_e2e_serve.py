"""`splitserve serve` as users run it: a real process that starts a local Ray
cluster, the router and one worker per pool on the embedded model; `splitserve
generate` answers through it over gRPC; SIGTERM stops it cleanly, during its
start as well as after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]
FLAGS = ["--grpc-port", "0", "--http-port", "-1", "--threads", "1", "--num-blocks", "256"]


class Serve:
    def __init__(self, tmp: Path) -> None:
        self.log = tmp / "serve.log"
        # its own session, so that the test can see every process of it is gone
        self.proc = subprocess.Popen(
            [*SPLITSERVE, "serve", *FLAGS],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, line: str, timeout_s: float) -> str:
        end = time.monotonic() + timeout_s
        while line not in self.text():
            assert self.proc.poll() is None, f"serve exited ({self.proc.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < end, f"no {line!r} within {timeout_s:g}s:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        return next(ln for ln in self.text().splitlines() if line in ln)

    def terminate(self, timeout_s: float = 90.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path)
    yield s
    if s.proc.poll() is None:
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)


def test_serve_answers_generate_and_stops_on_sigterm(serve):
    line = serve.wait_for("splitserve: listening on", 240)
    port = line.split("listening on ")[1].split()[0].rsplit(":", 1)[1]
    out = subprocess.run(
        [
            *SPLITSERVE,
            "generate",
            "--address",
            f"127.0.0.1:{port}",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout
    assert serve.terminate() == 0, serve.text()[-3000:]
    assert "splitserve: stopping" in serve.text()
    assert "SIGTERM received" not in serve.text()  # Ray's own handler, which dies loudly


def test_sigterm_during_the_start_stops_what_has_started(serve):
    serve.wait_for("splitserve: starting", 120)  # Ray is up, the workers are starting
    assert serve.terminate() == 0, serve.text()[-3000:]
    assert "splitserve: stopping" in serve.text()
    assert "SIGTERM received" not in serve.text()
