"""Worker addresses as `splitserve router` is given them: each must be one
gRPC `host:port`, checked when the command starts.

An address gRPC cannot reach is otherwise found late: the router starts, its
health stays NOT_SERVING, and every request waits for a worker that never
answers. A pure function, so the command and its tests share one rule: a
comma-separated list is refused (the flag is repeated instead), as is a URL, a
missing or out-of-range port, or a bare IPv6 address (it goes in brackets).
"""

from __future__ import annotations

from collections.abc import Iterable


class BadAddress(ValueError):
    """An address that is not host:port; the message names the problem and the fix, in one line."""


def parse_worker_address(text: str, flag: str = "--decode") -> str:
    """The address as gRPC dials it ("10.0.0.5:7001", "decode-0:7001", "[::1]:7001");
    BadAddress if `text` is not one host:port. `flag`: the option it came from, for the message."""
    fix = f"give one host:port per {flag}, e.g. {flag} 10.0.0.5:7001 (repeat {flag} for more workers)"
    if "," in text:
        parts = " ".join(f"{flag} {p.strip()}" for p in text.split(",") if p.strip())
        raise BadAddress(f"{flag} {text!r} is a list, not one address: repeat the flag instead ({parts})")
    if not text.strip() or text != text.strip() or any(c.isspace() for c in text):
        raise BadAddress(f"{flag} {text!r} is not a host:port address (it is empty or has spaces): {fix}")
    if "://" in text:
        raise BadAddress(f"{flag} {text!r} is a URL, not a host:port address: {fix} (no scheme)")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise BadAddress(f"{flag} {text!r} has no port: {fix}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise BadAddress(f"{flag} {text!r} has no valid port ({port!r} is not in 1-65535): {fix}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise BadAddress(f"{flag} {text!r}: an IPv6 address goes in brackets, e.g. {flag} [::1]:7001")
    if host == "[]":
        raise BadAddress(f"{flag} {text!r} has an empty host: {fix}")
    return text


def parse_worker_addresses(texts: Iterable[str], flag: str) -> list[str]:
    """Each of a repeated flag's values, checked; the first bad one raises."""
    return [parse_worker_address(t, flag) for t in texts]
