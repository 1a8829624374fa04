"""Prompt-lookup drafting (n-gram speculation): the tokens that followed the most recent
earlier occurrence of a sequence's last n tokens, with n tried from `max_n` down to `min_n`.

A pure function of the tokens, so a sequence's draft is re-derivable anywhere from its
tokens alone (a migrated request's next worker drafts what the first one would have). The
search is vectorized over the context (numpy): a Python loop over 2K tokens would cost a
good part of a decode step per sequence; this is tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_ngram_range(min_n: int, max_n: int) -> None:
    """ValueError naming the bad bound (the engine config calls this for its flags)."""
    if min_n < 1:
        raise ValueError(f"ngram_min must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"ngram_max ({max_n}) must be >= ngram_min ({min_n})")


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """`k` draft tokens to follow `tokens`: what followed the latest earlier occurrence of their
    longest suffix of `max_n`..`min_n` tokens that occurred before; [] if none did."""
    check_ngram_range(min_n, max_n)
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = tokens if isinstance(tokens, np.ndarray) else np.fromiter(tokens, dtype=np.int64, count=length)
    # one pass over the context for the last token; the longer suffixes are checked at its hits only
    ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched, from the last one back
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, max_n):
        alive &= ends >= j
        alive[alive] = arr[ends[alive] - j] == arr[length - 1 - j]
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    e = int(ends[np.flatnonzero(matched == best)[-1]])
    return _continue(arr[e + 1 :].tolist(), k)


def _continue(following: list[int], k: int) -> list[int]:
    """k tokens copied from where the match ended, the copy running on into its own output where
    the context ends (LZ77's overlapping copy): a run or a repeating pattern keeps repeating."""
    draft: list[int] = []
    while len(draft) < k:
        draft.append(following[len(draft)] if len(draft) < len(following) else draft[len(draft) - len(following)])
    return draft
