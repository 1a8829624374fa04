"""Structured output over HTTP: OpenAI's `response_format` and vLLM's spellings of the same
constraint (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the newer
`structured_outputs` object), each turned into the public request's `sampling.grammar`.

Only the shape is checked here (a schema is a JSON object, a choice a list of strings); whether
the grammar compiles is validation's question (router/validation.py), answered as INVALID_ARGUMENT
"sampling.grammar: ...", which the front door returns as a 400 with that message. One
constraint per request: two (even two that agree) are a 400 naming both fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.fields import BadRequest, boolean, obj, string
from splitserve.router.openai.json_body import refuse_constant

# the body fields that constrain the output, in the order an error names them
CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")


def output_constraint(fields: dict[str, object]) -> tuple[str, pb.Grammar] | None:
    """The body's output constraint and the field it came from; None when there is none
    (`response_format: {"type": "text"}` is none)."""
    found: list[tuple[str, pb.Grammar]] = []
    for name in CONSTRAINT_FIELDS:
        if name in fields:
            grammar = _PARSERS[name](fields[name], name)
            if grammar is not None:
                found.append((name, grammar))
    if len(found) > 1:
        raise BadRequest(f"{found[0][0]} and {found[1][0]}: only one output constraint per request")
    return found[0] if found else None


def schema_text(schema: object, field: str) -> str:
    """A JSON schema (an object, or JSON text of one) as the compact JSON text the grammar carries."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema, parse_constant=refuse_constant)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"{field}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise BadRequest(f"{field}: must be a JSON schema object")
    # ASCII: a lone surrogate in a client's schema is escaped, so protobuf can always carry the text
    return json.dumps(schema, separators=(",", ":"))


def _response_format(v: object, field: str) -> pb.Grammar | None:
    fmt = obj(v, field, {"type", "json_schema"}, required=("type",))
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.Grammar(json_object=True)
    if kind != "json_schema":
        raise BadRequest(f"{field}.type: must be 'text', 'json_object' or 'json_schema', got {str(kind)[:32]!r}")
    spec = obj(fmt.get("json_schema"), f"{field}.json_schema", {"name", "description", "schema", "strict"})
    for key in ("name", "description"):
        if key in spec:
            string(spec[key], f"{field}.json_schema.{key}")
    if "strict" in spec:
        boolean(spec["strict"], f"{field}.json_schema.strict")
    if "schema" not in spec:  # OpenAI's schema is optional: then any JSON object
        return pb.Grammar(json_object=True)
    return pb.Grammar(json_schema=schema_text(spec["schema"], f"{field}.json_schema.schema"))


def _json(v: object, field: str) -> pb.Grammar:
    return pb.Grammar(json_schema=schema_text(v, field))


def _regex(v: object, field: str) -> pb.Grammar:
    regex = string(v, field)
    if not regex:
        raise BadRequest(f"{field}: must not be empty")
    return pb.Grammar(regex=regex)


def _choice(v: object, field: str) -> pb.Grammar:
    if not isinstance(v, list) or not v:
        raise BadRequest(f"{field}: must be a non-empty list of strings")
    return pb.Grammar(choice=pb.ChoiceList(choices=[string(c, f"{field}[{i}]") for i, c in enumerate(v)]))


def _grammar(v: object, field: str) -> pb.Grammar:
    # vLLM's guided_grammar is EBNF in the backend's dialect; here that is llguidance's Lark
    lark = string(v, field)
    if not lark.strip():
        raise BadRequest(f"{field}: must not be empty")
    return pb.Grammar(lark=lark)


def _json_object(v: object, field: str) -> pb.Grammar | None:
    return pb.Grammar(json_object=True) if boolean(v, field) else None


def _structured_outputs(v: object, field: str) -> pb.Grammar | None:
    spec = obj(v, field, set(_STRUCTURED_OUTPUTS))
    parsers: dict[str, Callable[[object, str], pb.Grammar | None]] = {
        "json": _json,
        "regex": _regex,
        "choice": _choice,
        "grammar": _grammar,
        "json_object": _json_object,
    }
    found = [
        g for key in _STRUCTURED_OUTPUTS if key in spec and (g := parsers[key](spec[key], f"{field}.{key}")) is not None
    ]
    if len(found) > 1:
        raise BadRequest(f"{field}: only one of {', '.join(_STRUCTURED_OUTPUTS)} per request")
    return found[0] if found else None


_PARSERS: dict[str, Callable[[object, str], pb.Grammar | None]] = {
    "response_format": _response_format,
    "guided_json": _json,
    "guided_regex": _regex,
    "guided_choice": _choice,
    "guided_grammar": _grammar,
    "structured_outputs": _structured_outputs,
}
