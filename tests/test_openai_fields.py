"""OpenAI request bodies -> the public GenerateRequest (router/openai/translate.py's from_openai and
the router/openai/ modules it uses): structured output, tools, messages, n, logprobs,
logit_bias, min_tokens, stop_token_ids; and every bad value a BadRequest naming its field."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.fields import BadRequest
from splitserve.router.openai.tools import Tool, calls_schema
from splitserve.router.openai.translate import from_openai

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(**body: Any) -> pb.GenerateRequest:
    return from_openai({"messages": MSG, **body}, chat=True, vocab_size=1000).generate


def completion(**body: Any) -> pb.GenerateRequest:
    return from_openai({"prompt": "x", **body}, chat=False, vocab_size=1000).generate


def grammar(req: pb.GenerateRequest) -> tuple[str | None, Any]:
    g = req.sampling.grammar
    kind = g.WhichOneof("kind")
    if kind == "json_schema":
        return kind, json.loads(g.json_schema)
    if kind == "choice":
        return kind, list(g.choice.choices)
    return kind, getattr(g, kind) if kind else None


# ---- structured output


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "text"}}, (None, None)),
        ({"response_format": {"type": "json_object"}}, ("json_object", True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            ("json_schema", SCHEMA),
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ("json_object", True)),
        ({"guided_json": SCHEMA}, ("json_schema", SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", SCHEMA)),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
        ({"guided_grammar": 'start: "a"+'}, ("lark", 'start: "a"+')),
        ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA)),
        ({"structured_outputs": {"regex": "a|b"}}, ("regex", "a|b")),
        ({"structured_outputs": {"choice": ["a"]}}, ("choice", ["a"])),
        ({"structured_outputs": {"grammar": "start: x\nx: /a/"}}, ("lark", "start: x\nx: /a/")),
        ({"structured_outputs": {"json_object": True}}, ("json_object", True)),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, ("regex", "a")),  # text is no constraint
    ],
)
def test_each_spelling_of_a_constraint_becomes_the_grammar(body, expected):
    assert grammar(chat(**body)) == expected
    assert grammar(completion(**body)) == expected  # vLLM takes them on completions too


@pytest.mark.parametrize(
    "body, field",
    [
        ({"response_format": "json"}, "response_format: must be an object"),
        ({"response_format": {}}, "response_format.type: required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema: must be a JSON schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        ({"response_format": {"type": "json_object", "extra": 1}}, "response_format: unsupported field(s) ['extra']"),
        ({"guided_json": "{not json"}, "guided_json: not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json: must be a JSON schema object"),
        ({"guided_regex": ""}, "guided_regex: must not be empty"),
        ({"guided_regex": 5}, "guided_regex: must be a string"),
        ({"guided_choice": []}, "guided_choice: must be a non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice[1]: must be a string"),
        ({"guided_grammar": " "}, "guided_grammar: must not be empty"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs: only one of"),
        ({"structured_outputs": {"xml": 1}}, "structured_outputs: unsupported field(s) ['xml']"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format and guided_regex: only one output constraint per request",
        ),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json and guided_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice and response_format: only one output constraint per request",
        ),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        chat(**body)
    assert str(e.value).startswith(field), str(e.value)


# ---- tools


def test_auto_puts_the_tools_in_a_system_message_and_no_grammar():
    req = chat(tools=[WEATHER, TIME])
    system, user = req.chat.messages
    assert (system.role, user.role, user.content) == ("system", "user", MSG[0]["content"])
    assert "<tools>\n" in system.content and "\n</tools>" in system.content
    lines = system.content.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == [
        WEATHER,
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    ]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system.content
    assert grammar(req) == (None, None)


def test_the_tools_are_appended_to_the_clients_own_system_message():
    req = chat(messages=[{"role": "system", "content": "Be brief."}, *MSG], tools=[WEATHER])
    assert [m.role for m in req.chat.messages] == ["system", "user"]
    assert req.chat.messages[0].content.startswith("Be brief.\n\n# Tools\n")


def test_none_gives_the_model_no_tools():
    req = chat(tools=[WEATHER], tool_choice="none")
    assert [m.role for m in req.chat.messages] == ["user"]
    assert grammar(req) == (None, None)


def test_required_is_a_json_array_of_calls_as_vllm_builds_it():
    kind, schema = grammar(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert kind == "json_schema"
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"],
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
    }
    one = grammar(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))[1]
    assert one["maxItems"] == 1


def test_required_lifts_each_tools_defs_to_the_top():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}
    schema: Any = calls_schema((Tool("f", None, params), Tool("g", None, params)))  # read as JSON
    assert schema["$defs"] == {"P": {"type": "string"}}
    assert all("$defs" not in b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    other = {**params, "$defs": {"P": {"type": "integer"}}}
    with pytest.raises(BadRequest, match=r"^tools\[1\].function.parameters.\$defs: 'P' differs"):
        calls_schema((Tool("f", None, params), Tool("g", None, other)))


def test_a_named_function_is_constrained_to_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = chat(tools=[TIME, WEATHER], tool_choice=named)
    assert grammar(req) == ("json_schema", WEATHER["function"]["parameters"])
    assert "Call the function get_weather" in req.chat.messages[0].content
    no_params = {"type": "function", "function": {"name": "get_time"}}
    assert grammar(chat(tools=[TIME], tool_choice=no_params))[1] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": {"a": 1}}, "tools: must be a non-empty list"),
        ({"tools": []}, "tools: must be a non-empty list"),
        ({"tools": [WEATHER, 5]}, "tools[1]: must be an object"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type: must be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function: required"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name: required"),
        ({"tools": [TIME, {"type": "function", "function": {"name": 7}}]}, "tools[1].function.name: must be a string"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name: must be 1-64"),
        ({"tools": [TIME, WEATHER, TIME]}, "tools[2].function.name: 'get_time' is already the name of tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters: must be a JSON schema object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools[0].function: unsupported"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice: must be one of"),
        ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tool_choice": "auto"}, "tool_choice: 'auto' needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function: required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "x", "function": {"name": "f"}}}, "tool_choice.type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name: no tool named 'nope' in tools",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls: must be a boolean"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        chat(**body)
    assert str(e.value).startswith(field), str(e.value)


def test_tool_choice_none_without_tools_is_fine_and_tools_are_chat_only():
    assert [m.role for m in chat(tool_choice="none").chat.messages] == ["user"]
    with pytest.raises(BadRequest, match="unsupported field"):
        completion(tools=[WEATHER])


# ---- messages


def test_earlier_calls_and_their_results_are_rendered_hermes_style():
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    req = chat(messages=messages, tools=[WEATHER, TIME])
    rendered = [(m.role, m.content) for m in req.chat.messages[1:]]
    assert rendered == [
        ("user", MSG[0]["content"]),
        (
            "assistant",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>',
        ),
        ("tool", "<tool_response>\n22 C, sunny\n</tool_response>"),
        ("tool", "<tool_response>\nnoon\n</tool_response>"),
    ]


def test_content_parts_are_joined_and_assistant_text_comes_before_its_calls():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = chat(
        messages=[{"role": "user", "content": parts}, {"role": "assistant", "content": "ok", "tool_calls": [call]}]
    )
    assert [m.content for m in req.chat.messages] == [
        "one\ntwo",
        'ok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ]


@pytest.mark.parametrize(
    "message, field",
    [
        ({"role": "user", "content": None}, "messages[0].content: must be a string"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[0].content[0]: only text"),
        ({"role": "user", "content": [{"type": "text", "text": 3}]}, "messages[0].content[0].text"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id: must be a string"),
        ({"role": "assistant", "tool_calls": "x"}, "messages[0].tool_calls: must be a list"),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function: required"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            "messages[0].tool_calls[0].function.arguments: must be a string",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f", "arguments": "{}"}}]},
            "messages[0].tool_calls[0].type",
        ),
    ],
)
def test_bad_messages_are_refused_naming_the_field(message, field):
    with pytest.raises(BadRequest) as e:
        chat(messages=[message])
    assert str(e.value).startswith(field), str(e.value)


def test_a_lone_surrogate_in_a_tools_schema_is_a_400_not_a_protobuf_error():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"description": "\ud800"}}}
    with pytest.raises(BadRequest, match="^tools: not valid Unicode"):
        chat(tools=[bad])


# ---- sampling fields


def test_n_logit_bias_min_tokens_and_stop_token_ids():
    sp = chat(n=3, logit_bias={"5": 10, "7": -100.0}, min_tokens=4, stop_token_ids=[1, 2]).sampling
    assert (sp.n, dict(sp.logit_bias), sp.min_tokens, list(sp.stop_token_ids)) == (3, {5: 10.0, 7: -100.0}, 4, [1, 2])
    sp = completion(n=2, logit_bias={"0": 1}).sampling
    assert (sp.n, dict(sp.logit_bias)) == (2, {0: 1.0})
    assert not chat().sampling.HasField("n")


def test_chat_logprobs_and_top_logprobs():
    sp = chat(logprobs=True, top_logprobs=5).sampling
    assert (sp.logprobs, sp.top_logprobs, sp.HasField("prompt_logprobs")) == (True, 5, False)
    sp = chat(logprobs=True).sampling
    assert (sp.logprobs, sp.HasField("top_logprobs")) == (True, False)
    assert not chat(logprobs=False).sampling.logprobs


def test_completions_logprobs_and_echo():
    sp = completion(logprobs=3).sampling
    assert (sp.logprobs, sp.top_logprobs, sp.HasField("prompt_logprobs")) == (True, 3, False)
    sp = completion(logprobs=0).sampling
    assert (sp.logprobs, sp.HasField("top_logprobs")) == (True, False)
    sp = completion(logprobs=2, echo=True).sampling
    assert sp.prompt_logprobs == 3  # each prompt token's own, and its 2 most likely others
    assert not completion(echo=True).sampling.HasField("prompt_logprobs")
    assert from_openai({"prompt": "Say hi", "echo": True}, chat=False).shape.echo == "Say hi"
    ids = from_openai({"prompt": [72, 105], "echo": True}, chat=False, decode=lambda ids: bytes(ids).decode())
    assert ids.shape.echo == "Hi"


@pytest.mark.parametrize(
    "body, field, is_chat",
    [
        ({"n": 0}, "n: must be >= 1", True),
        ({"n": 1.5}, "n: must be an integer", True),
        ({"n": 2**40}, "n: out of range", False),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs: must be in [0, 20], got 21", True),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs", True),
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true", True),
        ({"logprobs": 2}, "logprobs: must be a boolean", True),
        ({"logprobs": 6}, "logprobs: must be in [0, 5], got 6", False),
        ({"logprobs": -1}, "logprobs", False),
        ({"logprobs": "3"}, "logprobs: must be an integer", False),
        ({"echo": "yes"}, "echo: must be a boolean", False),
        ({"top_logprobs": 1}, "unsupported field(s): ['top_logprobs']", False),
        ({"echo": True}, "unsupported field(s): ['echo']", True),
        ({"logit_bias": [1]}, "logit_bias: must be an object", True),
        ({"logit_bias": {"abc": 1}}, "logit_bias: key 'abc' is not a token id", True),
        ({"logit_bias": {"-3": 1}}, "logit_bias: key '-3'", True),
        ({"logit_bias": {"1000": 1}}, "logit_bias: key '1000' is not a token id in [0, 1000)", True),
        ({"logit_bias": {"5": 101}}, "logit_bias['5']: must be in [-100, 100]", False),
        ({"logit_bias": {"5": "x"}}, "logit_bias['5']: must be a number", True),
        ({"min_tokens": -1}, "min_tokens: must be >= 0", True),
        ({"min_tokens": 2**33}, "min_tokens: out of range", True),
        ({"stop_token_ids": 5}, "stop_token_ids: must be a list", True),
        ({"stop_token_ids": [1, 1000]}, "stop_token_ids[1]: must be in [0, 999]", False),
    ],
)
def test_a_bad_sampling_value_is_refused_naming_the_field(body, field, is_chat):
    with pytest.raises(BadRequest) as e:
        chat(**body) if is_chat else completion(**body)
    assert str(e.value).startswith(field), str(e.value)


def test_every_translation_serialises():
    # the contract of from_openai: whatever it returns, protobuf can encode
    for req in (
        chat(tools=[WEATHER, TIME], tool_choice="required", n=2, logprobs=True, top_logprobs=20, logit_bias={"1": 1}),
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "é", "schema": {"description": "\ud800"}}}
        ),
        completion(logprobs=5, echo=True, guided_choice=["é"], min_tokens=1, stop_token_ids=[0]),
    ):
        assert pb.GenerateRequest.FromString(req.SerializeToString()) == req


# ---- no body makes the translation fail any other way


WEIRD: list[Any] = [None, True, 0, -1, 2**70, 1.5, "", "\ud800", "x", [], [1], {}, {"a": 1}, [{}], {"type": "function"}]


def rich_body(rng: random.Random) -> dict[str, Any]:
    """A valid body using the new fields, for the mutations below."""
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
    body: dict[str, Any] = {
        "messages": [
            *MSG,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}]},
        ],
        "tools": [WEATHER, TIME],
        "tool_choice": rng.choice(["auto", "required", "none", {"type": "function", "function": {"name": "get_time"}}]),
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "logit_bias": {"5": 1.5},
        "min_tokens": 1,
        "stop_token_ids": [2],
    }
    if body["tool_choice"] in ("auto", "none"):
        body[rng.choice(["response_format", "guided_json", "structured_outputs"])] = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            "guided_json": SCHEMA,
            "structured_outputs": {"choice": ["a", "b"]},
        }
    return copy.deepcopy(body)  # the mutations must not reach the module's constants


def slots(v: Any) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else []
    for k, child in items:
        out.append((v, k))
        out.extend(slots(child))
    return out


def test_a_mutated_body_is_translated_or_refused_never_an_error():
    rng = random.Random(20)
    refused = 0
    for _ in range(3000):
        body = rich_body(rng)
        for _ in range(rng.randint(1, 3)):
            container, key = rng.choice(slots(body))
            if rng.random() < 0.8:
                container[key] = copy.deepcopy(rng.choice(WEIRD))
            elif isinstance(container, dict):
                del container[key]
        for is_chat in (True, False):
            try:
                req = from_openai(body, chat=is_chat, vocab_size=1000).generate
            except BadRequest:
                refused += 1
                continue
            assert pb.GenerateRequest.FromString(req.SerializeToString()) == req
    assert 0 < refused < 6000  # both ways out were taken
