"""The public stream of `GenerateResponse`s -> OpenAI `choices`, streamed or whole.

With `n` > 1 the responses of different samples interleave, each tagged with its sample
(`index`); each sample is one choice, built response by response by its own `Choice`: its
text through the tool-call reader its tool_choice asks for (router/openai/tool_calls.py),
its log-probabilities in the endpoint's form (router/openai/logprobs.py), the echoed prompt
first (completions' `echo`), its finish reason ("tool_calls" when it ended by calling).

Each response gives one `Piece` of one choice. Streamed, a piece is one chunk's choice
(`stream_choice`); whole, a choice's pieces are put together (`whole_choices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.json_value import JsonObject
from splitserve.router.openai.logprobs import (
    ChatLogprobs,
    CompletionLists,
    CompletionLogprobs,
    TokenText,
    chat_logprobs,
    empty_completion_logprobs,
    extend_completion_logprobs,
)
from splitserve.router.openai.tool_calls import CallDelta, merge_calls
from splitserve.router.openai.tool_formats import tool_output
from splitserve.router.openai.tools import ToolChoice

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Shape:
    """How a request's answer is shaped, from its body."""

    chat: bool
    tools: ToolChoice | None = None  # chat only
    logprobs: bool = False
    top_logprobs: int = 0  # chat's top_logprobs, completions' logprobs
    echo: str | None = None  # completions' echo: the prompt's text, put before each choice's


class Piece(NamedTuple):
    """What one response adds to one choice."""

    choice: int  # the choice's index
    first: bool  # the choice's first piece
    text: str
    calls: list[CallDelta]
    logprobs: ChatLogprobs | CompletionLists | None  # None when not asked
    finish: str | None


class Answer:
    """Every choice of one request, fed its responses in order."""

    def __init__(self, shape: Shape, token_text: TokenText) -> None:
        self.shape = shape
        self.token_text = token_text
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: list[pb.PromptLogprob] = []  # the call's first response has them
        self.usage: pb.Usage | None = None  # the latest

    def update(self, r: pb.GenerateResponse) -> Piece:
        if r.prompt_logprobs:
            self.prompt_logprobs = list(r.prompt_logprobs)
        if r.HasField("usage"):
            self.usage = r.usage
        choice = self.choices.get(r.index)
        if choice is None:
            choice = self.choices[r.index] = Choice(r.index, self.shape, self.token_text)
        return choice.update(r, self.prompt_logprobs)


class Choice:
    """One sample's answer."""

    def __init__(self, index: int, shape: Shape, token_text: TokenText) -> None:
        self.index = index
        self.shape = shape
        self.output = tool_output(shape.tools)
        self.chat_text = token_text
        self.completion_lp = None if shape.chat else CompletionLogprobs(token_text, shape.top_logprobs)
        self.started = False

    def update(self, r: pb.GenerateResponse, prompt_logprobs: list[pb.PromptLogprob]) -> Piece:
        first, self.started = not self.started, True
        delta = self.output.feed(r.text)
        text, calls, finish = delta.content, delta.calls, None
        if r.finish_reason:
            end = self.output.finish()
            text, calls = text + end.content, merge_calls(calls + end.calls)
            finish = FINISH.get(r.finish_reason, "stop")
            if finish == "stop" and self.output.called:
                finish = "tool_calls"
        if first and self.shape.echo is not None:
            text = self.shape.echo + text
        return Piece(self.index, first, text, calls, self._logprobs(r, first, prompt_logprobs), finish)

    def _logprobs(
        self, r: pb.GenerateResponse, first: bool, prompt_logprobs: list[pb.PromptLogprob]
    ) -> ChatLogprobs | CompletionLists | None:
        if not self.shape.logprobs:
            return None
        if self.completion_lp is None:
            return chat_logprobs(r, self.chat_text, self.shape.top_logprobs)
        out = empty_completion_logprobs()
        if first and self.shape.echo is not None:
            out = self.completion_lp.prompt(prompt_logprobs, self.shape.echo)
        extend_completion_logprobs(out, self.completion_lp.tokens(r))
        return out


def stream_choice(piece: Piece, chat: bool) -> JsonObject | None:
    """A piece as a streamed chunk's choice; None when it adds nothing to send (a choice's first
    piece is always sent: it names the role)."""
    has_logprobs = bool(piece.logprobs["tokens"] if isinstance(piece.logprobs, dict) else piece.logprobs)
    if not (piece.first or piece.text or piece.calls or has_logprobs or piece.finish):
        return None
    logprobs = piece.logprobs
    if not chat:
        return {"index": piece.choice, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish}
    delta: JsonObject = {"role": "assistant"} if piece.first else {}
    if piece.text or (piece.first and not piece.calls):
        delta["content"] = piece.text
    if piece.calls:
        delta["tool_calls"] = [c.as_json() for c in piece.calls]
    return {
        "index": piece.choice,
        "delta": delta,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": piece.finish,
    }


class _Whole:
    """One choice's pieces put together."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.calls: dict[int, _WholeCall] = {}
        self.chat_logprobs: ChatLogprobs | None = None
        self.completion_logprobs: CompletionLists | None = None
        self.finish: str | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        for c in piece.calls:
            self.calls.setdefault(c.call, _WholeCall(c.id, c.name, [])).arguments.append(c.arguments)
        if isinstance(piece.logprobs, list):
            self.chat_logprobs = (self.chat_logprobs or []) + piece.logprobs
        elif piece.logprobs is not None:
            self.completion_logprobs = self.completion_logprobs or empty_completion_logprobs()
            extend_completion_logprobs(self.completion_logprobs, piece.logprobs)
        self.finish = piece.finish or self.finish

    def as_json(self, chat: bool) -> JsonObject:
        text = "".join(self.text)
        if not chat:
            return {
                "index": self.index,
                "text": text,
                "logprobs": self.completion_logprobs,
                "finish_reason": self.finish,
            }
        message: JsonObject = {"role": "assistant", "content": text}
        if self.calls:
            message["content"] = text or None  # OpenAI's: a message that only calls has no content
            message["tool_calls"] = [self.calls[k].as_json() for k in sorted(self.calls)]
        logprobs = {"content": self.chat_logprobs} if self.chat_logprobs is not None else None
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish}


class _WholeCall(NamedTuple):
    """One call of a whole answer: its id and name from its first delta, its arguments' pieces."""

    id: str | None
    name: str | None
    arguments: list[str]

    def as_json(self) -> JsonObject:
        fn = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"id": self.id, "type": "function", "function": fn}


def whole_choices(pieces: list[Piece], chat: bool) -> list[JsonObject]:
    """Every choice of a whole answer, in index order."""
    choices: dict[int, _Whole] = {}
    for piece in pieces:
        choices.setdefault(piece.choice, _Whole(piece.choice)).add(piece)
    return [choices[i].as_json(chat) for i in sorted(choices)]


def usage_json(u: pb.Usage | None) -> JsonObject:
    """The answer's token counts, as OpenAI's `usage`."""
    u = u or pb.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
