"""A text's tokens fed to an engine's model as the engine would feed them, outside its
scheduler: every position's next-token logits, by prefill in chunks or by one decode step per
token (the path a decode worker's steps take, fused kernels and quantized weights included).
For the benchmarks that compare two ways of holding the same model (bench kv-dtype, bench quant).
"""

from __future__ import annotations

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.engine import Engine


def meta(table: torch.Tensor, positions: torch.Tensor, context: int, decode: bool, bs: int) -> AttentionMetadata:
    n = positions.numel()
    return AttentionMetadata(
        slot_blocks=table[0, positions // bs].contiguous(),
        slot_offsets=positions % bs,
        block_tables=table,
        context_lens=torch.tensor([context]),
        query_lens=[n],
        context_lens_list=[context],
        is_decode=decode,
    )


def table(engine: Engine, n: int) -> torch.Tensor:
    """Blocks 1.. of the (idle) engine's pool for one sequence of n tokens."""
    bs = engine.cfg.block_size
    nb = (n + bs - 1) // bs
    if nb >= engine.kv_cache.num_blocks:
        raise ValueError(f"{n} tokens need {nb} blocks; the pool has {engine.kv_cache.num_blocks}")
    return torch.arange(1, nb + 1)[None]


def logprobs_of(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) from the logits at positions 0 .. n-2."""
    ids = torch.tensor(tokens)
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens) - 1), ids[1:]]


@torch.inference_mode()
def prefill_logits(engine: Engine, tokens: list[int], chunk: int) -> torch.Tensor:
    """[n - 1, vocab]: each position's logits, by prefill in chunks through the engine's pool."""
    model, cache = engine.model, engine.kv_cache.tensor
    ids = torch.tensor(tokens)
    blocks = table(engine, len(tokens))
    rows = []
    for start in range(0, len(tokens), chunk):
        pos = torch.arange(start, min(start + chunk, len(tokens)))
        m = meta(blocks, pos, int(pos[-1]) + 1, False, engine.cfg.block_size)
        rows.append(model.forward(ids[pos], pos, cache, m, torch.arange(pos.numel())))
    return torch.cat(rows)[:-1].float()


def teacher_forced(engine: Engine, tokens: list[int], chunk: int) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) for every i, by prefill in chunks through the engine's pool."""
    return logprobs_of(prefill_logits(engine, tokens, chunk), tokens)


@torch.inference_mode()
def decode_logits(engine: Engine, tokens: list[int], over_prefill: bool = False) -> torch.Tensor:
    """[n - 1, vocab]: the same logits by one decode step per token (the fused kernel on a CPU). With
    `over_prefill`, each step reads the earlier tokens' KV as a prefill of the whole text wrote it
    (the step's own write is undone after it), as a decode worker continues a prefill worker's KV."""
    model, cache = engine.model, engine.kv_cache.tensor
    ids = torch.tensor(tokens)
    blocks = table(engine, len(tokens))
    if over_prefill:
        prefill_logits(engine, tokens, len(tokens))
    prefilled = cache.clone() if over_prefill else None
    rows = []
    bs = engine.cfg.block_size
    for i in range(len(tokens) - 1):
        pos = torch.tensor([i])
        m = meta(blocks, pos, i + 1, True, bs)
        rows.append(model.forward(ids[i : i + 1], pos, cache, m, torch.zeros(1, dtype=torch.long)))
        if prefilled is not None:
            blk = blocks[0, i // bs]
            cache[:, blk] = prefilled[:, blk]
    return torch.cat(rows).float()


def step_by_step(engine: Engine, tokens: list[int], over_prefill: bool = False) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) by one decode step per token (see decode_logits)."""
    return logprobs_of(decode_logits(engine, tokens, over_prefill), tokens)
