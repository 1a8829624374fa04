"""The lifecycle of requests sent on threads of their own while something else is measured
(decoding_streams.py, prefilling_prompts.py): the threads start when the `with` block is entered;
when it is left they are told to stop (`_stop`) and joined, each finishing what it is in for at
most `timeout_s`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Self


class Background:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _start_later(self, target: Callable[..., object], args: tuple[object, ...], name: str) -> None:
        """A thread that runs `target(*args)` from the `with` block's entry on."""
        self._threads.append(threading.Thread(target=target, args=args, daemon=True, name=name))

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s)
