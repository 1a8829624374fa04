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
from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def feed(self, token_id: int) -> str:
        """Text newly complete after this token (possibly empty)."""
        ...

    def flush(self) -> str:
        """At the end of the stream: whatever text is still held back."""
        ...


class RouterTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """A raw text prompt, as the model should see it."""
        ...

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """(role, content) pairs rendered with the chat template, generation prompt added."""
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

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = "".join(f"<|{role}|>{content}\n" for role, content in messages) + "<|assistant|>"
        return [self.bos_token_id, *rendered.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()
