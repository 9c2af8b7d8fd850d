"""Sort and top-k along an axis, with the positions (torch.sort, topk, argmax, max(dim)).

`topk(x, k, axis, largest)` gives the first k of every row along `axis` in order (ascending, or
descending when `largest`) and their int32 positions; `sort` is k = the axis' length. The order is
stable: equal values keep their order, so an argmax or argmin is the first position of the extreme
value (as torch's max(dim) and argmax). NaN sorts as the largest value.

Plan (`rows.plan_rows`): each tile takes a block of whole rows, brought to it with one exchange,
and writes those rows of both results, mapped there; a block's rows are split over its workers.

Cycles per vertex (worker instructions), k rows of n elements, m kept: a merge sort,
12 + k * (n * ceil(log2 n) * 4 + 2 * n + 3 * m): per element and merge level a compare, a select
and two moves; the keys loaded once; per kept element a value and a position stored.
Both modes sort the same float64 keys with a stable sort, so they give the same values and the
same positions.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from .rows import along, plan_rows


F64_MAX = np.finfo(np.float64).max


@njit(**JIT)
def sort_key(value, largest):
    """The ascending key, in float64: infinity as the largest float64 (no float32, float16 or
    int32 value reaches it), NaN as infinity above it; negated for a descending order."""
    key = np.inf if value != value else (F64_MAX if value == np.inf else value)
    return -key if largest else key


@njit(parallel=True, **JIT)
def topk_codelet(x, x_addr, x_start, values, v_addr, v_start, positions, p_addr, p_start, params):
    """params: row length n, kept k, largest (1) or smallest (0)."""
    for v in prange(params.shape[0]):
        n, k, largest = int(params[v, 0]), int(params[v, 1]), params[v, 2] != 0
        xb, vb, pb = x_start[v], v_start[v], p_start[v]
        keys = np.empty(n)
        for r in range((v_start[v + 1] - vb) // max(k, 1)):
            for e in range(n):
                keys[e] = sort_key(ld(x, x_addr[xb + r * n + e]), largest)
            order = np.argsort(keys, kind="mergesort")
            for j in range(k):
                values[v_addr[vb + r * k + j]] = x[x_addr[xb + r * n + order[j]]]
                st(positions, p_addr[pb + r * k + j], order[j])


def _topk_cycles(sizes, params, dtype, target):
    n, k = np.maximum(params[:, 0], 1), np.maximum(params[:, 1], 1)
    rows = sizes["values"] // k
    levels = np.ceil(np.log2(np.maximum(n, 2)))
    return target.thread_cycles(12 + rows * (n * levels * 4 + 2 * n + 3 * k))


TOPK = VertexType("popops::TopK", ("x",), ("values", "positions"), topk_codelet, _topk_cycles, num_params=3)


def topk(graph: Graph, x: Tensor, k: int, axis: int, prog: Sequence, name: str = "topk", largest: bool = True
         ) -> tuple[Tensor, Tensor]:
    """The k largest (or smallest) of every row along `axis`, in order, and their int32 positions."""
    if x.dtype.kind not in "fib":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; sorting takes float, int32 or bool tensors")
    if not -x.rank <= axis < x.rank:
        raise ValueError(f"{name}: axis {axis} is out of range for {x.name!r} of shape {x.shape}")
    axis %= x.rank
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise ValueError(f"{name}: k = {k} must be within [0, {n}], the length of axis {axis} of {x.name!r}")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    values = graph.addVariable(x.dtype, shape, name, category="activations", always_live=False)
    positions = graph.addVariable(np.int32, shape, f"{name}/positions", category="activations", always_live=False)
    xv, vv, pv = along(x, axis), along(values, axis), along(positions, axis)
    R = xv.shape[0]
    body = Sequence(name=name)
    if values.numel:
        blocks = plan_rows(graph, R, n * max(1, int(np.log2(max(n, 2)))), k)
        blocks.map_output(vv)
        blocks.map_output(pv)
        local, at = blocks.bring(graph, body, xv, f"{name}/x", whole_rows=True)
        b, first, end = blocks.pieces(graph.target.workers_per_tile)
        fields = {"x": blocks.local_rows(local, at, b, first, end, n), "values": blocks.rows_of(vv, b, first, end),
                  "positions": blocks.rows_of(pv, b, first, end)}
        params = np.array([[n, k, float(largest)]], np.float64).repeat(b.size, 0)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, TOPK, blocks.tile[b], fields, params)
        body.add(Execute(cs))

    def fast(io):
        rows = np.moveaxis(io.read(x), axis, -1)
        keys = rows.astype(np.float64)
        keys = np.where(np.isnan(keys), np.inf, np.where(keys == np.inf, F64_MAX, keys))
        order = np.argsort(-keys if largest else keys, axis=-1, kind="stable")[..., :k]
        io.write(values, np.moveaxis(np.take_along_axis(rows, order, -1), -1, axis))
        io.write(positions, np.moveaxis(order.astype(np.int32), -1, axis))

    prog.add(OpProgram(name, body, fast, (x,), (values, positions)))
    return values, positions


def sort(graph: Graph, x: Tensor, axis: int, prog: Sequence, name: str = "sort", descending: bool = False
         ) -> tuple[Tensor, Tensor]:
    """Every row along `axis` sorted (stable), and the int32 positions the values came from."""
    return topk(graph, x, x.shape[axis] if x.rank else 0, axis, prog, name, largest=descending)
