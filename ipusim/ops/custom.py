"""Custom ops: a user's host kernel run as vertices on tiles, with its own cycle estimate.

A Poplar custom op is a codelet the user writes; here it is a Python function over NumPy arrays
(it may call Numba itself): `kernel(*inputs, **attributes)` returns an array or a sequence of
arrays, one per declared output (shapes checked, values cast to the declared dtypes). The op is
one compute set of vertices of one vertex type made for it; the kernel runs once per vertex on
the elements the vertex connects, read from and written to its own tile's memory (strict mode),
or once on the whole tensors (fast mode).

How the work is cut (`partition`, a property of the kernel the user declares):
- "none": one vertex; its inputs are exchanged to one tile (the tile holding most of the first
  input) and its outputs live there. Right for any kernel; the whole op on one tile.
- "rows": every input and output has the same leading dimension R and row r of the outputs
  depends only on row r of the inputs (a per-sample op). Rows are split in blocks over the
  tiles (at most R tiles), a tile's block over its workers, one vertex per piece.
- "elements": every input and output has the same number of elements and element i depends only
  on element i (an elementwise op); split like "rows" over the flattened tensors, in multiples
  of four elements.
With "rows" and "elements" the fast mode's single call on whole tensors gives the same values as
the per-vertex calls, which is what the declaration promises.

Cycles. `cycles(*shapes, **attributes)` (given) returns the cycles one vertex takes on one
worker for the shapes of the inputs it connects; without it a vertex costs one worker instruction
per element it reads or writes (`target.thread_cycles`), the cost of a plain scalar loop. The
fixed vertex overhead is added by the vertex table as for every vertex.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence as Seq

import numpy as np

from ..device.graph import Graph
from ..device.mapping import TileMap
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor, as_dtype
from ..device.vertex import Field, VertexType
from .common import GRAIN, placed, split_ranges

PARTITIONS = ("none", "rows", "elements")


class CustomKernelError(RuntimeError):
    """A custom op's kernel returned results that do not match the op's declared outputs."""


def run_kernel(kernel: Callable, arrays: list[np.ndarray], attributes: dict, out_specs: list[tuple],
               name: str) -> list[np.ndarray]:
    """Call the kernel and check its results against `out_specs` ((shape, dtype) per output):
    one array per output, of that shape; values cast to that dtype."""
    result = kernel(*arrays, **attributes)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(results) != len(out_specs):
        raise CustomKernelError(f"custom op {name}: the kernel returned {len(results)} result(s), the op declares "
                                f"{len(out_specs)} output(s) (example_outputs)")
    out = []
    for i, (r, (shape, dtype)) in enumerate(zip(results, out_specs)):
        r = np.asarray(r)
        if tuple(r.shape) != tuple(shape):
            raise CustomKernelError(f"custom op {name}: output {i} of the kernel has shape {tuple(r.shape)}, the op "
                                    f"declares {tuple(shape)}")
        out.append(r.astype(dtype, copy=False))
    return out


class HostCodelet:
    """The codelet of a custom op's vertex type: for every vertex, load its fields from its tile's
    arena, call the kernel, store the results (float16 arenas hold bit patterns, see
    `ipusim.device.kernels`). Parameter 0 of a vertex is the number of rows it holds."""

    def __init__(self, kernel: Callable, in_rows: list[tuple], in_dtypes: list, out_rows: list[tuple],
                 out_dtypes: list, attributes: dict, name: str):
        self.kernel = kernel
        self.in_rows, self.in_dtypes = in_rows, [np.dtype(d) for d in in_dtypes]
        self.out_rows, self.out_dtypes = out_rows, [np.dtype(d) for d in out_dtypes]
        self.attributes = dict(attributes)
        self.name = name

    @staticmethod
    def _load(arena, addresses, dtype) -> np.ndarray:
        values = arena[addresses]
        return values.view(np.float16) if dtype == np.float16 else values.astype(dtype, copy=False)

    @staticmethod
    def _store(arena, addresses, values: np.ndarray, dtype) -> None:
        arena[addresses] = values.astype(dtype).view(np.uint16) if dtype == np.float16 else values.reshape(-1)

    def __call__(self, *args):
        fields = len(self.in_rows) + len(self.out_rows)
        params = args[3 * fields]
        triples = [args[3 * f:3 * f + 3] for f in range(fields)]
        n_in = len(self.in_rows)
        for v in range(params.shape[0]):
            rows = int(params[v, 0])
            arrays = []
            for (arena, addr, starts), row, dtype in zip(triples[:n_in], self.in_rows, self.in_dtypes):
                arrays.append(self._load(arena, addr[starts[v]:starts[v + 1]], dtype).reshape(_shape(rows, row)))
            specs = [(_shape(rows, row), dtype) for row, dtype in zip(self.out_rows, self.out_dtypes)]
            results = run_kernel(self.kernel, arrays, self.attributes, specs, self.name)
            for (arena, addr, starts), r, dtype in zip(triples[n_in:], results, self.out_dtypes):
                self._store(arena, addr[starts[v]:starts[v + 1]], r.reshape(-1), dtype)


def _shape(rows: int, row: tuple) -> tuple:
    """A vertex's shape of a tensor: `row` is (None, *rest) for a tensor cut in rows, else the
    whole shape."""
    return (rows,) + tuple(row[1:]) if row and row[0] is None else tuple(row)


class _Estimator:
    """Per-vertex cycles of a custom op's vertex type (see the module docstring)."""

    def __init__(self, cycles: Callable | None, in_rows: list[tuple], out_rows: list[tuple], attributes: dict,
                 fields: tuple[str, ...]):
        self.cycles, self.in_rows, self.out_rows = cycles, in_rows, out_rows
        self.attributes, self.fields = dict(attributes), fields

    def __call__(self, sizes, params, dtype, target) -> np.ndarray:
        rows = params[:, 0].astype(np.int64)
        if self.cycles is None:
            elements = sum(np.asarray(sizes[f], np.int64) for f in self.fields)
            return target.thread_cycles(elements)
        out = np.empty(rows.size, np.int64)
        for v, r in enumerate(rows.tolist()):
            shapes = [_shape(r, row) for row in self.in_rows]
            c = self.cycles(*shapes, **self.attributes)
            if isinstance(c, bool) or not isinstance(c, (int, np.integer, float)) or c < 0 or not math.isfinite(c):
                raise ValueError(f"custom op cycle estimate returned {c!r} for shapes {shapes}: it must return a "
                                 "number of cycles >= 0")
            out[v] = int(math.ceil(c))
        return out


def _check(inputs: list[Tensor], out_specs: list[tuple], partition: str, name: str) -> int:
    """The number of rows the work is cut into (1 for "none")."""
    if partition not in PARTITIONS:
        raise ValueError(f"{name}: partition must be one of {PARTITIONS}, got {partition!r}")
    if not out_specs:
        raise ValueError(f"{name}: a custom op needs at least one output")
    if partition == "none":
        return 1
    shapes = [tuple(t.shape) for t in inputs] + [tuple(s) for s, _ in out_specs]
    if partition == "rows":
        leading = {s[0] if s else None for s in shapes}
        if len(leading) != 1 or None in leading:
            raise ValueError(f"{name}: partition 'rows' needs every input and output to have the same leading "
                             f"dimension; shapes are {shapes}")
        return leading.pop()
    counts = {math.prod(s) for s in shapes}
    if len(counts) != 1:
        raise ValueError(f"{name}: partition 'elements' needs every input and output to have the same number of "
                         f"elements; shapes are {shapes}")
    return counts.pop()


def _vertex_rows(graph: Graph, rows: int, partition: str, first_input: Tensor | None):
    """(tile of each vertex, its first row, its row count) and (tile of each tile block, its row
    count) for `rows` rows cut as `partition` says."""
    target = graph.target
    if partition == "none":
        tile = 0
        if first_input is not None and first_input.numel:
            tile = int(np.argmax(first_input.tile_map().counts(target.num_tiles)))
        one = np.array([tile], np.int32)
        return one, np.zeros(1, np.int64), np.ones(1, np.int64), one, np.ones(1, np.int64)
    grain = GRAIN if partition == "elements" else 1
    _, begin, end = split_ranges([rows], target.num_tiles, grain)   # blocks of rows, one per tile
    block_tiles = (np.arange(begin.size) * target.num_tiles // max(begin.size, 1)).astype(np.int32)
    which, b2, e2 = split_ranges(end - begin, target.workers_per_tile, grain)
    return block_tiles[which], begin[which] + b2, e2 - b2, block_tiles, end - begin


def custom(graph: Graph, inputs: Seq[Tensor], out_specs: Seq[tuple], kernel: Callable, prog: Sequence, *,
           partition: str = "none", cycles: Callable | None = None, attributes: dict | None = None,
           name: str = "custom") -> list[Tensor]:
    """Run `kernel` on the tiles: one compute set, one vertex type of its own (named `name`), the
    inputs exchanged to where the vertices run, new outputs of `out_specs` ((shape, dtype) each)
    mapped there. Returns the outputs."""
    inputs = list(inputs)
    out_specs = [(tuple(int(d) for d in s), as_dtype(d)) for s, d in out_specs]
    attributes = dict(attributes or {})
    rows = _check(inputs, out_specs, partition, name)
    tiles, first, count, block_tiles, block_rows = _vertex_rows(graph, rows, partition, inputs[0] if inputs else None)

    def row_shape(shape):
        if partition == "none":
            return tuple(shape)
        if partition == "elements":
            return (None,)
        return (None,) + tuple(shape[1:])

    def per_row(shape) -> int:
        return math.prod(shape) // max(rows, 1) if partition != "none" else math.prod(shape)

    body = Sequence(name=name)
    local_in = []
    for i, t in enumerate(inputs):
        flat = t.reshape((t.numel,))
        local_in.append(placed(graph, body, flat, TileMap.from_lengths(block_rows * per_row(t.shape), block_tiles),
                               f"{name}/in{i}"))
    outs = []
    for j, (shape, dtype) in enumerate(out_specs):
        out = graph.addVariable(dtype, shape, f"{name}/out{j}" if len(out_specs) > 1 else name,
                                category="activations", always_live=False)
        out.var.mapping = TileMap.from_lengths(block_rows * per_row(shape), block_tiles)
        outs.append(out)
    in_names = tuple(f"in{i}" for i in range(len(inputs)))
    out_names = tuple(f"out{j}" for j in range(len(outs)))
    in_rows = [row_shape(t.shape) for t in inputs]
    out_rows = [row_shape(s) for s, _ in out_specs]
    codelet = HostCodelet(kernel, in_rows, [t.dtype for t in inputs], out_rows, [d for _, d in out_specs],
                          attributes, name)
    vertex = VertexType(f"custom::{name}", in_names, out_names, codelet,
                        _Estimator(cycles, in_rows, out_rows, attributes, in_names + out_names), num_params=1)
    fields = {}
    for f, t in zip(in_names + out_names, local_in + [o.reshape((o.numel,)) for o in outs]):
        size = per_row(t.shape) if partition == "none" else t.numel // max(rows, 1)
        fields[f] = Field.strided(t, first * size, 1, count * size)
    cs = graph.addComputeSet(name)
    graph.addVertices(cs, vertex, tiles, fields, count.astype(np.float64).reshape(-1, 1))
    body.add(Execute(cs))

    def fast(io):
        arrays = [np.asarray(io.read(t)).reshape(t.shape) for t in inputs]
        for out, value in zip(outs, run_kernel(kernel, arrays, attributes, out_specs, name)):
            io.write(out, value)

    prog.add(OpProgram(name, body, fast, tuple(inputs), tuple(outs)))
    return outs


class GradientKernel:
    """A gradient kernel `backward(grads, inputs, outputs, **attributes)` as a kernel of flat
    arguments (the gradients, then the forward's inputs, then its outputs), returning the
    gradients of the inputs at positions `wanted` (a None gradient: zeros shaped like the input)."""

    def __init__(self, backward: Callable, counts: tuple[int, int, int], wanted: tuple[int, ...], name: str):
        self.backward, self.counts, self.wanted, self.name = backward, counts, wanted, name

    def __call__(self, *arrays, **attributes):
        g, i, _ = self.counts
        grads, inputs, outputs = list(arrays[:g]), list(arrays[g:g + i]), list(arrays[g + i:])
        result = self.backward(grads, inputs, outputs, **attributes)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(result) != i:
            raise CustomKernelError(f"custom op {self.name}: the gradient kernel returned {len(result)} result(s), "
                                    f"one per input ({i}) is needed (None for an input without a gradient)")
        return [np.zeros_like(inputs[k]) if result[k] is None else result[k] for k in self.wanted]
