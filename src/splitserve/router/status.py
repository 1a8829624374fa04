"""How a failure is put into words for a client, on both front doors (gRPC
status details, the HTTP error body): bounded, whatever it quotes."""

from __future__ import annotations

# gRPC sends a status message in a trailer, percent-encoded, and a client drops a trailer past
# 16 KiB: the call then fails RESOURCE_EXHAUSTED "Stream removed" instead of with its status.
MAX_DETAILS_CHARS = 512


def status_details(message: str) -> str:
    """A status message short enough for any trailer (one that quotes a client's value can be megabytes)."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}... ({len(message)} characters in all)"
