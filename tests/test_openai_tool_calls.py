"""The model's text -> OpenAI tool calls (router/openai/tool_calls.py): each tool_choice's reader,
fed the same text whole and in pieces of every size, gives the same content and calls; a
streamed answer never shows part of a <tool_call> tag."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.router.openai.tool_calls import (
    ArrayCalls,
    CallDelta,
    HermesCalls,
    NamedCall,
    PlainText,
    ToolOutput,
    merge_calls,
)
from splitserve.router.openai.tool_formats import tool_output
from splitserve.router.openai.tools import Tool, ToolChoice


def read(reader: ToolOutput, pieces: list[str]) -> tuple[str, list[dict], list[str]]:
    """(content, calls as whole answers show them, each delta's content) after feeding the pieces."""
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.call not in calls, "a call's id and name come once, first"
                calls[c.call] = {"id": c.id, "name": c.name, "arguments": c.arguments}
            else:
                calls[c.call]["arguments"] += c.arguments
    return "".join(d.content for d in deltas), [calls[k] for k in sorted(calls)], [d.content for d in deltas]


def pieces_of(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def every_split(text: str) -> list[list[str]]:
    rng = random.Random(0)
    return [[text], list(text), *(pieces_of(text, rng) for _ in range(20))]


HERMES = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" inside"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


@pytest.mark.parametrize("pieces", every_split(HERMES))
def test_hermes_blocks_become_calls_and_the_rest_content(pieces):
    reader = HermesCalls()
    content, calls, _ = read(reader, pieces)
    assert content == "Let me look that up."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "note": 'a } and a " inside'}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert reader.called


@pytest.mark.parametrize("pieces", every_split(HERMES))
def test_no_streamed_content_shows_part_of_a_tag(pieces):
    _, _, contents = read(HermesCalls(), pieces)
    for c in contents:
        assert "<" not in c and "tool" not in c


@pytest.mark.parametrize("text", ["The answer is 4 < 5, and <tool_ isn't a tag.\n", "<", "a <tool_call", ""])
def test_text_without_a_call_comes_out_unchanged(text):
    for pieces in every_split(text):
        content, calls, _ = read(HermesCalls(), pieces)
        assert (content, calls) == (text, [])


def test_a_block_that_is_not_a_call_stays_content_tags_and_all():
    text = "Hi <tool_call>not json</tool_call> bye"
    for pieces in every_split(text):
        content, calls, _ = read(HermesCalls(), pieces)
        assert (content, calls) == (text, [])


def test_a_block_never_closed_is_still_a_call():
    content, calls, _ = read(HermesCalls(), ['<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}'])
    assert (content, [(c["name"], c["arguments"]) for c in calls]) == ("", [("f", '{"x": [1, 2]}')])


@pytest.mark.parametrize(
    "block, arguments",
    [
        ('{"arguments": {"a": 1}, "name": "f"}', '{"a": 1}'),  # keys the other way round: read whole at the end
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),  # arguments as a JSON string: unquoted
        ('{"name": "f", "parameters": {"a": 1}}', '{"a": 1}'),  # the "parameters" spelling
        ('{"name": "f", "arguments": 7}', "7"),
    ],
)
def test_call_objects_in_other_shapes(block, arguments):
    for pieces in every_split(f"<tool_call>{block}</tool_call>"):
        content, calls, _ = read(HermesCalls(), pieces)
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == ("", [("f", arguments)])


def test_arguments_stream_piece_by_piece_once_the_name_is_known():
    reader = HermesCalls()
    deltas = [reader.feed(c) for c in '<tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>']
    calls = [c for d in deltas for c in d.calls]
    assert calls[0] == CallDelta(0, calls[0].id, "f", "")
    assert len(calls) == 1 + len('{"city": "Paris"}')  # then one piece per character fed
    assert "".join(c.arguments for c in calls) == '{"city": "Paris"}'


def test_whitespace_between_content_and_calls_is_dropped_but_kept_in_plain_text():
    assert read(HermesCalls(), ["Hello \n", "world\n\n"])[0] == "Hello \nworld\n\n"
    assert read(HermesCalls(), ["\n\n<tool_call>", '{"name": "f", "arguments": {}}', "</tool_call>\n\n"])[0] == ""


REQUIRED = '[{"name":"get_weather","parameters":{"city":"Paris"}}, {"name":"get_time","parameters":{}}]'


@pytest.mark.parametrize("pieces", every_split(REQUIRED))
def test_required_reads_the_array_items_as_calls(pieces):
    reader = ArrayCalls()
    content, calls, _ = read(reader, pieces)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert reader.called


def test_required_output_that_is_no_array_is_content():
    assert read(ArrayCalls(), ["sorry, ", "no"])[:2] == ("sorry, no", [])


def test_a_named_function_is_the_whole_output():
    reader = NamedCall("get_weather")
    content, calls, _ = read(reader, ['{"ci', 'ty":', '"Paris"}'])
    assert (content, [(c["name"], c["arguments"]) for c in calls]) == ("", [("get_weather", '{"city":"Paris"}')])
    # even with no output at all, the call is made (with the arguments it has)
    assert read(NamedCall("f"), [])[1][0]["arguments"] == ""


def test_plain_text_and_the_reader_each_choice_gets():
    assert read(PlainText(), ["a", "<tool_call>"])[:2] == ("a<tool_call>", [])
    tools = (Tool("f", None, None),)
    assert isinstance(tool_output(None), PlainText)
    assert isinstance(tool_output(ToolChoice("auto", tools)), HermesCalls)
    assert isinstance(tool_output(ToolChoice("required", tools)), ArrayCalls)
    assert isinstance(tool_output(ToolChoice("function", tools, "f")), NamedCall)


def test_merge_keeps_one_entry_per_call_and_the_head_first():
    head = CallDelta(0, "call_x", "f", "")
    merged = merge_calls(
        [head, CallDelta(0, None, None, "{"), CallDelta(0, None, None, "}"), CallDelta(1, "y", "g", "")]
    )
    assert merged == [CallDelta(0, "call_x", "f", "{}"), CallDelta(1, "y", "g", "")]
    assert merged[0].as_json() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    assert CallDelta(0, None, None, "{").as_json() == {"index": 0, "function": {"arguments": "{"}}
