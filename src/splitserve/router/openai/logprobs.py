"""Log-probabilities as OpenAI's two APIs show them.

Chat (`logprobs: true`, `top_logprobs: k`), one entry per token:
    {"token": "Hello", "logprob": -0.31, "bytes": [72, 101, 108, 108, 111],
     "top_logprobs": [{"token": ..., "logprob": ..., "bytes": [...]}, ...k]}
Completions (`logprobs: k`), lists side by side:
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...],
     "text_offset": [...]}
where each top_logprobs dict has the k most likely tokens and the chosen one (as vLLM's), and
text_offset is each token's character offset in the choice's text (vLLM's reading: from the
start of that text, the echoed prompt included). With `echo`, the prompt's tokens come first,
the first of them with null for its log-probability and its top_logprobs.

A token's text is its id decoded alone (`TokenText`), so a token that is part of a character
shows U+FFFD, and `bytes` is that text's UTF-8. JSON has no -Infinity: a log-probability
below -9999 (a token masked out) is reported as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.json_value import JsonObject, JsonValue
from splitserve.router.tokenizer import RouterTokenizer

LOGPROB_FLOOR = -9999.0

ChatLogprobs: TypeAlias = list[JsonObject]  # chat's `logprobs.content` entries, one per token
CompletionLists: TypeAlias = dict[str, list[JsonValue]]  # completions' `logprobs`, its lists side by side


def logprob(x: float) -> float:
    return x if math.isfinite(x) and x > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenText:
    """Each token id's text alone, cached: the same ids come back in every answer."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            detok = self.tokenizer.detokenizer(())
            text = detok.feed(token_id) + detok.flush()
            self._cache[token_id] = text
        return text


def _alternatives(r: pb.GenerateResponse, i: int, k: int) -> list[tuple[int, float]]:
    """The k most likely (id, logprob) at token i of a response (fewer if the worker sent fewer)."""
    if i >= len(r.top_logprobs) or k <= 0:
        return []
    top = r.top_logprobs[i]
    return list(zip(top.token_ids[:k], top.logprobs[:k], strict=False))


def _entry(token: str, lp: float) -> JsonObject:
    return {"token": token, "logprob": logprob(lp), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(r: pb.GenerateResponse, text: TokenText, top: int) -> ChatLogprobs:
    """A response's tokens as chat `logprobs.content` entries."""
    out: ChatLogprobs = []
    for i, (t, lp) in enumerate(zip(r.token_ids, r.logprobs, strict=False)):
        entry = _entry(text(t), lp)
        entry["top_logprobs"] = [_entry(text(a), alp) for a, alp in _alternatives(r, i, top)]
        out.append(entry)
    return out


def empty_completion_logprobs() -> CompletionLists:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def extend_completion_logprobs(into: CompletionLists, more: CompletionLists) -> None:
    for key, values in more.items():
        into[key].extend(values)


class CompletionLogprobs:
    """One choice's completions logprobs, response by response; `offset` is where the next
    token's text starts in the choice's text."""

    def __init__(self, text: TokenText, top: int) -> None:
        self.text = text
        self.top = top
        self.offset = 0

    def prompt(self, prompt_logprobs: Sequence[pb.PromptLogprob], echo: str) -> CompletionLists:
        """The echoed prompt's tokens (its first has no logprob); later tokens start after `echo`."""
        out = empty_completion_logprobs()
        for p in prompt_logprobs:
            token = self.text(p.token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
            if not p.HasField("logprob"):
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            alts = list(zip(p.top.token_ids[: self.top], p.top.logprobs[: self.top], strict=False))
            out["token_logprobs"].append(logprob(p.logprob))
            out["top_logprobs"].append(self._top(token, p.logprob, alts))
        self.offset = len(echo)
        return out

    def tokens(self, r: pb.GenerateResponse) -> CompletionLists:
        out = empty_completion_logprobs()
        for i, (t, lp) in enumerate(zip(r.token_ids, r.logprobs, strict=False)):
            token = self.text(t)
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob(lp))
            out["top_logprobs"].append(self._top(token, lp, _alternatives(r, i, self.top)))
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def _top(self, token: str, lp: float, alts: list[tuple[int, float]]) -> dict[str, float]:
        top = {self.text(a): logprob(alp) for a, alp in alts}
        top.setdefault(token, logprob(lp))  # the chosen token, as vLLM adds it
        return top
