"""Helpers every op uses: output allocation, operand placement by exchange, and the vectorised
work splits and boxes ops build their vertex tables from (no Python loop over vertices or tiles)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.graph import Graph
from ..device.program import Copy, Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field, expand_runs

# Elements a tile processes in one vector step; outputs are mapped in multiples of it so that
# vertices see whole vectors (64-bit loads: 2 x float32, 4 x float16).
GRAIN = 4


def new_output(graph: Graph, dtype, shape, name: str, *, category: str = "activations",
               always_live: bool = False, grain: int = GRAIN, min_elements_per_tile: int = 64,
               like: Tensor | None = None) -> Tensor:
    """A new tensor mapped like `like` (when it has the same shape and is fully mapped, as
    PopLibs clones an operand for elementwise outputs), else spread linearly over all tiles."""
    if like is not None and tuple(like.shape) == tuple(shape) and (like.tiles() >= 0).all():
        return graph.clone(like, name, dtype=dtype, category=category, always_live=always_live)
    t = graph.addVariable(dtype, shape, name, category=category, always_live=always_live)
    graph.map_linearly(t, grain=grain, min_elements_per_tile=min_elements_per_tile)
    return t


def placed(graph: Graph, prog: Sequence, src: Tensor, tiles: np.ndarray, name: str) -> Tensor:
    """A tensor shaped like `src` whose flat element i lives on `tiles[i]`.

    Returns `src` itself when its elements already live there; otherwise a new temporary (not
    always live) mapped to `tiles`, filled by an exchange `Copy` appended to `prog`.
    """
    tiles = np.asarray(tiles).reshape(-1)
    if np.array_equal(src.tiles().reshape(-1), tiles):
        return src
    tmp = graph.addVariable(src.dtype, src.shape, name, category="temporaries", always_live=False)
    tmp.var.mapping[:] = tiles
    prog.add(Copy(src, tmp))
    return tmp


def gather_boxes(graph: Graph, body: Sequence, src: Tensor, first: np.ndarray, extent: np.ndarray, tiles, name: str
           ) -> tuple[Tensor, np.ndarray]:
    """Bring box i of the view `src` (`first[i]`, `extent[i]` per dimension) to `tiles[i]`, with
    one exchange for all boxes; returns a flat view holding the boxes one after the other, each
    on its tile (a view of the source itself where every element already lives there), and the
    boxes' offsets in it."""
    sizes = np.asarray(extent, np.int64).prod(axis=1)
    index = src.elements_at(box_positions(first, extent, src.shape))
    local = placed(graph, body, Tensor(src.var, index), np.repeat(np.asarray(tiles), sizes), name)
    return local, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass(frozen=True)
class Work:
    """Vertices over the flat elements of same-shaped tensors: vertex v runs on `tiles[v]` and
    takes the flat positions `positions[offsets[v]:offsets[v+1]]`."""
    tiles: np.ndarray
    positions: np.ndarray
    offsets: np.ndarray

    @property
    def num_vertices(self) -> int:
        return self.tiles.size

    def field(self, t: Tensor) -> Field:
        """Each vertex connects its positions of `t`."""
        return Field.at(t, self.positions, self.offsets)

    def rows(self, t: Tensor) -> Field:
        """Each vertex connects its positions in every row of `t` ([rows, n], n the positions'
        range), row after row."""
        rows, n = t.shape[0], t.numel // max(1, t.shape[0])
        sizes = np.repeat(np.diff(self.offsets), rows)  # per (vertex, row): the vertex's positions
        at = expand_runs(np.repeat(self.offsets[:-1], rows), sizes)
        row = np.repeat(np.tile(np.arange(rows, dtype=np.int64), self.num_vertices), sizes)
        return Field.at(t, self.positions[at] + row * n, np.concatenate(([0], np.cumsum(sizes)))[::rows])


def tile_groups(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The flat positions of `tiles` grouped by tile: (order, the tiles in increasing order, where
    each tile's positions start in `order`, how many there are); positions of a tile in
    increasing order. One stable sort and one pass, no second sort."""
    tiles = np.asarray(tiles).reshape(-1)
    order = np.argsort(tiles, kind="stable")
    grouped = tiles[order]
    first = np.flatnonzero(np.diff(grouped)) + 1
    first = np.concatenate(([0], first)) if grouped.size else first
    return order, grouped[first], first, np.diff(np.append(first, grouped.size))


def region_work(tiles: np.ndarray, workers: int, grain: int = 1) -> Work:
    """About one vertex per worker on every tile, over the elements that tile holds: a tile's
    elements (in increasing position) split as `split_ranges(count, workers, grain)` splits them,
    tiles in increasing order."""
    order, values, first, counts = tile_groups(tiles)
    tile, begin, _ = split_ranges(counts, workers, grain)
    return Work(values[tile].astype(np.int32), order.astype(np.int64, copy=False),
                np.append(first[tile] + begin, order.size).astype(np.int64))


def split_ranges(sizes, parts, grain: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each range(sizes[i]) into at most `parts[i]` contiguous pieces in multiples of
    `grain` (the last may be shorter): per piece, (i, begin, end), pieces of one range in order,
    ranges in order."""
    sizes, parts = np.broadcast_arrays(np.asarray(sizes, np.int64).reshape(-1), np.asarray(parts, np.int64).reshape(-1))
    grains = -(-sizes // grain)
    per = np.maximum(1, -(-grains // np.maximum(1, np.minimum(parts, grains))) * grain)
    count = -(-sizes // per)
    index = np.repeat(np.arange(sizes.size), count)
    begin = (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)) * per[index]
    return index, begin, np.minimum(begin + per[index], sizes[index])


def box_positions(first: np.ndarray, extent: np.ndarray, shape) -> np.ndarray:
    """Flat positions (C order, in an array of `shape`) of the elements of every box, box after
    box: box i spans [first[i, d], first[i, d] + extent[i, d]) along each dimension d. Work is per
    row of a box (its last dimension is one run), then one expansion of the runs."""
    first, extent = np.asarray(first, np.int64), np.asarray(extent, np.int64)
    row_length = extent[:, -1]
    rows = extent[:, :-1].prod(axis=1) * (row_length > 0)
    box = np.repeat(np.arange(len(first)), rows)
    local = np.arange(rows.sum(), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
    row_start, stride = first[box, -1], int(shape[-1])
    for d in reversed(range(len(shape) - 1)):
        local, r = np.divmod(local, extent[box, d])
        row_start += (first[box, d] + r) * stride
        stride *= int(shape[d])
    return expand_runs(row_start, row_length[box])


def lookup(table: dict, keys: np.ndarray) -> np.ndarray:
    """`table[k]` for every k of an array of small non-negative integer codes."""
    dense = np.zeros(max(table) + 1, dtype=np.result_type(*table.values()))
    dense[list(table)] = list(table.values())
    return dense[np.asarray(keys, np.int64)]


def by_distinct_rows(params: np.ndarray, fn) -> np.ndarray:
    """`fn(row)` (row as a tuple) for every row of a parameter matrix, computed once per distinct row."""
    if not len(params):
        return np.zeros(0, np.int64)
    order = np.lexsort(params.T[::-1])
    ordered = params[order]
    new = np.ones(len(params), bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    inverse = np.empty(len(params), np.int64)
    inverse[order] = np.cumsum(new) - 1
    return np.asarray([fn(tuple(r)) for r in ordered[new]], np.int64)[inverse]


def flat(t: Tensor, positions: np.ndarray) -> Tensor:
    """The elements of `t` at flat `positions`, as a 1-D view."""
    return t.flatten()[positions]
