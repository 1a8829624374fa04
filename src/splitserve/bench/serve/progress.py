"""A one-line progress bar on stderr (no dependency): redrawn in place on a
terminal, printed at most every tenth of the way otherwise (logs stay short)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, out: TextIO | None = None) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.done = self.failed = 0
        self._shown_tenth = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        tenth = self.done * 10 // self.total if self.total > 0 else self.done // 10
        if self.tty:
            self.out.write("\r\x1b[K" + self.line())
        elif tenth != self._shown_tenth:
            self.out.write(self.line() + "\n")
        self._shown_tenth = tenth
        self.out.flush()

    def line(self, width: int = 30) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        if self.total <= 0:  # open-ended (the burst scenario's steady streams): a count, no bar
            return f"{self.label}: {self.done} done{failed}"
        filled = self.done * width // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total}{failed}"

    def close(self) -> None:
        if self.enabled and self.tty:
            self.out.write("\n")
            self.out.flush()
