"""An OpenAI body -> the public `GenerateRequest` to run, and the `Shape` of its answer.

`from_openai` checks every field's type and range before anything is put into a protobuf
(which raises on an int32 out of range or a lone surrogate), and names the field that is wrong
(`BadRequest`, a 400). The fields a body may carry are `CHAT_FIELDS` and `COMPLETION_FIELDS`:
OpenAI's, and beyond them what vLLM's clients use, in vLLM's spellings: structured output
(response_format.py), tools (tools.py), `n` choices, log-probabilities, `logit_bias`,
`min_tokens`, `stop_token_ids`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import NamedTuple, TypeGuard

from splitserve.engine.tool_call_format import ToolCallFormat
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.choices import Shape
from splitserve.router.openai.fields import BadRequest, boolean, bounded, integer, number, set_field, string, unicode
from splitserve.router.openai.messages import chat_messages
from splitserve.router.openai.response_format import CONSTRAINT_FIELDS, output_constraint
from splitserve.router.openai.tools import TOOL_FIELDS, ToolChoice, parse_tool_choice, template_tools, tool_grammar

_INT32 = 2**31

# OpenAI field -> GenerateRequest sampling field. Extensions beyond OpenAI's API
# (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, the guided_*
# constraints) are the ones vLLM accepts too, spelled as vLLM spells them.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed")
_COMMON = {
    "model",
    "user",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logprobs",
    "request_id",
    "ignore_eos",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    *CONSTRAINT_FIELDS,
    *_FLOATS,
    *_INTS,
}
# every field a body may carry, the one list of them (any other is a 400 naming it)
CHAT_FIELDS = frozenset({*_COMMON, "messages", "top_logprobs", *TOOL_FIELDS})
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "echo"})
_KNOWN = {True: CHAT_FIELDS, False: COMPLETION_FIELDS}  # by chat or not
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
_MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's bounds)


class OpenAIRequest(NamedTuple):
    """A checked OpenAI body: the request to run, and how to answer it."""

    generate: pb.GenerateRequest
    stream: bool
    include_usage: bool  # a last chunk with usage (streaming only)
    shape: Shape = Shape(chat=True)  # the choices' form: tool calls, logprobs, echo
    continuous_usage: bool = False  # usage on every chunk too (vLLM's continuous_usage_stats)


def _all_ints(prompt: list[object]) -> TypeGuard[list[int]]:
    return all(type(t) is int for t in prompt)  # not isinstance: a bool is no token id


def _token_ids(prompt: list[object], vocab_size: int | None) -> list[int]:
    limit = vocab_size if vocab_size is not None else _INT32
    if _all_ints(prompt) and 0 <= min(prompt) and max(prompt) < limit:
        return prompt
    for i, t in enumerate(prompt):  # only to name the bad one
        if type(t) is not int:
            raise BadRequest(f"prompt[{i}]: must be a token id (an integer)")
        if not 0 <= t < limit:
            what = "the vocabulary" if vocab_size is not None else "the token id range"
            raise BadRequest(f"prompt[{i}]: {t} is outside {what} [0, {limit})")
    raise AssertionError("unreachable")


def _prompt(req: pb.GenerateRequest, fields: dict[str, object], vocab_size: int | None) -> None:
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        req.text = string(prompt, "prompt")
    elif isinstance(prompt, list) and prompt:
        req.token_ids.ids.extend(_token_ids(prompt, vocab_size))
    else:
        raise BadRequest("prompt: must be a string or a non-empty list of token ids")


def _sampling(sp: pb.SamplingParams, fields: dict[str, object]) -> None:
    for name in _FLOATS:
        if name in fields:
            set_field(sp, name, number(fields[name], name), name)
    for name in _INTS:
        if name in fields:
            set_field(sp, name, integer(fields[name], name, integral_floats=True), name)
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if name in fields:
            set_field(sp, "max_tokens", integer(fields[name], name), name)
            break
    if "ignore_eos" in fields:
        sp.ignore_eos = boolean(fields["ignore_eos"], "ignore_eos")
    if "stop" in fields:
        stop = fields["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("stop: must be a string or a list of strings")
        sp.stop.extend(string(s, "stop" if isinstance(stop, str) else f"stop[{i}]") for i, s in enumerate(stops))
    if "n" in fields:
        set_field(sp, "n", bounded(fields["n"], "n", 1), "n")  # the upper bound is the server's (validation)
    if "min_tokens" in fields:
        set_field(sp, "min_tokens", bounded(fields["min_tokens"], "min_tokens", 0), "min_tokens")


def _token_lists(sp: pb.SamplingParams, fields: dict[str, object], vocab_size: int | None) -> None:
    """stop_token_ids and logit_bias: token ids, each in the vocabulary (when it is known here)."""
    limit = vocab_size if vocab_size is not None else _INT32
    if "stop_token_ids" in fields:
        ids = fields["stop_token_ids"]
        if not isinstance(ids, list):
            raise BadRequest("stop_token_ids: must be a list of token ids")
        for i, t in enumerate(ids):
            sp.stop_token_ids.append(bounded(t, f"stop_token_ids[{i}]", 0, limit - 1))
    if "logit_bias" in fields:
        bias = fields["logit_bias"]
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias: must be an object of token id -> bias")
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else -1
            if not 0 <= token < limit:
                raise BadRequest(f"logit_bias: key {key[:32]!r} is not a token id in [0, {limit})")
            b = number(value, f"logit_bias[{key!r}]")
            if not -100 <= b <= 100:
                raise BadRequest(f"logit_bias[{key!r}]: must be in [-100, 100], got {b:g}")
            sp.logit_bias[token] = b


def _logprobs(req: pb.GenerateRequest, fields: dict[str, object], chat: bool) -> tuple[bool, int]:
    """Whether log-probabilities are asked for, and how many alternatives each token's come with:
    chat's logprobs (a boolean) and top_logprobs, completions' logprobs (a count; echo adds the
    prompt's)."""
    if chat:
        on = boolean(fields["logprobs"], "logprobs") if "logprobs" in fields else False
        top = 0
        if "top_logprobs" in fields:
            top = bounded(fields["top_logprobs"], "top_logprobs", 0, _MAX_TOP_LOGPROBS[True])
            if not on:
                raise BadRequest("top_logprobs: needs logprobs: true")
    else:
        v = fields.get("logprobs", False)
        on = v is not False
        top = int(v) if isinstance(v, bool) else bounded(v, "logprobs", 0, _MAX_TOP_LOGPROBS[False])
        if on and fields.get("echo") is True:
            req.sampling.prompt_logprobs = top + 1  # the prompt token's own and `top` others
    if on:
        req.sampling.logprobs = True
    if top:
        req.sampling.top_logprobs = top
    return on, top


def _constraint(sp: pb.SamplingParams, fields: dict[str, object], tools: ToolChoice | None) -> None:
    """The output constraint: response_format or a guided_* field, or the one a forced tool call
    puts (only one of them)."""
    found = output_constraint(fields)
    forced = tool_grammar(tools) if tools is not None else None
    if found is not None and forced is not None:
        raise BadRequest(f"tool_choice and {found[0]}: only one output constraint per request")
    grammar = forced if forced is not None else found[1] if found is not None else None
    if grammar is not None:
        sp.grammar.CopyFrom(grammar)


def _stream_options(fields: dict[str, object]) -> dict[str, bool]:
    opts = fields.get("stream_options", {})
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: must be an object")
    unknown = set(opts) - _STREAM_OPTIONS
    if unknown:
        raise BadRequest(f"stream_options: unsupported field(s) {sorted(unknown)!r}")
    return {k: boolean(v, f"stream_options.{k}") for k, v in opts.items() if v is not None}


def _echo(req: pb.GenerateRequest, fields: dict[str, object], decode: Callable[[list[int]], str] | None) -> str | None:
    """completions' echo: the prompt's text, to put before each choice's."""
    if "echo" not in fields or not boolean(fields["echo"], "echo"):
        return None
    if req.WhichOneof("prompt") == "text":
        return req.text
    return decode(list(req.token_ids.ids)) if decode is not None else ""


def from_openai(
    body: object,
    chat: bool,
    vocab_size: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    tool_format: ToolCallFormat | None = None,
) -> OpenAIRequest:
    """An OpenAI JSON body -> the request to run; BadRequest names the field that is wrong.

    Every value is checked before it goes into the protobuf, so what comes out
    serialises; `null` counts as absent, as in OpenAI's API. `decode` gives a token-id
    prompt's text for echo; `tool_format`, the syntax the model's chat template teaches (None
    where it takes no tools).
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - _KNOWN[chat]
    if unknown:
        raise BadRequest(f"unsupported field(s): {sorted(unknown)!r}")  # repr: a surrogate in a key stays printable
    fields = {k: v for k, v in body.items() if v is not None}
    for name in ("model", "user"):  # not used, but a wrong type is still a wrong body
        if name in fields:
            string(fields[name], name)
    req = pb.GenerateRequest()
    req.request_id = string(fields["request_id"], "request_id") if "request_id" in fields else ""
    req.request_id = req.request_id or f"http-{uuid.uuid4().hex}"
    tools = parse_tool_choice(fields) if chat else None
    if tools is not None and tool_format is not None:
        tools = dataclasses.replace(tools, template_format=tool_format.name)
        req.chat.tools_json = unicode(json.dumps(template_tools(tools), ensure_ascii=False), "tools")
    if chat:
        for message in chat_messages(fields.get("messages"), tools):
            req.chat.messages.add(**message)
    else:
        _prompt(req, fields, vocab_size)
    _sampling(req.sampling, fields)
    _token_lists(req.sampling, fields, vocab_size)
    logprobs, top = _logprobs(req, fields, chat)
    _constraint(req.sampling, fields, tools)
    opts = _stream_options(fields)
    req.stream_options.continuous_usage = opts.get("continuous_usage_stats", False)
    stream = boolean(fields.get("stream", False), "stream")
    include_usage = stream and opts.get("include_usage", False)
    shape = Shape(chat, tools, logprobs, top, None if chat else _echo(req, fields, decode))
    return OpenAIRequest(req, stream, include_usage, shape, include_usage and req.stream_options.continuous_usage)
