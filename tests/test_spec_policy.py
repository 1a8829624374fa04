"""The speculation's pure parts: the n-gram drafter, the acceptance rule and the policy that
decides from measured acceptance and measured step costs whether a draft pays."""

from __future__ import annotations

import pytest

from splitserve.engine.spec.ngram import propose
from splitserve.engine.spec.policy import Acceptance, StepCosts, expected_tokens, plan_drafts
from splitserve.engine.spec.verify import accepted_tokens

pytestmark = pytest.mark.timeout(30)


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # [1, 2, 3] occurred at the start (followed by 9, 9, 7); [2, 3] alone later (followed by 4)
    assert propose(tokens, k=3, min_n=1, max_n=3) == [9, 9, 7]
    assert propose(tokens, k=3, min_n=1, max_n=2) == [4, 5, 6]
    assert propose(tokens, k=2, min_n=1, max_n=2) == [4, 5]


def test_a_draft_past_the_end_of_the_context_repeats_the_pattern_and_is_empty_without_a_match():
    assert propose([5, 6, 7, 5, 6], k=4, min_n=2, max_n=2) == [7, 5, 6, 7]
    assert propose([1, 2, 3, 4], k=4, min_n=1, max_n=3) == []
    assert propose([1, 2, 3, 1], k=4, min_n=2, max_n=3) == []  # a 1-gram match is below min_n
    assert propose([1], k=4, min_n=1, max_n=3) == []
    assert propose([1, 2, 1, 2], k=0, min_n=1, max_n=2) == []


def test_a_repeated_token_run_drafts_its_continuation():
    assert propose([4, 4, 4, 4], k=3, min_n=1, max_n=3) == [4, 4, 4]
    assert propose([0, 4, 4, 4, 4, 4], k=2, min_n=2, max_n=2) == [4, 4]


def test_bad_ngram_bounds_are_named():
    with pytest.raises(ValueError, match="ngram_min"):
        propose([1, 2], k=1, min_n=0, max_n=2)
    with pytest.raises(ValueError, match="ngram_max"):
        propose([1, 2], k=1, min_n=3, max_n=2)


def test_the_longest_agreeing_prefix_is_accepted_with_the_draw_after_it():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, and a bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's own token replaces the miss
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]  # nothing accepted: a plain decode step's token
    assert accepted_tokens([], [3]) == [3]
    with pytest.raises(ValueError, match="draws for a draft of 2"):
        accepted_tokens([1, 2], [1, 2])


def test_acceptance_counts_the_accepted_positions_and_the_first_mismatch():
    a = Acceptance()
    a.record(drafted=4, accepted=4, decay=1.0)  # 4 checked, 4 accepted
    a.record(drafted=4, accepted=1, decay=1.0)  # 2 checked: one accepted, the mismatch
    assert (a.verified, a.accepted) == (6, 5)
    assert a.rate(prior=0.0, prior_weight=0.0) == pytest.approx(5 / 6)
    assert Acceptance().rate(prior=0.3) == pytest.approx(0.3)  # nothing measured: the prior
    with pytest.raises(ValueError, match="accepted 3 of a 2-token draft"):
        a.record(drafted=2, accepted=3)


def test_old_measurements_fade():
    a = Acceptance()
    for _ in range(10):
        a.record(4, 4)
    assert a.rate(prior=0.0, prior_weight=0.0) == 1.0
    for _ in range(10):
        a.record(4, 0)  # each a single position checked, against four accepted before
    assert a.rate(prior=0.0, prior_weight=0.0) < 0.35


def test_step_costs_are_interpolated_between_and_extrapolated_past_what_was_measured():
    c = StepCosts()
    assert c.seconds(4) is None
    c.record(1, 0.010)
    assert c.seconds(1) == 0.010 and c.seconds(5) is None  # one point says nothing of the slope
    c.record(9, 0.018)
    assert c.seconds(5) == pytest.approx(0.014)
    assert c.seconds(13) == pytest.approx(0.022)
    c.record(9, 0.028)  # a running mean, not the last figure
    assert 0.018 < c.seconds(9) < 0.028  # type: ignore[operator]


def test_expected_tokens_of_a_draft():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5


def flat(seconds: float):
    return lambda rows: seconds


def test_cheap_rows_and_good_acceptance_take_the_whole_drafts():
    assert plan_drafts([0.9, 0.8], [4, 3], base_rows=2, seconds=flat(0.01), max_rows=32) == [4, 3]


def test_costly_rows_and_poor_acceptance_take_nothing():
    linear = lambda rows: 0.01 * rows  # noqa: E731 (every row costs a whole step's worth)
    assert plan_drafts([0.3, 0.1], [4, 4], base_rows=1, seconds=linear, max_rows=32) == [0, 0]


def test_the_drafts_that_pay_are_taken_first_and_the_rest_left():
    # each row costs 10% of a 1-row step: a token worth more than 0.1 steps of the batch pays
    costs = lambda rows: 0.01 * (1 + 0.1 * (rows - 2))  # noqa: E731
    lens = plan_drafts([0.9, 0.05], [4, 4], base_rows=2, seconds=costs, max_rows=32)
    assert lens[0] >= 3 and lens[1] == 0


def test_unmeasured_costs_are_tried_and_the_row_bound_holds():
    assert plan_drafts([0.1], [4], base_rows=1, seconds=lambda rows: None, max_rows=32) == [4]
    assert sum(plan_drafts([0.9] * 4, [8] * 4, base_rows=4, seconds=flat(0.01), max_rows=12)) == 8


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The drafter's rule written the slow, obvious way."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for e in range(len(tokens) - 2, n - 2, -1):  # the latest earlier occurrence first
            if tokens[e - n + 1 : e + 1] == suffix:
                following = tokens[e + 1 :]
                draft: list[int] = []
                while len(draft) < k:
                    draft.append(following[len(draft)] if len(draft) < len(following) else draft[-len(following)])
                return draft
    return []


def test_the_drafter_agrees_with_the_obvious_rule_on_random_token_strings():
    import random

    rng = random.Random(7)
    for _ in range(500):
        tokens = [rng.randrange(rng.choice((2, 4, 16))) for _ in range(rng.randrange(1, 40))]
        k, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 3)
        assert propose(tokens, k, min_n, max_n) == reference_propose(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
