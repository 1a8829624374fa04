"""One forward step's inputs as plain integers: what the model runner builds from
the scheduled batch and, under tensor parallelism, sends to every rank.

`run_step` turns them into tensors and attention metadata and runs the model;
rank 0's runner and the other ranks' loops call it alike, so every rank computes
the same step. On the wire (rank 0 to a rank, a local pipe) a step is one array
of int64: a header of counts, then each field in turn; no pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.lora.rows import LoraRows
from splitserve.engine.model import DecoderModel, LayerHook

_HEADER = 5  # tokens, sequences, block-table width, is_decode, window groups


@dataclass(frozen=True)
class StepInputs:
    input_ids: list[int]  # [T] every new token of the step, sequence after sequence
    positions: list[int]  # [T]
    slot_blocks: list[int]  # [T] cache block each new token's K/V goes to
    slot_offsets: list[int]  # [T] its offset in that block
    block_tables: list[list[int]]  # [B] each sequence's blocks (ragged; padded with 0 as tensors)
    context_lens: list[int]  # [B] tokens in the cache after the step
    query_lens: list[int]  # [B] new tokens of each sequence
    logits_rows: list[int]  # rows of the step whose logits are wanted (rank 0's; not sent)
    is_decode: bool  # every sequence brings one token
    # a grouped cache (engine/kv_groups.py): per group of windowed layers, the slots' pages [T] and
    # the block tables' pages [B] (each row as long as block_tables')
    window_slot_blocks: list[list[int]] = field(default_factory=list)
    window_tables: list[list[list[int]]] = field(default_factory=list)

    def encode(self) -> bytes:
        """The wire form. `logits_rows` stays behind: only rank 0 computes logits."""
        width = max((len(t) for t in self.block_tables), default=0)

        def padded(tables: list[list[int]]) -> list[int]:
            return [b for t in tables for b in (*t, *[0] * (width - len(t)))]

        values = [
            len(self.input_ids),
            len(self.query_lens),
            width,
            int(self.is_decode),
            len(self.window_tables),
            *self.input_ids,
            *self.positions,
            *self.slot_blocks,
            *self.slot_offsets,
            *padded(self.block_tables),
            *self.context_lens,
            *self.query_lens,
        ]
        for slots, tables in zip(self.window_slot_blocks, self.window_tables, strict=True):
            values += [*slots, *padded(tables)]
        return torch.tensor(values, dtype=torch.long).numpy().tobytes()

    @staticmethod
    def decode(data: bytes) -> StepInputs:
        """A step as `encode` wrote it, with no logits rows; ValueError if the lengths disagree."""
        if len(data) % 8:
            raise ValueError(f"a step message of {len(data)} bytes is not whole int64s")
        values: list[int] = torch.frombuffer(bytearray(data), dtype=torch.long).tolist()
        if len(values) < _HEADER:
            raise ValueError("a step message shorter than its header")
        t, b, width, is_decode, groups = values[:_HEADER]
        if len(values) != _HEADER + 4 * t + b * width + 2 * b + groups * (t + b * width):
            raise ValueError(f"a step message of {len(values)} values for {t} tokens and {b} sequences")
        fields = []
        at = _HEADER
        for n in (t, t, t, t, b * width, b, b, *(n for _ in range(groups) for n in (t, b * width))):
            fields.append(values[at : at + n])
            at += n
        ids, pos, blocks, offsets, tables, ctx, qlens = fields[:7]

        def rows(flat: list[int]) -> list[list[int]]:
            return [flat[i * width : (i + 1) * width] for i in range(b)]

        return StepInputs(
            ids,
            pos,
            blocks,
            offsets,
            rows(tables),
            ctx,
            qlens,
            [],
            bool(is_decode),
            fields[7::2],
            [rows(f) for f in fields[8::2]],
        )


def run_step(
    model: DecoderModel,
    kv_cache: torch.Tensor,
    step: StepInputs,
    on_layer_done: LayerHook | None = None,
    decode_rows: int = 0,
    lora: LoraRows | None = None,
) -> torch.Tensor:
    """Logits [len(step.logits_rows), vocab] (fp32); the step's K/V lands in `kv_cache`.
    `decode_rows`: the step's first rows are decode rows, joined in one pass with its chunks."""
    dev = model.device
    width = max(len(t) for t in step.block_tables)

    def table_tensor(rows: list[list[int]]) -> torch.Tensor:
        tables = torch.zeros((len(rows), width), dtype=torch.long)
        for i, table in enumerate(rows):
            tables[i, : len(table)] = torch.as_tensor(table)
        return tables.to(dev)

    meta = AttentionMetadata(
        slot_blocks=torch.as_tensor(step.slot_blocks, dtype=torch.long, device=dev),
        slot_offsets=torch.as_tensor(step.slot_offsets, dtype=torch.long, device=dev),
        block_tables=table_tensor(step.block_tables),
        context_lens=torch.as_tensor(step.context_lens, dtype=torch.long, device=dev),
        query_lens=list(step.query_lens),
        context_lens_list=list(step.context_lens),
        is_decode=step.is_decode,
    )
    if step.window_tables:
        windowed = (
            replace(
                meta, slot_blocks=torch.as_tensor(slots, dtype=torch.long, device=dev), block_tables=table_tensor(t)
            )
            for slots, t in zip(step.window_slot_blocks, step.window_tables, strict=True)
        )
        meta = replace(meta, windowed=tuple(windowed))
    with torch.inference_mode():
        return model.forward(
            torch.as_tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.as_tensor(step.positions, dtype=torch.long, device=dev),
            kv_cache,
            meta,
            torch.as_tensor(step.logits_rows, dtype=torch.long, device=dev),
            on_layer_done,
            decode_rows,
            lora,
        )
