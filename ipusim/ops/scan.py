"""Cumulative ops along an axis: sums and products (torch.cumsum, torch.cumprod), the log of
cumulative sums of exponentials (torch.logcumsumexp), and running maxima and minima with their
positions (torch.cummax, torch.cummin).

Plan (`rows.plan_rows`): the tensor seen as rows along the axis; each tile takes a block of whole
rows, brought to it with one exchange, and writes those rows of the result (and of the positions),
which are mapped there; a block's rows are split over the tile's workers.

Numerics: a row is accumulated in float64 from its first element (torch's CPU kernels accumulate
in double too) and every output rounded once. logsumexp adds each element to the running value
as torch's `_log_add_exp_helper` does, log1p(exp(min - max)) + max from -inf, so large inputs
never overflow and infinities of one sign stay as they are. A running maximum takes the element
when it is NaN or, while the running value is not NaN, when it is >= the running value (<= for
the minimum): of equal values the last position, a NaN sticks and its position is the last NaN's
(torch's rule). The fast mode runs the same loops over whole arrays (`np.cumsum` / `np.cumprod`
in float64, element after element, and Numba loops for the others), so both modes agree bit for
bit.

Cycles per vertex (worker instructions), k rows of n elements (not vectorised: each step needs
the previous one):
  sum, prod      10 + k * (4 + 3 * n)    a load, the dependent add or multiply, a store
  logsumexp      10 + k * (4 + 10 * n)   also the min and max, an exp, a log1p and the checks
  max, min       10 + k * (4 + 5 * n)    a load, the compare, the value and position kept, two stores
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from .reduce import stored
from .rows import along, plan_rows

OPS = {"sum": 0, "prod": 1, "logsumexp": 2}
EXTREMES = {"max": 1, "min": 0}


@njit(**JIT)
def log_add_exp(x, y):
    """log(exp(x) + exp(y)) as torch's `_log_add_exp_helper` computes it (y the running value)."""
    if y != y:
        lo = hi = y
    elif x != x:
        lo = hi = x
    else:
        lo, hi = min(x, y), max(x, y)
    if lo != hi or math.isfinite(lo):
        return math.log1p(math.exp(lo - hi)) + hi
    return x


@njit(**JIT)
def _takes(value, best, largest):
    """Whether a running maximum (largest) or minimum at `best` moves to `value`."""
    if value != value:
        return True
    if best != best:
        return False
    return value >= best if largest else value <= best


@njit(parallel=True, **JIT)
def scan_codelet(x, x_addr, x_start, out, o_addr, o_start, params):
    """params: row length n, op (0 sum, 1 product, 2 logsumexp)."""
    for v in prange(params.shape[0]):
        n, op = int(params[v, 0]), int(params[v, 1])
        xb, ob = x_start[v], o_start[v]
        for k in range((o_start[v + 1] - ob) // max(n, 1)):
            acc = 0.0 if op == 0 else (1.0 if op == 1 else -np.inf)
            for e in range(n):
                value = ld(x, x_addr[xb + k * n + e])
                if op == 0:
                    acc = acc + value
                elif op == 1:
                    acc = acc * value
                else:
                    acc = log_add_exp(np.float64(value), acc)
                st(out, o_addr[ob + k * n + e], acc)


@njit(parallel=True, **JIT)
def extreme_codelet(x, x_addr, x_start, values, v_addr, v_start, positions, p_addr, p_start, params):
    """params: row length n, largest (1 running maximum, 0 minimum)."""
    for v in prange(params.shape[0]):
        n, largest = int(params[v, 0]), params[v, 1] != 0
        xb, vb, pb = x_start[v], v_start[v], p_start[v]
        for k in range((v_start[v + 1] - vb) // max(n, 1)):
            best = ld(x, x_addr[xb + k * n])
            at = 0
            for e in range(n):
                value = ld(x, x_addr[xb + k * n + e])
                if _takes(value, best, largest):
                    best = value
                    at = e
                st(values, v_addr[vb + k * n + e], best)
                st(positions, p_addr[pb + k * n + e], at)


def _scan_cycles(sizes, params, dtype, target):
    n = np.maximum(params[:, 0], 1)
    per = np.where(params[:, 1] == OPS["logsumexp"], 10, 3)
    return target.thread_cycles(10 + (sizes["out"] // n) * (4 + per * n))


def _extreme_cycles(sizes, params, dtype, target):
    n = np.maximum(params[:, 0], 1)
    return target.thread_cycles(10 + (sizes["values"] // n) * (4 + 5 * n))


SCAN = VertexType("popops::Scan", ("x",), ("out",), scan_codelet, _scan_cycles, num_params=2)
EXTREME = VertexType("popops::ScanExtreme", ("x",), ("values", "positions"), extreme_codelet, _extreme_cycles,
                     num_params=2)


# ---- fast mode: the same loops over whole arrays ---------------------------------------------------
@njit(**JIT)
def logcumsumexp_rows(x, out):
    """out[r, :] = the running log_add_exp of x[r, :] (float64 rows)."""
    for r in range(x.shape[0]):
        acc = -np.inf
        for e in range(x.shape[1]):
            acc = log_add_exp(x[r, e], acc)
            out[r, e] = acc


@njit(**JIT)
def extreme_rows(x, largest, values, positions):
    """Running maxima (largest) or minima of the rows of x and the positions they were taken at."""
    for r in range(x.shape[0]):
        if x.shape[1] == 0:
            continue
        best, at = x[r, 0], 0
        for e in range(x.shape[1]):
            if _takes(x[r, e], best, largest):
                best, at = x[r, e], e
            values[r, e] = best
            positions[r, e] = at


# ---- ops ------------------------------------------------------------------------------------------
def _check(name: str, x: Tensor, axis: int, kinds: str) -> int:
    if x.dtype.kind not in kinds:
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; this cumulative op takes "
                        f"{'float32, float16 or int32' if 'i' in kinds else 'float32 or float16'} (cast first)")
    if not -x.rank <= axis < x.rank:
        raise ValueError(f"{name}: axis {axis} is out of range for {x.name!r} of shape {x.shape}")
    return axis % x.rank


def _rows(graph: Graph, body: Sequence, xv: Tensor, outs: list[Tensor], name: str):
    """The row blocks of a scan of the [R, N] view xv: outputs mapped, x brought, vertex pieces."""
    R, N = xv.shape
    blocks = plan_rows(graph, R, N, N)
    for o in outs:
        blocks.map_output(o)
    local, at = blocks.bring(graph, body, xv, f"{name}/x")
    k, a, b = blocks.pieces(graph.target.workers_per_tile)
    return blocks, blocks.local_rows(local, at, k, a, b, N), k, a, b


def scan(graph: Graph, x: Tensor, axis: int, op: str, prog: Sequence, name: str = "scan") -> Tensor:
    """out[.., i, ..] = x[.., 0, ..] op x[.., 1, ..] op ... op x[.., i, ..] along `axis` (op "sum",
    "prod", or "logsumexp": log(exp(x_0) + ... + exp(x_i)), float tensors only)."""
    if op not in OPS:
        raise ValueError(f"{name}: unknown scan op {op!r}; known: {sorted(OPS)} (and max, min with positions: "
                         "scan_with_positions)")
    axis = _check(name, x, axis, "f" if op == "logsumexp" else "fi")
    out = graph.addVariable(x.dtype, x.shape, name, category="activations", always_live=False)
    xv, ov = along(x, axis), along(out, axis)
    N = xv.shape[1]
    body = Sequence(name=name)
    if out.numel:
        blocks, local, k, a, b = _rows(graph, body, xv, [ov], name)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, SCAN, blocks.tile[k], {"x": local, "out": blocks.rows_of(ov, k, a, b)},
                          np.array([[N, OPS[op]]], np.float64).repeat(k.size, 0))
        body.add(Execute(cs))

    def fast(io):
        rows = io.read(x).astype(np.float64)
        if op == "logsumexp":
            flat = np.ascontiguousarray(np.moveaxis(rows, axis, -1))
            acc = np.empty_like(flat)
            logcumsumexp_rows(flat.reshape(-1, N), acc.reshape(-1, N))
            acc = np.moveaxis(acc, -1, axis)
        else:
            acc = (np.cumsum if op == "sum" else np.cumprod)(rows, axis=axis)
        io.write(out, stored(acc, x.dtype))

    prog.add(OpProgram(name, body, fast, (x,), (out,)))
    return out


def scan_with_positions(graph: Graph, x: Tensor, axis: int, op: str, prog: Sequence, name: str = "scan"
                        ) -> tuple[Tensor, Tensor]:
    """The running maximum (op "max") or minimum ("min") along `axis` and the int32 position each
    value was taken at (torch.cummax / cummin: of equal values the last, NaN sticks)."""
    if op not in EXTREMES:
        raise ValueError(f"{name}: unknown scan op {op!r} with positions; known: {sorted(EXTREMES)}")
    axis = _check(name, x, axis, "fi")
    values = graph.addVariable(x.dtype, x.shape, name, category="activations", always_live=False)
    positions = graph.addVariable(np.int32, x.shape, f"{name}/positions", category="activations",
                                  always_live=False)
    xv, vv, pv = along(x, axis), along(values, axis), along(positions, axis)
    N = xv.shape[1]
    body = Sequence(name=name)
    if values.numel:
        blocks, local, k, a, b = _rows(graph, body, xv, [vv, pv], name)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, EXTREME, blocks.tile[k],
                          {"x": local, "values": blocks.rows_of(vv, k, a, b), "positions": blocks.rows_of(pv, k, a, b)},
                          np.array([[N, EXTREMES[op]]], np.float64).repeat(k.size, 0))
        body.add(Execute(cs))

    def fast(io):
        flat = np.ascontiguousarray(np.moveaxis(io.read(x).astype(np.float64), axis, -1))
        best, at = np.empty_like(flat), np.empty(flat.shape, np.int32)
        extreme_rows(flat.reshape(-1, N), op == "max", best.reshape(-1, N), at.reshape(-1, N))
        io.write(values, stored(np.moveaxis(best, -1, axis), x.dtype))
        io.write(positions, np.moveaxis(at, -1, axis))

    prog.add(OpProgram(name, body, fast, (x,), (values, positions)))
    return values, positions
