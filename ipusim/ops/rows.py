"""Ops along one axis, row by row: the plan that spreads rows over tiles.

A tensor seen along `axis` is a matrix of R rows (every other axis, in order) by N columns (the
axis), a strided view (`along`), never a copy. Ops whose result on a row depends on the whole row
(gather and scatter along an axis, cumulative sums and products, sort and top-k) give each tile a
block of whole rows: `plan_rows` cuts the R rows into at most one block per tile, each block big
enough to be worth a tile (`MIN_ELEMENTS` of work), blocks spread evenly over the tiles. Ops that
read a whole row but write only some columns (gather) may also cut the written columns into
blocks when there are fewer rows than tiles (each column block gets its own copy of the rows).
Each block's operands come to its tile with one exchange (`common.gather_boxes`); its result is
mapped there. A block's rows are then split over the tile's workers, one vertex per piece.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.graph import Graph
from ..device.program import Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field
from .common import gather_boxes, map_boxes, split_ranges

MIN_ELEMENTS = 64   # work a block must hold before another tile is used, as `new_output` maps


def along(t: Tensor, axis: int) -> Tensor:
    """The view of `t` as [rows, t.shape[axis]]: `axis` last, the others in order as rows."""
    axis %= max(t.rank, 1)
    if t.rank == 0:
        return t.reshape(1, 1)
    perm = [d for d in range(t.rank) if d != axis] + [axis]
    rows = int(np.prod([t.shape[d] for d in perm[:-1]], dtype=np.int64))
    return t.transpose(perm).reshape(rows, t.shape[axis])


@dataclass(frozen=True)
class RowBlocks:
    """Block b holds rows [row[b], row[b] + rows[b]) and columns [col[b], col[b] + cols[b]) of the
    written matrix, on `tile[b]`."""
    tile: np.ndarray
    row: np.ndarray
    rows: np.ndarray
    col: np.ndarray
    cols: np.ndarray

    def map_output(self, out: Tensor) -> None:
        """Map the [R, M] view `out` block by block."""
        map_boxes(out, np.stack([self.row, self.col], 1), np.stack([self.rows, self.cols], 1), self.tile)

    def bring(self, graph: Graph, body: Sequence, t: Tensor, name: str, whole_rows: bool = False
              ) -> tuple[Tensor, np.ndarray]:
        """Each block's part of the [R, *] view `t` (its columns, or whole rows) on its tile: the
        local tensor and where each block starts in it (blocks row-major, one after the other)."""
        first = np.stack([self.row, np.zeros_like(self.col) if whole_rows else self.col], 1)
        extent = np.stack([self.rows, np.full_like(self.cols, t.shape[1]) if whole_rows else self.cols], 1)
        return gather_boxes(graph, body, t, first, extent, self.tile, name)

    def pieces(self, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block, first row, end row) of each vertex: every block's rows split over the workers."""
        return split_ranges(self.rows, workers)

    def local_rows(self, local: Tensor, at: np.ndarray, block, a, b, width) -> Field:
        """Rows [a, b) of each block's local copy, `width` elements per row."""
        return Field.strided(local, at[block] + a * width, 1, (b - a) * width)

    def rows_of(self, out: Tensor, block, a, b) -> Field:
        """Rows [a, b) of each block in the [R, M] view `out`, the block's columns of each."""
        return Field.strided(out, (self.row[block] + a) * out.shape[1] + self.col[block], b - a, self.cols[block],
                             out.shape[1])


def plan_rows(graph: Graph, num_rows: int, row_work: int, written: int, split_columns: bool = False) -> RowBlocks:
    """Blocks of whole rows (`row_work` elements of work per row), at most one per tile; with
    `split_columns`, when rows are fewer than the tiles, the `written` columns are cut too."""
    T = graph.target.num_tiles
    R, M = int(num_rows), int(written)
    work = max(R * max(row_work, 1), 1)
    blocks = int(max(1, min(T, R, work // MIN_ELEMENTS)))
    per = -(-R // blocks) if R else 0
    row = np.arange(blocks, dtype=np.int64) * per
    rows = np.clip(R - row, 0, per)
    keep = rows > 0 if R else np.ones(1, bool)
    row, rows = row[keep], rows[keep]
    col_blocks = 1
    if split_columns and M and row.size < T:
        col_blocks = int(max(1, min(T // max(row.size, 1), M, (rows.max() * M) // MIN_ELEMENTS)))
    cper = -(-M // col_blocks) if M else 0
    col = np.arange(col_blocks, dtype=np.int64) * cper
    cols = np.clip(M - col, 0, cper)
    keep = cols > 0 if M else np.ones(col_blocks, bool)
    col, cols = col[keep], cols[keep]
    i, j = (a.reshape(-1) for a in np.meshgrid(np.arange(row.size), np.arange(col.size), indexing="ij"))
    tile = (np.arange(i.size, dtype=np.int64) * T) // max(i.size, 1)
    return RowBlocks(tile.astype(np.int32), row[i], rows[i], col[j], cols[j])
