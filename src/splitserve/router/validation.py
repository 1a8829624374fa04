"""Client request -> internal request, every field checked.

A bad field raises `ValidationError` whose message starts with the field's path
("sampling.top_p: ..."); the server answers it with INVALID_ARGUMENT. Fields
the public proto does not define (as a newer or hostile client might send) are
rejected, so nothing internal can be set from outside. Unset sampling fields
take the engine's defaults; max_tokens takes the router's.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from splitserve.engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    GrammarSpec,
    InvalidSamplingParam,
    SamplingParams,
)
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Limits
from splitserve.router.tokenizer import ChatTurn, RouterTokenizer

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool's result, as the OpenAI surface sends it
_INT64_MAX = 2**63
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_PROMPT_LOGPROBS = MAX_TOP_LOGPROBS + 1  # the prompt token's own and the 20 most likely others


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    continuous_usage: bool


def _reject_unknown(msg: Message, path: str) -> None:
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({unknown[i].field_number for i in range(len(unknown))})  # indexed: the set has no __iter__
        more = f" and {len(numbers) - 8} more" if len(numbers) > 8 else ""  # a status message stays small
        raise ValidationError(path or "request", f"unknown field number(s) {numbers[:8]}{more}")


def _float(sp: pb.SamplingParams, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    if not sp.HasField(name):
        return None
    v = float(getattr(sp, name))
    ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise ValidationError(f"sampling.{name}", f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return v


def validate_request_id(request_id: str, limits: Limits) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > limits.max_request_id_chars:
        raise ValidationError("request_id", f"longer than {limits.max_request_id_chars} characters")
    if not _REQUEST_ID.fullmatch(request_id):
        raise ValidationError("request_id", "may contain only A-Z a-z 0-9 . _ : -")
    return request_id


def validate_sampling(sp: pb.SamplingParams, limits: Limits, vocab_size: int) -> dict[str, object]:
    """The client's sampling fields as SamplingParams keyword arguments (unset ones left out)."""
    _reject_unknown(sp, "sampling")
    kw: dict[str, object] = {}
    for name, lo, hi, lo_open in (
        ("temperature", 0.0, 100.0, False),
        ("top_p", 0.0, 1.0, True),
        ("min_p", 0.0, 1.0, False),
        ("repetition_penalty", 0.0, 100.0, True),
        ("presence_penalty", -2.0, 2.0, False),
        ("frequency_penalty", -2.0, 2.0, False),
    ):
        v = _float(sp, name, lo, hi, lo_open)
        if v is not None:
            kw[name] = v
    if sp.HasField("top_k"):
        if not 0 <= sp.top_k <= vocab_size:
            raise ValidationError("sampling.top_k", f"must be in [0, {vocab_size}] (0 = off), got {sp.top_k}")
        kw["top_k"] = sp.top_k
    if sp.HasField("seed"):
        if not 0 <= sp.seed < _INT64_MAX:
            raise ValidationError("sampling.seed", f"must be in [0, 2^63), got {sp.seed}")
        kw["seed"] = sp.seed
    if sp.HasField("max_tokens"):
        if not 1 <= sp.max_tokens <= limits.max_tokens_cap:
            raise ValidationError(
                "sampling.max_tokens", f"must be in [1, {limits.max_tokens_cap}], got {sp.max_tokens}"
            )
        kw["max_tokens"] = sp.max_tokens
    _validate_stops(sp, limits, vocab_size, kw)
    if sp.HasField("logprobs"):
        if sp.logprobs and not limits.allow_logprobs:
            raise ValidationError("sampling.logprobs", "not enabled on this server")
        kw["logprobs"] = sp.logprobs
    if sp.HasField("ignore_eos"):
        kw["ignore_eos"] = sp.ignore_eos
    _validate_logprob_counts(sp, limits, kw)
    _validate_logit_bias(sp, vocab_size, kw)
    _validate_output_shape(sp, limits, kw)
    return kw


def _validate_stops(sp: pb.SamplingParams, limits: Limits, vocab_size: int, kw: dict[str, object]) -> None:
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise ValidationError("sampling.stop_token_ids", f"more than {limits.max_stop_token_ids} entries")
    for i, t in enumerate(sp.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise ValidationError(f"sampling.stop_token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")
    if sp.stop_token_ids:
        kw["stop_token_ids"] = tuple(dict.fromkeys(sp.stop_token_ids))
    if len(sp.stop) > limits.max_stop_strings:
        raise ValidationError("sampling.stop", f"more than {limits.max_stop_strings} stop strings")
    for i, s in enumerate(sp.stop):
        if not s:
            raise ValidationError(f"sampling.stop[{i}]", "must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise ValidationError(f"sampling.stop[{i}]", f"longer than {limits.max_stop_string_chars} characters")
    if sp.stop:
        kw["stop"] = tuple(sp.stop)


def _validate_output_shape(sp: pb.SamplingParams, limits: Limits, kw: dict[str, object]) -> None:
    """n, min_tokens and the grammar: how many outputs, how short at least, and in what form."""
    if sp.HasField("n"):
        if not 1 <= sp.n <= limits.max_n:
            raise ValidationError("sampling.n", f"must be in [1, {limits.max_n}], got {sp.n}")
        kw["n"] = sp.n
    if sp.HasField("min_tokens"):  # against max_tokens in `validate`, once its default is known
        kw["min_tokens"] = sp.min_tokens
    if sp.HasField("grammar"):
        kw["grammar"] = validate_grammar(sp.grammar, limits)


def _validate_logprob_counts(sp: pb.SamplingParams, limits: Limits, kw: dict[str, object]) -> None:
    if sp.HasField("top_logprobs"):
        if sp.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValidationError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {sp.top_logprobs}")
        if sp.top_logprobs and not sp.logprobs:  # as OpenAI: asking for them alone is a mistake, not a no-op
            raise ValidationError("sampling.top_logprobs", "requires sampling.logprobs = true")
        kw["top_logprobs"] = sp.top_logprobs
    if sp.HasField("prompt_logprobs"):
        if sp.prompt_logprobs > MAX_PROMPT_LOGPROBS:
            raise ValidationError(
                "sampling.prompt_logprobs", f"must be in [0, {MAX_PROMPT_LOGPROBS}], got {sp.prompt_logprobs}"
            )
        if sp.prompt_logprobs and not limits.allow_logprobs:
            raise ValidationError("sampling.prompt_logprobs", "not enabled on this server")
        kw["prompt_logprobs"] = sp.prompt_logprobs


def _validate_logit_bias(sp: pb.SamplingParams, vocab_size: int, kw: dict[str, object]) -> None:
    if not sp.logit_bias:
        return
    if len(sp.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError("sampling.logit_bias", f"more than {MAX_LOGIT_BIAS_ENTRIES} entries")
    biases = sorted(sp.logit_bias.items())  # sorted: the same request names the same bad entry every time
    for token, bias in biases:
        if not 0 <= token < vocab_size:
            raise ValidationError(
                f"sampling.logit_bias[{token}]", f"{token} is outside the vocabulary [0, {vocab_size})"
            )
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise ValidationError(
                f"sampling.logit_bias[{token}]", f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
            )
    kw["logit_bias"] = tuple(biases)


def validate_grammar(g: pb.Grammar, limits: Limits) -> GrammarSpec:
    """The client's grammar as the engine's GrammarSpec, compiled once here so that one that does
    not compile is the client's INVALID_ARGUMENT, not a failed attempt on a worker."""
    _reject_unknown(g, "sampling.grammar")
    kind = g.WhichOneof("kind")
    if kind is None:
        raise ValidationError("sampling.grammar", "one of json_schema, json_object, regex, choice or lark is required")
    path = f"sampling.grammar.{kind}"
    if kind == "json_object":
        if not g.json_object:
            raise ValidationError(path, "must be true (leave grammar unset for no constraint)")
        source = ""
    elif kind == "choice":
        _reject_unknown(g.choice, path)
        if not g.choice.choices:
            raise ValidationError(f"{path}.choices", "must not be empty")
        source = json.dumps(list(g.choice.choices))
    else:
        source = getattr(g, kind)
        if not source:
            raise ValidationError(path, "must not be empty")
    if len(source) > limits.max_prompt_chars:  # compiling is the costly part: bounded like a prompt
        raise ValidationError(path, f"longer than {limits.max_prompt_chars} characters")
    try:
        spec = GrammarSpec(kind, source)
        _check_grammar(spec)
    except InvalidSamplingParam as e:
        raise ValidationError("sampling.grammar", str(e)) from None
    return spec


def _check_grammar(spec: GrammarSpec) -> None:
    """InvalidSamplingParam("grammar", why) if the grammar does not compile. Imported at the first
    grammar: the compiler (llguidance) is heavy and most requests have none."""
    from splitserve.engine.grammar_source import check_grammar

    check_grammar(spec)


def tokenize_prompt(req: pb.GenerateRequest, limits: Limits, tokenizer: RouterTokenizer) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt", "one of text, token_ids or chat is required")
    vocab = tokenizer.vocab_size
    if kind == "text":
        if not req.text:
            raise ValidationError("text", "must not be empty")
        if len(req.text) > limits.max_prompt_chars:
            raise ValidationError("text", f"longer than {limits.max_prompt_chars} characters")
        ids = tokenizer.encode(req.text)
    elif kind == "token_ids":
        _reject_unknown(req.token_ids, "token_ids")
        ids = req.token_ids.ids[:]  # a list; slicing is the fastest way out of a repeated field
        if len(ids) > limits.max_prompt_tokens:
            raise ValidationError("token_ids", f"{len(ids)} tokens exceed the limit of {limits.max_prompt_tokens}")
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # the loop only to name the bad one
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValidationError(f"token_ids.ids[{i}]", f"{t} is outside the vocabulary [0, {vocab})")
    else:
        ids = _tokenize_chat(req.chat, limits, tokenizer)
    if not ids:
        raise ValidationError(kind, "gives no tokens")
    if len(ids) > limits.max_prompt_tokens:
        raise ValidationError(kind, f"{len(ids)} tokens exceed the limit of {limits.max_prompt_tokens}")
    return ids


def _tokenize_chat(chat: pb.ChatMessages, limits: Limits, tokenizer: RouterTokenizer) -> list[int]:
    """The chat rendered by the model's template: tools and earlier calls as structures it renders."""
    _reject_unknown(chat, "chat")
    msgs = chat.messages
    if not msgs:
        raise ValidationError("chat.messages", "must not be empty")
    if len(msgs) > limits.max_chat_messages:
        raise ValidationError("chat.messages", f"more than {limits.max_chat_messages} messages")
    total = len(chat.tools_json)
    turns: list[ChatTurn] = []
    for i, m in enumerate(msgs):
        _reject_unknown(m, f"chat.messages[{i}]")
        if m.role not in CHAT_ROLES:
            raise ValidationError(f"chat.messages[{i}].role", f"must be one of {CHAT_ROLES}, got {m.role[:32]!r}")
        total += len(m.content) + len(m.tool_calls_json) + len(m.tool_call_id)
        if total > limits.max_prompt_chars:
            raise ValidationError("chat.messages", f"longer than {limits.max_prompt_chars} characters in all")
        if not (m.tool_calls_json or m.tool_call_id):
            turns.append((m.role, m.content))
            continue
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            turn["tool_calls"] = _json_list(m.tool_calls_json, f"chat.messages[{i}].tool_calls_json")
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    tools = _json_list(chat.tools_json, "chat.tools_json") if chat.tools_json else None
    if tools and tokenizer.tool_format is None:
        raise ValidationError("chat.tools_json", "this model's chat template takes no tools")
    try:
        return tokenizer.encode_chat(turns, tools)
    except ValueError as e:  # the template refused the conversation (its raise_exception)
        raise ValidationError("chat", str(e)[:200]) from None


def _json_list(text: str, field: str) -> list[Any]:
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        raise ValidationError(field, "is not valid JSON") from None
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ValidationError(field, "must be a JSON list of objects")
    return v


def validate(req: pb.GenerateRequest, limits: Limits, tokenizer: RouterTokenizer) -> ValidRequest:
    _reject_unknown(req, "")
    request_id = validate_request_id(req.request_id, limits)
    kw = validate_sampling(req.sampling, limits, tokenizer.vocab_size)
    _reject_unknown(req.stream_options, "stream_options")
    ids = tokenize_prompt(req, limits, tokenizer)
    room = limits.max_model_len - len(ids)
    max_tokens = kw.get("max_tokens")
    if isinstance(max_tokens, int):
        if max_tokens > room:
            raise ValidationError(
                "sampling.max_tokens",
                f"{max_tokens} plus the prompt's {len(ids)} tokens exceed max_model_len {limits.max_model_len}",
            )
    else:
        kw["max_tokens"] = max_tokens = min(limits.default_max_tokens, room)
    min_tokens = kw.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > max_tokens:
        raise ValidationError("sampling.min_tokens", f"{min_tokens} exceeds max_tokens {max_tokens}")
    try:
        sampling = SamplingParams(**kw)  # type: ignore[arg-type]  # kw: the fields validate_sampling checked
    except InvalidSamplingParam as e:  # the engine's own checks, in case they are stricter than ours
        raise ValidationError(f"sampling.{e.field}", str(e)) from None
    return ValidRequest(request_id, tuple(ids), sampling, req.stream_options.continuous_usage)
