"""One OpenAI body field each: its JSON type checked, then what protobuf can hold.

Shared by the HTTP front door (router/openai/door.py) and the modules that translate the larger
fields (tools, response_format, messages): each raises `BadRequest` with a message that starts
with the field's path, which the client gets as a 400.
"""

from __future__ import annotations

import math

from google.protobuf.message import Message


class BadRequest(Exception):
    pass


def string(v: object, field: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{field}: must be a string")
    return unicode(v, field)


def unicode(v: str, field: str) -> str:
    """`v` if protobuf can encode it: a lone surrogate (a JSON "\\ud800") it cannot."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return v


def boolean(v: object, field: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{field}: must be a boolean")
    return v


def number(v: object, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{field}: must be a number")
    try:
        f = float(v)
    except OverflowError:
        raise BadRequest(f"{field}: out of range") from None
    if not math.isfinite(f):  # a JSON number too large for a float parses as infinity
        raise BadRequest(f"{field}: must be finite")
    return f


def integer(v: object, field: str, integral_floats: bool = False) -> int:
    if integral_floats and isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{field}: must be an integer")
    return v


def bounded(v: object, field: str, lo: int, hi: int | None = None) -> int:
    """An integer in [lo, hi] (no upper bound when hi is None)."""
    i = integer(v, field)
    if i < lo or (hi is not None and i > hi):
        raise BadRequest(f"{field}: must be {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}, got {i}")
    return i


def obj(v: object, field: str, known: set[str] | frozenset[str], required: tuple[str, ...] = ()) -> dict[str, object]:
    """A JSON object with only the `known` keys (and every `required` one); null values count as absent."""
    if not isinstance(v, dict):
        raise BadRequest(f"{field}: must be an object")
    unknown = set(v) - known
    if unknown:
        raise BadRequest(f"{field}: unsupported field(s) {sorted(unknown)!r}")  # repr: a surrogate stays printable
    out = {k: x for k, x in v.items() if x is not None}
    for k in required:
        if k not in out:
            raise BadRequest(f"{field}.{k}: required")
    return out


def set_field(msg: Message, name: str, value: float, field: str) -> None:
    """Set a protobuf scalar; one out of the field's range (int32, int64, uint32) is the client's error."""
    try:
        setattr(msg, name, value)
    except (ValueError, OverflowError, TypeError):
        raise BadRequest(f"{field}: out of range") from None
