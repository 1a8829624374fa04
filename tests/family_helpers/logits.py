"""Every position's logits from splitserve's decoder, computed as the engine computes them:
the prompt prefilled in chunks over the paged KV cache (each chunk attending to the blocks
the ones before it wrote), then the rest decoded one token a step (teacher-forced)."""

from __future__ import annotations

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.blocks import cdiv
from splitserve.engine.model import DecoderModel


def chunked_logits(model: DecoderModel, tokens: list[int], prompt_len: int, chunk: int, block_size: int = 16):
    """[len(tokens), vocab] float32: positions [0, prompt_len) in prefill chunks of `chunk`
    tokens, every later position in a decode step of its own."""
    cfg = model.cfg
    nb = cdiv(len(tokens), block_size)
    cache = torch.zeros(cfg.num_layers, nb + 1, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    table = (torch.arange(nb) + 1).flip(0)[None].contiguous()  # scattered: blocks in descending order, 0 unused
    spans = [(s, min(s + chunk, prompt_len)) for s in range(0, prompt_len, chunk)]
    spans += [(p, p + 1) for p in range(prompt_len, len(tokens))]
    out = []
    with torch.inference_mode():
        for start, end in spans:
            pos = torch.arange(start, end)
            meta = AttentionMetadata(
                table[0, pos // block_size].contiguous(),
                pos % block_size,
                table,
                torch.tensor([end]),
                [end - start],
                [end],
                start >= prompt_len,
            )
            logits = model.forward(torch.tensor(tokens[start:end]), pos, cache, meta, torch.arange(end - start))
            out.append(logits.float())
    return torch.cat(out)
