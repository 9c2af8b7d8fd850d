"""Softmax and log-softmax along one axis, forward and backward (numerically stable).

Built like PopLibs' `popnn::softmaxStable`: from reductions (`reduce.reduce`) and segment maps
(`reduce.segment_map`, which brings each row's statistics once to every tile holding part of
the row and combines them elementwise there). Rows that live on one tile need no exchange at all;
rows spread over tiles exchange one partial per (tile, row) to the row's tile and one statistic
back. Statistics and the exponentials are kept in float32 (float16 inputs accumulate in float32).

    softmax:      m = max(x);  e = exp(x - m);  s = sum(e);  y = e / s
    log_softmax:  m = max(x);  e = exp(x - m);  s = sum(e);  y = x - m - log(s)
    softmax backward:      dx = y * (dy - sum(dy * y))
    log_softmax backward:  dx = dy - exp(y) * sum(dy)

Cycles are those of the parts (see reduce.py): two reductions and two segment maps forward,
one reduction and one or two maps backward. The output is mapped like the input. Both modes take
exp from `reduce.exp64` and sum in the reductions' lane order, so they agree bit for bit.

Fast mode: when the axis is the last one and each reduction takes the rows one after another
(rows held whole by tiles, the usual case), one kernel (`rows_kernel`) does all the parts row by
row, rounding each statistic and temporary to float32 where the parts store it, so it gives the
parts' bits; otherwise the parts run one after another.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..device.graph import Graph
from ..device.kernels import JIT
from ..device.program import Sequence
from ..device.tensor import Tensor
from .reduce import (ERR, MAX, SEGMENT_OPS, SUM, composite, contiguous_reduce, kernel_values, normalize_axes,
                     output_storage, reduce, segment_map, segment_value)

F32 = np.float32
TEMP = "temporaries"


def _axis(x: Tensor, axis: int, name: str) -> tuple:
    if x.rank == 0:
        raise ValueError(f"{name}: {x.name!r} is a scalar; softmax needs an axis to normalise over")
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; softmax needs a float tensor")
    return normalize_axes((axis,), x.rank, name)


SOFTMAX, LOG_SOFTMAX, SOFTMAX_GRAD, LOG_SOFTMAX_GRAD = range(4)
REDUCTIONS = {SOFTMAX: 2, LOG_SOFTMAX: 2, SOFTMAX_GRAD: 1, LOG_SOFTMAX_GRAD: 1}  # among the parts
EXP_SUB, DIV, LOG_SOFTMAX_OP, SOFTMAX_GRAD_OP, LOG_SOFTMAX_GRAD_OP, MUL = (
    SEGMENT_OPS[op][0] for op in ("exp_sub", "div", "log_softmax", "softmax_grad", "log_softmax_grad", "mul"))


@njit(**ERR, **JIT)
def rows_kernel(kind, a, b, rows, length, out):
    """The parts of `kind` over rows of `length` (a, b: float32, flat; out: float32), row by row:
    statistics reduced with `contiguous_reduce` and every value made by `segment_value`, each
    rounded to float32 where the parts store it."""
    t = np.empty(max(length, 1), np.float32)  # the row's temporary (exp(x - max), or y * dy)
    for row in range(rows):
        at = row * length
        if kind == SOFTMAX or kind == LOG_SOFTMAX:
            m = np.float64(np.float32(contiguous_reduce(a, at, length, MAX)))
            for j in range(length):
                t[j] = segment_value(EXP_SUB, np.float64(a[at + j]), 0.0, 0.0, m, 0.0, 0.0, 0.0, 0.0)
            s = np.float64(np.float32(contiguous_reduce(t, 0, length, SUM)))
            for j in range(length):
                if kind == SOFTMAX:
                    out[at + j] = segment_value(DIV, np.float64(t[j]), 0.0, 0.0, s, 0.0, 0.0, 0.0, 0.0)
                else:
                    out[at + j] = segment_value(LOG_SOFTMAX_OP, np.float64(a[at + j]), 0.0, 0.0, m, s, 0.0, 0.0, 0.0)
        elif kind == SOFTMAX_GRAD:
            for j in range(length):
                t[j] = segment_value(MUL, np.float64(a[at + j]), np.float64(b[at + j]), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            s = np.float64(np.float32(contiguous_reduce(t, 0, length, SUM)))
            for j in range(length):
                out[at + j] = segment_value(SOFTMAX_GRAD_OP, np.float64(a[at + j]), np.float64(b[at + j]), 0.0, s,
                                            0.0, 0.0, 0.0, 0.0)
        else:
            s = np.float64(np.float32(contiguous_reduce(b, at, length, SUM)))
            for j in range(length):
                out[at + j] = segment_value(LOG_SOFTMAX_GRAD_OP, np.float64(a[at + j]), np.float64(b[at + j]), 0.0,
                                            s, 0.0, 0.0, 0.0, 0.0)


def _fused(kind: int, body: Sequence, a: Tensor, b: Tensor | None, out: Tensor, axes: tuple):
    """The fast mode of the parts in `body` as one `rows_kernel` pass, or None (the parts then run
    one after another) unless the axis is the last and every reduction among the parts takes
    whole rows one after another."""
    length = a.shape[-1] if a.rank else 1
    rows = a.numel // length if length else 0
    if axes != (a.rank - 1,) or rows == 0 or a.dtype not in (np.float32, np.float16):
        return None
    reductions = [p.fast.reduction for p in body.programs if hasattr(p.fast, "reduction")]
    if len(reductions) != REDUCTIONS[kind] or not all(r.row_by_row(rows, length) for r in reductions):
        return None

    def fast(io):
        av = kernel_values(np.ascontiguousarray(io.read(a)))
        bv = av if b is None else kernel_values(np.ascontiguousarray(io.read(b)))
        target = output_storage(io, out)
        res = target if target is not None else np.empty(out.numel, np.float32)
        rows_kernel(kind, av, bv, rows, length, res)
        if target is None:
            io.write(out, res.reshape(out.shape))

    return fast


def _stats(graph: Graph, x: Tensor, axes: tuple, body: Sequence, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(max, exp(x - max), sum of exp(x - max)) along the axes."""
    m = reduce(graph, x, axes, "max", body, f"{name}/max", out_dtype=F32, category=TEMP)
    e = segment_map(graph, "exp_sub", x, axes, body, f"{name}/exp", r=m, out_dtype=F32, category=TEMP)
    s = reduce(graph, e, axes, "sum", body, f"{name}/sum", out_dtype=F32, category=TEMP)
    return m, e, s


def softmax(graph: Graph, x: Tensor, axis: int, prog: Sequence, name: str = "softmax") -> Tensor:
    """y = exp(x - max) / sum(exp(x - max)) along `axis`."""
    axes = _axis(x, axis, name)
    body = Sequence(name=name)
    _, e, s = _stats(graph, x, axes, body, name)
    y = segment_map(graph, "div", e, axes, body, name, r=s, out_dtype=x.dtype)
    prog.add(composite(name, body, (x,), (y,), _fused(SOFTMAX, body, x, None, y, axes)))
    return y


def log_softmax(graph: Graph, x: Tensor, axis: int, prog: Sequence, name: str = "log_softmax") -> Tensor:
    """y = x - max - log(sum(exp(x - max))) along `axis`."""
    axes = _axis(x, axis, name)
    body = Sequence(name=name)
    m, _, s = _stats(graph, x, axes, body, name)
    y = segment_map(graph, "log_softmax", x, axes, body, name, r=m, q=s, out_dtype=x.dtype)
    prog.add(composite(name, body, (x,), (y,), _fused(LOG_SOFTMAX, body, x, None, y, axes)))
    return y


def _check_pair(y: Tensor, dy: Tensor, name: str) -> None:
    if y.shape != dy.shape:
        raise ValueError(f"{name}: output {y.name!r} {y.shape} and gradient {dy.name!r} {dy.shape} differ in shape")


def softmax_backward(graph: Graph, y: Tensor, dy: Tensor, axis: int, prog: Sequence,
                     name: str = "softmax_backward") -> Tensor:
    """dx = y * (dy - sum(dy * y)) along `axis`, given the forward output y; mapped like y."""
    axes = _axis(y, axis, name)
    _check_pair(y, dy, name)
    body = Sequence(name=name)
    s = reduce(graph, segment_map(graph, "mul", y, axes, body, f"{name}/dy_y", b=dy,
                                  out_dtype=F32, category=TEMP),
               axes, "sum", body, f"{name}/sum", out_dtype=F32, category=TEMP)
    dx = segment_map(graph, "softmax_grad", y, axes, body, name, r=s, b=dy, out_dtype=dy.dtype)
    prog.add(composite(name, body, (y, dy), (dx,), _fused(SOFTMAX_GRAD, body, y, dy, dx, axes)))
    return dx


def log_softmax_backward(graph: Graph, y: Tensor, dy: Tensor, axis: int, prog: Sequence,
                         name: str = "log_softmax_backward") -> Tensor:
    """dx = dy - exp(y) * sum(dy) along `axis`, given the forward output y; mapped like y."""
    axes = _axis(y, axis, name)
    _check_pair(y, dy, name)
    body = Sequence(name=name)
    s = reduce(graph, dy, axes, "sum", body, f"{name}/sum", out_dtype=F32, category=TEMP)
    dx = segment_map(graph, "log_softmax_grad", y, axes, body, name, r=s, b=dy, out_dtype=dy.dtype)
    prog.add(composite(name, body, (y, dy), (dx,), _fused(LOG_SOFTMAX_GRAD, body, y, dy, dx, axes)))
    return dx

