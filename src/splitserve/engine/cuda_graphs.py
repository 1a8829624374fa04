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
from splitserve.engine.model import DecoderModel
from splitserve.engine.sequence import Sequence

_FIELDS = 5  # input_ids, positions, slot_blocks, slot_offsets, context_lens: one row each per sequence


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, cfg: EngineConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = kv_cache.shape[1] - 1
        self.batch_sizes = sorted(cfg.cuda_graph_batch_sizes)
        max_width = cdiv(model.cfg.max_position, cfg.block_size)
        self.widths = sorted({min(1 << k, max_width) for k in range(3, max_width.bit_length() + 1)} | {max_width})
        n, dev = self.batch_sizes[-1], model.device
        width = self.widths[-1]
        # The static inputs are views of one device buffer, filled from one pinned host buffer by
        # one copy a step: six small copies from pageable memory cost more host time than a
        # SmolLM2 decode step's kernels leave (each blocks until its bytes have left).
        size = _FIELDS * n + n * width
        self.staging = torch.empty(size, dtype=torch.long, device=dev)
        self.host = torch.empty(size, dtype=torch.long, pin_memory=True)
        self._host = self.host.numpy()
        self._copied = torch.cuda.Event()  # the last copy out of `host` has happened
        self.input_ids, self.positions, self.slot_blocks, self.slot_offsets, self.context_lens = (
            self.staging[i * n : (i + 1) * n] for i in range(_FIELDS)
        )
        self.block_tables = self.staging[_FIELDS * n :].view(n, width)
        self._n, self._width = n, width
        self._stage([], [], [], [], [], [], n)  # every row padding until a step fills it
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
        self._stage([s.block_table for s in seqs], input_ids, positions, slot_blocks, slot_offsets, context_lens, bp)
        key = (bp, wp)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bp, wp)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:b].clone()

    def _stage(
        self,
        tables: list[list[int]],
        input_ids: list[int],
        positions: list[int],
        slot_blocks: list[int],
        slot_offsets: list[int],
        context_lens: list[int],
        bp: int,
    ) -> None:
        """Write rows 0..bp of every input into the host buffer (rows past the batch as padding) and
        copy them to the device in one transfer, ordered before the next replay on the stream."""
        self._copied.synchronize()  # the host buffer is free again once the last copy has read it
        n, b, h = self._n, len(input_ids), self._host
        for i, (values, pad) in enumerate(
            ((input_ids, 0), (positions, 0), (slot_blocks, self.scratch_block), (slot_offsets, 0), (context_lens, 1))
        ):
            h[i * n : i * n + b] = values
            h[i * n + b : i * n + bp] = pad
        end = _FIELDS * n + bp * self._width
        rows = h[_FIELDS * n : end].reshape(bp, self._width)
        rows.fill(self.scratch_block)
        for i, table in enumerate(tables):
            rows[i, : len(table)] = table
        self.staging[:end].copy_(self.host[:end], non_blocking=True)
        self._copied.record()

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
