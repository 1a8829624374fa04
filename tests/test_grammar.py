"""Structured output on the default model's vocabulary: what a matcher lets through is what the
grammar says (random walks over the allowed tokens come out as valid JSON, matching strings, one
of the choices), the masks are the same however the state was reached, bad grammars are refused
naming the field, and the ids no grammar may produce are never allowed."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest
import torch

from splitserve.engine import grammar_source
from splitserve.engine.grammar import (
    GrammarCompiler,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
    bitmask_words,
    fill_masks,
)
from splitserve.engine.grammar_source import check_grammar, grammar_text
from splitserve.engine.sampling import GrammarSpec, InvalidSamplingParam
from splitserve.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)

# Installed with ray. Imported by name: it ships no types, and whether the tree gets its stubs or
# an ignore_missing_imports for it, an import line here would need a different (or no) ignore.
jsonschema = importlib.import_module("jsonschema")

# logits wider than the tokenizer's vocabulary (as a model padded to a multiple of 64 has), and not
# a multiple of 32, so the last mask word is partly padding
LOGITS_PAD = 37

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "subject": {"enum": ["math", "art"]},
                    "grade": {"type": "integer", "minimum": 1, "maximum": 6},
                },
                "required": ["subject", "grade"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "nickname": {"type": "string", "maxLength": 5},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tok_dir: str) -> Tokenizer:
    return Tokenizer.from_hf_dir(tok_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + LOGITS_PAD, tokenizer.eos_token_ids)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """The ids whose bit is set in `bitmask[row]`, unpacked by hand (not by the code under test)."""
    bits = [(int(bitmask[row, i // 32]) >> (i % 32)) & 1 for i in range(vocab_size)]
    return torch.tensor([i for i, b in enumerate(bits) if b], dtype=torch.long)


def random_walk(
    compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, seed: int, max_steps: int = 400
) -> list[int]:
    """Tokens drawn uniformly among those each mask allows (through apply_bitmask, as the engine
    masks logits), ending with the first end-of-sequence the grammar allows."""
    matcher = Matcher(compiler.compile(spec))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_ids[0]
    out: list[int] = []
    for _ in range(max_steps):
        if matcher.allows_eos:
            assert matcher.accept(eos)
            assert matcher.is_finished
            return out
        matcher.fill_mask(bitmask, 0)
        logits = torch.zeros(1, compiler.vocab_size)
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        assert matcher.accept(token), matcher.error
        out.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_a_random_walk_under_a_nested_schema_is_valid_json_that_validates(compiler, tokenizer, seed):
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    text = tokenizer.decode(random_walk(compiler, tokenizer, spec, seed))
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_any_object_and_only_an_object(compiler, tokenizer):
    spec = GrammarSpec("json_object")
    value = '{"a":[1,2.5,{"b":null}],"c":"d","e":true}'
    assert accepted_prefix(compiler, tokenizer, spec, value) == value
    matcher = Matcher(compiler.compile(spec))
    matcher.replay(tokenizer.encode(value))
    assert matcher.allows_eos
    for not_an_object in ('["a"]', '"a"', "1"):
        assert accepted_prefix(compiler, tokenizer, spec, not_an_object) == ""


def test_json_may_be_compact_or_indented_and_additional_properties_false_is_honored(compiler, tokenizer):
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    assert compiler.compile(spec)  # compiles
    compact = '{"name":"Al","age":3,"role":"user","tags":[],"address":{"city":"Oslo","zip":"01234"},"scores":[]}'
    assert accepted_prefix(compiler, tokenizer, spec, compact) == compact
    extra = compact[:-1] + ',"x":1}'
    assert accepted_prefix(compiler, tokenizer, spec, extra) == compact[:-1] + ',"'  # no key "x"
    indented = '{\n    "name": "Al",\n    "age": 3'
    assert accepted_prefix(compiler, tokenizer, spec, indented) == indented
    runaway = '{"name":' + " " * 30 + '"Al"'
    assert accepted_prefix(compiler, tokenizer, spec, runaway) == '{"name":' + " " * 20  # whitespace is bounded
    open_schema = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert accepted_prefix(compiler, tokenizer, open_schema, '{"a":1,"b":2}') == '{"a":1,"b":2}'


def accepted_prefix(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, text: str) -> str:
    """The longest prefix of `text` the grammar lets through, fed a character at a time (so no
    token spans the character where the grammar says no)."""
    matcher = Matcher(compiler.compile(spec))
    done = ""
    for char in text:
        if not all(matcher.accept(t) for t in tokenizer.encode(char)):
            break
        done += char
    return done


@pytest.mark.parametrize("seed", range(3))
def test_a_regex_walk_matches_the_regex(compiler, tokenizer, seed):
    pattern = r"[a-z]{2,5}-[0-9]{1,4}( \(v[0-9]\))?"
    text = tokenizer.decode(random_walk(compiler, tokenizer, GrammarSpec("regex", pattern), seed))
    assert re.fullmatch(pattern, text), text


def test_a_choice_walk_is_one_of_the_choices_written_literally(compiler, tokenizer):
    choices = ["yes", "no", "maybe so", "a|b.*", 'say "hi"\\n', "日本語", "line\nbreak"]
    spec = GrammarSpec("choice", json.dumps(choices))
    seen = {tokenizer.decode(random_walk(compiler, tokenizer, spec, seed)) for seed in range(24)}
    assert seen <= set(choices)
    assert len(seen) >= 3  # the walks do branch


def test_replaying_a_prefix_gives_the_mask_that_stepping_gave(compiler, tokenizer):
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    tokens = random_walk(compiler, tokenizer, spec, seed=7)
    stepped = Matcher(compiler.compile(spec))
    replayed = Matcher(compiler.compile(spec))
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    for k, token in enumerate(tokens):
        if k % 5 == 0:
            stepped.fill_mask(bitmask, 0)
            replayed.replay(tokens[:k])
            replayed.fill_mask(bitmask, 1)
            assert torch.equal(bitmask[0], bitmask[1]), f"after {k} tokens"
        assert stepped.accept(token)
    replayed.replay([*tokens, tokenizer.eos_token_ids[0]])  # a finished sequence's output, its EOS too
    assert replayed.is_finished and replayed.error is None


def test_replay_names_the_first_token_the_grammar_refuses(compiler, tokenizer):
    matcher = Matcher(compiler.compile(GrammarSpec("regex", "[0-9]+")))
    ids = tokenizer.encode("12x3")
    with pytest.raises(ValueError, match=f"output token {ids[2]} at position 2"):
        matcher.replay(ids)


def test_a_refused_token_puts_the_matcher_in_its_error_state_with_only_eos_allowed(compiler, tokenizer):
    matcher = Matcher(compiler.compile(GrammarSpec("regex", "[0-9]+")))
    assert not matcher.accept(tokenizer.encode("x")[0])
    assert matcher.error and matcher.is_finished
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    assert allowed_ids(bitmask, 0, compiler.vocab_size).tolist() == list(tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json_schema", '{"type": "strin"}'), "strin"),
        (GrammarSpec("json_schema", '{"type": "string", "format": "shoe-size"}'), "shoe-size"),
        (GrammarSpec("json_schema", "{not json"), "json_schema is not a JSON object"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
        (GrammarSpec("choice", '"yes"'), "choice must be a non-empty JSON list of strings"),
        (GrammarSpec("choice", "[]"), "choice must be a non-empty JSON list of strings"),
        (GrammarSpec("choice", "[1, 2]"), "choice must be a non-empty JSON list of strings"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(compiler, spec, reason):
    with pytest.raises(InvalidSamplingParam, match=re.escape(reason)) as checked:
        check_grammar(spec)
    assert checked.value.field == "grammar"
    with pytest.raises(InvalidSamplingParam, match=re.escape(reason)) as compiled:
        compiler.compile(spec)
    assert compiled.value.field == "grammar"


def test_grammar_source_loads_neither_torch_nor_the_tokenizer():
    code = (
        "import sys\n"
        "from splitserve.engine.grammar_source import check_grammar, grammar_text\n"
        "from splitserve.engine.sampling import GrammarSpec\n"
        "check_grammar(GrammarSpec('json_schema', '{\"type\": \"object\"}'))\n"
        "grammar_text(GrammarSpec('regex', 'a+'))\n"
        "print(sorted(m for m in ('torch', 'tokenizers', 'splitserve.engine.tokenizer') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stderr


def test_grammar_text_and_the_check_are_cached_by_spec():
    spec = GrammarSpec("regex", "[a-c]{3}")
    assert grammar_text(spec) is grammar_text(GrammarSpec("regex", "[a-c]{3}"))
    bad = GrammarSpec("regex", "(")
    for _ in range(2):
        with pytest.raises(InvalidSamplingParam):
            check_grammar(bad)
    assert grammar_source._compile_error.cache_info().hits >= 1  # the failure is cached too


def test_the_compile_cache_counts_hits_and_evicts_the_least_recently_used(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, cache_size=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GrammarSpec("regex", "a+")) is first
    assert (compiler.cache_hits, compiler.cache_misses) == (1, 1)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert compiler.compile(a) is first
    compiler.compile(b)
    assert (compiler.cache_hits, compiler.cache_misses) == (3, 4)


def test_ids_past_the_vocabulary_and_unnamed_special_tokens_are_never_allowed(compiler, tokenizer):
    vocab = tokenizer.vocab_size
    matcher = Matcher(compiler.compile(GrammarSpec("json_schema", '{"type": "string"}')))
    assert matcher.accept(tokenizer.encode('"')[0])  # inside a string: nearly every id is allowed
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    allowed = allowed_ids(bitmask, 0, compiler.vocab_size)
    assert len(allowed) > vocab // 2
    assert int(allowed.max()) < vocab
    specials = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>")]
    assert not set(specials) & set(allowed.tolist())
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask(logits, bitmask, [0])
    assert torch.isinf(logits[0, vocab:]).all() and torch.isinf(logits[0, specials]).all()
    assert torch.isfinite(logits[0, allowed]).all()


def test_eos_is_allowed_exactly_where_the_grammar_can_end(compiler, tokenizer):
    eos = set(tokenizer.eos_token_ids)
    matcher = Matcher(compiler.compile(GrammarSpec("regex", "[0-9]{1,3}")))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for step, digit in enumerate(["", "4", "2", "7"]):
        if digit:
            assert matcher.accept(tokenizer.encode(digit)[0])
        matcher.fill_mask(bitmask, 0)
        allowed = set(allowed_ids(bitmask, 0, compiler.vocab_size).tolist())
        assert matcher.allows_eos == (step > 0) == bool(eos & allowed)
        assert matcher.is_finished == (step == 3)
    assert allowed == eos  # three digits: nothing else can follow


def test_fill_masks_fills_each_row_as_its_matcher_alone_would(compiler, tokenizer):
    specs = [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("regex", "[0-9]+"), GrammarSpec("json_object")]
    matchers = [Matcher(compiler.compile(s)) for s in specs]
    matchers[0].replay(tokenizer.encode('{"name":"Bo'))
    rows = [3, 0, 2]
    batched = torch.zeros(4, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    fill_masks(list(zip(matchers, rows, strict=True)), batched)
    alone = allocate_bitmask(1, compiler.vocab_size)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_mask(alone, 0)
        assert torch.equal(batched[row], alone[0])
    assert not batched[1].any()  # an unconstrained row is left alone


def test_apply_bitmask_masks_only_the_constrained_rows(compiler):
    vocab = compiler.vocab_size
    bitmask = torch.zeros(3, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = 0b101  # ids 0 and 2
    bitmask[2, 1] = -(1 << 31)  # id 63: the sign bit
    bitmask[2, -1] = -1  # the last word: every id it covers, up to the logits' width
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    last_word = list(range(32 * (bitmask.shape[1] - 1), vocab))
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63, *last_word]
    assert torch.equal(logits[1], before[1])
    assert torch.equal(logits[0, [0, 2]], before[0, [0, 2]])


def test_a_bitmask_of_the_wrong_shape_is_refused_before_llguidance_writes_to_it(compiler):
    matcher = Matcher(compiler.compile(GrammarSpec("regex", "a")))
    with pytest.raises(ValueError, match="words a row"):
        matcher.fill_mask(allocate_bitmask(1, compiler.vocab_size - 64), 0)
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_mask(torch.zeros(1, bitmask_words(compiler.vocab_size), dtype=torch.int64), 0)
    with pytest.raises(IndexError):
        matcher.fill_mask(allocate_bitmask(1, compiler.vocab_size), 1)


def test_logits_narrower_than_the_tokenizer_are_refused(tokenizer):
    with pytest.raises(ValueError, match="more than the"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size - 1, tokenizer.eos_token_ids)


def _many_literals(n: int) -> GrammarSpec:
    """A grammar whose lexer build grows with alternatives x vocabulary (no llguidance fuel bounds
    it): 3,000 alternatives took 13 s on SmolLM2's vocabulary."""
    return GrammarSpec("lark", "start: s\ns: " + " | ".join(f's "w{i}"' for i in range(n)) + ' | "x"\n')


def test_a_compile_past_its_budget_is_refused_and_refused_again_without_compiling(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    slow = _many_literals(1500)
    with pytest.raises(InvalidSamplingParam, match=r"grammar did not compile within the budget of 0.01 s \(lark\)"):
        compiler.compile_within(slow, budget_s=0.01)
    misses = compiler.cache_misses
    for _ in range(2):  # at once, from memory: the slow compile is not started again
        with pytest.raises(InvalidSamplingParam, match="budget"):
            compiler.compile_within(slow, budget_s=60)
        with pytest.raises(InvalidSamplingParam, match="budget"):
            compiler.compile(slow)  # the engine thread's own call refuses it too
    assert compiler.cache_misses == misses
    # a grammar within its budget compiles, once
    quick = GrammarSpec("regex", "[0-9]{3}")
    assert compiler.compile_within(quick) is compiler.compile_within(quick)


def test_a_grammar_that_does_not_compile_is_refused_within_the_budget_and_remembered(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    bad = GrammarSpec("lark", "start: undefined_rule\n")
    for _ in range(2):
        with pytest.raises(InvalidSamplingParam, match=r"does not compile \(lark\)"):
            compiler.compile_within(bad)
    assert compiler.cache_misses == 1


def test_a_pattern_that_explodes_the_lexer_compiles_quickly_and_fails_only_its_own_matcher(compiler, tokenizer):
    """`(a{1000}){1000}` cost 1.8 s of the engine thread at its first mask under llguidance's
    default limits; under ours it compiles (the first mask built on the compiling thread) and its
    matcher ends in its error state when the lexer runs out of room, not the process."""
    spec = GrammarSpec("regex", "(a{1000}){1000}")
    m = Matcher(compiler.compile_within(spec))
    (a,) = tokenizer.encode("a")
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for _ in range(4):
        m.fill_mask(bitmask, 0)
        if not m.accept(a):
            break
    assert m.error is not None and "too many expressions" in m.error
    other = Matcher(compiler.compile(GrammarSpec("regex", "b+")))  # the compiler goes on serving others
    (b,) = tokenizer.encode("b")
    assert other.accept(b) and other.error is None


@pytest.mark.parametrize(
    "spec", [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("regex", "(a{1000}){1000}")]
)
def test_a_fresh_matchers_mask_is_the_start_mask_computed_once(compiler, spec):
    """A sequence's first mask is copied from its compiled grammar (computed on the compiling
    thread), and is exactly what llguidance computes for the fresh state."""
    compiled = compiler.compile(spec)
    fresh = Matcher(compiled)
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    fill_masks([(fresh, 0)], bitmask)
    computed = torch.empty_like(bitmask[1])
    fresh._matcher.unsafe_compute_mask_ptr(computed.data_ptr(), computed.numel() * 4)
    assert torch.equal(bitmask[0], computed) and torch.equal(bitmask[0], compiled.start_mask)
