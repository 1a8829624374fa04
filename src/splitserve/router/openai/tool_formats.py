"""The readers of the tool-call syntaxes other than Hermes (engine/tool_call_format.py names
them), each with router/openai/tool_calls.py's interface: `feed(text)` returns what is new,
`finish()` the rest, and output that turns out not to be a call is given back as content.

- "mistral" and "phi4_mini" (`MarkedArray`): content, then a marker ([TOOL_CALLS], functools),
  then a JSON array of {"name", "arguments"} objects, each a call;
- "llama3_json" (`LeadingObjects`): an answer that opens with a JSON object (or <|python_tag|>)
  is calls, {"name", "parameters"} objects separated by ";"; any other answer is content.
"""

from __future__ import annotations

from splitserve.router.openai.tool_calls import (
    ArrayCalls,
    CallDelta,
    CallReader,
    HermesCalls,
    NamedCall,
    OutputDelta,
    PlainText,
    ToolOutput,
    partial_tag,
)
from splitserve.router.openai.tools import ToolChoice

PYTHON_TAG = "<|python_tag|>"


def tool_output(choice: ToolChoice | None) -> ToolOutput:
    """The reader of a sample's output for what its tool_choice asks (router/openai/tool_calls.py)."""
    if choice is None:
        return PlainText()
    if choice.mode == "required":
        return ArrayCalls()
    if choice.mode == "function":
        assert choice.function is not None
        return NamedCall(choice.function)
    if choice.template_format == "mistral":
        return MarkedArray("[TOOL_CALLS]")
    if choice.template_format == "phi4_mini":
        return MarkedArray("functools")
    if choice.template_format == "llama3_json":
        return LeadingObjects()
    return HermesCalls()


class MarkedArray:
    """Content until `marker`, then the calls' JSON array. Whitespace just before the marker is
    no content (it only separated the calls)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.pending = ""  # content not yet sent: a partial marker, or trailing whitespace
        self.array: ArrayCalls | None = None  # after the marker
        self.space = ""  # the whitespace dropped before the marker (given back if no call follows)

    @property
    def called(self) -> bool:
        return self.array is not None and self.array.called

    def feed(self, text: str) -> OutputDelta:
        if self.array is not None:
            return self.array.feed(text)
        self.pending += text
        i = self.pending.find(self.marker)
        if i < 0:
            body = self.pending[: len(self.pending) - partial_tag(self.pending, self.marker)]
            body = body[: len(body.rstrip())]
            self.pending = self.pending[len(body) :]
            return OutputDelta(body, [])
        before, rest = self.pending[:i].rstrip(), self.pending[i + len(self.marker) :]
        self.space, self.pending = self.pending[len(before) : i], ""
        self.array = ArrayCalls()
        return OutputDelta(before, self.array.feed(rest).calls)

    def finish(self) -> OutputDelta:
        if self.array is None:
            rest, self.pending = self.pending, ""
            return OutputDelta(rest, [])
        end = self.array.finish()
        if not self.called:  # the marker led no array of calls: it and what followed are content
            return OutputDelta(self.space + self.marker + end.content, end.calls)
        return end


class LeadingObjects:
    """Llama 3.x's JSON calls: the whole answer is calls when it opens with "{" or <|python_tag|>."""

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self.mode = "open"  # "open" (deciding), "content", "calls"
        self.at = 0  # calls mode: where the text not yet given to a reader starts
        self.reader: CallReader | None = None
        self.calls = 0
        self.failed = False  # an object that was no call: the whole answer is content after all

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> OutputDelta:
        self.text += text
        if self.mode == "open":
            head = self.text.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return OutputDelta("", [])  # too little yet to tell
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self.mode = "calls"
                self.at = len(self.text) - len(head) + (len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0)
            else:
                self.mode = "content"
                return OutputDelta(self.text, [])
        if self.mode == "content":
            return OutputDelta(text, [])
        return OutputDelta("", self._calls(final=False))

    def finish(self) -> OutputDelta:
        if self.mode != "calls":
            return OutputDelta(self.text if self.mode == "open" else "", [])
        calls = self._calls(final=True)
        if self.failed and not self.called:
            return OutputDelta(self.text.strip(), [])
        return OutputDelta("", calls)

    def _calls(self, final: bool) -> list[CallDelta]:
        out: list[CallDelta] = []
        while not self.failed:
            if self.reader is None:
                rest = self.text[self.at :].lstrip().lstrip(";").lstrip()
                if not rest.startswith("{"):
                    self.failed = bool(rest)  # text after the calls that is no call
                    break
                self.at = len(self.text) - len(rest)
                self.reader = CallReader(self.calls)
            out.extend(self.reader.feed(self.text[self.at + len(self.reader.text) :]))
            end = self.reader.end
            if end is None and not final:
                break
            reader, self.reader = self.reader, None
            closed = reader.close()
            if closed is None:
                self.failed = True
                break
            out.extend(closed)
            self.calls += 1
            self.at += end if end is not None else len(reader.text)
            if end is None:
                break
        return out
