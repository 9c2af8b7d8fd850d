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
"""
from __future__ import annotations

import numpy as np

from ..device.graph import Graph
from ..device.program import Sequence
from ..device.tensor import Tensor
from .reduce import composite, normalize_axes, reduce, segment_map

F32 = np.float32
TEMP = "temporaries"


def _axis(x: Tensor, axis: int, name: str) -> tuple:
    if x.rank == 0:
        raise ValueError(f"{name}: {x.name!r} is a scalar; softmax needs an axis to normalise over")
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; softmax needs a float tensor")
    return normalize_axes((axis,), x.rank, name)


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
    prog.add(composite(name, body, (x,), (y,)))
    return y


def log_softmax(graph: Graph, x: Tensor, axis: int, prog: Sequence, name: str = "log_softmax") -> Tensor:
    """y = x - max - log(sum(exp(x - max))) along `axis`."""
    axes = _axis(x, axis, name)
    body = Sequence(name=name)
    m, _, s = _stats(graph, x, axes, body, name)
    y = segment_map(graph, "log_softmax", x, axes, body, name, r=m, q=s, out_dtype=x.dtype)
    prog.add(composite(name, body, (x,), (y,)))
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
    prog.add(composite(name, body, (y, dy), (dx,)))
    return dx


def log_softmax_backward(graph: Graph, y: Tensor, dy: Tensor, axis: int, prog: Sequence,
                         name: str = "log_softmax_backward") -> Tensor:
    """dx = dy - exp(y) * sum(dy) along `axis`, given the forward output y; mapped like y."""
    axes = _axis(y, axis, name)
    _check_pair(y, dy, name)
    body = Sequence(name=name)
    s = reduce(graph, dy, axes, "sum", body, f"{name}/sum", out_dtype=F32, category=TEMP)
    dx = segment_map(graph, "log_softmax_grad", y, axes, body, name, r=s, b=dy, out_dtype=dy.dtype)
    prog.add(composite(name, body, (y, dy), (dx,)))
    return dx

