"""The OpenAI surface end to end through the router and its fake workers on loopback, read by the
official `openai` client as a vLLM user's code reads it: tool calls (required, named, auto;
whole and streamed), n choices, logprobs, echo, structured output and its 400s.

The fakes ignore the grammar and the prompt: each sample's output is its canned script, so each
test scripts the output the constraint or the prompt would have produced. Whether the real model
follows the Hermes tool prompt is a check against the real model, not here."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import openai
import pytest

from splitserve.bench.fake_workers import (
    DECODE_LOGPROB,
    PROMPT_LOGPROB,
    FakeDecodeWorker,
    FakeKVPlane,
    FakePrefillWorker,
)
from splitserve.router.config import Deadlines, Listeners, RouterConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)

LOCAL = Listeners(host="127.0.0.1", grpc_port=0, http_port=0)
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def run(
    outputs: Sequence[str], body: Callable[[openai.AsyncOpenAI, FakeDecodeWorker], Awaitable[Any]], **sections: Any
) -> Any:
    """`body(client, decode_worker)` against a router whose sample k answers `outputs[k]`."""

    async def scenario() -> Any:
        kv = FakeKVPlane()
        scripts = [list(o.encode()) for o in outputs]
        d = FakeDecodeWorker(kv, scripts[0], worker_id="d0", sample_scripts=scripts)
        p = FakePrefillWorker(kv, scripts[0], worker_id="p0", sample_scripts=scripts)
        await d.start()
        await p.start()
        cfg = RouterConfig(deadlines=Deadlines(stats_interval_s=0.05), listeners=LOCAL, **sections)
        router = Router(cfg, ByteTokenizer(), decode=[d.address], prefill=[p.address], rng=random.Random(0))
        await router.start()
        await router.wait_for_workers()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="k", max_retries=0)
        try:
            return await body(client, d)
        finally:
            await client.close()
            await router.stop(0)
            await d.stop()
            await p.stop()

    return asyncio.run(scenario())


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


async def streamed_calls(stream: Any) -> tuple[str, dict[int, dict[str, Any]], list[str | None], list[Any]]:
    """(content, calls by index, finish reasons, chunks) of a streamed chat answer, put together as
    OpenAI's documentation tells a client to."""
    content, finishes, chunks = "", [], []
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finishes.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
    return content, calls, finishes, chunks


REQUIRED_OUT = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'


def test_tool_choice_required_gives_message_tool_calls():
    async def body(client, d):
        r = await client.chat.completions.create(
            model="m", messages=MSG, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200
        )
        return r

    r = run([REQUIRED_OUT], body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)


def test_tool_choice_required_streamed():
    async def body(client, d):
        stream = await client.chat.completions.create(
            model="m", messages=MSG, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, stream=True
        )
        return await streamed_calls(stream)

    content, calls, finishes, _ = run([REQUIRED_OUT], body)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert finishes[-1] == "tool_calls"


def test_a_named_tool_choice_and_the_streamed_argument_pieces():
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def body(client, d):
        whole = await client.chat.completions.create(
            model="m", messages=MSG, tools=[WEATHER, TIME], tool_choice=named, max_tokens=200
        )
        stream = await client.chat.completions.create(
            model="m", messages=MSG, tools=[WEATHER, TIME], tool_choice=named, max_tokens=200, stream=True
        )
        return whole, await streamed_calls(stream)

    whole, (_, calls, finishes, chunks) = run(['{"city":"Paris"}'], body)
    assert calls_of(whole.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    pieces = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if not d.id]
    assert len(pieces) > 1  # the arguments come in pieces, as the tokens do
    assert finishes[-1] == "tool_calls"


HERMES_OUT = 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_parses_hermes_tool_calls_whole_and_streamed():
    async def body(client, d):
        whole = await client.chat.completions.create(model="m", messages=MSG, tools=[WEATHER], max_tokens=200)
        stream = await client.chat.completions.create(
            model="m", messages=MSG, tools=[WEATHER], max_tokens=200, stream=True
        )
        return whole, await streamed_calls(stream)

    whole, (content, calls, finishes, _) = run([HERMES_OUT], body)
    message = whole.choices[0].message
    assert message.content == "I will check."
    assert calls_of(message) == [("get_weather", {"city": "Paris"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert content == "I will check." and "<" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert finishes[-1] == "tool_calls"


def test_a_conversation_with_earlier_calls_and_tool_results_is_accepted():
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]

    async def body(client, d):
        return await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=200)

    r = run(["It is 22 C and sunny in Paris."], body)
    assert r.choices[0].message.content == "It is 22 C and sunny in Paris."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_n_choices_whole_and_streamed_with_usage_last():
    outputs = ["first answer", "the second one", "3rd"]

    async def body(client, d):
        whole = await client.chat.completions.create(model="m", messages=MSG, n=3, max_tokens=50)
        stream = await client.completions.create(
            model="m", prompt="Say", n=3, max_tokens=50, stream=True, stream_options={"include_usage": True}
        )
        return whole, [c async for c in stream]

    whole, chunks = run(outputs, body)
    assert [(c.index, c.message.content, c.finish_reason) for c in whole.choices] == [
        (i, o, "stop") for i, o in enumerate(outputs)
    ]
    assert whole.usage.completion_tokens == sum(len(o) + 1 for o in outputs)  # each script, and its EOS
    texts = {i: "" for i in range(3)}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
    assert list(texts.values()) == outputs
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_with_top_logprobs():
    async def body(client, d):
        return await client.chat.completions.create(
            model="m", messages=MSG, logprobs=True, top_logprobs=2, max_tokens=3
        )

    r = run(["Hi!"], body)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "i", "!"]
    assert [t.bytes for t in content] == [[72], [105], [33]]
    assert content[1].logprob == DECODE_LOGPROB
    assert [(a.token, a.logprob) for a in content[1].top_logprobs] == [("i", DECODE_LOGPROB), ("j", DECODE_LOGPROB - 1)]


def test_completions_logprobs_with_echo():
    async def body(client, d):
        return await client.completions.create(model="m", prompt="Hey", logprobs=1, echo=True, max_tokens=2)

    r = run(["ok"], body)
    choice = r.choices[0]
    assert choice.text == "Heyok"
    lp = choice.logprobs
    assert lp.tokens == ["H", "e", "y", "o", "k"]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:3] == [PROMPT_LOGPROB] * 2
    assert lp.token_logprobs[4] == DECODE_LOGPROB
    assert lp.top_logprobs[0] is None and lp.top_logprobs[4] == {"k": DECODE_LOGPROB}
    assert lp.text_offset == [0, 1, 2, 3, 4]


def test_response_format_json_schema_through_the_client():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    async def body(client, d):
        return await client.chat.completions.create(
            model="m",
            messages=MSG,
            max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
        )

    r = run(['{"city":"Paris"}'], body)
    assert json.loads(r.choices[0].message.content) == {"city": "Paris"}


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"extra_body": {"guided_regex": "("}}, "sampling.grammar"),  # llguidance's compile error, kept
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "schema"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"n": 0}, "n: must be >= 1"),
        ({"n": 17}, "sampling.n"),  # the server's cap (Limits.max_n)
        ({"logit_bias": {"5": 300}}, "logit_bias"),
        ({"tools": "get_weather"}, "tools: must be a non-empty list"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ],
)
def test_each_bad_value_is_a_400_the_client_sees_naming_the_field(extra, words):
    async def body(client, d):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=MSG, max_tokens=5, **extra)
        return e.value

    error = run(["x"], body)
    assert error.status_code == 400
    assert words in error.message, error.message


def test_completions_logprobs_over_5_is_a_400():
    async def body(client, d):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="m", prompt="x", logprobs=6)
        return e.value.message

    assert "logprobs: must be in [0, 5]" in run(["x"], body)
