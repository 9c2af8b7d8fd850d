"""Helpers every op uses: output allocation, operand placement by exchange, and the vectorised
work splits and boxes ops build their vertex tables from (no Python loop over vertices or tiles)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.graph import Graph
from ..device.program import Copy, Sequence
from ..device.mapping import TileMap, merged
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
    if like is not None and tuple(like.shape) == tuple(shape) and like.tile_map().mapped:
        return graph.clone(like, name, dtype=dtype, category=category, always_live=always_live)
    t = graph.addVariable(dtype, shape, name, category=category, always_live=always_live)
    graph.map_linearly(t, grain=grain, min_elements_per_tile=min_elements_per_tile)
    return t


def kernel_array(target: np.ndarray | None, shape: tuple, dtype) -> np.ndarray:
    """Where a fast-mode kernel that makes `dtype` writes its [shape] result: `target` (an output's
    storage, `io.output`) when it is contiguous and of that dtype, else a new array."""
    if target is not None and target.dtype == dtype and target.flags.c_contiguous:
        return target.reshape(shape)
    return np.empty(shape, dtype)


def store(io, t: Tensor, values: np.ndarray, target: np.ndarray | None) -> None:
    """Write a fast-mode kernel's result to `t`, unless the kernel computed it in `target`, t's
    own storage (`kernel_array`)."""
    if target is None or not np.may_share_memory(values, target):
        io.write(t, values)


def placed(graph: Graph, prog: Sequence, src: Tensor, tiles: np.ndarray, name: str) -> Tensor:
    """A tensor shaped like `src` whose flat element i lives on `tiles[i]` (a tile per element, or
    a `TileMap` of the positions).

    Returns `src` itself when its elements already live there; otherwise a new temporary (not
    always live) mapped to `tiles`, filled by an exchange `Copy` appended to `prog`.
    """
    tiles = tiles if isinstance(tiles, TileMap) else TileMap.from_tiles(tiles)
    if src.lives_on(tiles):
        return src
    tmp = graph.addVariable(src.dtype, src.shape, name, category="temporaries", always_live=False)
    tmp.var.mapping = tiles
    prog.add(Copy(src, tmp))
    return tmp


def gather_boxes(graph: Graph, body: Sequence, src: Tensor, first: np.ndarray, extent: np.ndarray, tiles, name: str
           ) -> tuple[Tensor, np.ndarray]:
    """Bring box i of the view `src` (`first[i]`, `extent[i]` per dimension) to `tiles[i]`, with
    one exchange for all boxes; returns a flat view holding the boxes one after the other, each
    on its tile (a view of the source itself where every element already lives there), and the
    boxes' offsets in it."""
    first, extent = np.asarray(first, np.int64), np.asarray(extent, np.int64)
    sizes = extent.prod(axis=1)
    boxes, sequence = np.unique(np.concatenate([first, extent], axis=1), axis=0, return_inverse=True)
    d = first.shape[1]
    starts, lengths, box = box_runs(boxes[:, :d], boxes[:, d:], src.shape)  # each distinct box once
    k, first_element, length = src.runs_at(starts, lengths)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(box[k], minlength=len(boxes)))))
    view = Tensor.of_blocks(src.var, first_element, length, offsets, sequence.reshape(-1))
    local = placed(graph, body, view, TileMap.from_lengths(sizes, tiles), name)
    return local, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass(frozen=True)
class Work:
    """Vertices over the flat positions of same-shaped tensors: vertex v runs on `tiles[v]` and
    takes the runs of positions `starts[k]`, `lengths[k]` for k in `offsets[v] .. offsets[v+1] - 1`,
    in that order."""
    tiles: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray

    @property
    def num_vertices(self) -> int:
        return self.tiles.size

    @property
    def positions(self) -> np.ndarray:
        """Every vertex's positions, vertex after vertex (`offsets` of the runs turned into
        offsets of these are `element_offsets`)."""
        return expand_runs(self.starts, self.lengths)

    @property
    def element_offsets(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.lengths)))[self.offsets]

    def field(self, t: Tensor) -> Field:
        """Each vertex connects its positions of `t`."""
        return Field.from_positions(t, self.starts, self.lengths, self.offsets)

    def rows(self, t: Tensor) -> Field:
        """Each vertex connects its positions in every row of `t` ([rows, n], n the positions'
        range), row after row."""
        rows, n = t.shape[0], t.numel // max(1, t.shape[0])
        per = np.diff(self.offsets)  # runs of each vertex
        count = per * rows            # runs of each vertex over all rows
        first = np.cumsum(count) - count
        k = np.arange(count.sum()) - np.repeat(first, count)  # (row, run) of each, row-major
        row, j = np.divmod(k, np.repeat(np.maximum(per, 1), count))
        run = np.repeat(self.offsets[:-1], count) + j
        offsets = np.concatenate(([0], np.cumsum(count)))
        return Field.from_positions(t, self.starts[run] + row * n, self.lengths[run], offsets)


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


def region_work(tiles: TileMap, workers: int, grain: int = 1, split=None) -> Work:
    """About one vertex per worker on every tile, over the positions that tile holds (a `TileMap`
    of them): a tile's positions (in increasing order) split as `split_ranges(count, workers,
    grain)` splits them (or as `split(counts)` does, returning the same triple), tiles in
    increasing order. Work per run of the map, not per position."""
    order, values, first, counts = tile_groups(tiles.tiles)  # the map's runs grouped by tile
    lengths = tiles.lengths[order]
    sizes = np.add.reduceat(lengths, first) if first.size else np.zeros(0, np.int64)
    tile, begin, end = split_ranges(sizes, workers, grain) if split is None else split(sizes)
    # one coordinate over every tile's positions, tile after tile: cut at runs and pieces
    run_at = np.cumsum(lengths) - lengths
    piece_at = (np.cumsum(sizes) - sizes)[tile] + begin
    cuts = merged(run_at, piece_at)
    run = np.searchsorted(run_at, cuts, side="right") - 1
    piece = np.searchsorted(piece_at, cuts, side="right") - 1
    starts = tiles.starts[order][run] + cuts - run_at[run]
    return Work(values[tile].astype(np.int32), starts, np.diff(np.append(cuts, lengths.sum())),
                np.searchsorted(piece, np.arange(piece_at.size + 1)))


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


def box_runs(first: np.ndarray, extent: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The elements of every box as runs of flat positions (C order, in an array of `shape`), box
    after box: box i spans [first[i, d], first[i, d] + extent[i, d]) along each dimension d.
    One run per row of a box (its last dimension): (starts, lengths, box of each run)."""
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
    return row_start, row_length[box], box


def box_positions(first: np.ndarray, extent: np.ndarray, shape) -> np.ndarray:
    """Flat positions (C order, in an array of `shape`) of the elements of every box, box after
    box (`box_runs` expanded)."""
    starts, lengths, _ = box_runs(first, extent, shape)
    return expand_runs(starts, lengths)


def map_boxes(t: Tensor, first: np.ndarray, extent: np.ndarray, tiles) -> None:
    """Map box i of the view `t` (`first[i]`, `extent[i]` per dimension) to `tiles[i]`."""
    starts, lengths, box = box_runs(first, extent, t.shape)
    t.map_positions(starts, lengths, np.asarray(tiles)[box])


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


def flat(t: Tensor, positions: np.ndarray, *, distinct: bool = False) -> Tensor:
    """The elements of `t` at flat `positions`, as a 1-D view (`distinct`: no position repeats)."""
    return t.take(positions, distinct=distinct)
