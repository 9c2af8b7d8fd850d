"""Cumulative sums and products along an axis (torch.cumsum, torch.cumprod).

Plan (`rows.plan_rows`): the tensor seen as rows along the axis; each tile takes a block of whole
rows, brought to it with one exchange, and writes those rows of the result, which is mapped
there; a block's rows are split over the tile's workers.

Numerics: a row is accumulated in float64 from its first element (torch's CPU kernel accumulates
in double too) and every output rounded once; the fast mode accumulates the same way
(`np.cumsum` / `np.cumprod` in float64 run element after element), so both modes agree bit for bit.

Cycles per vertex (worker instructions): 10 + k * (4 + 3 * n) for k rows of n elements: per
element a load, the dependent add or multiply and a store (not vectorised: each step needs the
previous one).
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

OPS = {"sum": 0, "prod": 1}


@njit(parallel=True, **JIT)
def scan_codelet(x, x_addr, x_start, out, o_addr, o_start, params):
    """params: row length n, op (0 sum, 1 product)."""
    for v in prange(params.shape[0]):
        n, op = int(params[v, 0]), int(params[v, 1])
        xb, ob = x_start[v], o_start[v]
        for k in range((o_start[v + 1] - ob) // max(n, 1)):
            acc = 0.0 if op == 0 else 1.0
            for e in range(n):
                value = ld(x, x_addr[xb + k * n + e])
                acc = acc + value if op == 0 else acc * value
                st(out, o_addr[ob + k * n + e], acc)


def _scan_cycles(sizes, params, dtype, target):
    n = np.maximum(params[:, 0], 1)
    return target.thread_cycles(10 + (sizes["out"] // n) * (4 + 3 * n))


SCAN = VertexType("popops::Scan", ("x",), ("out",), scan_codelet, _scan_cycles, num_params=2)


def scan(graph: Graph, x: Tensor, axis: int, op: str, prog: Sequence, name: str = "scan") -> Tensor:
    """out[.., i, ..] = x[.., 0, ..] op x[.., 1, ..] op ... op x[.., i, ..] along `axis` (op "sum" or "prod")."""
    if op not in OPS:
        raise ValueError(f"{name}: unknown scan op {op!r}; known: {sorted(OPS)}")
    if x.dtype.kind not in "fi":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; cumulative ops take float32, float16 or int32 "
                        "(cast first)")
    if not -x.rank <= axis < x.rank:
        raise ValueError(f"{name}: axis {axis} is out of range for {x.name!r} of shape {x.shape}")
    axis %= x.rank
    out = graph.addVariable(x.dtype, x.shape, name, category="activations", always_live=False)
    xv, ov = along(x, axis), along(out, axis)
    R, N = xv.shape
    body = Sequence(name=name)
    if out.numel:
        blocks = plan_rows(graph, R, N, N)
        blocks.map_output(ov)
        local, at = blocks.bring(graph, body, xv, f"{name}/x")
        k, a, b = blocks.pieces(graph.target.workers_per_tile)
        fields = {"x": blocks.local_rows(local, at, k, a, b, N), "out": blocks.rows_of(ov, k, a, b)}
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, SCAN, blocks.tile[k], fields, np.array([[N, OPS[op]]], np.float64).repeat(k.size, 0))
        body.add(Execute(cs))
    accumulate = np.cumsum if op == "sum" else np.cumprod

    def fast(io):
        io.write(out, stored(accumulate(io.read(x).astype(np.float64), axis=axis), x.dtype))

    prog.add(OpProgram(name, body, fast, (x,), (out,)))
    return out
