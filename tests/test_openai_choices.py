"""Synthetic GenerateResponse sequences -> OpenAI choices (router/openai/choices.py and
openai/logprobs.py): samples interleaved (n > 1), chat and completions logprobs, echo with the
prompt's logprobs, tool calls whole and streamed, finish reasons."""

from __future__ import annotations

import json
import math

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.openai.choices import Answer, Shape, stream_choice, whole_choices
from splitserve.router.openai.logprobs import TokenText
from splitserve.router.openai.tools import Tool, ToolChoice
from splitserve.router.tokenizer import ByteTokenizer

STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH
TEXT = TokenText(ByteTokenizer())


def resp(
    index: int, text: str, finish: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED, lp: float = -0.5, top: int = 0, **kw
) -> pb.GenerateResponse:
    """A response whose tokens are the text's bytes (ByteTokenizer's ids), each with logprob `lp` and
    `top` alternatives: the token itself, then the next byte values, each 1 less likely."""
    ids = list(text.encode())
    tops = [pb.TopLogprobs(token_ids=[t + j for j in range(top)], logprobs=[lp - j for j in range(top)]) for t in ids]
    return pb.GenerateResponse(
        text=text, token_ids=ids, logprobs=[lp] * len(ids), top_logprobs=tops, finish_reason=finish, index=index, **kw
    )


def shape_all(shape: Shape, responses: list[pb.GenerateResponse]) -> tuple[list, list]:
    """(whole choices, streamed chunk choices) for the same responses."""
    whole_answer, stream_answer = Answer(shape, TEXT), Answer(shape, TEXT)
    pieces = [whole_answer.update(r) for r in responses]
    streamed = [c for r in responses if (c := stream_choice(stream_answer.update(r), shape.chat)) is not None]
    return whole_choices(pieces, shape.chat), streamed


def test_interleaved_samples_are_choices_by_index():
    responses = [
        resp(1, "Bon"),
        resp(0, "Hel"),
        resp(0, "lo", STOP),
        resp(1, "jour", LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=9)),
    ]
    whole, streamed = shape_all(Shape(chat=True), responses)
    assert whole == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None, "finish_reason": "stop"},
        {
            "index": 1,
            "message": {"role": "assistant", "content": "Bonjour"},
            "logprobs": None,
            "finish_reason": "length",
        },
    ]
    assert streamed == [
        {"index": 1, "delta": {"role": "assistant", "content": "Bon"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "delta": {"content": "jour"}, "logprobs": None, "finish_reason": "length"},
    ]
    completions, _ = shape_all(Shape(chat=False), responses)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in completions] == [
        (0, "Hello", "stop"),
        (1, "Bonjour", "length"),
    ]


def test_a_response_that_adds_nothing_is_no_chunk_but_a_first_one_is():
    answer = Answer(Shape(chat=True), TEXT)
    first = stream_choice(answer.update(pb.GenerateResponse(token_ids=[0xE6])), chat=True)  # text held back
    assert first == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert stream_choice(answer.update(pb.GenerateResponse(token_ids=[0xBC])), chat=True) is None


def test_chat_logprobs_with_top_logprobs():
    whole, streamed = shape_all(Shape(chat=True, logprobs=True, top_logprobs=2), [resp(0, "Hi", STOP, top=3)])
    h = {"token": "H", "logprob": -0.5, "bytes": [72]}
    i = {"token": "i", "logprob": -0.5, "bytes": [105]}
    assert whole[0]["logprobs"] == {
        "content": [
            {**h, "top_logprobs": [h, {"token": "I", "logprob": -1.5, "bytes": [73]}]},
            {**i, "top_logprobs": [i, {"token": "j", "logprob": -1.5, "bytes": [106]}]},
        ]
    }
    assert streamed[0]["logprobs"] == whole[0]["logprobs"]


def test_chat_logprobs_without_top_ones_and_a_masked_token():
    r = pb.GenerateResponse(text="é", token_ids=[0xC3, 0xA9], logprobs=[-math.inf, -1e6], finish_reason=STOP)
    whole, _ = shape_all(Shape(chat=True, logprobs=True), [r])
    # JSON has no -Infinity: vLLM's floor; each byte of é decodes alone to U+FFFD
    assert (
        whole[0]["logprobs"]["content"]
        == [{"token": "\ufffd", "logprob": -9999.0, "bytes": [239, 191, 189], "top_logprobs": []}] * 2
    )
    json.dumps(whole, allow_nan=False)


def test_completions_logprobs_text_offset_and_top_dicts():
    whole, streamed = shape_all(
        Shape(chat=False, logprobs=True, top_logprobs=1), [resp(0, "ab", lp=-2.0, top=2), resp(0, "c", STOP)]
    )
    assert whole[0]["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-2.0, -2.0, -0.5],
        "top_logprobs": [{"a": -2.0}, {"b": -2.0}, {"c": -0.5}],
        "text_offset": [0, 1, 2],
    }
    assert [c["logprobs"]["tokens"] for c in streamed] == [["a", "b"], ["c"]]
    # logprobs k gives k alternatives, the chosen token added when it is not among them
    r = pb.GenerateResponse(
        text="a", token_ids=[97], logprobs=[-3.0], top_logprobs=[pb.TopLogprobs(token_ids=[98], logprobs=[-1.0])]
    )
    whole, _ = shape_all(Shape(chat=False, logprobs=True, top_logprobs=1), [r])
    assert whole[0]["logprobs"]["top_logprobs"] == [{"b": -1.0, "a": -3.0}]


def test_echo_puts_the_prompt_and_its_logprobs_first_in_each_choice():
    prompt = [
        pb.PromptLogprob(token_id=ord("H")),
        pb.PromptLogprob(token_id=ord("i"), logprob=-1.0, top=pb.TopLogprobs(token_ids=[ord("o")], logprobs=[-0.125])),
    ]
    responses = [resp(0, "!", prompt_logprobs=prompt), resp(1, "?"), resp(0, "", STOP), resp(1, "", STOP)]
    whole, streamed = shape_all(Shape(chat=False, logprobs=True, top_logprobs=1, echo="Hi"), responses)
    for c, last in zip(whole, "!?", strict=True):
        assert c["text"] == "Hi" + last
        assert c["logprobs"] == {
            "tokens": ["H", "i", last],
            "token_logprobs": [None, -1.0, -0.5],
            "top_logprobs": [None, {"o": -0.125, "i": -1.0}, {last: -0.5}],
            "text_offset": [0, 1, 2],
        }
    assert [c["text"] for c in streamed] == ["Hi!", "Hi?", "", ""]
    plain, _ = shape_all(Shape(chat=False, echo="Hi"), [resp(0, "!", STOP)])
    assert (plain[0]["text"], plain[0]["logprobs"]) == ("Hi!", None)


TOOLS = (Tool("get_weather", None, None), Tool("get_time", None, None))


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_required_calls_whole_and_streamed():
    out = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    responses = [resp(0, out[:30]), resp(0, out[30:], STOP)]
    whole, streamed = shape_all(Shape(chat=True, tools=ToolChoice("required", TOOLS)), responses)
    message = whole[0]["message"]
    assert message["content"] is None and whole[0]["finish_reason"] == "tool_calls"
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    # streamed: each call's id, type and name in its first delta, its arguments in pieces after
    deltas = [d for c in streamed for d in c["delta"].get("tool_calls", [])]
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["type"], d["function"]["name"]) for d in heads] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    args = {i: "".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)}
    assert args == {0: '{"city":"Paris"}', 1: "{}"}
    assert streamed[-1]["finish_reason"] == "tool_calls"


def test_a_named_function_and_auto_calls():
    named = Shape(chat=True, tools=ToolChoice("function", TOOLS, "get_time"))
    whole, streamed = shape_all(named, [resp(0, '{"tz":'), resp(0, '"UTC"}', STOP)])
    assert calls_of(whole[0]["message"]) == [("get_time", {"tz": "UTC"})]
    assert streamed[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz":'}
    auto = Shape(chat=True, tools=ToolChoice("auto", TOOLS))
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole, streamed = shape_all(auto, [resp(0, text[:20]), resp(0, text[20:], STOP)])
    assert whole[0]["message"]["content"] == "Checking."
    assert calls_of(whole[0]["message"]) == [("get_weather", {"city": "Oslo"})]
    assert "".join(c["delta"].get("content", "") for c in streamed) == "Checking."
    plain, _ = shape_all(auto, [resp(0, "Just text.", STOP)])
    assert plain[0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Just text."},
        "logprobs": None,
        "finish_reason": "stop",
    }


def test_a_call_cut_by_max_tokens_finishes_with_length():
    whole, _ = shape_all(Shape(chat=True, tools=ToolChoice("function", TOOLS, "get_time")), [resp(0, '{"tz', LENGTH)])
    assert whole[0]["finish_reason"] == "length"
    assert whole[0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"tz'


def test_usage_is_the_last_one_reported():
    answer = Answer(Shape(chat=True), TEXT)
    answer.update(resp(0, "a", usage=pb.Usage(prompt_tokens=2, completion_tokens=1)))
    answer.update(resp(1, "b"))
    assert answer.usage is not None and answer.usage.completion_tokens == 1
