"""Stop strings on streamed text.

Text arrives in pieces (one detokenized token at a time), so a stop string can
be split across pieces. `StopMatcher.feed` releases only text that cannot be
the start of a stop string, holds back the rest, and on a match releases the
text before the stop string and reports the match; the stop string itself and
everything after it are never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Released(NamedTuple):
    text: str  # safe to send now
    stopped: bool  # a stop string matched; `text` ends just before it


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self._stopped = False

    @property
    def held(self) -> str:
        """Text held back as a possible start of a stop string."""
        return self._held

    def feed(self, text: str) -> Released:
        if self._stopped:
            return Released("", True)
        if not self._stops:
            return Released(text, False)
        buf = self._held + text
        # The stop string that completes first wins (as it would token by token,
        # whatever the pieces), then the one that starts first. The held part
        # holds no whole stop string, so every match found ends in the new text.
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        if best is not None:
            first = best[1]
            self._held = ""
            self._stopped = True
            return Released(buf[:first], True)
        hold = _longest_partial_suffix(buf, self._stops)
        self._held = buf[len(buf) - hold :] if hold else ""
        return Released(buf[: len(buf) - hold], False)

    def flush(self) -> str:
        """At the end of the stream: the held text was not a stop string after all."""
        out, self._held = ("" if self._stopped else self._held), ""
        return out


def _longest_partial_suffix(buf: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:k]):
                best = k
                break
    return best
