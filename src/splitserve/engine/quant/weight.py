"""A weight matrix kept in the format the user's file holds it in: GGUF blocks, not floats.

`QuantizedWeight` is [n, k] as one or more parts of rows, each (format, packed blocks): a
fused slot's q, k and v may come in different formats (a Q4_K_M file keeps some v in Q6_K).
Every linear layer takes one where it takes a float tensor (engine/kernels/linear.py's
`linear` hands it to `QuantizedWeight.linear`), and no dequantized copy is ever kept: a decode
step reads the blocks' bytes, a prefill dequantizes one matrix at a time into its GEMM, and an
embedding lookup dequantizes the rows it reads.

The operations the loaders, the model and tensor parallelism need are rows' operations on the
packed bytes: a row is whole blocks, so permuting rows (llama.cpp's q/k order), joining them
(q, k and v into `qkv`) and taking a rank's rows are byte copies; taking a rank's columns
(row-parallel o and down) cuts every row on a block boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from splitserve.engine.gguf_formats import BlockFormat
from splitserve.engine.kernels import quant as kernel
from splitserve.engine.kernels.linear import linear


@dataclass(frozen=True)
class Part:
    fmt: BlockFormat
    data: Tensor  # uint8 [rows, fmt.row_bytes(k)], contiguous, CPU


class QuantizedWeight:
    """`batch_invariant`: every call runs the kernel, whatever its rows, so that a row's result
    never depends on the rows beside it (a prefill's too, at the kernel's pace); else a call of more
    than kernel.max_rows() rows (a long prefill chunk) runs the dequantized GEMM. Up to those rows
    the kernel gives a row the same bits whatever shares the call.

    `order`: row i of the weight is stored row order[i] (None: stored in order). The rows of a
    file's q and k stay where llama.cpp put them, in the mapped file, and each product's columns
    are put back in HF's order instead: copying those rows cost a tenth of a model's resident
    bytes, the gather costs one index of a few thousand floats per layer."""

    def __init__(
        self, parts: Sequence[Part], k: int, batch_invariant: bool = False, order: Tensor | None = None
    ) -> None:
        if not parts:
            raise ValueError("a quantized weight needs at least one part")
        self.parts = tuple(Part(p.fmt, p.data.contiguous()) for p in parts)
        self.k = k
        self.batch_invariant = batch_invariant
        self.shape = torch.Size((sum(p.data.shape[0] for p in self.parts), k))
        if order is not None and order.shape != (self.shape[0],):
            raise ValueError(f"a row order of {tuple(order.shape)} for {self.shape[0]} rows")
        self.order = None if order is None else order.to(torch.int64)
        # what a decode step's call hands the kernel, checked here once
        self._checked = tuple(v for p in self.parts for v in kernel.check_blocks(p.fmt, p.data, k))

    @classmethod
    def of(cls, fmt: BlockFormat, data: Tensor, k: int) -> QuantizedWeight:
        return cls((Part(fmt, data),), k)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickled as its parts (a tensor-parallel rank's shard: torch.multiprocessing shares the
        bytes); the kernel's entries, which hold addresses, are made again where it is unpickled."""
        parts = tuple((p.fmt.name, p.data) for p in self.parts)
        return (_rebuilt, (parts, self.k, self.batch_invariant, self.order))

    def own_parts(self) -> QuantizedWeight:
        """The same weight with each part in a storage of its own (a view of a mapped file or of a
        larger tensor copied): what is handed to another process, which shares whole storages."""
        own = [p if owns_storage(p.data) else Part(p.fmt, p.data.clone()) for p in self.parts]
        return QuantizedWeight(own, self.k, self.batch_invariant, self.order)

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def format_names(self) -> tuple[str, ...]:
        return tuple(sorted({p.fmt.name for p in self.parts}))

    def __repr__(self) -> str:
        return f"QuantizedWeight({'+'.join(self.format_names)}, shape={tuple(self.shape)}, bytes={self.nbytes})"

    # -- computing -------------------------------------------------------------------------

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., k] @ W.T (+ bias) in x's dtype (fp32 or bf16 on a CPU)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        rows = x2.shape[0] if self.batch_invariant else None
        y = kernel.decode_linear(x2, self._checked, self.shape[0], self.k, rows, exact=True)
        if y is None:  # a prefill's rows: one float GEMM on the matrix dequantized, its rows in order
            y = linear(x2, self.dequantize(kernel.gemm_dtype(x2)))
        elif self.order is not None:  # a decode step's few rows: their columns put in order
            y = y.index_select(1, self.order)
        if bias is not None:
            y += bias.to(y.dtype)
        return y if x.dim() == 2 else y.reshape(*lead, self.shape[0])

    def invariant(self) -> QuantizedWeight:
        """The same blocks (not copied), every call on the integer-dot kernel."""
        return QuantizedWeight(self.parts, self.k, batch_invariant=True, order=self.order)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The whole matrix as floats (a GPU's copy, a test's reference): never kept by the CPU model."""
        w = self._stored(dtype)
        return w if self.order is None else w.index_select(0, self.order)

    def _stored(self, dtype: torch.dtype) -> Tensor:
        """The matrix dequantized in its stored row order, each part straight into its rows (a
        prefill dequantizes every matrix it multiplies: a torch.cat would write it twice)."""
        if len(self.parts) == 1:
            p = self.parts[0]
            return kernel.dequantize(p.fmt, p.data, self.k, dtype)
        out = torch.empty(self.shape[0], self.k, dtype=dtype)
        start = 0
        for p in self.parts:
            rows = p.data.shape[0]
            kernel.dequantize(p.fmt, p.data, self.k, dtype, out=out[start : start + rows])
            start += rows
        return out

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """F.embedding on the blocks: the rows `ids` names, dequantized, [*ids.shape, k]."""
        flat = ids.reshape(-1)
        if self.order is not None:
            flat = self.order[flat]
        if len(self.parts) == 1:
            p = self.parts[0]
            rows = kernel.dequantize(p.fmt, p.data, self.k, dtype, rows=flat)
        else:
            rows = self._stored(dtype)[flat]
        return rows.reshape(*ids.shape, self.k)

    def sample(self, stride: int, count: int) -> Tensor:
        """flat[::stride][:count] of the dequantized matrix (fp32), reading only the rows it touches."""
        flat_idx = torch.arange(0, self.shape[0] * self.k, stride, dtype=torch.int64)[:count]
        row_ids, inverse = torch.unique(flat_idx // self.k, return_inverse=True)
        rows = self.take_rows(row_ids).dequantize()
        return rows[inverse, flat_idx % self.k]

    # -- rows and columns ------------------------------------------------------------------

    def in_row_order(self, index: Tensor) -> QuantizedWeight:
        """The rows in the order `index` (a permutation) gives, as a view: the blocks stay where
        they are and each product's columns are gathered (llama.cpp's q/k permutation undone)."""
        index = index.to(torch.int64)
        order = index if self.order is None else self.order[index]
        return QuantizedWeight(self.parts, self.k, self.batch_invariant, order=order)

    def take_rows(self, index: Tensor) -> QuantizedWeight:
        """The rows `index` names, in its order, copied (a sample; a rank's rows of a permuted weight)."""
        index = index.to(torch.int64)
        if self.order is not None:
            index = self.order[index]
        if len(self.parts) == 1:
            p = self.parts[0]
            return QuantizedWeight((Part(p.fmt, p.data[index]),), self.k, self.batch_invariant)
        starts = [0]
        for p in self.parts:
            starts.append(starts[-1] + p.data.shape[0])
        owner = torch.bucketize(index, torch.tensor(starts[1:]), right=True)  # each row's part
        out: list[Part] = []
        begin = 0
        for end in range(1, len(index) + 1):  # runs of rows from one part, each gathered at once
            if end == len(index) or owner[end] != owner[begin]:
                i = int(owner[begin])
                out.append(Part(self.parts[i].fmt, self.parts[i].data[index[begin:end] - starts[i]]))
                begin = end
        return QuantizedWeight(out, self.k, self.batch_invariant)

    def rows(self, sel: slice) -> QuantizedWeight:
        """Rows sel.start..sel.stop (a column-parallel rank's)."""
        if self.order is not None:
            return self.take_rows(torch.arange(sel.start, sel.stop))
        out, start = [], 0
        for p in self.parts:
            n = p.data.shape[0]
            lo, hi = max(sel.start, start), min(sel.stop, start + n)
            if lo < hi:
                out.append(Part(p.fmt, p.data[lo - start : hi - start]))
            start += n
        return QuantizedWeight(out, self.k, self.batch_invariant)

    def cols(self, sel: slice) -> QuantizedWeight:
        """Columns sel.start..sel.stop of every row (a row-parallel rank's), on block boundaries."""
        out = []
        for p in self.parts:
            e = p.fmt.block_elems
            if sel.start % e or sel.stop % e:
                raise ValueError(f"{p.fmt.name} weights split only on {e}-column blocks, not at {sel.start}:{sel.stop}")
            b0, b1 = sel.start // e * p.fmt.block_bytes, sel.stop // e * p.fmt.block_bytes
            out.append(Part(p.fmt, p.data[:, b0:b1].contiguous()))
        return QuantizedWeight(out, sel.stop - sel.start, self.batch_invariant, order=self.order)

    @staticmethod
    def cat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows joined in order (q, k and v into `qkv`); the columns must agree."""
        k = weights[0].k
        if any(w.k != k for w in weights):
            raise ValueError("joined quantized weights must have the same number of columns")
        invariant = all(w.batch_invariant for w in weights)
        order = None
        if any(w.order is not None for w in weights):
            orders, offset = [], 0
            for w in weights:
                orders.append((torch.arange(w.shape[0]) if w.order is None else w.order) + offset)
                offset += w.shape[0]
            order = torch.cat(orders)
        return QuantizedWeight(_merge([p for w in weights for p in w.parts]), k, invariant, order)


def _rebuilt(
    parts: tuple[tuple[str, Tensor], ...], k: int, batch_invariant: bool, order: Tensor | None
) -> QuantizedWeight:
    from splitserve.engine.gguf_formats import BY_NAME

    return QuantizedWeight([Part(BY_NAME[name], data) for name, data in parts], k, batch_invariant, order)


def _merge(parts: list[Part]) -> list[Part]:
    """Adjacent parts that are consecutive rows of one tensor as one view; anything else stays a
    part of its own, where it lies (a view of the mapped file): joining q, k and v copies nothing,
    and one kernel call covers all the parts."""
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if (
            last is not None
            and last.fmt is p.fmt
            and last.data.untyped_storage().data_ptr() == p.data.untyped_storage().data_ptr()
            and last.data.data_ptr() + last.data.numel() == p.data.data_ptr()
        ):
            whole = last.data.untyped_storage()
            rows = last.data.shape[0] + p.data.shape[0]
            out[-1] = Part(
                p.fmt,
                torch.empty(0, dtype=torch.uint8).set_(
                    whole, last.data.storage_offset(), (rows, p.data.shape[1]), (p.data.shape[1], 1)
                ),
            )
        else:
            out.append(p)
    return out


Weight = Tensor | QuantizedWeight


def owns_storage(t: Tensor) -> bool:
    """Whether `t` is its whole storage: handing a view to another process would share (and move
    into shared memory) all of the storage under it."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """A fused slot's parts joined by rows: blocks where every part is quantized, else floats."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat([p for p in parts if isinstance(p, QuantizedWeight)])
    floats = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    dtype = next(p.dtype for p in floats if not isinstance(p, QuantizedWeight))
    return torch.cat([p.to(dtype) for p in floats], dim=max(0, floats[0].dim() - 2))


def nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


def floats(weights: Mapping[str, Weight]) -> dict[str, Tensor]:
    """`weights` where every one is a float tensor (loaded with quantization "none", or from a
    float checkpoint); TypeError naming the first kept in blocks."""
    out: dict[str, Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            raise TypeError(f"{name} is kept in {'+'.join(w.format_names)} blocks; float weights expected")
        out[name] = w
    return out


def dequantized(weights: Mapping[str, Weight], dtype: torch.dtype) -> dict[str, Tensor]:
    """Every weight as a float tensor: blocks dequantized into `dtype`, floats as they are."""
    return {n: w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w for n, w in weights.items()}
