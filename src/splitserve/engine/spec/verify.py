"""Which draft tokens a verified step accepts.

The target draws a token at every verified position exactly as plain decode would draw it
there (same logits, grammar mask, processors and seeded randomness), assuming the draft
tokens before it were accepted. The draft's longest prefix that equals those draws is
accepted, and the draw at the first mismatch (or after the whole draft) follows it: the
output is token for token what decoding without speculation produces, for greedy and
seeded requests alike, and an unseeded request's tokens come from the same distribution.
This is vLLM's greedy rule applied to every request; the rejection rule would accept more
of a sampled request's draft, but its tokens would no longer be the ones plain decode draws.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(draft: Sequence[int], drawn: Sequence[int]) -> list[int]:
    """The tokens a step emits: `drawn[j]` is the target's draw at draft position j (after
    draft[:j]); there is one draw more than draft tokens. Always at least one token."""
    if len(drawn) != len(draft) + 1:
        raise ValueError(f"{len(drawn)} draws for a draft of {len(draft)} tokens; expected {len(draft) + 1}")
    m = 0
    while m < len(draft) and drawn[m] == draft[m]:
        m += 1
    return list(drawn[: m + 1])
