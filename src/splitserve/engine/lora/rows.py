"""A step's LoRA rows: which rows of the step each adapter's update applies to.

One step runs base rows and the rows of several adapters together: each linear layer runs
once over every row on the base weights, then each adapter adds its low-rank update to its own
rows (grouped by adapter, as punica and S-LoRA do: one pair of small matmuls per adapter and
module, not per row). A row's update depends only on that row, so a row's bits do not depend on
which other adapters share its step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from splitserve.engine.block_hash import ROOT_HASH, BlockHash
from splitserve.engine.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraRows:
    groups: tuple[tuple[LoraAdapter, Tensor], ...]  # each adapter and its rows of the step (long)

    @staticmethod
    def of(adapters: list[LoraAdapter | None], rows_per_seq: list[int], device: torch.device) -> LoraRows | None:
        """From each sequence's adapter (None: the base model) and its rows in the step, in order;
        None where no row takes an adapter."""
        by_id: dict[str, tuple[LoraAdapter, list[int]]] = {}
        at = 0
        for adapter, n in zip(adapters, rows_per_seq, strict=True):
            if adapter is not None:
                by_id.setdefault(adapter.id, (adapter, []))[1].extend(range(at, at + n))
            at += n
        if not by_id:
            return None
        return LoraRows(
            tuple((a, torch.as_tensor(rows, dtype=torch.long, device=device)) for a, rows in by_id.values())
        )

    def apply(self, y: Tensor, x: Tensor, layer: int, slot: str) -> None:
        """y += each adapter's update of `slot` in `layer` on its rows of x, in place (y = x @ W.T)."""
        for adapter, rows in self.groups:
            parts = adapter.parts(layer, slot)
            if not parts:
                continue
            xs = x.index_select(0, rows)
            for p in parts:
                delta = (xs @ p.a.T.to(x.dtype)) @ p.b.T.to(x.dtype)
                y[rows, p.start : p.end] += delta.to(y.dtype)


def adapter_root(adapter: LoraAdapter | None) -> BlockHash:
    """The parent of a sequence's first block hash: the adapter's id folded in, so that KV computed
    with one adapter's weights is never another's (or the base model's) prefix hit."""
    if adapter is None:
        return ROOT_HASH
    # a domain of its own: no block of tokens hashes to it
    return hashlib.blake2b(b"splitserve lora " + bytes.fromhex(adapter.id), digest_size=16).digest()
