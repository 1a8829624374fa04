"""The families' tool-call syntaxes (engine/tool_call_format.py, router/openai/tool_formats.py):
which syntax a chat template teaches, the reader of each, fed whole and in pieces of every
size, and output that is no call given back as content."""

from __future__ import annotations

import json

import pytest

from splitserve.engine.tool_call_format import template_tool_format
from splitserve.router.openai.tool_calls import HermesCalls
from splitserve.router.openai.tool_formats import LeadingObjects, MarkedArray, tool_output
from splitserve.router.openai.tools import Tool, ToolChoice
from tests.test_openai_tool_calls import every_split, read

WEATHER = {"city": "Paris", "note": 'a } and a " inside'}
MISTRAL = 'Checking.\n[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}, "
MISTRAL += '{"name": "get_time", "arguments": {}}]'
PHI4 = 'functools[{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]"
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}; "
LLAMA += '{"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),  # no tools: the router's Hermes prompt
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("{% if tools %}<|python_tag|>{{ tools|tojson }}{% endif %}", "llama3_json"),
        ("{% if tools %}Environment: ipython{% endif %}", "llama3_json"),
        ("{% if tools %}<|tool|>{{ tools|tojson }}<|/tool|> functools[...]{% endif %}", "phi4_mini"),
        ("{% if tools %}<tools>{{ tools|tojson }}</tools> <tool_call>{% endif %}", "hermes"),
        ("{% if tools %}{{ tools|tojson }}{% endif %}", "hermes"),  # takes tools, syntax unnamed
    ],
)
def test_the_template_names_its_syntax(template, expected):
    fmt = template_tool_format(template)
    assert (fmt.name if fmt else None) == expected


def test_auto_reads_the_template_s_syntax():
    tools = (Tool("f", None, None),)
    readers = {None: HermesCalls, "hermes": HermesCalls, "mistral": MarkedArray, "llama3_json": LeadingObjects}
    for fmt, kind in readers.items():
        assert isinstance(tool_output(ToolChoice("auto", tools, template_format=fmt)), kind)


@pytest.mark.parametrize("pieces", every_split(MISTRAL))
def test_mistral_marker_then_array(pieces):
    content, calls, _ = read(MarkedArray("[TOOL_CALLS]"), pieces)
    assert content == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]


@pytest.mark.parametrize("pieces", every_split(PHI4))
def test_phi4_mini_functools_array(pieces):
    content, calls, deltas = read(MarkedArray("functools"), pieces)
    assert content == "" and all(d == "" for d in deltas)  # no piece of the marker shows
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER)]


def test_a_marker_that_leads_no_calls_is_content():
    text = "Use functools.partial here."
    for pieces in every_split(text):
        content, calls, _ = read(MarkedArray("functools"), pieces)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("pieces", every_split(LLAMA))
def test_llama3_objects_separated_by_semicolons(pieces):
    content, calls, _ = read(LeadingObjects(), pieces)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", ["The weather in Paris is mild.", ' {"answer": 42}', "  "])
def test_llama3_answers_that_are_no_calls_stay_content(text):
    for pieces in every_split(text):
        content, calls, _ = read(LeadingObjects(), pieces)
        assert calls == []
        assert content.strip() == text.strip()


def test_llama3_plain_answer_streams_as_it_comes():
    reader = LeadingObjects()
    assert reader.feed("The ") == ("The ", [])
    assert reader.feed("sky") == ("sky", [])
