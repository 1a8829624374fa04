"""The engine's Tokenizer as the router's `RouterTokenizer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.router.tokenizer import ChatTurn, turn_dict


class _Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._inner = IncrementalDetokenizer(tokenizer)

    def feed(self, token_id: int) -> str:
        return self._inner.push(token_id)

    def flush(self) -> str:
        return self._inner.flush()


class EngineTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.tool_format = tokenizer.tool_format
        # The first render compiles the model's jinja chat template (about 30 ms for SmolLM2's):
        # paid here, at start, rather than by the first client's time to first token.
        self.encode_chat([("user", "warm-up")])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[ChatTurn], tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template([turn_dict(m) for m in messages], tools=tools)
        # the template already holds any BOS it wants
        return self.tokenizer.encode(text, add_special_tokens=False)

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> _Detokenizer:
        return _Detokenizer(self.tokenizer)


def model_tokenizer(model: str | None) -> EngineTokenizer:
    """The router's tokenizer for `model` (None: the embedded default), loaded from its file."""
    from splitserve.engine.weights import load_tokenizer

    return EngineTokenizer(load_tokenizer(model))
