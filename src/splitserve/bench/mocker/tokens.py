"""The token sequence every mocker emits, so that a client can check each token it receives.

The token at output position `position` of sample `sample` depends only on the
prompt and those two numbers: a request migrated to another mocker continues
exactly where it stopped, and a token lost, repeated or swapped between streams
shows as a mismatch. Tokens are bytes (0-255), which every tokenizer the router
may hold maps, and never an end of sequence: a mocker's request ends at its
max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

# A stride coprime with 256: the sequence runs through all 256 bytes before it repeats.
_STRIDE = 97


def prompt_key(first: int, last: int, length: int) -> int:
    """What of a prompt its tokens depend on: cheap to take from a sequence at every step."""
    return (first * 8191 + last * 131 + length * 1_000_003) & 0xFFFF


def mocker_token(key: int, position: int, sample: int = 0) -> int:
    return (key + sample * 61 + position * _STRIDE) % 256


def expected_tokens(prompt: Sequence[int], count: int, sample: int = 0) -> list[int]:
    """The first `count` output tokens of `sample` after `prompt`, as a mocker emits them."""
    key = prompt_key(prompt[0], prompt[-1], len(prompt))
    return [mocker_token(key, i, sample) for i in range(count)]
