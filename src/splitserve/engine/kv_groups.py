"""Where each layer's KV lives when a model mixes windowed and global layers (Gemma 3's 5:1).

A global layer reads its whole context; a windowed layer only the last `window` tokens. With one
block per (layer, position range), every layer would hold the whole context, and the windowed
layers' blocks behind their window would sit unread until the request ends. So, as vLLM's hybrid
allocator does, such a model's cache is made of pages of `rows` layers each, `rows` being the
number of global layers:

- a block (the id the scheduler, the prefix cache and the KV transfer use) is one page: row r
  of page b holds global layer r's K/V of that block;
- while a block is inside the window, it also holds `window_pages` more pages, one per group of
  `rows` windowed layers: windowed layer j sits at row j % rows of the block's page j // rows;
- once every sequence holding the block has moved past the window, those pages go back to the
  pool, which they share with the blocks.

So a long context costs one page per block, and the windowed layers only their window. A model
with one kind of layer (every layer global, or every layer windowed alike) keeps the plain
layout, one row per layer, no pages to add.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.blocks import cdiv

OWN_PAGE = -1  # CacheGroups.layer_rows: the layer lives in the block's own page


@dataclass(frozen=True)
class CacheGroups:
    rows: int  # layers per page: the number of global layers
    window: int  # the windowed layers' window, in tokens (one size for all of them)
    window_pages: int  # pages a block's windowed layers take while in the window
    layer_rows: tuple[tuple[int, int], ...]  # per layer: (row, window page index or OWN_PAGE)

    @staticmethod
    def of(windows: tuple[int, ...]) -> CacheGroups | None:
        """The grouping of a model whose layers have these windows (0: global); None where the
        plain layout serves (one kind of layer, or windows of more than one size)."""
        sizes = {w for w in windows if w}
        globals_ = [i for i, w in enumerate(windows) if not w]
        if len(sizes) != 1 or not globals_:
            return None
        rows = len(globals_)
        placed: dict[int, tuple[int, int]] = {i: (r, OWN_PAGE) for r, i in enumerate(globals_)}
        windowed = [i for i, w in enumerate(windows) if w]
        placed.update({i: (j % rows, j // rows) for j, i in enumerate(windowed)})
        return CacheGroups(rows, sizes.pop(), cdiv(len(windowed), rows), tuple(placed[i] for i in range(len(windows))))

    def is_windowed(self, layer: int) -> bool:
        return self.layer_rows[layer][1] != OWN_PAGE

    @property
    def pages_per_block(self) -> int:
        """Pages a block takes while its windowed layers are held."""
        return 1 + self.window_pages
