"""Lowerings of the sort-like and counting ops: searchsorted, histograms (histc, histogram,
histogramdd), mode, nanmedian and segment reductions over lengths or offsets.

Their outputs have static shapes; what depends on the data is where each element goes, found on
the device: a binary search (searchsorted), a bin position from the outer edges (histograms, as
PyTorch's CPU kernels compute it, with its local search among the neighbouring edges), a segment
number from the running sums of the lengths. Counting is then a scatter that adds, reducing a
scatter with the reduction; an element that belongs nowhere is given a position past the end,
which a scatter drops.

Registered into :data:`.aten.LOWERINGS` when :mod:`.aten` is imported.
"""
from __future__ import annotations

import numpy as np

from .aten import _gather_along, _indices, _scatter_along, _topk_along, aten, binary_search, lowers
from .ir import Value


# ---- searchsorted ----------------------------------------------------------------------------------
@lowers(aten.searchsorted, doc="binary search as bucketize's (per row of the sorted sequence when it has rows; "
                               "sorter: a gather first)")
def _searchsorted(c, seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    right = bool(right) or side == "right"
    if sorter is not None:
        seq = _gather_along(c, seq, _indices(c, sorter), len(seq.shape) - 1)
    if not isinstance(x, Value):
        x = c.const(np.asarray(x), seq.dtype)
    if len(seq.shape) <= 1:
        bounds = c.reshape(seq, (seq.shape[0] if seq.shape else 1,))
    else:
        bounds = seq
    return c.cast(binary_search(c, x, bounds, right), c.out_dtype())


# ---- histograms ------------------------------------------------------------------------------------
def _linspace(c, start: Value, end: Value, steps: int) -> Value:
    """torch.linspace(start, end, steps) of device scalars, in float32 as PyTorch's CPU kernel
    computes it: start + i * step for the first half, end - (steps - 1 - i) * step for the rest."""
    f32 = np.float32
    step = c.binary("div", c.binary("sub", end, start, f32), float(steps - 1), f32)
    i = np.arange(steps)
    first = c.binary("add", start, c.binary("mul", step, c.const(i, f32), f32), f32)
    last = c.binary("sub", end, c.binary("mul", step, c.const(steps - 1 - i, f32), f32), f32)
    return c.where(c.const(i < steps // 2, np.bool_), first, last, f32)


def _widened(c, lo: Value, hi: Value, by: float) -> tuple[Value, Value]:
    """(lo, hi), or (lo - by, hi + by) where they are equal (numpy's rule for an empty range)."""
    f32 = np.float32
    same = c.binary("eq", lo, hi, f32)
    return (c.where(same, c.binary("sub", lo, by, f32), lo, f32),
            c.where(same, c.binary("add", hi, by, f32), hi, f32))


def _bin_positions(c, x: Value, edges: Value, bins: int, local_search: bool) -> tuple[Value, Value]:
    """(int32 bin of each value of x, whether it is counted) for `bins` equal bins between the first
    and last of `edges` [bins + 1]: PyTorch's linear interpolation (truncated), checked against the
    neighbouring edges with local_search; the last bin holds its right edge; values outside the
    edges (and NaN) are not counted."""
    f32 = np.float32
    left = c.reshape(_gather_along(c, edges, c.const([0], np.int32), 0), ())
    right = c.reshape(_gather_along(c, edges, c.const([bins], np.int32), 0), ())
    inside = c.binary("logical_and", c.binary("ge", x, left, f32), c.binary("le", x, right, f32), np.bool_)
    scaled = c.binary("div", c.binary("mul", c.binary("sub", x, left, f32), float(bins), f32),
                      c.binary("sub", right, left, f32), f32)
    scaled = c.where(inside, scaled, 0.0, f32)   # NaN and values outside: any bin, not counted
    pos = c.cast(c.unary("trunc", scaled), np.int32)
    if local_search:   # upper bound among edges[pos - 1 : pos + 2], minus one
        lowest = c.binary("max", c.binary("sub", pos, 1, np.int32), 0, np.int32)
        found = c.binary("sub", lowest, 1, np.int32)
        for k in range(3):
            at = c.binary("add", lowest, k, np.int32)
            within = c.binary("lt", at, c.binary("min", c.binary("add", pos, 2, np.int32), bins + 1, np.int32),
                              np.int32)
            edge = c.reshape(_gather_along(c, edges, c.reshape(c.binary("min", at, bins, np.int32), (-1,)), 0),
                             at.shape)
            step = c.binary("logical_and", within, c.binary("le", edge, x, f32), np.bool_)
            found = c.binary("add", found, c.cast(step, np.int32), np.int32)
        pos = found
    pos = c.binary("min", pos, bins - 1, np.int32)   # the last bin holds its right edge
    return pos, inside


def _histogram_dd(c, x: Value, bins: list, range_, weight, density: bool, widen: float,
                  local_search: bool = True, edges: list | None = None) -> tuple[Value, list]:
    """The histogram of the rows of x [M, D] in bins[d] equal bins per dimension: (counts, or
    weights summed, shaped `bins`; the edges of each dimension). The outer edges are `range_`
    (lo, hi per dimension) or the data's minimum and maximum, widened by `widen` where equal."""
    f32 = np.float32
    M, D = x.shape
    if edges is None:
        edges = []
        for d in range(D):
            if range_ is not None:
                lo, hi = c.const(range_[2 * d], f32), c.const(range_[2 * d + 1], f32)
                if float(lo.data) == float(hi.data):
                    lo, hi = c.const(float(lo.data) - widen, f32), c.const(float(hi.data) + widen, f32)
            else:
                column = c.reshape(_gather_along(c, x, c.const(np.full((M, 1), d), np.int32), 1), (M,))
                lo, hi = _widened(c, c.reduce("min", column, None, False), c.reduce("max", column, None, False), widen)
            edges.append(_linspace(c, lo, hi, int(bins[d]) + 1))
    total = int(np.prod(bins))
    lin, counted = None, None
    stride = 1
    for d in reversed(range(D)):
        column = c.reshape(_gather_along(c, x, c.const(np.full((M, 1), d), np.int32), 1), (M,))
        pos, inside = _bin_positions(c, column, edges[d], int(bins[d]), local_search)
        term = pos if stride == 1 else c.binary("mul", pos, stride, np.int32)
        lin = term if lin is None else c.binary("add", lin, term, np.int32)
        counted = inside if counted is None else c.binary("logical_and", counted, inside, np.bool_)
        stride *= int(bins[d])
    lin = c.where(counted, lin, total, np.int32)   # not counted: past the end, dropped
    w = c.const(np.ones(M), f32) if weight is None else c.reshape(c.cast(weight, f32), (M,))
    hist = _scatter_along(c, c.const(np.zeros(total), f32), lin, w, 0, True)
    hist = c.reshape(hist, tuple(int(b) for b in bins))
    if density:
        hist = c.binary("div", hist, c.reduce("sum", hist, None, False), f32)
        for d in range(D):
            e = edges[d]
            n = int(bins[d])
            width = c.binary("sub", c.one("slice", [e], (n,), f32, key=(slice(1, n + 1),)),
                             c.one("slice", [e], (n,), f32, key=(slice(0, n),)), f32)
            hist = c.binary("div", hist, c.reshape(width, tuple(n if k == d else 1 for k in range(D))), f32)
    return hist, edges


@lowers(aten.histc, doc="reduce min and max (without a range), linspace of the edges, bin positions, scatter add")
def _histc(c, x, bins=100, min=0, max=0):
    f32 = np.float32
    flat = c.reshape(c.cast(x, f32), (x.numel, 1))
    if float(min) == float(max):
        lo, hi = c.reduce("min", flat, None, False), c.reduce("max", flat, None, False)
    else:
        lo, hi = c.const(float(min), f32), c.const(float(max), f32)
    lo, hi = _widened(c, lo, hi, 1.0)
    edges = _linspace(c, lo, hi, int(bins) + 1)
    hist, _ = _histogram_dd(c, flat, [int(bins)], None, None, False, 1.0, local_search=False, edges=[edges])
    return hist


@lowers(aten.histogram, doc="reduce min and max (without a range), linspace of the edges, bin positions (checked "
                            "against the neighbouring edges), scatter add; given edges: binary search")
def _histogram(c, x, bins=100, *, range=None, weight=None, density=False):
    flat = c.reshape(x, (x.numel, 1))
    if isinstance(bins, Value):   # the edges given: a binary search among them
        return _histogram_by_edges(c, flat, [bins], weight, density), bins
    hist, edges = _histogram_dd(c, flat, [int(bins)], range, weight, bool(density), 0.5)
    return hist, edges[0]


def _histogram_by_edges(c, x: Value, edges: list, weight, density: bool) -> Value:
    """histogramdd with the edges given (any increasing sequences): torch's upper bound among the
    edges, minus one, the last bin holding its right edge."""
    f32 = np.float32
    M, D = x.shape
    total = int(np.prod([e.shape[0] - 1 for e in edges]))
    lin, counted, stride = None, None, 1
    for d in reversed(range(D)):
        e = edges[d]
        n = e.shape[0] - 1
        column = c.reshape(_gather_along(c, x, c.const(np.full((M, 1), d), np.int32), 1), (M,))
        first = c.reshape(_gather_along(c, e, c.const([0], np.int32), 0), ())
        last = c.reshape(_gather_along(c, e, c.const([n], np.int32), 0), ())
        inside = c.binary("logical_and", c.binary("ge", column, first, f32), c.binary("le", column, last, f32),
                          np.bool_)
        pos = c.binary("min", c.binary("sub", binary_search(c, column, e, True), 1, np.int32), n - 1, np.int32)
        term = pos if stride == 1 else c.binary("mul", pos, stride, np.int32)
        lin = term if lin is None else c.binary("add", lin, term, np.int32)
        counted = inside if counted is None else c.binary("logical_and", counted, inside, np.bool_)
        stride *= n
    lin = c.where(counted, lin, total, np.int32)
    w = c.const(np.ones(M), f32) if weight is None else c.reshape(c.cast(weight, f32), (M,))
    hist = c.reshape(_scatter_along(c, c.const(np.zeros(total), f32), lin, w, 0, True),
                     tuple(e.shape[0] - 1 for e in edges))
    if density:
        hist = c.binary("div", hist, c.reduce("sum", hist, None, False), f32)
        for d, e in enumerate(edges):
            n = e.shape[0] - 1
            width = c.binary("sub", c.one("slice", [e], (n,), f32, key=(slice(1, n + 1),)),
                             c.one("slice", [e], (n,), f32, key=(slice(0, n),)), f32)
            hist = c.binary("div", hist, c.reshape(width, tuple(n if k == d else 1 for k in range(D))), f32)
    return hist


def _rows(c, x: Value) -> Value:
    return c.reshape(x, (x.numel // x.shape[-1], x.shape[-1]))


@lowers(aten._histogramdd_bin_edges, doc="reduce min and max per dimension (without a range), linspace")
def _histogramdd_bin_edges(c, x, bins, *, range=None, weight=None, density=False):
    return list(_histogram_dd(c, _rows(c, x), list(bins), range, weight, bool(density), 0.5)[1])


@lowers(aten._histogramdd_from_bin_cts, doc="reduce min and max per dimension (without a range), linspace, bin "
                                            "positions (checked against the neighbouring edges), scatter add")
def _histogramdd_from_bin_cts(c, x, bins, *, range=None, weight=None, density=False):
    return _histogram_dd(c, _rows(c, x), list(bins), range, weight, bool(density), 0.5)[0]


@lowers(aten._histogramdd_from_bin_tensors, doc="binary search among the given edges per dimension, scatter add")
def _histogramdd_from_bin_tensors(c, x, bins, *, weight=None, density=False):
    return _histogram_by_edges(c, _rows(c, x), list(bins), weight, bool(density))


# ---- mode, nanmedian ---------------------------------------------------------------------------------
@lowers(aten.mode, doc="eq of every pair along the axis, reduce sum (each value's count), reduce max, where, "
                       "reduce min (the smallest most frequent value) and max (its last position)")
def _mode(c, x, dim=-1, keepdim=False):
    """torch.mode along `dim`: the most frequent value, the smallest of those equally frequent, and
    the last position holding it (PyTorch's CPU kernel sorts (value, position) pairs and takes the
    end of the value's run)."""
    shape = tuple(c.out_meta(0).shape)
    if not x.shape:
        return x, c.const(np.zeros(()), np.int32)
    dim = dim % len(x.shape)
    n = x.shape[dim]
    f32 = x.dtype
    a = c.reshape(x, x.shape[:dim + 1] + (1,) + x.shape[dim + 1:])
    b = c.reshape(x, x.shape[:dim] + (1,) + x.shape[dim:])
    counts = c.reduce("sum", c.cast(c.binary("eq", a, b, f32), np.int32), (dim + 1,), False)
    best = c.reduce("max", counts, (dim,), True)
    candidate = c.binary("eq", counts, best, np.int32)
    largest = np.inf if f32.kind == "f" else np.iinfo(np.int32).max
    value = c.reduce("min", c.where(candidate, x, largest, f32), (dim,), True)
    positions = c.const(np.arange(n).reshape((n,) + (1,) * (len(x.shape) - dim - 1)), np.int32)
    holds = c.binary("eq", x, value, f32)
    index = c.reduce("max", c.where(holds, c.expand(positions, x.shape), -1, np.int32), (dim,), True)
    return c.reshape(value, shape), c.reshape(index, shape)


@lowers(aten.nanmedian, doc="topk (NaN as the largest), reduce sum of the numbers (not NaN), gather of the lower "
                            "median of the numbers")
def _nanmedian(c, x, dim=None, keepdim=False):
    """The lower median of the values that are not NaN (NaN when all are): the sorted values'
    element (count - 1) // 2, the count found on the device."""
    if dim is None:
        return c.reshape(_nan_median_along(c, c.reshape(x, (x.numel,)), 0)[0], ())
    if not x.shape:
        return x, c.const(np.zeros(()), np.int32)
    values, positions = _nan_median_along(c, x, dim % len(x.shape))
    shape = tuple(c.out_meta(0).shape)
    return c.reshape(values, shape), c.reshape(positions, shape)


def _nan_median_along(c, x: Value, dim: int) -> tuple[Value, Value]:
    n = x.shape[dim]
    values, positions = _topk_along(c, x, n, dim, False)     # ascending, NaN last
    isnan = c.one("unary", [x], x.shape, np.dtype(np.bool_), fn="isnan")
    numbers = c.reduce("sum", c.cast(c.unary("logical_not", isnan), np.int32), (dim,), True)
    k = c.binary("max", c.binary("sub", numbers, 1, np.int32), 0, np.int32)
    half = c.binary("div", c.binary("sub", k, c.binary("remainder", k, 2, np.int32), np.int32), 2, np.int32)
    return _gather_along(c, values, half, dim), _gather_along(c, positions, half, dim)


# ---- segment reductions ------------------------------------------------------------------------------
SEGMENT_IDENTITY = {"max": -np.inf, "min": np.inf, "sum": 0.0, "mean": 0.0, "prod": 1.0}


def _segments(c, data: Value, axis: int, lengths, offsets) -> tuple[Value, Value, int]:
    """(the segment of each element of data along `axis`, past the last where it is in none, as
    int32 shaped like data; the segments' lengths [..., S] as float32; S). The segments are given by
    their lengths or their offsets [..., S + 1] (a row per row of data before `axis`), read on the
    device: an element's segment is how many segment ends come at or before it."""
    f32 = np.float32
    if lengths is not None:
        lengths = c.cast(lengths, np.int32)
        S = lengths.shape[-1]
        ends = c.one("scan", [lengths], lengths.shape, lengths.dtype, fn="sum", axis=len(lengths.shape) - 1)
        first = c.const(np.zeros(lengths.shape[:-1] + (1,)), np.int32)
    else:
        offsets = c.cast(offsets, np.int32)
        S = offsets.shape[-1] - 1
        r = len(offsets.shape) - 1
        ends = c.one("slice", [offsets], offsets.shape[:-1] + (S,), offsets.dtype,
                     key=(slice(None),) * r + (slice(1, S + 1),))
        starts = c.one("slice", [offsets], offsets.shape[:-1] + (S,), offsets.dtype,
                       key=(slice(None),) * r + (slice(0, S),))
        lengths = c.binary("sub", ends, starts, np.int32)
        first = c.one("slice", [offsets], offsets.shape[:-1] + (1,), offsets.dtype,
                      key=(slice(None),) * r + (slice(0, 1),))
    n = data.shape[axis]
    lead = data.shape[:axis]                     # the rows the lengths have one row each of
    inner = data.shape[axis + 1:]
    # [lead..., N, S]: segment s ends at or before position p
    pos = c.const(np.arange(n).reshape((n, 1)), np.int32)
    ends_b = c.reshape(ends, lead + (1, S)) if lead else c.reshape(ends, (1, S))
    before = c.cast(c.binary("le", ends_b, pos, np.int32), np.int32)
    segment = c.reduce("sum", before, (len(lead) + 1,), False)        # [lead..., N]
    last = c.one("slice", [ends], ends.shape[:-1] + (1,), ends.dtype,
                 key=(slice(None),) * (len(ends.shape) - 1) + (slice(S - 1, S),))
    first = c.reshape(first, lead + (1,))
    last = c.reshape(last, lead + (1,))
    p = c.const(np.arange(n), np.int32)
    inside = c.binary("logical_and", c.binary("ge", p, first, np.int32), c.binary("lt", p, last, np.int32),
                      np.bool_)
    segment = c.where(inside, segment, S, np.int32)
    segment = c.expand(c.reshape(segment, lead + (n,) + (1,) * len(inner)), data.shape)
    return segment, c.cast(lengths, f32), S


@lowers(aten.segment_reduce, doc="scan sum of the lengths (segment ends), le, reduce sum (each element's "
                                 "segment), scatter with the reduction onto the initial value; mean: div by the "
                                 "lengths")
def _segment_reduce(c, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                    initial=None):
    if indices is not None or (lengths is None and offsets is None):
        raise c.error("segment_reduce needs its segments as lengths or offsets (indices are not supported by "
                      "PyTorch either)")
    if reduce not in SEGMENT_IDENTITY:
        raise c.error(f"segment_reduce with reduce={reduce!r}: the reductions are {sorted(SEGMENT_IDENTITY)}")
    axis = axis % len(data.shape)
    segment, length, S = _segments(c, data, axis, lengths, offsets)
    dtype = data.dtype
    start = SEGMENT_IDENTITY[reduce] if initial is None else float(initial)
    out_shape = data.shape[:axis] + (S,) + data.shape[axis + 1:]
    base = c.const(np.full(out_shape, start), dtype)
    how = {"max": "max", "min": "min", "prod": "mul"}.get(reduce)
    out = _scatter_along(c, base, segment, data, axis, how is None, how)
    if reduce == "mean":
        length = c.reshape(length, length.shape + (1,) * (len(data.shape) - axis - 1))
        empty = np.nan if initial is None else float(initial)
        out = c.where(c.binary("gt", length, 0.0, np.float32), c.binary("div", out, length, dtype), empty, dtype)
    return out


@lowers(aten._segment_reduce_backward, doc="gather of each element's segment's gradient; max and min: eq, the "
                                           "count of the extremes (scatter add), div where more than one; mean: "
                                           "div by the lengths; prod: the product over the element")
def _segment_reduce_backward(c, grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """PyTorch's CPU backward kernel, element for element: an element takes its segment's gradient
    (an element in no segment none); of max and min only the elements equal to the result (or NaN),
    the positive ones divided by how many there are when more than one; of a mean the gradient over
    the length; of a product the gradient times the product over the element (the product of the
    others where the element is 0)."""
    axis = axis % len(data.shape)
    segment, length, S = _segments(c, data, axis, lengths, offsets)
    dtype = data.dtype
    in_one = c.binary("lt", segment, S, np.int32)
    g = _gather_along(c, grad, segment, axis)     # past the end: 0
    if reduce in ("sum", "mean"):
        if reduce == "mean":
            per = c.reshape(length, length.shape + (1,) * (len(data.shape) - axis - 1))
            g = _gather_along(c, c.binary("div", grad, c.binary("max", per, 1.0, np.float32), dtype), segment, axis)
        return g
    out = _gather_along(c, output, segment, axis)
    if reduce in ("max", "min"):
        isnan = c.one("unary", [data], data.shape, np.dtype(np.bool_), fn="isnan")
        hit = c.binary("logical_and", in_one, c.binary("logical_or", isnan, c.binary("eq", data, out, dtype),
                                                       np.bool_), np.bool_)
        gi = c.where(hit, g, 0.0, dtype)
        zeros = c.const(np.zeros(grad.shape), dtype)
        counts = _scatter_along(c, zeros, c.where(hit, segment, S, np.int32), c.cast(hit, dtype), axis, True)
        count = _gather_along(c, counts, segment, axis)
        shared = c.binary("logical_and", c.binary("ge", count, 2.0, dtype), c.binary("gt", gi, 0.0, dtype), np.bool_)
        return c.where(shared, c.binary("div", gi, c.binary("max", count, 1.0, dtype), dtype), gi, dtype)
    if reduce == "prod":
        zero = c.binary("eq", data, 0.0, dtype)
        start = 1.0 if initial is None else float(initial)
        # the product of the segment's other elements, for its zeros: the nonzero product if it
        # has one zero, else 0
        nonzero = c.where(zero, 1.0, data, dtype)
        ones = c.const(np.full(grad.shape, start), dtype)
        product = _scatter_along(c, ones, segment, nonzero, axis, False, "mul")
        zeros = _scatter_along(c, c.const(np.zeros(grad.shape), dtype), segment, c.cast(zero, dtype), axis, True)
        others = c.where(c.binary("eq", _gather_along(c, zeros, segment, axis), 1.0, dtype),
                         _gather_along(c, product, segment, axis), 0.0, dtype)
        general = c.binary("div", c.binary("mul", g, out, dtype), c.where(zero, 1.0, data, dtype), dtype)
        return c.where(in_one, c.where(zero, c.binary("mul", g, others, dtype), general, dtype), 0.0, dtype)
    raise c.error(f"segment_reduce backward with reduce={reduce!r} is not supported")
