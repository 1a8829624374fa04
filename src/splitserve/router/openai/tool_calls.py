"""The model's text -> OpenAI tool calls, as the text arrives.

One reader per tool_choice (router/openai/tools.py says what each asks of the model;
router/openai/tool_formats.py's `tool_output` picks it, and holds the readers of the other
families' syntaxes for "auto"):
- "auto" (`HermesCalls`): <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks become
  calls, the text outside them stays content. Text that could be the start of "<tool_call>" is
  held back until it is known not to be, so a streamed answer never shows half a tag.
- "required" (`ArrayCalls`): the output is a JSON array of {"name", "parameters"}; each item a call.
- a named function (`NamedCall`): the whole output is that function's arguments.
- no tools (`PlainText`): the text as it comes.

Each `feed(text)` returns what is new (`OutputDelta`: content and `CallDelta`s in OpenAI's
streaming form: the first delta of a call has its id and name, the later ones pieces of its
arguments); `finish()` at the sample's end returns the rest. A whole (not streamed) answer is
the same deltas put together, so both ways give the same calls. A block that is not a call
(not JSON, no name) is given back as content, tags and all, rather than lost.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import NamedTuple, Protocol

from splitserve.router.openai.json_value import JsonObject

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# a call's head, {"name": "...", "arguments": (or "parameters":), once it has all arrived
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class CallDelta(NamedTuple):
    call: int  # the call's place among the sample's calls (its `index` in OpenAI's deltas)
    id: str | None  # on the call's first delta only
    name: str | None  # on the call's first delta only
    arguments: str  # the next piece of the arguments' JSON text

    def as_json(self) -> JsonObject:
        """The delta as an entry of a streamed chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.call, "function": {"arguments": self.arguments}}
        fn = {"name": self.name, "arguments": self.arguments}
        return {"index": self.call, "id": self.id, "type": "function", "function": fn}


class OutputDelta(NamedTuple):
    content: str
    calls: list[CallDelta]


class ToolOutput(Protocol):
    @property
    def called(self) -> bool:
        """Whether the output has made a call (so far)."""
        ...

    def feed(self, text: str) -> OutputDelta: ...

    def finish(self) -> OutputDelta: ...


def merge_calls(calls: list[CallDelta]) -> list[CallDelta]:
    """Consecutive deltas of one call as one (a chunk carries each call once)."""
    out: list[CallDelta] = []
    for c in calls:
        if out and out[-1].call == c.call and c.id is None:
            out[-1] = out[-1]._replace(arguments=out[-1].arguments + c.arguments)
        else:
            out.append(c)
    return out


class PlainText:
    called = False

    def feed(self, text: str) -> OutputDelta:
        return OutputDelta(text, [])

    def finish(self) -> OutputDelta:
        return OutputDelta("", [])


class NamedCall:
    """A forced function: the output is its arguments, constrained by its schema."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.called = False

    def feed(self, text: str) -> OutputDelta:
        if not self.called:
            self.called = True
            return OutputDelta("", [CallDelta(0, new_call_id(), self.name, text)])
        return OutputDelta("", [CallDelta(0, None, None, text)] if text else [])

    def finish(self) -> OutputDelta:
        return self.feed("") if not self.called else OutputDelta("", [])


class _JsonEnd:
    """Where the JSON value at or after position `at` of a growing text ends: strings and nesting
    tracked, each character looked at once however often the text grows."""

    def __init__(self, at: int) -> None:
        self.pos = at  # the next character to look at
        self.start: int | None = None  # the value's first character
        self.kind = ""  # "nested" (an object or array), "string" or "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None  # just past the value's last character

    def scan(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            self._step(text[self.pos], self.pos)
            self.pos += 1
        return self.end

    def _step(self, c: str, i: int) -> None:
        if self.start is None:
            if not c.isspace():
                self.start = i
                self.kind = "nested" if c in "{[" else "string" if c == '"' else "scalar"
                self.depth, self.in_string = int(c in "{["), c == '"'
        elif self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.kind == "string":
                    self.end = i + 1
        elif self.kind == "scalar":
            if c in ",}] \t\r\n":
                self.end = i
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.end = i + 1


def _name(literal: str) -> str:
    """A JSON string literal's value (one that is not valid JSON: as written, unquoted)."""
    try:
        return str(json.loads(literal))
    except ValueError:
        return literal[1:-1]


def _parse_call(text: str) -> tuple[str, str] | None:
    """A whole call object's name and arguments (as JSON text); None if it is not one."""
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        return None
    args = v.get("arguments", v.get("parameters", {}))
    return v["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class CallReader:
    """One call, {"name": N, "arguments" (or "parameters"): A}, as its text arrives: a delta with
    the call's id and name once its head has arrived, then A's text piece by piece. A string A
    (some models quote the arguments) is sent whole, unquoted, once it ends."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.object = _JsonEnd(0)  # where the call's object ends
        self.args: _JsonEnd | None = None  # where A ends, once the head is read
        self.sent: int | None = None  # A's text up to here has been sent

    @property
    def end(self) -> int | None:
        return self.object.end

    def feed(self, piece: str) -> list[CallDelta]:
        self.text += piece
        self.object.scan(self.text)
        out: list[CallDelta] = []
        if self.args is None:
            m = _HEAD.match(self.text)
            if m is None:
                return out
            out.append(CallDelta(self.index, new_call_id(), _name(m.group(1)), ""))
            self.args = _JsonEnd(m.end())
        return out + self._arguments(final=False)

    def close(self) -> list[CallDelta] | None:
        """At the call's end: what is left of it; None if the text was never a call."""
        if self.args is not None:
            return self._arguments(final=True)
        call = _parse_call(self.text[: self.end])
        if call is None:
            return None
        return [CallDelta(self.index, new_call_id(), call[0], call[1])]

    def _arguments(self, final: bool) -> list[CallDelta]:
        a = self.args
        assert a is not None
        end = a.scan(self.text)
        if a.start is None:  # nothing but whitespace after the key yet
            return []
        stop = end if end is not None else len(self.text)
        if a.kind != "nested":  # a string or a bare value: sent whole, once complete
            if self.sent is not None or (end is None and not final):
                return []
            self.sent = stop
            raw = self.text[a.start : stop]
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            return [CallDelta(self.index, None, None, value if isinstance(value, str) else raw)]
        piece = self.text[self.sent if self.sent is not None else a.start : stop]
        self.sent = stop
        return [CallDelta(self.index, None, None, piece)] if piece else []


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (what to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesCalls:
    """tool_choice "auto": <tool_call> blocks become calls, the rest stays content. Whitespace is
    held back too, and dropped where it only separated calls (or trailed them)."""

    def __init__(self) -> None:
        self.pending = ""  # text not handled yet
        self.reader: CallReader | None = None  # inside a block
        self.calls = 0
        self.space = ""  # whitespace that ended the content so far
        self.before = ""  # the whitespace held before the block being read

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> OutputDelta:
        self.pending += text
        content: list[str] = []
        calls: list[CallDelta] = []
        while self._step(content, calls):
            pass
        return OutputDelta("".join(content), merge_calls(calls))

    def finish(self) -> OutputDelta:
        content: list[str] = []
        calls: list[CallDelta] = []
        if self.reader is not None:  # a block the output never closed: vLLM takes it as a call too
            calls.extend(self.reader.feed(self.pending))
            self._close(content, calls, closed=False)
        else:
            self._content(self.pending, content)
        self.pending = ""
        if not self.called:
            content.append(self.space)
        self.space = ""
        return OutputDelta("".join(content), merge_calls(calls))

    def _step(self, content: list[str], calls: list[CallDelta]) -> bool:
        """Handle what the pending text allows; True while there may be more to handle."""
        tag = TOOL_CALL_START if self.reader is None else TOOL_CALL_END
        i = self.pending.find(tag)
        upto = i if i >= 0 else len(self.pending) - partial_tag(self.pending, tag)
        if self.reader is None:
            self._content(self.pending[:upto], content)
        else:
            calls.extend(self.reader.feed(self.pending[:upto]))
        self.pending = self.pending[upto + len(tag) if i >= 0 else upto :]
        if i < 0:
            return False
        if self.reader is None:
            self.before, self.space = self.space, ""  # the whitespace before a call is no content
            self.reader = CallReader(self.calls)
        else:
            self._close(content, calls, closed=True)
        return True

    def _close(self, content: list[str], calls: list[CallDelta], closed: bool) -> None:
        reader, self.reader = self.reader, None
        assert reader is not None
        rest = reader.close()
        if rest is None:  # not a call: the block is the model's text after all
            self._content(self.before + TOOL_CALL_START + reader.text + (TOOL_CALL_END if closed else ""), content)
            return
        calls.extend(rest)
        self.calls += 1

    def _content(self, text: str, out: list[str]) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if body:
            out.append(body)


class ArrayCalls:
    """tool_choice "required": a JSON array of {"name", "parameters"}, each item a call. Output
    that is no such array (only without a grammar) is given back as content at the end."""

    def __init__(self) -> None:
        self.text = ""  # the whole output
        self.pending = ""
        self.state = "open"  # "open" (before "["), "items", "done"
        self.reader: CallReader | None = None
        self.calls = 0

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> OutputDelta:
        self.text += text
        self.pending += text
        calls: list[CallDelta] = []
        while self._step(calls):
            pass
        return OutputDelta("", merge_calls(calls))

    def finish(self) -> OutputDelta:
        calls: list[CallDelta] = []
        if self.reader is not None:
            calls.extend(self._close())
        content = "" if self.called else self.text
        return OutputDelta(content, merge_calls(calls))

    def _step(self, calls: list[CallDelta]) -> bool:
        if self.reader is not None:
            calls.extend(self.reader.feed(self.pending))
            self.pending = ""
            end = self.reader.end
            if end is None:
                return False
            self.pending = self.reader.text[end:]
            calls.extend(self._close())
            return True
        s = self.pending.lstrip()
        self.pending = s
        if not s or self.state == "done":
            return False
        if self.state == "open":
            self.state = "items" if s[0] == "[" else "done"
        elif s[0] == "{":
            self.reader = CallReader(self.calls)
            return True
        elif s[0] != ",":
            self.state = "done"  # "]", or what no grammar would have allowed
        self.pending = s[1:]
        return self.state == "items"

    def _close(self) -> list[CallDelta]:
        reader, self.reader = self.reader, None
        assert reader is not None
        rest = reader.close()
        if rest is None:
            return []
        self.calls += 1
        return rest
