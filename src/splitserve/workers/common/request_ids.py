"""Which request ids a worker holds state for, and which call owns each.

A call claims its request id before it touches the engine or the KV plane and
gives it back only after everything it held is gone (engine blocks, KV
reservation, output sink). Until then the same id is refused at once
(ALREADY_EXISTS): a new call can never be answered by, or aborted by, the
cleanup of an old one that happened to use the same id.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from splitserve.kv_transfer.frame import REQUEST_ID_BYTES

T = TypeVar("T")


def check_request_id(request_id: str) -> None:
    """Raise ValueError unless the id can name a request here and in the KV frames it travels in."""
    if not request_id:
        raise ValueError("request_id is empty")
    if len(request_id.encode()) > REQUEST_ID_BYTES:
        raise ValueError(f"request_id is longer than the KV frame's {REQUEST_ID_BYTES} bytes")


class RequestIds(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[str, T] = {}

    def claim(self, request_id: str, owner: T) -> bool:
        """Take `request_id` for `owner`; False if another owner holds it."""
        with self._lock:
            if request_id in self._owners:
                return False
            self._owners[request_id] = owner
            return True

    def release(self, request_id: str, owner: T) -> None:
        """Give the id back; only its owner can."""
        with self._lock:
            if self._owners.get(request_id) is owner:
                del self._owners[request_id]

    def owner(self, request_id: str) -> T | None:
        with self._lock:
            return self._owners.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._owners)
