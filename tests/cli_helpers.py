"""The `splitserve` command run as a user runs it: a fresh interpreter, its output captured."""

from __future__ import annotations

import subprocess
import sys


def splitserve(*argv: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *argv], capture_output=True, text=True, timeout=timeout
    )
