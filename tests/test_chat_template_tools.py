"""Tools through the model's own chat template: a template that takes tools gets them, and the
conversation's earlier calls and results, as structures (router/openai/messages.py,
router/validation.py), the special token that opens its calls stays in the decoded text, and a
template that takes none keeps the router's Hermes prompt. Each refusal names its field."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Limits
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.openai.translate import from_openai
from splitserve.router.validation import ValidationError, validate

# Mistral's way, cut down: the tools before the last user turn, earlier calls after [TOOL_CALLS],
# results inside [TOOL_RESULTS] with the call's id.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls|tojson }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ {'call_id': m.tool_call_id, 'content': m.content}|tojson }}"
    "[/TOOL_RESULTS]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'system' %}{{ m.content }}\n{% else %}{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}{% endfor %}"
)
PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
SPECIALS = ["<s>", "</s>", "[TOOL_CALLS]", "[INST]", "[/INST]"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "user", "content": "And tomorrow?"},
]


def tokenizer(template: str) -> Tokenizer:
    """Byte-level, no merges: every text round-trips; the specials are one token each."""
    alphabet = ByteLevel.alphabet()
    backend = Backend(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    bos, eos = (backend.token_to_id(t) for t in ("<s>", "</s>"))
    assert bos is not None and eos is not None
    return Tokenizer(backend, chat_template=template, bos_token_id=bos, eos_token_ids=[eos])


def prompt(tok: Tokenizer, messages: list, tools: list | None = TOOLS) -> tuple[pb.GenerateRequest, str]:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    router_tok = EngineTokenizer(tok)
    oreq = from_openai(body, True, tok.vocab_size, None, router_tok.tool_format)
    ids = validate(oreq.generate, Limits(), router_tok).prompt_token_ids
    return oreq.generate, tok.decode(ids, skip_special_tokens=False)


def test_a_template_that_takes_tools_renders_them_and_the_history():
    tok = tokenizer(MISTRAL)
    assert tok.tool_format is not None and tok.tool_format.name == "mistral"
    req, text = prompt(tok, HISTORY)
    assert json.loads(req.chat.tools_json) == TOOLS
    tools = json.dumps(TOOLS, ensure_ascii=False)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call_1"}
    assert text == (
        "<s>[INST]Weather in Paris?[/INST]"
        f"[TOOL_CALLS]{json.dumps([call], ensure_ascii=False)}</s>"
        '[TOOL_RESULTS]{"call_id": "call_1", "content": "18 C"}[/TOOL_RESULTS]'
        f"[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS][INST]And tomorrow?[/INST]"
    )
    assert "<tools>" not in text  # no Hermes prompt beside the model's own


def test_the_call_marker_is_decoded_and_other_specials_skipped():
    tok = tokenizer(MISTRAL)
    out = tok.encode('[TOOL_CALLS][{"name": "f", "arguments": {}}]</s>')
    assert tok.decode(out) == '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(t) for t in out) + detok.flush()
    assert streamed == tok.decode(out)
    assert tokenizer(PLAIN).decode(out) == '[{"name": "f", "arguments": {}}]'  # no tools: all specials skipped


def test_a_template_without_tools_gets_the_router_s_hermes_prompt():
    tok = tokenizer(PLAIN)
    assert tok.tool_format is None
    req, text = prompt(tok, HISTORY)
    assert not req.chat.tools_json
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


def chat(**kw: object) -> pb.GenerateRequest:
    msgs = kw.pop("messages", [pb.ChatMessage(role="user", content="hi")])
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=msgs, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("template", "request_", "field"),
    [
        (PLAIN, chat(tools_json=json.dumps(TOOLS)), "chat.tools_json"),  # takes no tools
        (MISTRAL, chat(tools_json="[{"), "chat.tools_json"),
        (MISTRAL, chat(tools_json='{"a": 1}'), "chat.tools_json"),
        (
            MISTRAL,
            chat(messages=[pb.ChatMessage(role="assistant", content="", tool_calls_json="[1]")]),
            "chat.messages[0].tool_calls_json",
        ),
        (MISTRAL, chat(messages=[pb.ChatMessage(role="tool", content="x")]), "chat"),  # the template refuses
    ],
)
def test_refusals_name_the_field(template, request_, field):
    with pytest.raises(ValidationError) as e:
        validate(request_, Limits(), EngineTokenizer(tokenizer(template)))
    assert e.value.field == field
