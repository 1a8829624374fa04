"""A JSON value as the door writes one: an answer's choices, its usage, an error body.

What a client sends is typed `object` until a check (fields.py and the modules beside it) has
read it, and so is what is built from it unread (a tool's schema, handed on as it came).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

# Sequence and Mapping, not list and dict: they are covariant, so a list[str] or a
# dict[str, int] already is a JSON value without being copied into one
JsonValue: TypeAlias = None | bool | int | float | str | Sequence["JsonValue"] | Mapping[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]  # one the door is still filling in
