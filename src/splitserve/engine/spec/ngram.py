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
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # candidate n-grams end at e in [n-1, length-2]: strictly before the suffix's own end
        ends = np.arange(n - 1, length - 1)
        match = arr[ends] == arr[length - 1]
        for j in range(1, n):
            match &= arr[ends - j] == arr[length - 1 - j]
        hits = np.flatnonzero(match)
        if hits.size:
            return _continue(arr[int(ends[hits[-1]]) + 1 :].tolist(), k)
    return []


def _continue(following: list[int], k: int) -> list[int]:
    """k tokens copied from where the match ended, the copy running on into its own output where
    the context ends (LZ77's overlapping copy): a run or a repeating pattern keeps repeating."""
    draft: list[int] = []
    while len(draft) < k:
        draft.append(following[len(draft)] if len(draft) < len(following) else draft[len(draft) - len(following)])
    return draft
