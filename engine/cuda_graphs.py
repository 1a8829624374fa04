"""CUDA graphs for decode steps.

A graph is captured per (padded batch size, padded block-table width) the first
time that bucket is needed, over static input buffers; later steps copy their
inputs into the buffers and replay. Padding rows write their K/V into the
cache's scratch block (the one block the block manager never hands out) and
attend to one token, so they cannot disturb real requests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from typing import Any

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.blocks import cdiv
from splitserve.engine.config import EngineConfig
from splitserve.engine.model import LlamaModel
from splitserve.engine.sequence import Sequence


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, cfg: EngineConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = kv_cache.shape[1] - 1
        self.batch_sizes = sorted(cfg.cuda_graph_batch_sizes)
        max_width = cdiv(model.cfg.max_position, cfg.block_size)
        self.widths = sorted({min(1 << k, max_width) for k in range(3, max_width.bit_length() + 1)} | {max_width})
        n, dev = self.batch_sizes[-1], model.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_blocks = torch.full((n,), self.scratch_block, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(n, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.widths[-1]), self.scratch_block, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs share one memory pool (torch types its handle privately)

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.batch_sizes[-1] and width <= self.widths[-1]

    def run(
        self,
        seqs: Seq[Sequence],
        input_ids: list[int],
        positions: list[int],
        slot_blocks: list[int],
        slot_offsets: list[int],
        context_lens: list[int],
    ) -> torch.Tensor:
        b = len(seqs)
        bp = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        width = max(len(s.block_table) for s in seqs)
        wp = self.widths[bisect.bisect_left(self.widths, width)]
        tables = torch.full((bp, wp), self.scratch_block, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.as_tensor(s.block_table)
        pad = bp - b
        self.input_ids[:bp].copy_(torch.as_tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:bp].copy_(torch.as_tensor(positions + [0] * pad), non_blocking=True)
        self.slot_blocks[:bp].copy_(torch.as_tensor(slot_blocks + [self.scratch_block] * pad), non_blocking=True)
        self.slot_offsets[:bp].copy_(torch.as_tensor(slot_offsets + [0] * pad), non_blocking=True)
        self.context_lens[:bp].copy_(torch.as_tensor(context_lens + [1] * pad), non_blocking=True)
        self.block_tables[:bp, :wp].copy_(tables, non_blocking=True)
        key = (bp, wp)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bp, wp)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:b].clone()

    def _forward(self, bp: int, wp: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_blocks=self.slot_blocks[:bp],
            slot_offsets=self.slot_offsets[:bp],
            block_tables=self.block_tables[:bp, :wp],
            context_lens=self.context_lens[:bp],
            query_lens=[1] * bp,
            context_lens_list=[],  # unused on the decode path
            is_decode=True,
        )
        return self.model.forward(self.input_ids[:bp], self.positions[:bp], self.kv_cache, meta, self.rows[:bp], None)

    def _capture(self, bp: int, wp: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: allocator and kernel selection
                    self._forward(bp, wp)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(bp, wp)
            self.pool = graph.pool()
        return graph, out
