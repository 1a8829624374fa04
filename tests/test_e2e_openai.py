"""The OpenAI surface on real processes and the default model, through the official `openai`
client: structured output that validates even when the decode worker dies mid-stream, tool
calls the client parses, n samples, logprobs (DESIGN.md, "The handoff record")."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Literal

import jsonschema
import openai
import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import FLAGS, stats, wait_all_blocks_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"enum": ["python", "rust", "cooking", "chess"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES: Any = [{"role": "user", "content": "Invent a person and describe them as JSON."}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: Any = [WEATHER, TIME]


@pytest.fixture(scope="module")
def model():
    return load_model(None, torch.float32, progress=False)


Mode = Literal["auto", "disaggregated", "colocated"]


async def _router(model: Any, decode: list[WorkerProcess], prefill: list[WorkerProcess], mode: Mode) -> Router:
    router = Router(
        RouterConfig(listeners=Listeners(host="127.0.0.1", grpc_port=0, http_port=0), routing=RoutingConfig(mode=mode)),
        EngineTokenizer(model.tokenizer),
        decode=[w.grpc_address for w in decode],
        prefill=[w.grpc_address for w in prefill],
    )
    await router.start(0)
    await router.wait_for_workers(30)
    return router


def _client(router: Router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0)


async def _person(client: openai.AsyncOpenAI, seed: int) -> tuple[str, str | None]:
    r = await client.chat.completions.create(
        model="splitserve",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        temperature=0.8,
        seed=seed,
        max_tokens=160,
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


async def _streamed_person(
    client: openai.AsyncOpenAI, seed: int, started: asyncio.Event, count: list[int], of: int
) -> str:
    stream = await client.chat.completions.create(
        model="splitserve",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        temperature=0.8,
        seed=seed,
        max_tokens=160,
        stream=True,
    )
    text, told = "", False
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            if not told:
                told = True
                count[0] += 1
                if count[0] == of:
                    started.set()
    return text


MIGRATED = 24


def test_json_schema_72_requests_validate_24_of_them_migrated_mid_stream(model):
    """48 requests, 16 at a time; then 24 streams on one decode worker, which is killed once every
    one of them has text: they migrate with their grammar (the replacement rebuilds each matcher
    from the tokens streamed) and still validate."""
    d1, d2, p = spawn_worker("decode", *FLAGS), spawn_worker("decode", *FLAGS), spawn_worker("prefill", *FLAGS)

    async def body() -> tuple[list[tuple[str, str | None]], list[str], float]:
        router = await _router(model, [d1], [p], "disaggregated")
        client = _client(router)
        try:
            gate = asyncio.Semaphore(16)

            async def one(seed: int) -> tuple[str, str | None]:
                async with gate:
                    return await _person(client, seed)

            first = await asyncio.gather(*(one(s) for s in range(48)))
            started, count = asyncio.Event(), [0]
            streams = [
                asyncio.ensure_future(_streamed_person(client, 1000 + s, started, count, MIGRATED))
                for s in range(MIGRATED)
            ]
            await asyncio.wait_for(started.wait(), 300)
            router.workers.add(d2.grpc_address, "decode")
            deadline = time.monotonic() + 30
            while not router.workers.healthy("decode", exclude=[d1.grpc_address]):
                assert time.monotonic() < deadline, "the second decode worker never became healthy"
                await asyncio.sleep(0.05)
            d1.kill()  # SIGKILL, mid-stream for all of them
            migrated = await asyncio.gather(*streams)
            return first, migrated, router.metrics.migrations._value.get()
        finally:
            await client.close()  # on this loop: a client left to the collector closes on a closed one
            await router.stop()

    try:
        first, migrated, migrations = asyncio.run(body())
        for text, finish in first:
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), PERSON)
        for text in migrated:
            jsonschema.validate(json.loads(text), PERSON)
        assert migrations >= MIGRATED, f"only {migrations} of the {MIGRATED} streams migrated"
        assert len({t for t, _ in first}) > 30  # sampled, not one answer 48 times
        wait_all_blocks_free([d2, p])
    finally:
        for w in (d1, d2, p):
            w.stop()


@pytest.fixture(scope="module")
def cluster(model):
    d, p = spawn_worker("decode", *FLAGS), spawn_worker("prefill", *FLAGS)
    yield model, d, p
    for w in (d, p):
        w.stop()


def _with_router(cluster: Any, mode: Mode, body: Any) -> Any:
    model, d, p = cluster

    async def run() -> Any:
        router = await _router(model, [d], [p], mode)
        client = _client(router)
        try:
            return await body(client)
        finally:
            await client.close()  # on this loop: a client left to the collector closes on a closed one
            await router.stop()

    out = asyncio.run(run())
    wait_all_blocks_free([d, p])
    return out


def _check_calls(message: Any, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_tool_calls_required_named_and_auto_come_back_as_tool_calls(cluster, mode):
    ask: Any = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]

    async def body(client: openai.AsyncOpenAI) -> Any:
        required = await client.chat.completions.create(
            model="splitserve", messages=ask, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120
        )
        named = await client.chat.completions.create(
            model="splitserve",
            messages=ask,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0,
            max_tokens=80,
        )
        auto = await client.chat.completions.create(
            model="splitserve", messages=ask, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=120
        )
        stream = await client.chat.completions.create(
            model="splitserve",
            messages=ask,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=120,
            stream=True,
        )
        pieces: dict[int, dict[str, str]] = {}
        async for chunk in stream:
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                got = pieces.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function and d.function.name:
                    got["name"] = d.function.name
                if d.function and d.function.arguments:
                    got["arguments"] += d.function.arguments
        return required, named, auto, pieces

    required, named, auto, pieces = _with_router(cluster, mode, body)
    _check_calls(required.choices[0].message, {"get_weather", "get_time"})
    assert required.choices[0].finish_reason == "tool_calls"
    _check_calls(named.choices[0].message, {"get_time"})
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(pieces.items())]
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in required.choices[0].message.tool_calls]
    assert streamed == whole  # greedy: the deltas put together are the whole answer's calls
    message = auto.choices[0].message
    assert message.tool_calls or message.content  # the model chose; either way the client parsed it
    if message.tool_calls:
        _check_calls(message, {"get_weather", "get_time"})


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_n_samples_logprobs_and_echo(cluster, mode):
    async def body(client: openai.AsyncOpenAI) -> Any:
        chat = await client.chat.completions.create(
            model="splitserve",
            messages=MESSAGES,
            n=4,
            temperature=0.9,
            seed=5,
            max_tokens=24,
            logprobs=True,
            top_logprobs=5,
        )
        again = await client.chat.completions.create(
            model="splitserve",
            messages=MESSAGES,
            n=4,
            temperature=0.9,
            seed=5,
            max_tokens=24,
        )
        echo = await client.completions.create(
            model="splitserve", prompt="The capital of France is", max_tokens=4, temperature=0, echo=True, logprobs=2
        )
        # four samples streaming, the client gone after two chunks: all four are freed (checked
        # by _with_router's wait for every block)
        stream = await client.chat.completions.create(
            model="splitserve", messages=MESSAGES, n=4, temperature=0.9, max_tokens=400, stream=True
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()
        return chat, again, echo

    chat, again, echo = _with_router(cluster, mode, body)
    texts = [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(chat.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4  # four different seeded samples
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]  # and the same again
    for c in chat.choices:
        assert c.logprobs is not None and c.logprobs.content
        for t in c.logprobs.content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 5
            assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    choice = echo.choices[0]
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert re.sub(r"\s+", " ", "".join(lp.tokens or [])) == re.sub(r"\s+", " ", choice.text)


def test_bad_fields_are_400_naming_the_field(cluster):
    async def body(client: openai.AsyncOpenAI) -> list[str]:
        bad: list[dict[str, Any]] = [
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            {"tools": {"not": "a list"}},
            {"logprobs": True, "top_logprobs": 21},
            {"n": 0},
            {"logit_bias": {"5": 101}},
        ]
        errors = []
        for extra in bad:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="splitserve", messages=MESSAGES, max_tokens=4, **extra)
            errors.append(str(e.value))
        # and a good request after them is answered
        ok = await client.chat.completions.create(model="splitserve", messages=MESSAGES, max_tokens=4)
        assert ok.choices[0].message.content is not None
        return errors

    errors = _with_router(cluster, "disaggregated", body)
    for error, field in zip(errors, ["grammar", "tools", "top_logprobs", "n", "logit_bias"], strict=True):
        assert field in error, error
    model, d, _ = cluster
    assert stats(d).running_requests == 0


SLOW_LARK = "start: s\ns: " + " | ".join(f's "w{i}"' for i in range(3000)) + ' | "x"\n'  # 13 s to build here


def test_slow_grammars_cost_their_own_request_only(cluster):
    """The 15-character regex that stalled every stream for two seconds, and a grammar whose
    lexer takes 13 s to build, sent while another stream runs: the first compiles within the
    budget and ends its own answer early, the second is refused 400 naming the grammar and the
    budget, and the running stream gets every token, its gaps printed beside their median."""

    async def body(client: openai.AsyncOpenAI) -> tuple[list[float], list[Any]]:
        gaps: list[float] = []
        started = asyncio.Event()

        async def running() -> int:
            stream = await client.completions.create(
                model="splitserve",
                prompt="Once upon a time",
                max_tokens=60,
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            )
            n, tokens, last = 0, 0, time.monotonic()
            async for chunk in stream:
                now = time.monotonic()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    n += 1
                    if n > 1:
                        gaps.append(now - last)
                    if n == 5:
                        started.set()
                last = now
            return tokens

        async def slow(extra: dict[str, Any]) -> Any:
            await started.wait()
            try:
                r = await client.completions.create(model="splitserve", prompt="a", max_tokens=8, extra_body=extra)
                return r.choices[0].finish_reason
            except openai.BadRequestError as e:
                return e

        count, regex, lark = await asyncio.gather(
            running(), slow({"guided_regex": "(a{1000}){1000}"}), slow({"guided_grammar": SLOW_LARK})
        )
        assert count == 60
        return gaps, [regex, lark]

    gaps, (regex, lark) = _with_router(cluster, "colocated", body)
    assert regex in ("stop", "length"), regex
    assert isinstance(lark, openai.BadRequestError) and lark.status_code == 400
    assert "grammar did not compile within the budget" in str(lark), lark
    median = sorted(gaps)[len(gaps) // 2]
    print(f"inter-token gaps: median {median * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f} ms ({max(gaps) / median:.2f}x)")
