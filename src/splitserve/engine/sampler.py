"""Turn one step's logits into tokens, each row with its own parameters.

Order of the processors follows vLLM: penalties on raw logits, then
temperature, then min-p, top-k and top-p filters, then a draw from the
request's own generator. The log-probability reported is that of the chosen
token under the raw model distribution.

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

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

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


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float | None]


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
    logits: torch.Tensor,  # [B, vocab] fp32
    params: Seq[SamplingParams],
    prompts: Seq[Seq[int]],
    outputs: Seq[Seq[int]],
    generators: Seq[torch.Generator | None],
    default_generator: torch.Generator,
) -> SampleResult:
    want_logprobs = any(p.logprobs for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if all(p.greedy and not p.has_penalties for p in params):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = []
        for i, p in enumerate(params):
            row = logits[i]
            if p.has_penalties:
                row = apply_penalties(row, p, prompts[i], outputs[i])
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            probs = torch.softmax(filter_logits(row, p), dim=-1).cpu()
            if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
                tokens.append(int(row.argmax()))  # unreachable after the clamps; a last guard for the batch
                continue
            gen = generators[i] if generators[i] is not None else default_generator
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    logprobs: list[float | None] = [None] * len(tokens)
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, torch.as_tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        logprobs = [lp if p.logprobs else None for lp, p in zip(chosen, params, strict=True)]
    return SampleResult(tokens, logprobs)
