"""Client requests are checked field by field; each rejection names its field."""

from __future__ import annotations

import sys
import types

import pytest

from splitserve.engine.sampling import GrammarSpec, InvalidSamplingParam
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Limits
from splitserve.router.tokenizer import ByteTokenizer
from splitserve.router.validation import ValidationError, validate

CFG = Limits(
    max_model_len=1024,
    max_prompt_tokens=512,
    max_tokens_cap=256,
    default_max_tokens=64,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_prompt_chars=2000,
    max_chat_messages=3,
)
TOK = ByteTokenizer()


def req(**kw: object) -> pb.GenerateRequest:
    kw.setdefault("text", "hello")
    return pb.GenerateRequest(**kw)  # type: ignore[arg-type]  # any field, of any type: validation's input


def sampling(**kw: object) -> pb.GenerateRequest:
    return req(sampling=pb.SamplingParams(**kw))  # type: ignore[arg-type]  # any field, of any type


def rejected(r: pb.GenerateRequest, cfg: Limits = CFG) -> str:
    with pytest.raises(ValidationError) as e:
        validate(r, cfg, TOK)
    return str(e.value)


def test_defaults_apply_to_unset_fields() -> None:
    v = validate(req(request_id="r-1"), CFG, TOK)
    assert v.request_id == "r-1"
    assert v.prompt_token_ids == tuple(b"hello")
    s = v.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, s.logprobs) == (1.0, 1.0, 0, 64, None, False)


def test_explicit_zero_is_not_unset() -> None:
    assert validate(sampling(temperature=0.0), CFG, TOK).sampling.temperature == 0.0


def test_every_field_is_carried() -> None:
    s = validate(
        sampling(
            temperature=0.5,
            top_p=0.5,
            top_k=5,
            min_p=0.25,
            seed=7,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            max_tokens=9,
            stop_token_ids=[3, 3, 4],
            stop=["x"],
            logprobs=True,
            ignore_eos=True,
        ),
        CFG,
        TOK,
    ).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.repetition_penalty) == (0.5, 0.5, 5, 0.25, 7, 1.5)
    assert (s.presence_penalty, s.frequency_penalty, s.max_tokens) == (0.5, -0.5, 9)
    assert (s.stop_token_ids, s.stop, s.logprobs, s.ignore_eos) == ((3, 4), ("x",), True, True)


def test_an_empty_request_id_gets_a_fresh_one() -> None:
    a, b = validate(req(), CFG, TOK), validate(req(), CFG, TOK)
    assert a.request_id and a.request_id != b.request_id


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (req(request_id="has space"), "request_id:"),
        (req(request_id="x" * 129), "request_id:"),
        (pb.GenerateRequest(), "prompt:"),
        (req(text=""), "text:"),
        (req(text="x" * 2001), "text:"),
        (req(text="x" * 600), "text: 600 tokens exceed"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids: gives no tokens"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 258])), "token_ids.ids[1]:"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), "token_ids.ids[0]:"),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "chat.messages:"),
        (
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="root", content="x")])),
            "chat.messages[0].role:",
        ),
        (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 4)), "chat.messages:"),
        (sampling(temperature=-0.1), "sampling.temperature:"),
        (sampling(temperature=float("nan")), "sampling.temperature:"),
        (sampling(top_p=0.0), "sampling.top_p:"),
        (sampling(top_p=1.5), "sampling.top_p:"),
        (sampling(top_k=-1), "sampling.top_k:"),
        (sampling(top_k=10_000), "sampling.top_k:"),
        (sampling(min_p=2.0), "sampling.min_p:"),
        (sampling(seed=-5), "sampling.seed:"),
        (sampling(repetition_penalty=0.0), "sampling.repetition_penalty:"),
        (sampling(presence_penalty=3.0), "sampling.presence_penalty:"),
        (sampling(frequency_penalty=-2.5), "sampling.frequency_penalty:"),
        (sampling(max_tokens=0), "sampling.max_tokens:"),
        (sampling(max_tokens=257), "sampling.max_tokens:"),
        (sampling(stop_token_ids=[999]), "sampling.stop_token_ids[0]:"),
        (sampling(stop_token_ids=list(range(33))), "sampling.stop_token_ids:"),
        (sampling(stop=["a", "b", "c"]), "sampling.stop:"),
        (sampling(stop=["ok", ""]), "sampling.stop[1]:"),
        (sampling(stop=["x" * 9]), "sampling.stop[0]:"),
    ],
)
def test_each_bad_field_is_named(request_: pb.GenerateRequest, field: str) -> None:
    assert rejected(request_).startswith(field)


def test_prompt_plus_max_tokens_must_fit_the_model() -> None:
    cfg = Limits(max_model_len=560, max_prompt_tokens=512, max_tokens_cap=256, default_max_tokens=64)
    assert rejected(req(text="x" * 400, sampling=pb.SamplingParams(max_tokens=201)), cfg).startswith(
        "sampling.max_tokens:"
    )
    # unset max_tokens shrinks to the room left instead
    assert validate(req(text="x" * 500), cfg, TOK).sampling.max_tokens == 60


def test_logprobs_can_be_switched_off_by_the_server() -> None:
    cfg = Limits(allow_logprobs=False)
    assert rejected(sampling(logprobs=True), cfg).startswith("sampling.logprobs:")
    assert validate(sampling(logprobs=False), cfg, TOK).sampling.logprobs is False


def test_chat_is_rendered_with_the_template() -> None:
    r = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    ids = validate(r, CFG, TOK).prompt_token_ids
    assert ids == tuple(TOK.encode_chat([("user", "hi")]))


def _with_unknown_field(msg: bytes, number: int) -> bytes:
    return msg + bytes([(number << 3) & 0x7F | 0x80, number >> 4, 0x01])  # varint field `number` = 1


def test_fields_the_api_does_not_define_are_rejected() -> None:
    """So nothing beyond the public API (an internal field, a newer client's option) slips through."""
    raw = _with_unknown_field(req().SerializeToString(), 99)
    assert rejected(pb.GenerateRequest.FromString(raw)).startswith("request: unknown field number(s) [99]")
    s = pb.SamplingParams.FromString(_with_unknown_field(b"", 40))
    assert rejected(req(sampling=s)).startswith("sampling: unknown field number(s) [40]")


# ---- the fields of structured output, n samples and logprobs


def test_the_new_sampling_fields_are_carried() -> None:
    s = validate(
        sampling(
            logprobs=True,
            top_logprobs=5,
            logit_bias={7: 1.5, 3: -100.0},
            min_tokens=3,
            n=4,
            grammar=pb.Grammar(choice=pb.ChoiceList(choices=["yes", "no"])),
            prompt_logprobs=2,
        ),
        CFG,
        TOK,
    ).sampling
    assert (s.top_logprobs, s.logit_bias, s.min_tokens, s.n, s.prompt_logprobs) == (5, ((3, -100.0), (7, 1.5)), 3, 4, 2)
    assert s.grammar == GrammarSpec("choice", '["yes", "no"]')
    unset = validate(req(), CFG, TOK).sampling
    assert (unset.top_logprobs, unset.logit_bias, unset.min_tokens, unset.n, unset.grammar) == (0, (), 0, 1, None)


@pytest.mark.parametrize(
    ("grammar", "spec"),
    [
        (pb.Grammar(json_schema='{"type": "object"}'), GrammarSpec("json_schema", '{"type": "object"}')),
        (pb.Grammar(json_object=True), GrammarSpec("json_object")),
        (pb.Grammar(regex="[0-9]+"), GrammarSpec("regex", "[0-9]+")),
        (pb.Grammar(lark='start: "a"'), GrammarSpec("lark", 'start: "a"')),
    ],
)
def test_each_grammar_kind_becomes_its_spec(grammar: pb.Grammar, spec: GrammarSpec) -> None:
    assert validate(sampling(grammar=grammar), CFG, TOK).sampling.grammar == spec


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (sampling(logprobs=True, top_logprobs=21), "sampling.top_logprobs: must be in [0, 20]"),
        (sampling(top_logprobs=3), "sampling.top_logprobs: requires sampling.logprobs"),
        (sampling(logprobs=False, top_logprobs=3), "sampling.top_logprobs: requires sampling.logprobs"),
        (sampling(prompt_logprobs=22), "sampling.prompt_logprobs:"),
        (sampling(n=0), "sampling.n:"),
        (sampling(n=17), "sampling.n:"),
        (sampling(logit_bias={5: 1.0, 999: 1.0}), "sampling.logit_bias[999]: 999 is outside the vocabulary"),
        (sampling(logit_bias={-1: 1.0}), "sampling.logit_bias[-1]:"),
        (sampling(logit_bias={5: 100.5}), "sampling.logit_bias[5]: must be in [-100, 100]"),
        (sampling(logit_bias={5: -101.0}), "sampling.logit_bias[5]:"),
        (sampling(logit_bias={5: float("nan")}), "sampling.logit_bias[5]:"),
        (sampling(logit_bias=dict.fromkeys(range(301), 1.0)), "sampling.logit_bias: more than 300"),
        (sampling(min_tokens=10, max_tokens=5), "sampling.min_tokens: 10 exceeds max_tokens 5"),
        (sampling(min_tokens=65), "sampling.min_tokens: 65 exceeds max_tokens 64"),  # the default's
        (sampling(grammar=pb.Grammar()), "sampling.grammar: one of"),
        (sampling(grammar=pb.Grammar(json_object=False)), "sampling.grammar.json_object:"),
        (sampling(grammar=pb.Grammar(regex="")), "sampling.grammar.regex:"),
        (sampling(grammar=pb.Grammar(json_schema="")), "sampling.grammar.json_schema:"),
        (sampling(grammar=pb.Grammar(choice=pb.ChoiceList())), "sampling.grammar.choice.choices:"),
        (sampling(grammar=pb.Grammar(lark="x" * 2001)), "sampling.grammar.lark: longer than"),
    ],
)
def test_each_bad_new_field_is_named(request_: pb.GenerateRequest, field: str) -> None:
    assert rejected(request_).startswith(field)


def test_n_has_a_server_cap() -> None:
    assert validate(sampling(n=16), CFG, TOK).sampling.n == 16
    cfg = Limits(max_n=2)
    assert rejected(sampling(n=3), cfg) == "sampling.n: must be in [1, 2], got 3"


def test_prompt_logprobs_are_logprobs_the_server_can_switch_off() -> None:
    assert rejected(sampling(prompt_logprobs=1), Limits(allow_logprobs=False)).startswith("sampling.prompt_logprobs:")


def test_a_grammar_that_does_not_compile_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the engine's check refuses (InvalidSamplingParam("grammar", why)) is the client's
    INVALID_ARGUMENT on sampling.grammar, with the check's reason."""
    checked: list[GrammarSpec] = []

    def check_grammar(spec: GrammarSpec) -> None:
        checked.append(spec)
        if spec.source.startswith("{"):
            raise InvalidSamplingParam("grammar", "does not compile: expected a property name")

    module = types.ModuleType("splitserve.engine.grammar_source")
    module.check_grammar = check_grammar  # type: ignore[attr-defined]  # a stand-in module's function
    monkeypatch.setitem(sys.modules, "splitserve.engine.grammar_source", module)
    message = rejected(sampling(grammar=pb.Grammar(json_schema="{nope")))
    assert message == "sampling.grammar: grammar does not compile: expected a property name"
    assert validate(sampling(grammar=pb.Grammar(regex="a+")), CFG, TOK).sampling.grammar == GrammarSpec("regex", "a+")
    assert checked == [GrammarSpec("json_schema", "{nope"), GrammarSpec("regex", "a+")]


@pytest.mark.parametrize("schema", ['{"type": "objec"}', "{not json", '{"type": "object", "properties": 5}'])
def test_a_schema_the_real_compiler_refuses_is_invalid_argument(schema: str) -> None:
    pytest.importorskip("splitserve.engine.grammar_source")
    assert rejected(sampling(grammar=pb.Grammar(json_schema=schema))).startswith("sampling.grammar:")


def test_tool_results_are_a_chat_role() -> None:
    msgs = [pb.ChatMessage(role="user", content="weather?"), pb.ChatMessage(role="tool", content='{"c": 21}')]
    ids = validate(pb.GenerateRequest(chat=pb.ChatMessages(messages=msgs)), CFG, TOK).prompt_token_ids
    assert ids == tuple(TOK.encode_chat([("user", "weather?"), ("tool", '{"c": 21}')]))
