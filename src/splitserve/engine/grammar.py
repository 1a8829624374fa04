"""Structured output in the engine: grammars compiled against the model's vocabulary (llguidance),
one matcher per constrained sequence, and the batch's token masks.

One `GrammarCompiler` per engine holds llguidance's view of the vocabulary (built once, in about
0.2 s for a 49k vocabulary) and a bounded cache of compiled grammars, keyed by `GrammarSpec`.
Each constrained sequence owns a `Matcher`, a cheap copy of its grammar's start state. A step
fills one bitmask row per constrained sequence (`fill_masks`: llguidance computes the masks with
the GIL released, on its own threads, so the runner can overlap it with the forward pass) and then
masks the whole batch's logits in one op (`apply_bitmask`) before the sampler sees them.

The masks are one bit per token id, 32 ids to an int32 word (bit j of word w is id 32*w + j),
as wide as the model's logits. Ids the tokenizer does not have (a logits width padded past the
vocabulary) and special tokens the grammar never names are never allowed; the end-of-sequence
ids are allowed exactly when the grammar may end there, and are all that is allowed once nothing
else can follow.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache

import llguidance
import torch

from splitserve.engine.grammar_source import grammar_text, parser_limits
from splitserve.engine.sampling import GrammarSpec, InvalidSamplingParam
from splitserve.engine.tokenizer import Tokenizer

_BITS = 32  # token ids per bitmask word
_WORD_BYTES = 4


# What no fuel bounds, the wall clock does: building the lexer for a grammar of many literal
# alternatives grows with alternatives x vocabulary (1,000 took 0.5 s on SmolLM2's vocabulary, 3,000
# took 13 s). A compile still running after this long is refused, and so is every later request for
# the same grammar, at once.
COMPILE_BUDGET_S = 2.0
_COMPILE_THREADS = 2  # a compile holds no GIL: two at once cost two cores, not the process
_COMPILE_NICE = 10


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a bitmask over `vocab_size` token ids."""
    return (vocab_size + _BITS - 1) // _BITS


class CompiledGrammar:
    """A spec compiled against one vocabulary: its start state, which every `Matcher` copies, and
    that state's mask, computed once here (on the compiling thread) for every sequence's first
    step: it is the costly one (the lexer's first states; 24 ms a sequence for `(a{1000}){1000}`,
    paid by the whole batch's step), and it is the same for every sequence."""

    __slots__ = ("_start", "spec", "start_mask", "vocab_size")

    def __init__(self, spec: GrammarSpec, start: llguidance.LLMatcher, vocab_size: int) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self._start = start
        self.start_mask = torch.empty(bitmask_words(vocab_size), dtype=torch.int32)
        start.unsafe_compute_mask_ptr(self.start_mask.data_ptr(), self.start_mask.numel() * _WORD_BYTES)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one model: its tokenizer, its logits width (`vocab_size`, which
    may exceed the tokenizer's vocabulary) and the ids that end a sequence."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256
    ) -> None:
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the {vocab_size} logits")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # llguidance reads the same tokenizer.json our Tokenizer runs; n_vocab pads its view to the
        # logits width, and the padding ids have no bytes, so no grammar ever allows them. No
        # eos_token_ids: llguidance's guess from the tokenizer, better than a grammar that can't end.
        try:
            self.ll_tokenizer = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(self.eos_token_ids) or None
            )
        except Exception as e:  # the Rust side raises a bare Exception for a tokenizer it cannot read
            raise ValueError(f"llguidance cannot read this tokenizer: {e}") from None
        self.cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[GrammarSpec, str] = OrderedDict()  # spec -> why: asked again, refused at once
        self._lock = threading.Lock()  # compile() may run on a compile thread beside the engine's
        self._threads: ThreadPoolExecutor | None = None  # compile_within's, made at its first call

    def compile_within(self, spec: GrammarSpec, budget_s: float = COMPILE_BUDGET_S) -> CompiledGrammar:
        """`compile`, on the compiler's own threads, waited for at most `budget_s`: the caller (a
        worker's call handler, the router's check) never holds the engine thread or an event loop
        while a grammar builds. InvalidSamplingParam("grammar", ...) when it does not compile or
        runs past the budget; a grammar refused once is refused again without a second compile
        (the compile that ran long finishes on its thread, and its result is dropped)."""
        with self._lock:
            compiled = self._cache.get(spec)
            reason = self._refused.get(spec)
            if compiled is None and reason is None and self._threads is None:
                self._threads = ThreadPoolExecutor(
                    _COMPILE_THREADS, thread_name_prefix="grammar-compile", initializer=_yield_to_the_engine
                )
        if compiled is not None:
            return self.compile(spec)  # counted as a hit, moved to the cache's fresh end
        if reason is not None:
            raise InvalidSamplingParam("grammar", reason)
        assert self._threads is not None
        future = self._threads.submit(self.compile, spec)
        try:
            return future.result(timeout=budget_s)
        except FutureTimeout:
            reason = f"did not compile within the budget of {budget_s:g} s ({spec.kind}): simplify it"
            self._refuse(spec, reason)
            raise InvalidSamplingParam("grammar", reason) from None
        except InvalidSamplingParam as e:
            self._refuse(spec, str(e).removeprefix(f"{e.field} "))
            raise

    def _refuse(self, spec: GrammarSpec, reason: str) -> None:
        with self._lock:
            self._refused[spec] = reason
            self._cache.pop(spec, None)  # a compile that finished after the budget ran out
            while len(self._refused) > self.cache_size:
                self._refused.popitem(last=False)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """`spec` compiled (from the cache when seen lately); InvalidSamplingParam("grammar", reason)
        when it does not compile, or was refused by `compile_within` before."""
        with self._lock:
            if spec in self._refused:
                raise InvalidSamplingParam("grammar", self._refused[spec])
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return compiled
            self.cache_misses += 1
        # Outside the lock: llguidance builds the grammar with the GIL released (up to a second
        # for a huge schema), and two threads compiling one spec at once only waste the second.
        start = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(spec), log_level=0, limits=parser_limits())
        # The start state's mask builds most of the lexer (1.8 s of `(a{1000}){1000}`'s cost
        # under llguidance's default limits): computed by CompiledGrammar, on this thread.
        compiled = CompiledGrammar(spec, start, self.vocab_size)
        if start.is_error():
            raise InvalidSamplingParam("grammar", f"does not compile ({spec.kind}): {start.get_error().strip()}")
        with self._lock:
            if spec in self._refused:  # it ran past its budget: refused, however it ended
                raise InvalidSamplingParam("grammar", self._refused[spec])
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


class Matcher:
    """One sequence's place in its grammar: advanced by each token the sequence samples."""

    __slots__ = ("_at_start", "_matcher", "compiled")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = compiled._start.deep_copy()  # shares the compiled grammar; about 1 us
        self._at_start = True  # no token taken yet: the mask is the compiled grammar's start_mask

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`. False when the grammar does not allow it: the matcher is then in
        its error state for good (`error` says why) and its mask allows only end-of-sequence."""
        self._at_start = False
        return self._matcher.consume_token(token_id)

    def fork(self) -> Matcher:
        """A matcher at this one's state that advances on its own (a draft's positions are masked
        on copies, so the sequence's own matcher only ever takes accepted tokens)."""
        copy = Matcher.__new__(Matcher)
        copy.compiled = self.compiled
        copy._matcher = self._matcher.deep_copy()
        copy._at_start = self._at_start
        return copy

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar allows from here (state unchanged)."""
        return int(self._matcher.validate_tokens(token_ids))

    def replay(self, token_ids: Iterable[int]) -> None:
        """Rebuild the state from the start and a sequence's output so far (a handoff from the
        prefill worker, a migration, a preempted sequence coming back). ValueError naming the
        first token the grammar does not allow (the matcher is then of no further use)."""
        ids = [int(t) for t in token_ids]
        self._matcher = self.compiled._start.deep_copy()
        self._at_start = not ids
        accepted = self._matcher.try_consume_tokens(ids)
        # try_consume_tokens stops at an end-of-sequence id even where the grammar may end;
        # consume_token takes it there (and nothing may follow it)
        if accepted == len(ids) - 1 and self._matcher.consume_token(ids[accepted]):
            accepted += 1
        if accepted < len(ids):
            raise ValueError(
                f"output token {ids[accepted]} at position {accepted} is not allowed by the {self.compiled.spec.kind} "
                "grammar"
            )

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into `bitmask[row]` (see `allocate_bitmask`)."""
        _check_bitmask(bitmask, self.compiled.vocab_size)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        words = bitmask[row]
        if self._at_start:
            words.copy_(self.compiled.start_mask)
            return
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    @property
    def is_finished(self) -> bool:
        """Nothing but end-of-sequence can follow: the grammar is complete (or the end-of-sequence
        was accepted, or the matcher is in its error state)."""
        return self._matcher.is_stopped()

    @property
    def allows_eos(self) -> bool:
        """Whether the output may end here (the next mask allows the end-of-sequence ids)."""
        return self._matcher.is_accepting() or self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state (a token the grammar did not allow); None if not."""
        return self._matcher.get_error() or None


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A [batch, words] int32 bitmask on the CPU, every id allowed. Pinned when CUDA is there, so
    `apply_bitmask`'s copy to the device does not stage through pageable memory."""
    shape = (batch, bitmask_words(vocab_size))
    if torch.cuda.is_available():
        try:
            return torch.full(shape, -1, dtype=torch.int32, pin_memory=True)
        except RuntimeError:  # no pinnable memory left: pageable works, a little slower
            pass
    return torch.full(shape, -1, dtype=torch.int32)


def fill_masks(matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """Fill `bitmask[row]` for each (matcher, row), all in one call on llguidance's threads with
    the GIL released, so a thread can run it while the forward pass runs. The matchers are the
    call's until it returns: accept() on one of them meanwhile would race with its mask."""
    for matcher, row in matchers:
        if matcher._at_start:  # copied from its compiled grammar, not computed
            matcher.fill_mask(bitmask, row)
    matchers = [(m, row) for m, row in matchers if not m._at_start]
    if not matchers:
        return
    if len(matchers) == 1:  # the thread pool's hand-off costs more than one mask
        matcher, row = matchers[0]
        matcher.fill_mask(bitmask, row)
        return
    vocab_sizes = {m.compiled.vocab_size for m, _ in matchers}
    if len(vocab_sizes) != 1:
        raise ValueError(f"the matchers are compiled for different vocabularies: {sorted(vocab_sizes)}")
    _check_bitmask(bitmask, vocab_sizes.pop())
    rows = [row for _, row in matchers]
    if len(set(rows)) != len(rows) or not all(0 <= r < bitmask.shape[0] for r in rows):
        raise IndexError(f"rows must be distinct and within the bitmask's {bitmask.shape[0]}, got {rows}")
    batch, words = bitmask.shape
    _executor().unsafe_compute_mask_ptr(
        [(m._matcher, row) for m, row in matchers], bitmask.data_ptr(), words * bitmask.element_size(), batch
    )


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of ids each row's mask disallows to -inf, in place, for `rows` only (rows of
    `logits` and of `bitmask` alike; the others are unconstrained). One vectorized op for the batch."""
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask takes [batch, vocab] logits and a [batch, words] int32 bitmask")
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True).index_select(0, index)
    disallowed = _disallowed(words, logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(disallowed, float("-inf")))


def _disallowed(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool, True where a bit is clear; ids past the mask's width are disallowed."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=words.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))
    return bits[:, :vocab_size] == 0


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    """llguidance writes through a raw pointer: anything but a contiguous CPU int32 [batch, words]
    tensor of this width would be written out of bounds or misread."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"a bitmask is a 2-D int32 CPU tensor, got {bitmask.dtype} {bitmask.dim()}-D on {bitmask.device}"
        )
    if not bitmask.is_contiguous() or bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(
            f"a bitmask over {vocab_size} ids is contiguous with {bitmask_words(vocab_size)} words a row, "
            f"got shape {tuple(bitmask.shape)}"
        )


def _yield_to_the_engine() -> None:
    """A compile thread runs at a lower priority than the process's others (on Linux a thread is
    a task of its own, and has its own nice value): a grammar that builds for seconds on a
    machine with few cores then takes the cores the engine's step leaves, not the step's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICE)
    except (OSError, AttributeError):  # not Linux, or not allowed: the compile runs at the process's priority
        pass


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for batched masks, made at first use: one per process, like torch's."""
    return llguidance.LLExecutor()
