"""What the router needs from a tokenizer, and a byte-level one for tests and
benchmarks.

The router tokenizes (raw text, or a chat rendered with the model's template)
and detokenizes incrementally; the engine's Tokenizer is adapted to
`RouterTokenizer` by whoever starts the router. `ByteTokenizer` is a real
tokenizer of the simplest kind (one token per UTF-8 byte), so incremental
detokenization has the real difficulty: a character split across tokens.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from splitserve.engine.tool_call_format import ToolCallFormat

# One chat message: (role, content), or a mapping with OpenAI's keys where the message carries
# an assistant's `tool_calls` or a tool result's `tool_call_id` for the model's template to render.
ChatTurn = tuple[str, str] | Mapping[str, Any]


def turn_dict(turn: ChatTurn) -> dict[str, Any]:
    """A message as its template sees it."""
    return {"role": turn[0], "content": turn[1]} if isinstance(turn, tuple) else dict(turn)


class Detokenizer(Protocol):
    def feed(self, token_id: int) -> str:
        """Text newly complete after this token (possibly empty)."""
        ...

    def flush(self) -> str:
        """At the end of the stream: whatever text is still held back."""
        ...


class RouterTokenizer(Protocol):
    vocab_size: int
    # the tool-call syntax the chat template teaches; None where it takes no tools (the router
    # then teaches Hermes blocks in a system message of its own)
    tool_format: ToolCallFormat | None

    def encode(self, text: str) -> list[int]:
        """A raw text prompt, as the model should see it."""
        ...

    def encode_chat(self, messages: Sequence[ChatTurn], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages rendered with the chat template, generation prompt added; `tools` (OpenAI's
        list) handed to a template that takes them (ValueError for one that does not)."""
        ...

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        """A fresh incremental detokenizer for the tokens that follow this prompt."""
        ...


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id >= 256:  # special tokens have no text
            return ""
        return self._decoder.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """Token i is byte i (vocab 256 plus specials: 256 = BOS, 257 = EOS)."""

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    tool_format: ToolCallFormat | None = None

    def encode_chat(self, messages: Sequence[ChatTurn], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if tools:
            raise ValueError("this model's chat template takes no tools")
        turns = [turn_dict(m) for m in messages]
        rendered = "".join(f"<|{t['role']}|>{t['content']}\n" for t in turns) + "<|assistant|>"
        return [self.bos_token_id, *rendered.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()
