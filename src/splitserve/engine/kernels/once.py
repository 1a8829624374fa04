"""`Once`: a value made on first use, at most once across threads.

Each kernel module builds or imports its kernels the first time a caller asks
(a JIT build takes seconds, an import of Triton more) and keeps the result,
None included: a build that failed is not retried on every decode step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Once(Generic[T]):
    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self.done = False  # read without the lock on hot paths: `x.value if x.done else x.get()`
        self.value: T | None = None

    def get(self) -> T | None:
        if not self.done:
            with self._lock:
                if not self.done:
                    self.value = self._make()
                    self.done = True
        return self.value
