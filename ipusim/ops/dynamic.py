"""Dynamic slices and updates: a slice of a tensor at a position read from the device (PopLibs'
`popops::dynamicSlice` and `dynamicUpdate`), the ops a device loop reads and writes its step with.

`dynamic_slice(t, offset, dim, size)`: the `size` rows of `t` along `dim` starting at the int32
scalar `offset`, a tensor on the device whose value is known only when the program runs.
`dynamic_update(t, src, offset, dim)` writes `src` (`t`'s shape with `size` along `dim`) there, in
place. As PopLibs' codelets do, an offset outside [0, N) (N = t.shape[dim]; a negative one is a
large unsigned number on the IPU) reads and writes from row 0, and a slice running past the end
wraps round to the first rows.

Layout (`sliceable`): the tensor seen as [P, N, Q] (the axes before `dim`, `dim`, the axes after)
is cut into regions of columns (p, q0 .. q0 + qlen), each on one tile with all its N rows, as
PopLibs' `createSliceableTensor` maps it: every tile then slices its own columns and no element
moves. Regions take the columns in order, at least 64 elements a tile, in vector-sized grains.
A tensor mapped otherwise is first copied into that layout (one exchange); a slice comes out
mapped region by region like its source, and the source of an update is brought to the regions'
tiles. The offset is broadcast to the tiles that slice (one exchange of 4 bytes).

Vertices (one per worker piece of a region; cycles = `target.thread_cycles`):
- slice and update, `size` rows of a region of qlen columns: 12 + size * (6 + ceil(qlen / w)):
  the offset load and wrap, then per row the row address and a vector copy (w elements per
  64-bit load: 2 float32 or int32, 4 float16, 8 bool).
The fast mode takes the same rows with NumPy; both modes copy values, so they agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT
from ..device.mapping import TileMap, merged
from ..device.program import Copy, Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import box_runs, map_boxes, placed, split_ranges

MIN_ELEMENTS = 64   # elements a tile holds before the next tile is used, as `new_output` maps
GRAIN = 4           # columns of a region come in multiples of this (vector loads)


# ---- codelets and estimators ----------------------------------------------------------------------
@njit(**JIT)
def _start(offset, n):
    """The first row a slice takes: the offset, or 0 when it is outside [0, n) (unsigned on the IPU)."""
    return offset if 0 <= offset < n else 0


@njit(parallel=True, **JIT)
def slice_codelet(base, b_addr, b_start, off, f_addr, f_start, out, o_addr, o_start, params):
    """params: rows N of the base, rows `size` of the slice. Each vertex holds a region of qlen
    columns: N rows of qlen in `base`, `size` rows of qlen in `out`."""
    for v in prange(params.shape[0]):
        n, size = int(params[v, 0]), int(params[v, 1])
        qlen = (o_start[v + 1] - o_start[v]) // max(size, 1)
        first = _start(np.int64(off[f_addr[f_start[v]]]), n)
        for j in range(size):
            row = (first + j) % n
            for e in range(qlen):
                out[o_addr[o_start[v] + j * qlen + e]] = base[b_addr[b_start[v] + row * qlen + e]]


@njit(parallel=True, **JIT)
def update_codelet(src, s_addr, s_start, off, f_addr, f_start, base, b_addr, b_start, params):
    """params: rows N of the base, rows `size` of the source (written in place into the base)."""
    for v in prange(params.shape[0]):
        n, size = int(params[v, 0]), int(params[v, 1])
        qlen = (s_start[v + 1] - s_start[v]) // max(size, 1)
        first = _start(np.int64(off[f_addr[f_start[v]]]), n)
        for j in range(size):
            row = (first + j) % n
            for e in range(qlen):
                base[b_addr[b_start[v] + row * qlen + e]] = src[s_addr[s_start[v] + j * qlen + e]]


def vector_width(dtype) -> int:
    """Elements of `dtype` in one 64-bit load."""
    return max(1, 8 // np.dtype(dtype).itemsize)


def _cycles(field: str):
    def estimate(sizes, params, dtype, target):
        size = np.maximum(params[:, 1], 1)
        qlen = sizes[field] // size
        return target.thread_cycles(12 + params[:, 1] * (6 + np.ceil(qlen / vector_width(dtype))))
    return estimate


SLICE = VertexType("popops::DynamicSlice2d", ("base", "offset"), ("out",), slice_codelet, _cycles("out"),
                   num_params=2)
UPDATE = VertexType("popops::DynamicUpdateSlice2d", ("src", "offset"), ("base",), update_codelet, _cycles("src"),
                    num_params=2)


# ---- layout ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Regions:
    """Region r: columns q0[r] .. q0[r] + qlen[r] of p[r] in the [P, N, Q] view, all rows, on tile[r]."""
    P: int
    N: int
    Q: int
    tile: np.ndarray
    p: np.ndarray
    q0: np.ndarray
    qlen: np.ndarray

    def boxes(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(first, extent) of each region as a box of a [P, rows, Q] view."""
        zeros = np.zeros_like(self.p)
        return np.stack([self.p, zeros, self.q0], 1), np.stack([np.ones_like(self.p), zeros + rows, self.qlen], 1)

    def tile_map(self, rows: int) -> TileMap:
        """The tiles of the positions of a [P, rows, Q] tensor mapped region by region."""
        first, extent = self.boxes(rows)
        starts, lengths, box = box_runs(first, extent, (self.P, rows, self.Q))
        order = np.argsort(starts, kind="stable")
        return TileMap(self.P * rows * self.Q, starts[order], self.tile[box[order]])


def dims(shape, dim: int) -> tuple[int, int, int, int]:
    """(dim, P, N, Q) of a tensor of `shape` sliced along `dim` (negative counts from the end)."""
    rank = len(shape)
    if not -rank <= dim < rank:
        raise ValueError(f"dimension {dim} is out of range for a tensor of shape {tuple(shape)}")
    dim %= rank
    return dim, int(np.prod(shape[:dim], dtype=np.int64)), int(shape[dim]), int(np.prod(shape[dim + 1:],
                                                                                         dtype=np.int64))


def plan(num_tiles: int, shape, dim: int) -> Regions:
    """The regions of a sliceable tensor of `shape` along `dim`: its P * Q columns in order, cut
    into chunks of at least MIN_ELEMENTS elements (whole columns, multiples of GRAIN), one tile
    per chunk, and at each p."""
    dim, P, N, Q = dims(shape, dim)
    C = P * Q
    if C == 0 or N == 0:
        empty = np.zeros(0, np.int64)
        return Regions(P, N, Q, empty.astype(np.int32), empty, empty, empty)
    per = max(-(-C // num_tiles), -(-MIN_ELEMENTS // N), 1)
    per = min(-(-per // GRAIN) * GRAIN, C)
    chunks = np.arange(0, C, per, dtype=np.int64)
    cuts = merged(chunks, np.arange(0, C, Q, dtype=np.int64))
    lengths = np.diff(np.append(cuts, C))
    return Regions(P, N, Q, (cuts // per).astype(np.int32), cuts // Q, cuts % Q, lengths)


def sliceable(graph: Graph, dtype, shape, dim: int, name: str, *, category: str = "activations",
              always_live: bool = False) -> Tensor:
    """A new tensor of `shape` laid out for slicing along `dim` (`plan`)."""
    t = graph.addVariable(dtype, shape, name, category=category, always_live=always_live)
    _map(t, plan(graph.target.num_tiles, t.shape, dim))
    return t


def _map(t: Tensor, r: Regions) -> None:
    if t.numel:
        first, extent = r.boxes(r.N)
        map_boxes(t.reshape(r.P, r.N, r.Q), first, extent, r.tile)


def is_sliceable(t: Tensor, dim: int, num_tiles: int) -> bool:
    """Whether `t` is laid out as `sliceable` lays it out along `dim` on a target of `num_tiles`."""
    r = plan(num_tiles, t.shape, dim)
    return t.numel == 0 or t.lives_on(r.tile_map(r.N))


def laid_out(graph: Graph, prog: Sequence, t: Tensor, dim: int, name: str) -> Tensor:
    """`t` itself when it is sliceable along `dim`, else a sliceable copy of it (an exchange)."""
    if is_sliceable(t, dim, graph.target.num_tiles):
        return t
    r = plan(graph.target.num_tiles, t.shape, dim)
    copy = graph.addVariable(t.dtype, t.shape, name, category="temporaries", always_live=False)
    _map(copy, r)
    prog.add(Copy(t, copy))
    return copy


# ---- ops ------------------------------------------------------------------------------------------
def _check(name: str, t: Tensor, offset: Tensor, size: int, dim: int) -> tuple[int, int, int, int]:
    if offset.numel != 1:
        raise ValueError(f"{name}: the offset {offset.name!r} must hold one element, it has shape {offset.shape}")
    if offset.dtype.kind not in "iu":
        raise TypeError(f"{name}: the offset {offset.name!r} is {offset.dtype.name}; it must be an integer "
                        "(cast it to int32 first)")
    dim, P, N, Q = dims(t.shape, dim)
    if not 1 <= size <= N:
        raise ValueError(f"{name}: a slice of {size} rows of dimension {dim} of {t.name!r} {t.shape}; it must take "
                         f"1 to {N} rows")
    return dim, P, N, Q


def _vertices(graph: Graph, body: Sequence, r: Regions, offset: Tensor, name: str):
    """Each region split over the workers: (region, column offset, columns) of every vertex, its
    tile, and the offset on every tile that slices."""
    k, a, b = split_ranges(r.qlen, graph.target.workers_per_tile, 2)
    tiles = r.tile[k]
    used = np.unique(tiles)
    local = placed(graph, body, offset.reshape(1).broadcast((used.size,)), TileMap.from_tiles(used),
                   f"{name}/offset")
    at = np.searchsorted(used, tiles)
    return k, a, b, tiles, Field.strided(local, at, 1, 1)


def _rows(t3: Tensor, r: Regions, k, a, b, rows: int) -> Field:
    """Each vertex's columns (q0 + a .. q0 + b of its region's p) in `rows` rows of the [P, rows, Q] view."""
    start = (r.p[k] * rows) * r.Q + r.q0[k] + a
    return Field.strided(t3, start, rows, b - a, r.Q)


def dynamic_slice(graph: Graph, t: Tensor, offset: Tensor, dim: int, size: int, prog: Sequence,
                  name: str = "dynamic_slice") -> Tensor:
    """The `size` rows of `t` along `dim` from the row the device tensor `offset` holds (see the
    module doc for offsets outside the dimension), mapped like the rows they come from."""
    dim, P, N, Q = _check(name, t, offset, size, dim)
    out_shape = t.shape[:dim] + (size,) + t.shape[dim + 1:]
    out = graph.addVariable(t.dtype, out_shape, name, category="activations", always_live=False)
    body = Sequence(name=name)
    if out.numel:
        base = laid_out(graph, body, t, dim, f"{name}/sliceable")
        r = plan(graph.target.num_tiles, t.shape, dim)
        first, extent = r.boxes(size)
        map_boxes(out.reshape(P, size, Q), first, extent, r.tile)
        k, a, b, tiles, off = _vertices(graph, body, r, offset, name)
        fields = {"offset": off, "base": _rows(base.reshape(P, N, Q), r, k, a, b, N),
                  "out": _rows(out.reshape(P, size, Q), r, k, a, b, size)}
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, SLICE, tiles, fields, np.array([[N, size]], np.float64).repeat(k.size, 0))
        body.add(Execute(cs))

    def fast(io):
        first = int(io.read(offset).reshape(-1)[0])
        rows = (np.arange(size) + (first if 0 <= first < N else 0)) % N
        io.write(out, np.take(io.read(t), rows, axis=dim))

    prog.add(OpProgram(name, body, fast, (t, offset), (out,)))
    return out


def dynamic_update(graph: Graph, t: Tensor, src: Tensor, offset: Tensor, dim: int, prog: Sequence,
                   name: str = "dynamic_update") -> Tensor:
    """Write `src` into the rows of `t` along `dim` from the row `offset` holds, in place; returns
    `t`. A `t` not laid out for slicing is updated through a sliceable copy (copied in and out)."""
    if src.dtype != t.dtype:
        raise TypeError(f"{name}: the source {src.name!r} is {src.dtype.name}, the tensor {t.name!r} "
                        f"{t.dtype.name}; cast one first")
    rank = t.rank
    if src.rank != rank:
        raise ValueError(f"{name}: the source {src.name!r} {src.shape} and the tensor {t.name!r} {t.shape} must "
                         "have the same number of dimensions")
    dim_ = dim % rank if rank else dim
    size = src.shape[dim_] if rank else 0
    dim, P, N, Q = _check(name, t, offset, size, dim)
    if tuple(src.shape[:dim] + src.shape[dim + 1:]) != tuple(t.shape[:dim] + t.shape[dim + 1:]):
        raise ValueError(f"{name}: the source {src.name!r} {src.shape} must match {t.name!r} {t.shape} on every "
                         f"dimension but {dim}")
    body = Sequence(name=name)
    if t.numel:
        base = laid_out(graph, body, t, dim, f"{name}/sliceable")
        r = plan(graph.target.num_tiles, t.shape, dim)
        s = placed(graph, body, src, r.tile_map(size), f"{name}/src")
        k, a, b, tiles, off = _vertices(graph, body, r, offset, name)
        fields = {"offset": off, "src": _rows(s.reshape(P, size, Q), r, k, a, b, size),
                  "base": _rows(base.reshape(P, N, Q), r, k, a, b, N)}
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, UPDATE, tiles, fields, np.array([[N, size]], np.float64).repeat(k.size, 0))
        body.add(Execute(cs))
        if base is not t:
            body.add(Copy(base, t))

    def fast(io):
        first = int(io.read(offset).reshape(-1)[0])
        rows = (np.arange(size) + (first if 0 <= first < N else 0)) % N
        key = (slice(None),) * dim + (rows,)
        view = io.output(t)
        if view is not None:
            view[key] = io.read(src)
        else:
            values = np.array(io.read(t), copy=True)
            values[key] = io.read(src)
            io.write(t, values)

    prog.add(OpProgram(name, body, fast, (t, src, offset), (t,)))
    return t
