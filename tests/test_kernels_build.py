"""One kernel build at a time per machine (engine/kernels/build.py `_build_turn`): a build killed
midway holds nobody up, and a build running elsewhere is waited for, by name, not raced."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitserve.engine.kernels.build import _build_turn

pytestmark = pytest.mark.timeout(60)

# holds the turn's flock the way a build does, says so, then sleeps until killed
_HOLDER = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write("pid %d" % __import__("os").getpid()); f.flush()
print("held", flush=True)
time.sleep(600)
"""


def test_a_lock_left_by_a_build_killed_midway_is_removed_at_once_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "lock").write_text("")  # torch's baton, as a killed build leaves it
    (tmp_path / "splitserve-build.lock").write_text("pid 999999")  # its holder's record: no flock on it
    with caplog.at_level(logging.INFO, logger="splitserve.engine.kernels.build"):
        t = time.monotonic()
        with _build_turn(tmp_path, "k"):
            took = time.monotonic() - t
            assert not (tmp_path / "lock").exists()
    assert took < 1.0
    assert any("killed midway" in r.getMessage() for r in caplog.records)


def test_a_build_in_another_process_is_waited_for_by_name_until_it_ends_however(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "splitserve-build.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build() -> None:
            with _build_turn(tmp_path, "k"):
                entered.set()

        with caplog.at_level(logging.INFO, logger="splitserve.engine.kernels.build"):
            waiter = threading.Thread(target=build)
            waiter.start()
            assert not entered.wait(0.5)  # the other build's turn: waited for, not raced
            holder.kill()  # killed midway: the kernel drops its flock with it
            assert entered.wait(10)
            waiter.join(10)
        waiting = [r.getMessage() for r in caplog.records if "waiting for its build" in r.getMessage()]
        assert waiting and f"pid {holder.pid}" in waiting[0], waiting
    finally:
        holder.kill()
        holder.wait(10)
