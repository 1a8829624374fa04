"""A client's output constraint (`GrammarSpec`) in llguidance's grammar language, and whether it compiles.

Torch-free and tokenizer-free on purpose: the router imports this at start to answer a grammar
that does not compile with HTTP 400 naming the field, before the request costs a prefill. The
engine compiles the same text against the model's tokenizer in engine/grammar.py.

Both functions are cached by spec (a frozen dataclass, its own key): a service sees the same few
schemas over and over, and checking one costs a third of a millisecond for a nested schema of a
few dozen keys, more for a large one.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

import llguidance

from splitserve.engine.sampling import GrammarSpec, InvalidSamplingParam

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the type lives only in llguidance's stub

# llguidance's JSON compile options, as the schema's defaults (a schema's own "x-guidance" key, an
# llguidance extension, may still override them). Whitespace as vLLM allows it (flexible, so both
# compact output, as OpenAI returns it, and the indented JSON a model writes by habit), but at most
# 20 characters between two tokens (a newline and an indent four levels deep), as xgrammar's
# max_whitespace_cnt bounds it: unbounded, a model can spend its whole max_tokens on newlines in an
# object it never closes. Measured on SmolLM2-135M (25 runs, greedy and sampled): whitespace-free
# JSON finished as often but came out with empty arrays ('"hobbies":[]') where the model wanted a
# newline after '['; ", " and ": " separators finished less often. Strict schema semantics stay
# llguidance's: additionalProperties false is honored, an absent one allows other keys (JSON
# Schema's default), and an unsupported keyword is an error, never silently ignored.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}

_CACHE_SIZE = 1024


# llguidance's own bounds on the work one grammar may cost, tighter than its defaults where a short
# pattern could cost seconds: `(a{1000}){1000}` (15 characters) took 1.8 s for its first mask under
# the defaults, on the engine thread, while every other stream in the batch waited; with a tenth of
# the initial lexer fuel it takes about 60 ms and then ends its own request with "too many
# expressions constructed". The step bounds keep each later mask to a few milliseconds (llguidance
# documents ~14k fuel and ~20k items a millisecond).
def parser_limits() -> llguidance.LLParserLimits:
    """The bounds every grammar is compiled and checked under, here and in the engine."""
    return llguidance.LLParserLimits(initial_lexer_fuel=100_000, step_lexer_fuel=50_000, step_max_items=20_000)


@lru_cache(maxsize=_CACHE_SIZE)
def grammar_text(spec: GrammarSpec) -> str:
    """`spec` as the grammar text llguidance's matcher takes. InvalidSamplingParam("grammar", ...)
    when the source cannot even be read (a schema that is not JSON, a choice that is not a list of
    strings); whether the grammar compiles is `check_grammar`'s question."""
    if spec.kind == "json_schema":
        return _json_schema(spec.source)
    if spec.kind == "json_object":
        return _json_schema('{"type": "object"}')
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec.source))
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def check_grammar(spec: GrammarSpec) -> None:
    """Raise InvalidSamplingParam("grammar", <llguidance's reason>) if `spec` does not compile."""
    reason = _compile_error(spec)
    if reason:
        raise InvalidSamplingParam("grammar", reason)


@lru_cache(maxsize=_CACHE_SIZE)
def _compile_error(spec: GrammarSpec) -> str:
    """Why `spec` does not compile ("" when it does). The failures are cached too: a client
    retrying a bad schema costs one compile, not one per request."""
    try:
        text = grammar_text(spec)
    except InvalidSamplingParam as e:
        return str(e).removeprefix(f"{e.field} ")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=parser_limits())
    if is_error:
        return f"does not compile ({spec.kind}): {messages[0].strip()}"
    return ""


def _json_schema(source: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    except ValueError as e:  # not JSON, or not a JSON object
        raise InvalidSamplingParam("grammar", f"json_schema is not a JSON object: {e}") from None


def _choice_lark(source: str) -> str:
    """A Lark rule with one alternative per choice: each string a literal, matched byte for byte
    (JSON's string escapes are Lark's), so no character of a choice is read as syntax."""
    try:
        choices = json.loads(source)
    except json.JSONDecodeError as e:
        raise InvalidSamplingParam("grammar", f"choice must be a JSON list of strings: {e}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidSamplingParam("grammar", "choice must be a non-empty JSON list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)
