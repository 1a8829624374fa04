"""Turn one step's logits into tokens, each row with its own parameters.

Order of the processors follows vLLM: the grammar's mask (applied batched by
the runner before this), logit_bias, min_tokens (end-of-sequence masked),
penalties on raw logits, then temperature, then min-p, top-k and top-p filters,
then a draw from the request's own generator. The log-probabilities reported
(the chosen token's and the top_logprobs alternatives) are under the raw model
distribution, before any of these, as OpenAI and vLLM report them.

A seeded request's output token i draws from `draw_seed(seed, sample_index, i)`
(its sequence reseeds its generator with it right before the draw), never from
a generator's running state: a request continued on another worker (the first
token sampled by the prefill worker, a migration replaying the tokens already
streamed, a prefix found cached) draws what it would have drawn in one place.

No accepted parameter may make a step fail, because a failed step costs every
request in the batch its answer: every division is followed by a clamp to
finite values (a repetition penalty of 1e-45 divides a logit into infinity),
and a row whose probabilities still come out unusable falls back to argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from splitserve.engine.handoff import TokenLogprob
from splitserve.engine.sampling import SamplingParams

_U64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output for state `x` (Steele, Lea, Flood 2014): a bijection on 64-bit
    integers that spreads every input bit over every output bit."""
    z = (x + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def draw_seed(seed: int, sample_index: int, output_index: int) -> int:
    """The 64-bit seed of a seeded request's draw of output token `output_index` (counting every
    output token, those produced elsewhere included) for sample `sample_index` (n > 1) of the
    request: a function of the three and nothing else, wherever the draw happens."""
    return splitmix64(splitmix64(splitmix64(seed & _U64) ^ sample_index) ^ output_index)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Overflowed entries back into fp32's range (NaN to its lowest), so softmax stays defined."""
    info = torch.finfo(logits.dtype)
    return torch.nan_to_num(logits, nan=info.min, posinf=info.max, neginf=info.min)


# (logits [rows, vocab] fp32 CPU, temperatures, uniform draws [rows] fp64 CPU) -> tokens: DecodeKernels.draw
DrawRows = Callable[[torch.Tensor, list[float], torch.Tensor], list[int]]


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # for rows whose params ask for logprobs


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams, num_output: int, stop_ids: Seq[int]) -> torch.Tensor:
    """logit_bias added, and (before min_tokens output tokens) `stop_ids` masked; a new tensor."""
    logits = logits.clone()
    if params.logit_bias:
        vocab = logits.shape[-1]
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]  # ids past the logits: nothing to bias
        if pairs:
            ids = torch.as_tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
            logits[ids] += torch.as_tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    if num_output < params.min_tokens:
        ids = torch.as_tensor([t for t in stop_ids if t < logits.shape[-1]], dtype=torch.long, device=logits.device)
        held = logits[ids].clone()
        logits[ids] = float("-inf")
        if not bool(torch.isfinite(logits).any()):  # a grammar that allows only the end: it wins
            logits[ids] = held
    return logits


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int]
) -> torch.Tensor:
    """logits: [vocab] fp32 for one request; returns a new tensor."""
    logits = logits.clone()
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.as_tensor(list(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
            logits = _finite(logits)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids = torch.as_tensor(output_ids, dtype=torch.long, device=device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        logits = _finite(logits)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p on one row; filtered entries become -inf."""
    logits = _finite(logits / params.temperature)
    if not params.truncates(logits.shape[-1]):  # nothing more: as `sample` draws its batched rows
        return logits
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p; the first is always kept
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,  # [B, vocab] fp32, the grammars' masks applied
    params: Seq[SamplingParams],
    prompts: Seq[Seq[int]],
    outputs: Seq[Seq[int]],
    generators: Seq[torch.Generator | None],
    default_generator: torch.Generator,
    raw_logits: torch.Tensor | None = None,  # before the masks, for the logprobs (None: `logits`)
    stop_ids: Seq[Seq[int]] | None = None,  # per row: what min_tokens holds back (eos, stop_token_ids)
    draw_rows: DrawRows | None = None,  # the CPU kernel for the temperature-only rows (None: `draw`)
) -> SampleResult:
    if all(p.greedy and not p.shapes_logits for p in params):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = [-1] * len(params)
        vocab = logits.shape[-1]
        plain = [i for i, p in enumerate(params) if p.temperature_only(vocab)]
        if plain:  # the common case (a temperature, nothing else): one batched pass for them all
            rows = logits if len(plain) == len(params) else logits[plain]
            gens = [generators[i] or default_generator for i in plain]
            temps = [params[i].temperature for i in plain]
            if draw_rows is not None and rows.dtype is torch.float32 and rows.is_cpu and rows.is_contiguous():
                drawn = draw_rows(rows, temps, uniforms(gens))
            else:
                by = torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
                drawn = draw(torch.softmax(_finite(rows / by), dim=-1), gens, rows)
            for i, token in zip(plain, drawn, strict=True):
                tokens[i] = token
        for i, p in enumerate(params):
            if tokens[i] < 0:
                tokens[i] = _sample_row(
                    logits[i], p, prompts[i], outputs[i], generators[i] or default_generator, stop_ids, i
                )
    return SampleResult(tokens, _logprobs(raw_logits if raw_logits is not None else logits, params, tokens))


def _sample_row(
    row: torch.Tensor,
    p: SamplingParams,
    prompt: Seq[int],
    output: Seq[int],
    generator: torch.Generator,
    stop_ids: Seq[Seq[int]] | None,
    i: int,
) -> int:
    # each processor under a property that SamplingParams.temperature_only reads, so that a row
    # drawn in `sample`'s batched path is one this would draw from softmax(row / temperature) alone
    if p.biases_logits:
        row = apply_logit_bias(row, p, len(output), stop_ids[i] if stop_ids is not None else p.stop_token_ids)
    if p.has_penalties:
        row = apply_penalties(row, p, prompt, output)
    if p.greedy:
        return int(row.argmax())
    probs = torch.softmax(filter_logits(row, p), dim=-1)
    return draw(probs[None], [generator], row[None])[0]


_BLOCK = 1024  # vocabulary entries per block of the two-level CDF search in `draw`


def draw(probs: torch.Tensor, generators: Seq[torch.Generator], logits: torch.Tensor) -> list[int]:
    """One token per row of `probs` [rows, vocab] (each summing to about 1), row r with a uniform draw
    from `generators[r]`: the inverse of the row's CDF at it. torch.multinomial draws a random number
    per vocabulary entry (about 1 ms for SmolLM2's 49K on a CPU core), and a full cumsum is a serial
    scan (a fifth of that); this sums blocks of the vocabulary (one vectorised pass for every row),
    finds the block on their CDF, and scans that block alone. A token of probability 0 is never drawn
    (its CDF step is flat). A row whose probabilities are unusable takes its `logits`' argmax:
    unreachable after the clamps, a last guard for the batch."""
    rows, vocab = probs.shape
    full = vocab - vocab % _BLOCK
    sums = probs[:, :full].reshape(rows, -1, _BLOCK).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    cdf = sums.double().cumsum(-1)
    total = cdf[:, -1]
    # rounded to fp32, as this path has always taken it (so a seed draws the tokens it drew); the
    # kernel reads the fp64 draw
    u = uniforms(generators).float()
    at = u.to(cdf.device) * total
    blocks = torch.searchsorted(cdf, at[:, None], right=True)[:, 0].tolist()
    usable = (torch.isfinite(total) & (total > 0.0)).tolist()
    cdf_l, at_l = cdf.tolist(), at.tolist()
    tokens = []
    for r in range(rows):
        if not usable[r]:
            tokens.append(int(logits[r].argmax()))
            continue
        b = min(blocks[r], cdf.shape[1] - 1)
        start = b * _BLOCK
        within = probs[r, start : start + _BLOCK].double().cumsum(0)
        tokens.append(start + _search_block(within, at_l[r] - (cdf_l[r][b - 1] if b else 0.0)))
    return tokens


def uniforms(generators: Seq[torch.Generator]) -> torch.Tensor:
    """Each row's uniform draw in [0, 1) (fp64, CPU), from its request's own generator (CPU): the
    same number whichever device the row is on and whichever code draws its token."""
    return torch.tensor(
        [float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators], dtype=torch.float64
    )


def _search_block(within: torch.Tensor, target: float) -> int:
    """The first entry whose CDF `within` (one block's, from 0) passes `target`. The block's sum was
    rounded apart from this scan, so a target at or past the scan's end takes the block's last token
    of nonzero probability, and one below 0 its first: never a token of probability 0."""
    end = float(within[-1])
    at = torch.tensor([min(max(target, 0.0), end)], dtype=within.dtype, device=within.device)
    return int(torch.searchsorted(within, at, right=target < end))


def _logprobs(raw: torch.Tensor, params: Seq[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """The chosen tokens' log-probabilities under the raw distribution, and the top_logprobs most
    likely alternatives, for the rows that ask."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return out
    logprobs = torch.log_softmax(raw[rows], dim=-1)
    chosen = logprobs.gather(1, torch.as_tensor([tokens[i] for i in rows], device=raw.device)[:, None])[:, 0]
    k = max(params[i].top_logprobs for i in rows)
    top_v, top_i = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen_l, top_vl, top_il = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        n = params[i].top_logprobs
        out[i] = TokenLogprob(chosen_l[j], tuple(zip(top_il[j][:n], top_vl[j][:n], strict=True)))
    return out
