"""Gather and scatter along an axis (PopLibs' dynamic slices, torch.gather / scatter / index ops).

`gather(x, indices, axis)`: out[.., m, ..] = x[.., indices[.., m, ..], ..], indices shaped like
the output (a broadcast view for index_select). `scatter(base, indices, src, axis, reduce)`:
a copy of base with src[.., m, ..] written to position indices[.., m, ..] along the axis, or
combined with what is there (reduce "add", "max", "min" or "mul"; torch's scatter_reduce "sum", "amax",
"amin", "prod" with include_self). A maximum takes a NaN from src and keeps a NaN already there (torch's
rule); of equal values it keeps the one there. Indices are int32 on the device; a negative index counts from the end of the axis (as in
torch); an index still outside the axis gathers zero and scatters nothing (PopLibs' dynamic
slices; torch raises).

Plan (`rows.plan_rows`): the operands are seen as rows along the axis ([R, N] for x and base,
[R, M] for indices, src and the gather's output). A gather's block of rows and output columns
lives on one tile with a copy of its whole rows of x (one exchange); with fewer rows than tiles
the output columns are cut into blocks too. A scatter's block is whole rows of the result, with
its rows of base, indices and src. Each block's rows are split over the tile's workers.

Vertices (worker instructions; cycles = `target.thread_cycles`):
- gather, k rows of m outputs: 12 + k * (6 + 5 * m): per output an index load, the bounds check
  and wrap, a load and a store;
- scatter, k rows of n elements and m updates: 12 + k * (6 + 2 * n + 6 * m): the row copied in
  and out, per update an index load, the check, a load, the add, compare (maxima, minima) or write.
A scatter adds in float64 in update order and rounds once; the fast mode adds in the same order
(`np.add.at`; maxima and minima in a Numba loop in update order), so both modes agree bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from .reduce import stored
from .rows import along, plan_rows

INT32_MAX = 2**31 - 1
REDUCTIONS = {None: 0, "add": 1, "max": 2, "min": 3, "mul": 4}


# ---- codelets and estimators ------------------------------------------------------------------
@njit(parallel=True, **JIT)
def gather_codelet(x, x_addr, x_start, idx, i_addr, i_start, out, o_addr, o_start, params):
    """params: row length n, outputs per row m."""
    for v in prange(params.shape[0]):
        n, m = int(params[v, 0]), int(params[v, 1])
        xb, ib, ob = x_start[v], i_start[v], o_start[v]
        for k in range((o_start[v + 1] - ob) // max(m, 1)):
            for j in range(m):
                r = ld(idx, i_addr[ib + k * m + j])
                if r < 0:
                    r += n
                if r >= 0 and r < n:
                    out[o_addr[ob + k * m + j]] = x[x_addr[xb + k * n + r]]
                else:
                    st(out, o_addr[ob + k * m + j], 0)


@njit(**JIT)
def _combined(op, there, value):
    """What a scatter leaves at a position holding `there` when `value` arrives (op as REDUCTIONS)."""
    if op == 0:
        return value
    if op == 1:
        return there + value
    if op == 4:
        return there * value
    if value != value:
        return value
    if op == 2:
        return value if value > there else there
    return value if value < there else there


@njit(**JIT)
def scatter_rows(rows, r, c, values, op):
    """rows[r[j], c[j]] combined with values[j], update after update (the fast mode's max and min)."""
    for j in range(r.size):
        rows[r[j], c[j]] = _combined(op, rows[r[j], c[j]], values[j])


@njit(parallel=True, **JIT)
def scatter_codelet(base, b_addr, b_start, idx, i_addr, i_start, src, s_addr, s_start, out, o_addr, o_start,
                    params):
    """params: row length n, updates per row m, reduction (0 write, 1 add, 2 max, 3 min, 4 mul)."""
    for v in prange(params.shape[0]):
        n, m, op = int(params[v, 0]), int(params[v, 1]), int(params[v, 2])
        bb, ib, sb, ob = b_start[v], i_start[v], s_start[v], o_start[v]
        row = np.empty(n)
        for k in range((o_start[v + 1] - ob) // max(n, 1)):
            for e in range(n):
                row[e] = ld(base, b_addr[bb + k * n + e])
            for j in range(m):
                r = ld(idx, i_addr[ib + k * m + j])
                if r < 0:
                    r += n
                if r >= 0 and r < n:
                    value = ld(src, s_addr[sb + k * m + j])
                    row[r] = _combined(op, row[r], value)
            for e in range(n):
                st(out, o_addr[ob + k * n + e], row[e])


def _gather_cycles(sizes, params, dtype, target):
    m = np.maximum(params[:, 1], 1)
    return target.thread_cycles(12 + (sizes["out"] // m) * (6 + 5 * m))


def _scatter_cycles(sizes, params, dtype, target):
    n, m = np.maximum(params[:, 0], 1), params[:, 1]
    return target.thread_cycles(12 + (sizes["out"] // n) * (6 + 2 * n + 6 * m))


GATHER = VertexType("popops::MultiSlice(axis)", ("x", "indices"), ("out",), gather_codelet, _gather_cycles,
                    num_params=2)
SCATTER = VertexType("popops::MultiUpdate(axis)", ("base", "indices", "src"), ("out",), scatter_codelet,
                     _scatter_cycles, num_params=3)


# ---- checks ---------------------------------------------------------------------------------------
def _check(name: str, x: Tensor, indices: Tensor, axis: int) -> int:
    if indices.dtype != np.int32:
        raise TypeError(f"{name}: indices {indices.name!r} are {indices.dtype.name}; they must be int32 "
                        "(the IPU has no int64: cast them first)")
    if not -x.rank <= axis < x.rank:
        raise ValueError(f"{name}: axis {axis} is out of range for {x.name!r} of shape {x.shape} (a 0-d tensor "
                         "has no axis: reshape it to one element first)")
    axis %= x.rank
    if x.rank and x.shape[axis] > INT32_MAX:
        raise ValueError(f"{name}: axis {axis} of {x.name!r} has {x.shape[axis]} elements; int32 indices reach "
                         f"{INT32_MAX}: index a smaller axis")
    if indices.rank != x.rank or any(a != b for d, (a, b) in enumerate(zip(indices.shape, x.shape)) if d != axis):
        raise ValueError(f"{name}: indices {indices.name!r} of shape {indices.shape} must match {x.name!r} "
                         f"{x.shape} on every axis but {axis} (broadcast them first)")
    return axis


def _wrapped(idx: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.asarray(idx, np.int64)
    idx = np.where(idx < 0, idx + n, idx)
    return idx, (idx >= 0) & (idx < n)


# ---- ops ------------------------------------------------------------------------------------------
def gather(graph: Graph, x: Tensor, indices: Tensor, axis: int, prog: Sequence, name: str = "gather") -> Tensor:
    """out (shaped like indices) = x picked along `axis` at `indices`."""
    axis = _check(name, x, indices, axis)
    out = graph.addVariable(x.dtype, indices.shape, name, category="activations", always_live=False)
    xv, iv, ov = along(x, axis), along(indices, axis), along(out, axis)
    (R, N), M = xv.shape, ov.shape[1]
    if N == 0 and out.numel:
        raise ValueError(f"{name}: cannot gather from the empty axis {axis} of {x.name!r} {x.shape}")
    body = Sequence(name=name)
    if out.numel:
        blocks = plan_rows(graph, R, N + M, M, split_columns=True)
        blocks.map_output(ov)
        x_local, x_at = blocks.bring(graph, body, xv, f"{name}/x", whole_rows=True)
        i_local, i_at = blocks.bring(graph, body, iv, f"{name}/indices")
        k, a, b = blocks.pieces(graph.target.workers_per_tile)
        fields = {"x": blocks.local_rows(x_local, x_at, k, a, b, N),
                  "indices": blocks.local_rows(i_local, i_at, k, a, b, blocks.cols[k]),
                  "out": blocks.rows_of(ov, k, a, b)}
        params = np.stack(np.broadcast_arrays(N, blocks.cols[k]), 1).astype(np.float64)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, GATHER, blocks.tile[k], fields, params)
        body.add(Execute(cs))

    def fast(io):
        xs = np.moveaxis(io.read(x), axis, -1)
        idx, valid = _wrapped(np.moveaxis(io.read(indices), axis, -1), N)
        picked = np.take_along_axis(xs, np.where(valid, idx, 0), -1)
        io.write(out, np.moveaxis(np.where(valid, picked, 0).astype(x.dtype), -1, axis))

    prog.add(OpProgram(name, body, fast, (x, indices), (out,)))
    return out


def scatter(graph: Graph, base: Tensor, indices: Tensor, src: Tensor, axis: int, prog: Sequence,
            name: str = "scatter", accumulate: bool = False, reduce: str | None = None) -> Tensor:
    """A copy of `base` with `src` (shaped like indices) written at `indices` along `axis` (updates
    in order: of two writes to one element the later stays), or combined with what is there:
    added when `accumulate` or reduce="add", the larger kept for "max", the smaller for "min", multiplied
    for "mul"."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"{name}: unknown reduction {reduce!r}; use one of {sorted(r for r in REDUCTIONS if r)} "
                         "or None to write")
    if accumulate and reduce not in (None, "add"):
        raise ValueError(f"{name}: accumulate=True adds; it cannot be combined with reduce={reduce!r}")
    op = REDUCTIONS["add" if accumulate else reduce]
    axis = _check(name, base, indices, axis)
    if src.shape != indices.shape or src.dtype != base.dtype:
        raise ValueError(f"{name}: src {src.name!r} is {src.dtype.name}{src.shape}; it must be "
                         f"{base.dtype.name}{indices.shape}, the indices' shape and the base's dtype")
    out = graph.addVariable(base.dtype, base.shape, name, category="activations", always_live=False)
    bv, iv, sv, ov = along(base, axis), along(indices, axis), along(src, axis), along(out, axis)
    (R, N), M = bv.shape, iv.shape[1]
    body = Sequence(name=name)
    if out.numel:
        blocks = plan_rows(graph, R, 2 * N + M, N)
        blocks.map_output(ov)
        b_local, b_at = blocks.bring(graph, body, bv, f"{name}/base")
        i_local, i_at = blocks.bring(graph, body, iv, f"{name}/indices", whole_rows=True)
        s_local, s_at = blocks.bring(graph, body, sv, f"{name}/src", whole_rows=True)
        k, a, b = blocks.pieces(graph.target.workers_per_tile)
        fields = {"base": blocks.local_rows(b_local, b_at, k, a, b, N),
                  "indices": blocks.local_rows(i_local, i_at, k, a, b, M),
                  "src": blocks.local_rows(s_local, s_at, k, a, b, M),
                  "out": blocks.rows_of(ov, k, a, b)}
        params = np.array([[N, M, op]], np.float64).repeat(k.size, 0)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, SCATTER, blocks.tile[k], fields, params)
        body.add(Execute(cs))

    def fast(io):
        rows = np.moveaxis(io.read(base), axis, -1).reshape(R, N).astype(np.float64)
        idx, valid = _wrapped(np.moveaxis(io.read(indices), axis, -1).reshape(R, M), N)
        values = np.moveaxis(io.read(src), axis, -1).reshape(R, M).astype(np.float64)
        r = np.broadcast_to(np.arange(R)[:, None], (R, M))[valid]
        c, values = idx[valid], values[valid]
        if op == REDUCTIONS["add"]:
            np.add.at(rows, (r, c), values)
        elif op == REDUCTIONS["mul"]:
            np.multiply.at(rows, (r, c), values)
        elif op:
            scatter_rows(rows, r, c, values, op)
        else:   # the last update of an element stays
            key = r * N + c
            _, last = np.unique(key[::-1], return_index=True)
            last = key.size - 1 - last
            rows[r[last], c[last]] = values[last]
        shape = np.moveaxis(np.empty(base.shape, bool), axis, -1).shape
        io.write(out, stored(np.moveaxis(rows.reshape(shape), -1, axis), base.dtype))

    prog.add(OpProgram(name, body, fast, (base, indices, src), (out,)))
    return out
