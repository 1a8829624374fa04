"""Stop strings on streamed text: held back while they might start, cut where they match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.router.stop import StopMatcher


def stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        r = m.feed(p)
        out.append(r.text)
        if r.stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_no_stop_strings_pass_everything_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)


def test_match_inside_one_piece_cuts_before_it() -> None:
    assert stream(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_string_split_across_pieces() -> None:
    m = StopMatcher(["</s>"])
    assert m.feed("abc<") == ("abc", False)
    assert m.held == "<"
    assert m.feed("/") == ("", False)
    assert m.feed("s") == ("", False)
    assert m.feed(">tail") == ("", True)


def test_held_text_is_released_when_it_turns_out_not_to_match() -> None:
    m = StopMatcher(["</s>"])
    assert m.feed("a</") == ("a", False)
    assert m.feed("x") == ("</x", False)


def test_held_text_is_released_at_the_end_of_the_stream() -> None:
    assert stream(["STOP"], ["go ST"]) == ("go ST", False)


def test_the_stop_string_completed_first_wins() -> None:
    assert stream(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)
    assert stream(["abcd", "bc"], ["xabcd"]) == ("xa", True)  # "bc" completes before "abcd"
    assert stream(["ab", "b"], ["xab"]) == ("x", True)  # same end: the earlier start


def test_overlapping_prefixes_hold_the_longest_partial() -> None:
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)
    assert m.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert m.feed("b") == ("", True)


def test_nothing_after_a_match() -> None:
    m = StopMatcher(["x"])
    assert m.feed("ax") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="ab<>/", max_size=30),
    st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), min_size=1, max_size=3),
    st.data(),
)
def test_any_split_gives_the_unsplit_answer(text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    expected = (text[: min(hits)[1]], True) if hits else (text, False)
    assert stream(stops, pieces) == expected
