"""An HTTP request body's bytes -> a JSON value, with every way a client can get
the bytes wrong answered as `BodyError` (an HTTP status and a message naming
what is wrong) instead of an exception from inside a parser.

The order matters: the charset is checked before decoding, the UTF-8 is
decoded strictly (no lone surrogates, no overlong forms), and the nesting depth
is bounded by a vectorised scan before `json.loads` runs, so a body of 8 MiB
of `[` costs a few passes over the bytes, not a RecursionError. NaN and Infinity are
not JSON and are refused; numbers too large for a float still parse (as
infinity), and the field that holds one refuses it later.
"""

from __future__ import annotations

import json
from typing import NoReturn

import numpy as np
from aiohttp.helpers import parse_mimetype

MAX_DEPTH = 32  # the API's bodies nest 3 deep (body, messages, message); room for extensions
_UTF8 = ("utf-8", "utf8")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


class BodyError(Exception):
    """The body cannot be read as JSON; answer with this HTTP status.

    close: the connection cannot carry another request (the body was not read to its end).
    """

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.close = close


def check_charset(content_type: str | None) -> None:
    """Only UTF-8 (or no charset at all, which JSON means as UTF-8) is read.

    The media type itself is not checked: `curl -d` labels JSON as a form, and
    the body is read as JSON whatever its label says.
    """
    if content_type is None:
        return
    for charset in parse_mimetype(content_type).parameters.getall("charset", []):
        if charset.strip().lower() not in _UTF8:
            raise BodyError(415, f"content-type: charset {charset!r} is not supported (only utf-8)")


def _escaped(a: np.ndarray) -> np.ndarray:
    """True where a byte follows an odd run of backslashes (the 1st, 3rd, ... backslash of a
    run escapes the byte after it)."""
    backslash = a == _BACKSLASH
    idx = np.arange(a.size, dtype=np.int32)  # (a body is megabytes, far below 2 GiB)
    run_start = backslash.copy()
    run_start[1:] &= ~backslash[:-1]
    start = np.maximum.accumulate(np.where(run_start, idx, 0))  # within a run: where it started
    escapes = backslash & ((idx - start) & 1 == 0)
    out = np.zeros(a.size, dtype=bool)
    out[1:] = escapes[:-1]
    return out


def nesting_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text: exact for valid JSON, and for
    invalid JSON at least the depth json.loads reaches before it finds the error (the
    prefix it parses is valid, and so is scanned exactly).

    A few vectorised passes over the bytes, no Python loop and no regex that could
    backtrack: a quote counts unless escaped, a bracket counts unless an odd number
    of counted quotes precede it (it is inside a string).
    """
    a = np.frombuffer(raw, dtype=np.uint8)
    step = (a == _OPEN[0]).view(np.int8) + (a == _OPEN[1]).view(np.int8)
    step -= (a == _CLOSE[0]).view(np.int8) + (a == _CLOSE[1]).view(np.int8)
    quotes = a == _QUOTE
    if b'\\"' in raw:  # only then can a quote be escaped
        quotes &= ~_escaped(a)
    inside = np.cumsum(quotes.view(np.int8), dtype=np.int8) & 1  # int8 wraps around; the parity survives
    step[inside.view(bool)] = 0
    return max(0, int(step.cumsum(dtype=np.int32).max(initial=0)))


def refuse_constant(name: str) -> NoReturn:
    """json.loads's parse_constant: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON value")


def parse_json_body(raw: bytes, content_type: str | None, max_depth: int = MAX_DEPTH) -> object:
    """The body as a JSON value (unchecked: `object`); BodyError if it is not UTF-8 JSON of bounded depth."""
    check_charset(content_type)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not valid UTF-8 (byte {e.start})") from None
    # fewer brackets than the bound, strings and all: no need to look closer
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise BodyError(400, f"the body nests arrays and objects {depth} deep (at most {max_depth})")
    try:
        return json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # NaN/Infinity; an integer of more than 4300 digits
        raise BodyError(400, f"the body is not valid JSON ({e})") from None
