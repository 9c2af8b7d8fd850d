"""Pooling over two or three spatial dimensions in PyTorch's conventions ([N, C, H, W] or
[N, C, D, H, W]): max and average pooling with kernel, stride, padding (and dilation for max,
`count_include_pad` and `divisor_override` for average), `ceil_mode`, adaptive average and max
pooling, and the gradients of all four.

Windows, along each spatial dimension (`PoolDim`): output o reads the input positions
start + t * step for t in [0, count), positions outside [0, in_size) being padding:
  regular   start = o * stride - padding, count = kernel, step = dilation
  adaptive  start = floor(o * in / out), end = ceil((o + 1) * in / out), count = end - start, step 1
(torch's definitions). Output sizes follow torch, including ceil_mode's rule that the last window
must start inside the input or its left padding. A window is the product of its dimensions' windows.
- max: the largest value in the window, padding acting as -inf; a NaN wins (torch's rule).
- avg: the sum of the window's real elements divided by divisor_override if given; else, with
  count_include_pad, by the window's extent clipped to the padded input, min(start + kernel,
  in + padding) - start per dimension; else (and for adaptive windows) by the number of real
  elements.
- max gradient: each window's dy goes to the first position, in row-major window order, whose
  value equals the pooled value (NaN matching NaN): torch's choice for ties (the first maximum).
  For a window holding several NaNs torch's CPU kernel routes to the last NaN; here it is the first.
- avg gradient: dy / divisor to every real position of the window.

The general form has three spatial dimensions, `rows` (the outermost), `mid` and `cols` (the
innermost); 2-D pooling has a unit `mid`. Plan (`plan_pool`): planes (N * C) and rows (output
rows forward, input rows backward) are split into blocks, one per tile, spread over the IPU; a
tile receives by exchange the input rows its windows read (halo included; backward: the x rows
of every window touching its rows and the y and dy rows of those windows), each row a whole
mid x cols slab, and writes its piece of the output, which lives there. The cost model and the
choice rule are matmul's (see matmul.py), with the estimators below. A block's work is split
into about one vertex per worker, over planes or, with few planes, over rows.

Cycle estimators (thread instructions, like popnn's pooling estimators; vector width V = 2
float32 or 4 float16; `rows` output rows forward and gradient rows backward, `outputs` output
elements, `taps` real window positions summed over the vertex's outputs, `inputs` gradient
elements, `pairs` (window, position) pairs landing in the vertex's gradient rows):
  max       10 + rows + ceil(outputs / V) + ceil(taps / V)                  (MaxPooling)
  avg       10 + 3 rows + 3 ceil(outputs / V) + 2 ceil(taps / V)            (ScaledSumPooling)
  max grad  10 + 5 rows + 5 ceil(inputs / V) + 3 ceil(pairs / V)            (MaxPoolingGrad)
  avg grad  10 + 2 rows + 4 ceil(inputs / V) + ceil(pairs / V)              (SumPoolingGrad)

Numerics: sums and gradients accumulate in float64 and round once; the fast mode runs the same
window loops as the codelets, over whole arrays of planes (`pool_whole`, `pool_grad_whole`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.target import Target
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import by_distinct_rows, gather_boxes, kernel_array, map_boxes, store
from .matmul import (AVAILABLE_MEMORY_PROPORTION, block_grid, block_tiles, ceil_div, choose_split, float_dtype,
                     ranges, split_grid)

KINDS = ("max", "avg", "max_grad", "avg_grad")


# ---- geometry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolDim:
    """The windows of one spatial dimension (see the module doc)."""
    in_size: int
    out_size: int
    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    adaptive: bool = False

    def windows(self, o) -> tuple[np.ndarray, np.ndarray, int]:
        """(start, count, step) of the windows of outputs o."""
        o = np.asarray(o, dtype=np.int64)
        if self.adaptive:
            start = (o * self.in_size) // self.out_size
            return start, -(-((o + 1) * self.in_size) // self.out_size) - start, 1
        return o * self.stride - self.padding, np.full(o.shape, self.kernel, dtype=np.int64), self.dilation

    @property
    def max_count(self) -> int:
        return int(self.windows(np.arange(self.out_size))[1].max())

    def positions(self, o) -> np.ndarray:
        """[len(o), max_count] input positions of the windows of outputs o; -1 for padding."""
        start, count, step = self.windows(o)
        t = np.arange(self.max_count)
        pos = start[:, None] + t[None, :] * step
        return np.where((t[None, :] < count[:, None]) & (pos >= 0) & (pos < self.in_size), pos, -1)

    def span(self, o0: int, o1: int) -> tuple[int, int]:
        """[lo, hi) of the real input read by outputs [o0, o1)."""
        pos = self.positions(np.arange(o0, o1))
        real = pos[pos >= 0]
        return (int(real.min()), int(real.max()) + 1) if real.size else (0, 0)

    def touching(self, i0: int, i1: int) -> tuple[int, int]:
        """[lo, hi) of the outputs whose windows read an input in [i0, i1)."""
        pos = self.positions(np.arange(self.out_size))
        hit = np.flatnonzero(((pos >= i0) & (pos < i1)).any(axis=1))
        return (int(hit[0]), int(hit[-1]) + 1) if hit.size else (0, 0)

    def divisor_extent(self, o, count_include_pad: bool) -> np.ndarray:
        """Positions the average divides by along this dimension, per output."""
        if count_include_pad and not self.adaptive:
            start = self.windows(o)[0]
            return np.minimum(start + self.kernel, self.in_size + self.padding) - start
        return (self.positions(o) >= 0).sum(axis=1)

    @property
    def real_taps(self) -> int:
        """Real window positions summed over every output."""
        return int((self.positions(np.arange(self.out_size)) >= 0).sum())

    @property
    def params(self) -> tuple[int, ...]:
        return (int(self.adaptive), self.kernel, self.stride, self.padding, self.dilation, self.in_size,
                self.out_size)


UNIT = PoolDim(1, 1)   # the mid dimension of 2-D pooling


@dataclass(frozen=True)
class PoolGeometry:
    """The windows of a pooling op over planes of 2 or 3 spatial dimensions (`dims`, outermost first)."""
    kind: str                    # "max" or "avg"
    dims: tuple[PoolDim, ...]
    count_include_pad: bool = True
    divisor_override: int = 0    # 0: none

    @property
    def slots(self) -> tuple[PoolDim, PoolDim, PoolDim]:
        """(rows, mid, cols) of the general form (a unit mid for 2-D)."""
        return (self.dims[0],) + (UNIT,) * (3 - len(self.dims)) + tuple(self.dims[1:])

    @property
    def rows(self) -> PoolDim:
        return self.dims[0]

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(d.in_size for d in self.dims)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(d.out_size for d in self.dims)

    @property
    def in_row(self) -> int:
        """Input elements of one row (a mid x cols slab)."""
        return int(np.prod(self.in_shape[1:]))

    @property
    def out_row(self) -> int:
        return int(np.prod(self.out_shape[1:]))

    def divisors(self) -> np.ndarray:
        """[*out_shape] divisors of the average."""
        if self.divisor_override:
            return np.full(self.out_shape, float(self.divisor_override))
        out = np.ones((), np.int64)
        for d in self.dims:
            out = np.multiply.outer(out, d.divisor_extent(np.arange(d.out_size), self.count_include_pad))
        return out.astype(np.float64)


def _spatial(v, nd: int, what: str) -> tuple[int, ...]:
    t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * nd
    if len(t) == 1 and nd > 1:
        t = t * nd
    if len(t) != nd:
        raise ValueError(f"{what} must be an int or {nd} ints, got {v!r}")
    return t


def pool_output_size(in_size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """torch's pooling output size (with ceil_mode's last-window rule)."""
    out = (in_size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= in_size + padding:
        out -= 1
    return out


def _input_shape(shape, what: str) -> tuple[int, ...]:
    shape = tuple(int(v) for v in shape)
    if len(shape) not in (4, 5):
        raise ValueError(f"{what}: expected a 4-D input [N, C, H, W] or a 5-D input [N, C, D, H, W], got shape "
                         f"{list(shape)}")
    if min(shape) < 1:
        raise ValueError(f"{what}: empty input {list(shape)}")
    return shape


def pool_geometry(kind: str, x_shape, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                  count_include_pad=True, divisor_override=None, what: str | None = None) -> PoolGeometry:
    """Geometry of max or average pooling (2-D or 3-D by the input's rank) with torch's argument checks."""
    what = what or f"{kind}_pool"
    shape = _input_shape(x_shape, what)
    nd = len(shape) - 2
    k = _spatial(kernel_size, nd, f"{what}: kernel_size")
    s = _spatial(stride if stride is not None and stride != () and stride != [] else k, nd, f"{what}: stride")
    p = _spatial(padding, nd, f"{what}: padding")
    d = _spatial(dilation, nd, f"{what}: dilation")
    if min(k) < 1 or min(s) < 1 or min(d) < 1:
        raise ValueError(f"{what}: kernel_size {k}, stride {s} and dilation {d} must be positive")
    if min(p) < 0 or any(pp > kk // 2 for pp, kk in zip(p, k)):
        raise ValueError(f"{what}: pad should be at most half of kernel size, but got padding={p} and "
                         f"kernel_size={k}")
    if divisor_override is not None and int(divisor_override) < 1:
        raise ValueError(f"{what}: divisor_override must be positive, got {divisor_override}")
    out = [pool_output_size(i, *a, ceil_mode) for i, a in zip(shape[2:], zip(k, s, p, d))]
    if min(out) < 1:
        sizes = "x".join(map(str, shape[1:]))
        raise ValueError(f"{what}: given input size {sizes}, the calculated output size "
                         f"{'x'.join(map(str, [shape[1]] + out))} is too small")
    return PoolGeometry(kind, tuple(PoolDim(i, o, *a) for i, o, a in zip(shape[2:], out, zip(k, s, p, d))),
                        bool(count_include_pad), int(divisor_override or 0))


def adaptive_geometry(x_shape, output_size, what: str = "adaptive_avg_pool", kind: str = "avg") -> PoolGeometry:
    """Geometry of adaptive average (kind "avg") or max (kind "max") pooling, 2-D or 3-D by the
    input's rank; None in output_size keeps that input size (torch)."""
    shape = _input_shape(x_shape, what)
    nd = len(shape) - 2
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * nd
    if len(sizes) != nd:
        raise ValueError(f"{what}: output_size must be an int or {nd} ints, got {output_size!r}")
    out = [i if o is None else int(o) for i, o in zip(shape[2:], sizes)]
    if min(out) < 1:
        raise ValueError(f"{what}: output_size must be positive, got {output_size!r}")
    return PoolGeometry(kind, tuple(PoolDim(i, o, adaptive=True) for i, o in zip(shape[2:], out)), False, 0)


# ---- cycle estimators ------------------------------------------------------------------------
def pool_cycles(kind: str, rows, elements, taps, dtype, target: Target):
    """Cycles of one pooling worker (see the module doc); `elements` are outputs forward and
    gradient elements backward, `taps` the window positions (or pairs) it visits. Ints or arrays."""
    v = 4 if np.dtype(dtype) == np.float16 else 2
    e, t = ceil_div(elements, v), ceil_div(taps, v)
    instructions = {"max": 10 + rows + e + t, "avg": 10 + 3 * rows + 3 * e + 2 * t,
                    "max_grad": 10 + 5 * rows + 5 * e + 3 * t, "avg_grad": 10 + 2 * rows + 4 * e + t}[kind]
    return target.workers_per_tile * instructions


@njit(**JIT)
def _window(o, adaptive, k, s, p, d, n_in, n_out):
    if adaptive:
        start = (o * n_in) // n_out
        return start, ((o + 1) * n_in + n_out - 1) // n_out - start, 1
    return o * s - p, k, d


@njit(**JIT)
def _dim(q, base):
    """The 7 DIM_PARAMS of one dimension stored from q[base]."""
    return (int(q[base]), int(q[base + 1]), int(q[base + 2]), int(q[base + 3]), int(q[base + 4]),
            int(q[base + 5]), int(q[base + 6]))


@njit(**JIT)
def _real(start, count, step, n_in):
    n = 0
    for t in range(count):
        i = start + t * step
        if 0 <= i < n_in:
            n += 1
    return n


@njit(**JIT)
def _extent(o, q, base, include_pad):
    """The divisor's factor along the dimension whose DIM_PARAMS start at q[base], for output o."""
    a, k, s, p, d, n, m = _dim(q, base)
    start, count, step = _window(o, a, k, s, p, d, n, m)
    if include_pad and a == 0:
        return min(start + k, n + p) - start
    return _real(start, count, step, n)


@njit(**JIT)
def _divisor(orow, omid, ocol, q, base):
    """Divisor of the average of window (orow, omid, ocol); q[base:base + TAIL] holds the rows,
    mid and cols dimension parameters, count_include_pad and divisor_override."""
    if q[base + 22] > 0:
        return q[base + 22]
    pad = q[base + 21] != 0
    return float(_extent(orow, q, base, pad) * _extent(omid, q, base + 7, pad) * _extent(ocol, q, base + 14, pad))


# Forward vertex parameters: op (0 max, 1 avg), the vertex's planes and output rows, the
# window's first input row and size, then DIM_PARAMS for rows, mid and cols, count_include_pad,
# divisor. A row is a whole mid x cols slab of its plane.
FWD_PARAMS = ("op", "plane0", "planes", "row0", "rows", "win_row0", "win_rows")
GRAD_PARAMS = ("plane0", "planes", "row0", "rows", "win_row0", "win_rows", "out_row0", "out_rows")
DIM_PARAMS = ("adaptive", "kernel", "stride", "padding", "dilation", "in", "out")
TAIL = 3 * len(DIM_PARAMS) + 2


@njit(parallel=True, **JIT)
def pool_codelet(x, x_addr, x_start, out, o_addr, o_start, params):
    """Output rows [row0, row0 + rows) of planes [plane0, plane0 + planes) of the block; x is the
    block's input window [block planes, win_rows, mid, cols] starting at input row win_row0."""
    for v in prange(params.shape[0]):
        q = params[v]
        op, plane0, planes, row0, rows = int(q[0]), int(q[1]), int(q[2]), int(q[3]), int(q[4])
        win_row0, win_rows = int(q[5]), int(q[6])
        ha, hk, hs, hp, hd, hn, hm = _dim(q, 7)
        ma, mk, ms, mp, md, mn, mm = _dim(q, 14)
        wa, wk, ws, wp, wd, wn, wm = _dim(q, 21)
        bx, bo = x_start[v], o_start[v]
        for pl in range(planes):
            plane = (plane0 + pl) * win_rows
            for r in range(rows):
                h0, hc, hstep = _window(row0 + r, ha, hk, hs, hp, hd, hn, hm)
                for om in range(mm):
                    m0, mc, mstep = _window(om, ma, mk, ms, mp, md, mn, mm)
                    for ow in range(wm):
                        w0, wc, wstep = _window(ow, wa, wk, ws, wp, wd, wn, wm)
                        acc = -np.inf if op == 0 else 0.0
                        for th in range(hc):
                            ih = h0 + th * hstep
                            if ih < 0 or ih >= hn:
                                continue
                            for tm in range(mc):
                                im = m0 + tm * mstep
                                if im < 0 or im >= mn:
                                    continue
                                for tw in range(wc):
                                    iw = w0 + tw * wstep
                                    if iw < 0 or iw >= wn:
                                        continue
                                    val = ld(x, x_addr[bx + ((plane + ih - win_row0) * mn + im) * wn + iw])
                                    if op == 1:
                                        acc += val
                                    elif val > acc or val != val:
                                        acc = val
                        if op == 1:
                            acc = acc / _divisor(row0 + r, om, ow, q, 7)
                        st(out, o_addr[bo + ((pl * rows + r) * mm + om) * wm + ow], acc)


@njit(parallel=True, **JIT)
def max_grad_codelet(x, x_addr, x_start, y, y_addr, y_start, dy, dy_addr, dy_start, dx, dx_addr, dx_start,
                     params):
    """dx rows [row0, row0 + rows) of planes [plane0, plane0 + planes): each window of outputs rows
    [out_row0, out_row0 + out_rows) sends its dy to the first position equal to its y."""
    for v in prange(params.shape[0]):
        q = params[v]
        plane0, planes, row0, rows = int(q[0]), int(q[1]), int(q[2]), int(q[3])
        win_row0, win_rows, out_row0, out_rows = int(q[4]), int(q[5]), int(q[6]), int(q[7])
        ha, hk, hs, hp, hd, hn, hm = _dim(q, 8)
        ma, mk, ms, mp, md, mn, mm = _dim(q, 15)
        wa, wk, ws, wp, wd, wn, wm = _dim(q, 22)
        slab = mn * wn
        bx, by, bd, bo = x_start[v], y_start[v], dy_start[v], dx_start[v]
        acc = np.zeros(rows * slab)
        for pl in range(planes):
            acc[:] = 0.0
            plane = plane0 + pl
            for oi in range(out_rows):
                h0, hc, hstep = _window(out_row0 + oi, ha, hk, hs, hp, hd, hn, hm)
                if h0 + (hc - 1) * hstep < row0 or h0 >= row0 + rows:
                    continue
                for om in range(mm):
                    m0, mc, mstep = _window(om, ma, mk, ms, mp, md, mn, mm)
                    for ow in range(wm):
                        w0, wc, wstep = _window(ow, wa, wk, ws, wp, wd, wn, wm)
                        k = ((plane * out_rows + oi) * mm + om) * wm + ow
                        target = ld(y, y_addr[by + k])
                        found = False
                        for th in range(hc):
                            ih = h0 + th * hstep
                            if ih < 0 or ih >= hn:
                                continue
                            for tm in range(mc):
                                im = m0 + tm * mstep
                                if im < 0 or im >= mn:
                                    continue
                                for tw in range(wc):
                                    iw = w0 + tw * wstep
                                    if iw < 0 or iw >= wn:
                                        continue
                                    val = ld(x, x_addr[bx + ((plane * win_rows + ih - win_row0) * mn + im) * wn + iw])
                                    if val == target or (val != val and target != target):
                                        if row0 <= ih < row0 + rows:
                                            acc[((ih - row0) * mn + im) * wn + iw] += ld(dy, dy_addr[bd + k])
                                        found = True
                                        break
                                if found:
                                    break
                            if found:
                                break
            for i in range(rows * slab):
                st(dx, dx_addr[bo + pl * rows * slab + i], acc[i])


@njit(parallel=True, **JIT)
def avg_grad_codelet(dy, dy_addr, dy_start, dx, dx_addr, dx_start, params):
    """dx rows [row0, row0 + rows) of planes [plane0, plane0 + planes): every window of output rows
    [out_row0, out_row0 + out_rows) adds dy / divisor to its real positions."""
    for v in prange(params.shape[0]):
        q = params[v]
        plane0, planes, row0, rows = int(q[0]), int(q[1]), int(q[2]), int(q[3])
        out_row0, out_rows = int(q[6]), int(q[7])
        ha, hk, hs, hp, hd, hn, hm = _dim(q, 8)
        ma, mk, ms, mp, md, mn, mm = _dim(q, 15)
        wa, wk, ws, wp, wd, wn, wm = _dim(q, 22)
        slab = mn * wn
        bd, bo = dy_start[v], dx_start[v]
        acc = np.zeros(rows * slab)
        for pl in range(planes):
            acc[:] = 0.0
            plane = plane0 + pl
            for oi in range(out_rows):
                h0, hc, hstep = _window(out_row0 + oi, ha, hk, hs, hp, hd, hn, hm)
                if h0 + (hc - 1) * hstep < row0 or h0 >= row0 + rows:
                    continue
                for om in range(mm):
                    m0, mc, mstep = _window(om, ma, mk, ms, mp, md, mn, mm)
                    for ow in range(wm):
                        w0, wc, wstep = _window(ow, wa, wk, ws, wp, wd, wn, wm)
                        g = ld(dy, dy_addr[bd + ((plane * out_rows + oi) * mm + om) * wm + ow])
                        g = g / _divisor(out_row0 + oi, om, ow, q, 8)
                        for th in range(hc):
                            ih = h0 + th * hstep
                            if ih < row0 or ih >= row0 + rows or ih < 0 or ih >= hn:
                                continue
                            for tm in range(mc):
                                im = m0 + tm * mstep
                                if im < 0 or im >= mn:
                                    continue
                                for tw in range(wc):
                                    iw = w0 + tw * wstep
                                    if 0 <= iw < wn:
                                        acc[((ih - row0) * mn + im) * wn + iw] += g
            for i in range(rows * slab):
                st(dx, dx_addr[bo + pl * rows * slab + i], acc[i])


@lru_cache(maxsize=65536)
def _dims(params: tuple) -> tuple[PoolDim, PoolDim, PoolDim]:
    """The (rows, mid, cols) dimensions of a vertex's DIM_PARAMS."""
    out = []
    for i in (0, 7, 14):
        a = tuple(int(v) for v in params[i:i + 7])
        out.append(PoolDim(a[5], a[6], a[1], a[2], a[3], a[4], bool(a[0])))
    return tuple(out)


@lru_cache(maxsize=65536)
def _taps(dim_params: tuple, out0: int, outs: int, row0: int, rows: int) -> int:
    """Real window positions of outputs rows [out0, out0 + outs) (all of their mid x cols
    outputs) that fall in input rows [row0, row0 + rows)."""
    h, m, w = _dims(dim_params)
    pos = h.positions(np.arange(out0, out0 + outs))
    return int(((pos >= row0) & (pos < row0 + rows)).sum()) * m.real_taps * w.real_taps


DIMS_AT = len(FWD_PARAMS)   # where the forward vertex's DIM_PARAMS start
GRAD_DIMS_AT = len(GRAD_PARAMS)
IN_ROWS = 5   # the rows dimension's "in" among DIM_PARAMS


def _fwd_vertex_cycles(sizes, params, dtype, target):
    op, planes, rows = (params[:, i].astype(np.int64) for i in (0, 2, 4))
    dims = list(range(DIMS_AT, DIMS_AT + 21))
    taps = planes * by_distinct_rows(params[:, [3, 4] + dims],
                                     lambda r: _taps(r[2:], int(r[0]), int(r[1]), 0, int(r[2 + IN_ROWS])))
    return np.where(op == 0, pool_cycles("max", planes * rows, sizes["out"], taps, dtype, target),
                    pool_cycles("avg", planes * rows, sizes["out"], taps, dtype, target))


def _grad_vertex_cycles(kind):
    def estimate(sizes, params, dtype, target):
        planes, rows = (params[:, i].astype(np.int64) for i in (1, 3))
        dims = list(range(GRAD_DIMS_AT, GRAD_DIMS_AT + 21))
        pairs = planes * by_distinct_rows(params[:, [2, 3, 6, 7] + dims],
                                          lambda r: _taps(r[4:], int(r[2]), int(r[3]), int(r[0]), int(r[1])))
        return pool_cycles(kind, planes * rows, sizes["dx"], pairs, dtype, target)
    return estimate


POOL_VERTEX = VertexType("popnn::Pooling", ("x",), ("out",), pool_codelet, _fwd_vertex_cycles,
                         num_params=len(FWD_PARAMS) + TAIL)
MAX_GRAD_VERTEX = VertexType("popnn::MaxPoolingGrad", ("x", "y", "dy"), ("dx",), max_grad_codelet,
                             _grad_vertex_cycles("max_grad"), num_params=len(GRAD_PARAMS) + TAIL)
AVG_GRAD_VERTEX = VertexType("popnn::SumPoolingGrad", ("dy",), ("dx",), avg_grad_codelet,
                             _grad_vertex_cycles("avg_grad"), num_params=len(GRAD_PARAMS) + TAIL)


# ---- plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolPlan:
    """Parts of (planes, rows) (output rows forward, input rows backward), one block per tile."""
    kind: str
    planes: int
    rows: int
    splits: tuple[int, int]
    cycles: int
    bytes_per_tile: int
    fits: bool

    @property
    def tiles_used(self) -> int:
        return self.splits[0] * self.splits[1]


def _pool_work(planes: np.ndarray, rows: np.ndarray, workers: int):
    """The vertices of blocks of `planes` x `rows`: over planes (as `split_ranges(planes, workers)`),
    or with fewer planes than workers, over each plane's rows (`split_ranges(rows, workers //
    planes)`). Returns per vertex (block, plane0, planes, row0, rows)."""
    by_planes = planes >= workers
    plane_step = ceil_div(planes, np.maximum(1, np.minimum(workers, planes)))
    row_step = ceil_div(rows, np.maximum(1, np.minimum(workers // np.maximum(planes, 1), rows)))
    count = np.where(by_planes, ceil_div(planes, plane_step), planes * ceil_div(rows, row_step))
    block = np.repeat(np.arange(planes.size), count)
    k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    per_plane = ceil_div(rows, row_step)[block]
    p0 = np.where(by_planes[block], k * plane_step[block], k // np.maximum(per_plane, 1))
    np_ = np.where(by_planes[block], np.minimum(plane_step[block], planes[block] - p0), 1)
    r0 = np.where(by_planes[block], 0, (k % np.maximum(per_plane, 1)) * row_step[block])
    nr = np.where(by_planes[block], rows[block], np.minimum(row_step[block], rows[block] - r0))
    return block, p0, np_, r0, nr


def _pool_model(target: Target, kind: str, geom: PoolGeometry, planes: int, splits: np.ndarray, dtype):
    """(cycles, working-set bytes) of every candidate split, vectorised."""
    h, m, w = geom.slots
    pb = ceil_div(planes, splits[:, 0])
    backward = kind.endswith("grad")
    rb = ceil_div(h.in_size if backward else h.out_size, splits[:, 1])
    workers, tiles, xb, sync = (target.workers_per_tile, target.num_tiles, target.exchange_bytes_per_cycle,
                                target.sync_cycles)
    isz = np.dtype(dtype).itemsize
    reach = (h.max_count - 1) * (1 if h.adaptive else h.dilation) + 1  # input rows one window spans
    step = max(1, h.in_size // h.out_size) if h.adaptive else h.stride  # between consecutive windows
    taps_per_out = (h.positions(np.arange(h.out_size)) >= 0).mean(axis=0).sum() * \
        (m.positions(np.arange(m.out_size)) >= 0).mean(axis=0).sum() * \
        (w.positions(np.arange(w.out_size)) >= 0).mean(axis=0).sum()
    in_row, out_row = geom.in_row, geom.out_row
    if backward:
        out_rows = np.minimum(h.out_size, ceil_div(rb + reach, step))
        win_rows = np.minimum(h.in_size, (out_rows - 1) * step + reach) if kind == "max_grad" else 0
        received = (pb * win_rows * in_row + (2 if kind == "max_grad" else 1) * pb * out_rows * out_row) * isz
        piece = pb * rb * in_row
        per_input = h.out_size * out_row * taps_per_out / (h.in_size * in_row)
    else:
        win_rows = np.minimum(h.in_size, (rb - 1) * step + reach)
        received = pb * win_rows * in_row * isz
        piece = pb * rb * out_row
    v_planes = np.where(pb >= workers, ceil_div(pb, workers), 1)
    v_rows = np.where(pb >= workers, rb, ceil_div(rb, np.maximum(1, workers // pb)))
    elements = v_planes * v_rows * (in_row if backward else out_row)
    taps = np.ceil(elements * (per_input if backward else taps_per_out)).astype(np.int64)
    vertex = pool_cycles(kind, v_planes * v_rows, elements, taps, dtype, target) + target.vertex_overhead_cycles
    sent = ceil_div(received * splits.prod(axis=1), tiles)
    cycles = vertex + ceil_div(np.maximum(received, sent), xb) + 2 * sync
    return cycles, received + piece * isz


def plan_pool(target: Target, kind: str, geometry: PoolGeometry, planes: int, dtype="float32",
              available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> PoolPlan:
    """The tile plan of a pooling op of `kind` (one of KINDS) over `planes` planes."""
    if kind not in KINDS:
        raise ValueError(f"unknown pooling kind {kind!r}; use one of {KINDS}")
    rows = geometry.rows.in_size if kind.endswith("grad") else geometry.rows.out_size
    splits = split_grid((planes, rows), target.num_tiles)
    cycles, memory = _pool_model(target, kind, geometry, planes, splits, dtype)
    budget = available_memory_proportion * target.bytes_per_tile
    best = choose_split(cycles, memory, budget, splits.prod(axis=1)[:, None])
    return PoolPlan(kind, planes, rows, (int(splits[best, 0]), int(splits[best, 1])), int(cycles[best]),
                    int(memory[best]), bool(memory[best] <= budget))


# ---- building --------------------------------------------------------------------------------
def _spans(span, size: int, parts: int) -> np.ndarray:
    """`span(begin, end)` of every block of rows `ranges(size, parts)`, as a [blocks, 2] array."""
    return np.asarray([span(b, e) for b, e in ranges(size, parts)], np.int64).reshape(-1, 2)


def _unit_slot_params(geom: PoolGeometry) -> int:
    """The parameters of the unit slots the general form adds to an op of fewer spatial
    dimensions: its vertex in Poplar is one of the op's own rank, whose state holds none of them."""
    return len(DIM_PARAMS) * (3 - len(geom.dims))


def _dim_params(geom: PoolGeometry) -> tuple:
    return sum((d.params for d in geom.slots), ()) + (int(geom.count_include_pad), geom.divisor_override)


def _forward(graph: Graph, x: Tensor, geom: PoolGeometry, prog: Sequence, name: str) -> Tensor:
    n, c = x.shape[:2]
    planes, oh, ow, iw = n * c, geom.rows.out_size, geom.out_row, geom.in_row
    dtype = float_dtype(x, name)
    plan = plan_pool(graph.target, geom.kind, geom, planes, dtype)
    out = graph.addVariable(dtype, (n, c) + geom.out_shape, name, category="activations", always_live=False)
    (p0, r0), (pb, rb) = (a.T for a in block_grid((planes, oh), plan.splits))
    tiles = block_tiles(p0.size, graph.target.num_tiles)
    lo, hi = _spans(geom.rows.span, oh, plan.splits[1])[r0 // ceil_div(oh, plan.splits[1])].T
    map_boxes(Tensor(out.var).reshape(planes, oh * ow), np.stack([p0, r0 * ow], 1), np.stack([pb, rb * ow], 1),
              tiles)
    body = Sequence(name=name)
    windows, at = gather_boxes(graph, body, x.reshape(planes, geom.rows.in_size * iw), np.stack([p0, lo * iw], 1),
                               np.stack([pb, (hi - lo) * iw], 1), tiles, f"{name}/in")
    blk, vp, vn, vr, vrows = _pool_work(pb, rb, graph.target.workers_per_tile)
    op = 0 if geom.kind == "max" else 1
    params = np.concatenate([np.stack(np.broadcast_arrays(op, vp, vn, r0[blk] + vr, vrows, lo[blk], (hi - lo)[blk]), 1),
                             np.broadcast_to(_dim_params(geom), (blk.size, TAIL))], 1)
    fields = {"x": Field.strided(windows, at[blk], 1, np.diff(at)[blk]),
              "out": Field.strided(out, (p0[blk] + vp) * oh * ow + (r0[blk] + vr) * ow, vn, vrows * ow, oh * ow)}
    cs = graph.addComputeSet(f"{name}/pool")
    graph.addVertices(cs, POOL_VERTEX, tiles[blk], fields, params.astype(np.float64),
                      state_params=POOL_VERTEX.num_params - _unit_slot_params(geom))
    body.add(Execute(cs))

    def fast(io):
        target = io.output(out)
        store(io, out, pool_numpy(io.read(x), geom, target), target)

    prog.add(OpProgram(name, body, fast, (x,), (out,)))
    return out


def _backward(graph: Graph, geom: PoolGeometry, dy: Tensor, input_shape, prog: Sequence, name: str,
              x: Tensor | None = None, y: Tensor | None = None) -> Tensor:
    n, c = input_shape[:2]
    hh, iw = geom.rows.in_size, geom.in_row
    planes, oh, ow = n * c, geom.rows.out_size, geom.out_row
    if tuple(dy.shape) != (n, c) + geom.out_shape:
        raise ValueError(f"{name}: output gradient {dy.name!r} has shape {list(dy.shape)}, but pooling an input "
                         f"{list(input_shape)} gives {[n, c, *geom.out_shape]}")
    dtype = float_dtype(dy, name)
    kind = "max_grad" if geom.kind == "max" else "avg_grad"
    plan = plan_pool(graph.target, kind, geom, planes, dtype)
    dx = graph.addVariable(dtype, tuple(input_shape), name, category="gradients", always_live=False)
    (p0, r0), (pb, rb) = (a.T for a in block_grid((planes, hh), plan.splits))
    tiles = block_tiles(p0.size, graph.target.num_tiles)
    row_block = r0 // ceil_div(hh, plan.splits[1])
    o0, o1 = _spans(geom.rows.touching, hh, plan.splits[1])[row_block].T
    map_boxes(Tensor(dx.var).reshape(planes, hh * iw), np.stack([p0, r0 * iw], 1), np.stack([pb, rb * iw], 1),
              tiles)
    body = Sequence(name=name)
    outs_first, outs_extent = np.stack([p0, o0 * ow], 1), np.stack([pb, (o1 - o0) * ow], 1)
    grads, grads_at = gather_boxes(graph, body, dy.reshape(planes, oh * ow), outs_first, outs_extent, tiles,
                                   f"{name}/dy")
    blk, vp, vn, vr, vrows = _pool_work(pb, rb, graph.target.workers_per_tile)
    fields = {"dy": Field.strided(grads, grads_at[blk], 1, np.diff(grads_at)[blk]),
              "dx": Field.strided(dx, (p0[blk] + vp) * hh * iw + (r0[blk] + vr) * iw, vn, vrows * iw, hh * iw)}
    if kind == "max_grad":
        lo, hi = _spans(lambda b, e: geom.rows.span(*geom.rows.touching(b, e)), hh, plan.splits[1])[row_block].T
        windows, at = gather_boxes(graph, body, x.reshape(planes, hh * iw), np.stack([p0, lo * iw], 1),
                                   np.stack([pb, (hi - lo) * iw], 1), tiles, f"{name}/x")
        pooled, pooled_at = gather_boxes(graph, body, y.reshape(planes, oh * ow), outs_first, outs_extent, tiles,
                                         f"{name}/y")
        fields.update(x=Field.strided(windows, at[blk], 1, np.diff(at)[blk]),
                      y=Field.strided(pooled, pooled_at[blk], 1, np.diff(pooled_at)[blk]))
    else:
        lo = hi = np.zeros_like(p0)
    params = np.concatenate([np.stack(np.broadcast_arrays(vp, vn, r0[blk] + vr, vrows, lo[blk], (hi - lo)[blk],
                                                          o0[blk], (o1 - o0)[blk]), 1),
                             np.broadcast_to(_dim_params(geom), (blk.size, TAIL))], 1)
    cs = graph.addComputeSet(f"{name}/pool")
    vertex = MAX_GRAD_VERTEX if kind == "max_grad" else AVG_GRAD_VERTEX
    graph.addVertices(cs, vertex, tiles[blk], fields, params.astype(np.float64),
                      state_params=vertex.num_params - _unit_slot_params(geom))
    body.add(Execute(cs))

    reads = (x, y, dy) if kind == "max_grad" else (dy,)

    def fast(io):
        if kind == "max_grad":
            target = io.output(dx)
            store(io, dx, max_pool_grad_numpy(io.read(x), io.read(y), io.read(dy), geom, target), target)
        else:
            io.write(dx, avg_pool_grad_numpy(io.read(dy), tuple(input_shape), geom))

    prog.add(OpProgram(name, body, fast, reads, (dx,)))
    return dx


# ---- NumPy whole-tensor implementations (fast mode) -------------------------------------------
@njit(**JIT)
def pool_whole(x, win, divisors, op, out):
    """out[P, O] = the pooling (op 0 max, 1 average) of the flattened planes x[P, H*W] over the
    windows win[O, K] (flat input positions, -1 for padding, in the codelet's order). Serial: on
    whole tensors of this size a parallel region costs more than it gives."""
    for pl in range(x.shape[0]):
        for o in range(win.shape[0]):
            acc = -np.inf if op == 0 else 0.0
            for k in range(win.shape[1]):
                i = win[o, k]
                if i < 0:
                    continue
                val = np.float64(x[pl, i])
                if op == 1:
                    acc += val
                elif val > acc or val != val:
                    acc = val
            out[pl, o] = acc if op == 0 else acc / divisors[o]


@njit(**JIT)
def pool_grad_whole(x, y, dy, win, divisors, op, dx):
    """dx[P, H*W] = the sum of each window's dy[P, O]: for max pooling (op 0) at the window's first
    position equal to y, for average pooling (op 1) at every real position, divided by the
    window's divisor; windows as in `pool_whole`. Sums are float64 per plane, as the codelet
    keeps them, and rounded once into dx's dtype."""
    if op == 0:
        _max_grad_whole(x, y, dy, win, dx)
    else:
        _avg_grad_whole(dy, win, divisors, dx)


@njit(**JIT)
def _max_grad_whole(x, y, dy, win, dx):
    """Each window's first position equal to y (NaN equal to NaN) is found visiting the taps last
    to first, each a compare and a select with no branch on the data (a branch there mispredicts
    on most windows, as the maximum's position is random)."""
    taps = win.shape[1]
    acc = np.zeros(dx.shape[1])
    for pl in range(dy.shape[0]):
        xp, yp, dyp = x[pl], y[pl], dy[pl]
        acc[:] = 0.0
        for o in range(win.shape[0]):
            target = yp[o]
            first = np.int64(-1)
            if target == target:
                for k in range(taps - 1, -1, -1):
                    i = win[o, k]
                    first = i if (i >= 0) & (xp[np.uint64(max(i, 0))] == target) else first
            else:
                for k in range(taps - 1, -1, -1):
                    i = win[o, k]
                    val = xp[np.uint64(max(i, 0))]
                    first = i if (i >= 0) & (val != val) else first
            if first >= 0:
                acc[np.uint64(first)] += np.float64(dyp[o])
        dxp = dx[pl]
        for i in range(acc.size):
            dxp[i] = acc[i]


@njit(**JIT)
def _avg_grad_whole(dy, win, divisors, dx):
    acc = np.zeros(dx.shape[1])
    for pl in range(dy.shape[0]):
        acc[:] = 0.0
        for o in range(win.shape[0]):
            g = np.float64(dy[pl, o]) / divisors[o]
            for k in range(win.shape[1]):
                if win[o, k] >= 0:
                    acc[win[o, k]] += g
        for i in range(acc.size):
            dx[pl, i] = acc[i]


def _planes(a: np.ndarray) -> np.ndarray:
    """a [N, C, *spatial] as contiguous [N*C, positions] flattened planes of a dtype the kernels
    take (float16 widens to float32 exactly)."""
    a = np.ascontiguousarray(a)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    return a.reshape(a.shape[0] * a.shape[1], -1)


@lru_cache(maxsize=1024)
def _windows(geom: PoolGeometry) -> tuple:
    """The whole-array kernels' window table, divisors and op: per output (row-major), the flat
    input positions of its window, taps row-major as the codelets visit them (outer dimensions
    outer), -1 where the window reads padding."""
    return (window_table(geom), np.ones(1), 0) if geom.kind == "max" else \
        (window_table(geom), geom.divisors().reshape(-1), 1)


def window_table(geom: PoolGeometry) -> np.ndarray:
    """[outputs, taps]: per output (row-major) the flat input positions of its window, taps
    row-major (outer dimensions outer), -1 where the window reads padding."""
    nd = len(geom.dims)
    win, real = np.zeros((1,) * 2 * nd, np.int64), np.ones((1,) * 2 * nd, bool)
    for i, d in enumerate(geom.dims):
        pos = d.positions(np.arange(d.out_size))                  # [O_i, K_i]
        shape = [1] * 2 * nd
        shape[i], shape[nd + i] = pos.shape
        pos = pos.reshape(shape)
        win = win * d.in_size + pos
        real = real & (pos >= 0)
    outputs = int(np.prod(geom.out_shape))
    return np.where(real, win, -1).reshape(outputs, -1)


def pool_numpy(x: np.ndarray, geom: PoolGeometry, out: np.ndarray | None = None) -> np.ndarray:
    """max or average pooling of x [N, C, *spatial] (float64 result for averages, x's dtype for
    max), a max written into `out` when it is contiguous and of that dtype."""
    n, c = x.shape[:2]
    planes = _planes(x)
    # a maximum is one of the inputs: it is stored in their dtype, without a float64 detour
    dtype = planes.dtype if geom.kind == "max" else np.float64
    res = kernel_array(out, (n * c, int(np.prod(geom.out_shape))), dtype)
    pool_whole(planes, *_windows(geom), res)
    res = res.reshape((n, c) + geom.out_shape)
    return res.astype(x.dtype, copy=False) if geom.kind == "max" else res


def max_pool_grad_numpy(x: np.ndarray, y: np.ndarray, dy: np.ndarray, geom: PoolGeometry,
                        out: np.ndarray | None = None) -> np.ndarray:
    """Gradient of max pooling: dy to the first window position equal to y (float32, or dy's float64),
    written into `out` when it is contiguous and of that dtype."""
    planes, grads = _planes(x), _planes(dy)
    dx = kernel_array(out, planes.shape, grads.dtype)
    pool_grad_whole(planes, _planes(y), grads, *_windows(geom), dx)
    return dx.reshape(x.shape)


def avg_pool_grad_numpy(dy: np.ndarray, input_shape, geom: PoolGeometry) -> np.ndarray:
    """Gradient of average pooling: dy / divisor to every real window position (float32, or dy's float64)."""
    input_shape = tuple(int(v) for v in input_shape)
    planes = _planes(dy)
    dx = np.empty((input_shape[0] * input_shape[1], int(np.prod(input_shape[2:]))), planes.dtype)
    pool_grad_whole(planes, planes, planes, *_windows(geom), dx)
    return dx.reshape(input_shape)


def _max_grad_checks(x: Tensor, y: Tensor, dy: Tensor, name: str) -> None:
    if tuple(y.shape) != tuple(dy.shape):
        raise ValueError(f"{name}: pooled output {y.name!r} {list(y.shape)} and its gradient {dy.name!r} "
                         f"{list(dy.shape)} differ in shape")
    if not x.dtype == y.dtype == dy.dtype:
        raise TypeError(f"{name}: x, y and dy must share a dtype, got {x.dtype.name}, {y.dtype.name}, {dy.dtype.name}")


def _output_size(dy: Tensor, input_shape, name: str) -> tuple:
    if dy.rank != len(input_shape):
        raise ValueError(f"{name}: expected a {len(input_shape)}-D output gradient [N, C, *out] for an input "
                         f"{list(input_shape)}, got shape {list(dy.shape)}")
    return tuple(dy.shape[2:])


# ---- the ops ---------------------------------------------------------------------------------
def max_pool(graph: Graph, x: Tensor, kernel_size, prog: Sequence, stride=None, padding=0, dilation=1,
             ceil_mode: bool = False, name: str = "max_pool") -> Tensor:
    """y = max pooling of x [N, C, H, W] or [N, C, D, H, W] like torch's max_pool2d and
    max_pool3d (stride defaults to kernel_size)."""
    geom = pool_geometry("max", x.shape, kernel_size, stride, padding, dilation, ceil_mode, what=name)
    return _forward(graph, x, geom, prog, name)


def avg_pool(graph: Graph, x: Tensor, kernel_size, prog: Sequence, stride=None, padding=0,
             ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
             name: str = "avg_pool") -> Tensor:
    """y = average pooling of x [N, C, H, W] or [N, C, D, H, W] like torch's avg_pool2d and
    avg_pool3d (stride defaults to kernel_size)."""
    geom = pool_geometry("avg", x.shape, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                         divisor_override, what=name)
    return _forward(graph, x, geom, prog, name)


def adaptive_avg_pool(graph: Graph, x: Tensor, output_size, prog: Sequence,
                      name: str = "adaptive_avg_pool") -> Tensor:
    """y = adaptive average pooling of x [N, C, H, W] or [N, C, D, H, W] to `output_size` like torch."""
    return _forward(graph, x, adaptive_geometry(x.shape, output_size, name), prog, name)


def max_pool_backward(graph: Graph, x: Tensor, y: Tensor, dy: Tensor, kernel_size, prog: Sequence, stride=None,
                      padding=0, dilation=1, ceil_mode: bool = False, name: str = "max_pool_backward") -> Tensor:
    """dx of max pooling: each window's dy goes to its first maximum (y = max_pool(x) with the same arguments)."""
    geom = pool_geometry("max", x.shape, kernel_size, stride, padding, dilation, ceil_mode, what=name)
    _max_grad_checks(x, y, dy, name)
    return _backward(graph, geom, dy, x.shape, prog, name, x, y)


def avg_pool_backward(graph: Graph, dy: Tensor, input_shape, kernel_size, prog: Sequence, stride=None, padding=0,
                      ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
                      name: str = "avg_pool_backward") -> Tensor:
    """dx of average pooling for an input of `input_shape`."""
    geom = pool_geometry("avg", input_shape, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                         divisor_override, what=name)
    return _backward(graph, geom, dy, tuple(int(v) for v in input_shape), prog, name)


def adaptive_avg_pool_backward(graph: Graph, dy: Tensor, input_shape, prog: Sequence,
                               name: str = "adaptive_avg_pool_backward") -> Tensor:
    """dx of adaptive average pooling for an input of `input_shape` (the output size is dy's)."""
    input_shape = tuple(int(v) for v in input_shape)
    geom = adaptive_geometry(input_shape, _output_size(dy, input_shape, name), name)
    return _backward(graph, geom, dy, input_shape, prog, name)


def adaptive_max_pool(graph: Graph, x: Tensor, output_size, prog: Sequence,
                      name: str = "adaptive_max_pool") -> Tensor:
    """y = adaptive max pooling of x [N, C, H, W] or [N, C, D, H, W] to `output_size` like torch
    (the values; the gradient finds each window's first maximum again, as max_pool_backward does)."""
    return _forward(graph, x, adaptive_geometry(x.shape, output_size, name, "max"), prog, name)


def adaptive_max_pool_backward(graph: Graph, x: Tensor, y: Tensor, dy: Tensor, prog: Sequence,
                               name: str = "adaptive_max_pool_backward") -> Tensor:
    """dx of adaptive max pooling: each window's dy goes to its first maximum (y =
    adaptive_max_pool(x) with dy's output size)."""
    output_size = _output_size(dy, x.shape, name)
    _max_grad_checks(x, y, dy, name)
    geom = adaptive_geometry(x.shape, output_size, name, "max")
    return _backward(graph, geom, dy, x.shape, prog, name, x, y)
