"""Tokenizer, chat template and streaming detokenizer.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust library, not
transformers) built either from a model directory's tokenizer.json or from the
vocabulary a GGUF file carries in its metadata. For GGUF the pre-tokenizer is
chosen from `tokenizer.ggml.pre`, the name llama.cpp gives the splitting regex
the vocabulary was trained with; getting it wrong changes token ids silently,
so an unknown name is an error rather than a guess.

`IncrementalDetokenizer` turns a stream of token ids into a stream of text that
never splits a UTF-8 character: what it has emitted, concatenated, is always a
prefix of (and at the end equal to) `decode` of all the ids.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from splitserve.engine.tool_call_format import ToolCallFormat, template_tool_format

log = logging.getLogger(__name__)

# ---- pre-tokenizer regexes, by llama.cpp's `tokenizer.ggml.pre` name -----------------------------
# Written as in the models' own tokenizer.json (llama.cpp carries rewritten but equivalent forms).

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS = "digits"  # tokenizers' Digits(individual_digits=True): every numeric character alone
_GPT2 = "gpt2"  # ByteLevel's built-in GPT-2 regex

# name -> (splits applied in order, each isolating its matches; whether merges are skipped for
# words already in the vocabulary, as Llama 3's tokenizer.json asks with "ignore_merges")
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(["gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"], ((_GPT2,), False)),
    # SmolLM's and StarCoder's tokenizer.json: Digits(individual_digits=True), then ByteLevel's
    # GPT-2 split (llama.cpp writes the first step as the regex \p{N}).
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], ((_DIGITS, _GPT2), False)
    ),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], ((_LLAMA3,), True)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2"], ((_QWEN2,), False)),
    **dict.fromkeys(["gpt-4o", "llama4"], ((_GPT4O,), False)),
    "tekken": ((_TEKKEN,), False),
}

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4
_LONG_TEXT = 16_384  # characters: beyond, `encode` lets other threads run (about 10 ms of tokenizing)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end generation."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos_token = add_bos_token
        vocab = backend.get_vocab_size(with_added_tokens=True)
        for i in (bos_token_id, *self._eos_token_ids):
            if i is not None and not 0 <= i < vocab:
                raise ValueError(f"special token id {i} is outside the vocabulary of {vocab}")
        # The tool-call syntax the template teaches (None: it takes no tools). Where that syntax
        # opens with a special token ([TOOL_CALLS]), decoding shows the token, or no reader could
        # tell a call from content.
        self.tool_format: ToolCallFormat | None = template_tool_format(chat_template)
        specials = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(specials)
        marker = self.tool_format.marker if self.tool_format else None
        self._shown_ids = frozenset(i for i, text in specials.items() if text == marker)

    # ---- construction ----

    @staticmethod
    def from_hf_dir(directory: str | os.PathLike[str], extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """From tokenizer.json, plus tokenizer_config.json (and chat_template.jinja) when present."""
        directory = os.fspath(directory)
        tok_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"{tok_file}: no such file (only tokenizer.json tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ValueError(f"{tok_file}: cannot parse ({e})") from None
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{cfg_file}: cannot parse ({e})") from None
        template = _pick_chat_template(cfg.get("chat_template"))
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos = token_id(cfg.get("eos_token"))
        return Tokenizer(
            backend,
            chat_template=template,
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_ids=([eos] if eos is not None else []) + list(extra_eos_token_ids),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    @staticmethod
    def from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's `tokenizer.*` metadata (as plain Python values)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        if kind == "gpt2":
            backend = _byte_level_bpe(meta)
        elif kind == "llama":
            backend = _sentencepiece_bpe(meta)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")

        def special(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None else None

        bos = special("bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        if add_bos and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]}:0 $A:0",
                pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
                special_tokens=[(tokens[bos], bos)],
            )
        eos = [special(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        return Tokenizer(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_ids=[i for i in eos if i is not None],
            add_bos_token=add_bos,
        )

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and tokenizer_config.json, loadable by `from_hf_dir` and transformers."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos_token}
        if self.bos_token is not None:
            cfg["bos_token"] = self.bos_token
        if self._eos_token_ids:
            cfg["eos_token"] = self.id_to_token(self._eos_token_ids[0])
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)

    # ---- the contract ----

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are
        always recognised; `add_special_tokens` adds what the model adds itself (e.g. BOS).

        A long text goes through the batch call, which runs with the GIL released (the single
        call holds it: a 5 MB prompt held every other thread of the process for 3.4 s, against
        0.18 s this way), so a router or worker thread tokenizing it stalls no one else."""
        if len(text) > _LONG_TEXT:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """`skip_special_tokens` skips every special token but the tool-call format's marker."""
        if skip_special_tokens and self._shown_ids:
            shown = [i for i in ids if i not in self._special_ids or i in self._shown_ids]
            return self.backend.decode(shown, skip_special_tokens=False)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers renders it. `tools` (OpenAI's
        list) go to a template that takes them, as do messages' `tool_calls` and `tool_call_id`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if tools and self.tool_format is None:
            raise ValueError("this model's chat template takes no tools")
        context: dict[str, Any] = {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        if tools:
            context["tools"] = tools
        if self.bos_token is not None:
            context["bos_token"] = self.bos_token
        if self._eos_token_ids:
            context["eos_token"] = self.id_to_token(self._eos_token_ids[0])
        template = _compile_chat_template(self.chat_template)
        try:
            return template.render(**context)
        except Exception as e:  # its raise_exception, or a value it cannot handle: these messages'
            raise ValueError(f"the chat template refused the conversation: {type(e).__name__}: {e}") from None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_token_id is None else self.id_to_token(self._bos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (byte-level BPE spells a space as 'Ġ'); None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


class IncrementalDetokenizer:
    """Streams text from token ids, holding back bytes of a character not yet complete.

    It decodes a small window that starts where the last emitted text ended (always on
    a character boundary) and emits the window's growth, unless the window ends in
    U+FFFD, which is what an incomplete UTF-8 sequence decodes to. `flush()` at the end
    emits whatever is held back, so the pieces always add up to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: everything before it has been emitted
        self._read = 0  # window part already emitted (ids[_prefix:_read])

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any text still held back (an incomplete character decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        emitted = decode(self.ids[self._prefix : self._read], self.skip_special_tokens)
        text = decode(self.ids[self._prefix :], self.skip_special_tokens)
        if text.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(emitted) :]


# ---- GGUF vocabularies -------------------------------------------------------------------------


def _byte_level_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE (tokenizer.ggml.model == "gpt2"): SmolLM, Llama 3, Qwen2, ..."""
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        log.warning("GGUF has no tokenizer.ggml.pre; assuming the GPT-2 pre-tokenizer")
        pre = "gpt2"
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A vocabulary entry is spelled in the byte alphabet; a few converters store added tokens
    # raw, so respell those (as transformers does) to keep every entry reachable.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    merges = _merges(meta)
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=ignore_merges,
        )
    )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Digits(individual_digits=True) if s == _DIGITS else pre_tokenizers.Split(Regex(s), "isolated")
        for s in splits
        if s != _GPT2
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=splits[-1] == _GPT2))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; adding them would
    # grow the vocabulary past the embedding.
    _add_special_tokens(backend, meta, lambda t: set(t) <= alphabet)
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece BPE (tokenizer.ggml.model == "llama": Llama 2, Mistral, TinyLlama).

    Built as transformers' LlamaTokenizer builds it: merges recovered from the token scores,
    byte fallback for characters outside the vocabulary, '▁' for spaces, one leading space.
    """
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if "tokenizer.ggml.merges" not in meta and (scores is None or len(scores) != len(tokens)):
        raise ValueError("GGUF sentencepiece vocabulary has neither merges nor one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta) if "tokenizer.ggml.merges" in meta else _merges_from_scores(vocab, tokens, scores or [])
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, meta, lambda t: True)
    return backend


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((parts[0], parts[1]))
    return merges


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's score."""
    found = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(backend: tokenizers.Tokenizer, meta: Mapping[str, Any], spelled_ok: Any) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so
    that both are matched whole in text (as llama.cpp does) instead of cut into pieces."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    # no token types (or fewer than tokens): the untyped tokens are plain vocabulary
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and spelled_ok(t)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED
    ]
    if user:
        backend.add_tokens(user)


# ---- chat templates ----------------------------------------------------------------------------


def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config.json holds either one template or a list of named ones ("default" wins)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> Any:
    """The template compiled in a sandbox configured as transformers configures it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must not contain.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e}") from None
