"""Lowerings of the index and view ops whose positions are known at compile time: the strided
views (``as_strided``, its scatter, ``resize``), ``narrow_copy``, ``unbind_copy``, ``put``,
``masked_scatter`` and ``nonzero_static``.

A strided view of a tensor is a gather from the tensor's elements in memory order, at positions
computed here from the view's size, strides and storage offset (the same arithmetic as
torch's); its scatter writes at the same positions. ``masked_scatter`` and ``nonzero_static``
have static shapes but data-dependent positions, found on the device from a running count of the
mask (a cumulative sum): a gather for the first, a scatter for the second, positions past the end
of the output dropped (an index outside the axis scatters nothing).

Registered into :data:`.aten.LOWERINGS` when :mod:`.aten` is imported.
"""
from __future__ import annotations

import numpy as np
import torch

from .aten import (_check_int32, _gather_along, _indices, _scaled_sum, _scatter_along, _select, _slice, aten,
                   lowers)
from .ir import Value


# ---- strided views ---------------------------------------------------------------------------------
def strided_positions(size, stride, offset: int) -> np.ndarray:
    """The memory positions of the elements of the view (size, stride, storage offset), in the
    view's order."""
    pos = np.full(tuple(int(s) for s in size), int(offset), np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        pos = pos + (np.arange(int(n), dtype=np.int64) * int(s)).reshape((1,) * d + (-1,) + (1,) * (len(size) - d - 1))
    return pos


def _storage(c, x: Value) -> Value:
    """x's elements in memory order (x flattened), after checking that x is its own storage: a
    contiguous tensor from its start (every model input and every op result on the device is)."""
    arg = c.node.args[0]
    meta = arg.meta.get("val") if hasattr(arg, "meta") else None
    if isinstance(meta, torch.Tensor) and (meta.storage_offset() != 0 or not meta.is_contiguous()):
        raise c.error(f"as_strided of a view of another tensor (strides {list(meta.stride())}, storage offset "
                      f"{meta.storage_offset()}) is not supported: the compiler holds each tensor contiguously; "
                      "call .contiguous() first, or index the original tensor")
    return c.reshape(x, (x.numel,))


def _positions(c, x: Value, size, stride, storage_offset) -> np.ndarray:
    pos = strided_positions(size, stride, 0 if storage_offset is None else storage_offset)
    if pos.size and (pos.min() < 0 or pos.max() >= x.numel):
        raise c.error(f"as_strided with size {list(size)}, strides {list(stride)} and storage offset "
                      f"{storage_offset or 0} reaches element {int(pos.max())} of a tensor of {x.numel} elements")
    _check_int32(c, x.numel, "the strided tensor")
    return pos


@lowers(aten.as_strided, aten.as_strided_copy, doc="gather along an axis (the view's memory positions from its "
                                                   "size, strides and offset)")
def _as_strided(c, x, size, stride, storage_offset=None):
    flat = _storage(c, x)
    pos = _positions(c, x, size, stride, storage_offset)
    if pos.size == 0:
        return c.const(np.zeros(pos.shape), x.dtype)
    out = _gather_along(c, flat, c.const(pos.reshape(-1), np.int32), 0)
    return c.reshape(out, pos.shape)


@lowers(aten.as_strided_scatter, doc="scatter along an axis (the source written at the view's memory positions)")
def _as_strided_scatter(c, x, src, size, stride, storage_offset=None):
    flat = _storage(c, x)
    pos = _positions(c, x, size, stride, storage_offset)
    if pos.size == 0:
        return x
    y = _scatter_along(c, flat, c.const(pos.reshape(-1), np.int32), c.reshape(src, (pos.size,)), 0, False)
    return c.reshape(y, x.shape)


@lowers(aten.resize, doc="view (the first elements in memory order); growing is refused (new elements are "
                         "uninitialised)")
def _resize(c, x, size, memory_format=None):
    size = tuple(int(s) for s in size)
    n = int(np.prod(size, dtype=np.int64))
    if n > x.numel:
        raise c.error(f"resizing a tensor of {x.numel} elements to {list(size)} ({n} elements) would leave "
                      "elements uninitialised: the IPU holds no storage beyond a tensor's elements")
    flat = c.reshape(x, (x.numel,))
    return c.reshape(flat if n == x.numel else _slice(c, flat, 0, 0, n, 1), size)


# ---- slices ----------------------------------------------------------------------------------------
@lowers(aten.narrow_copy, doc="view")
def _narrow_copy(c, x, dim, start, length):
    dim = dim % len(x.shape)
    start = int(start) % x.shape[dim] if int(start) < 0 else int(start)
    return _slice(c, x, dim, start, start + int(length), 1)


@lowers(aten.unbind_copy, doc="views")
def _unbind_copy(c, x, dim=0):
    dim = dim % len(x.shape)
    return [_select(c, x, dim, i) for i in range(x.shape[dim])]


# ---- put, masked_scatter, nonzero_static -----------------------------------------------------------
@lowers(aten.put, doc="scatter along an axis of the flattened tensor (accumulate adds)")
def _put(c, x, index, source, accumulate=False):
    if index.numel == 0:
        return x
    flat = c.reshape(x, (x.numel,))
    _check_int32(c, x.numel, "the tensor")
    idx = c.reshape(_indices(c, index), (index.numel,))
    y = _scatter_along(c, flat, idx, c.reshape(source, (index.numel,)), 0, bool(accumulate))
    return c.reshape(y, x.shape)


def _running_count(c, mask: Value) -> Value:
    """For each element of the flattened mask, how many set elements come before it (int32)."""
    m = c.cast(c.reshape(mask, (mask.numel,)), np.int32)
    inclusive = c.one("scan", [m], m.shape, m.dtype, fn="sum", axis=0)
    return c.binary("sub", inclusive, m, dtype=np.int32)


@lowers(aten.masked_scatter, doc="scan sum of the mask (each set element's rank), gather of the source, where")
def _masked_scatter(c, x, mask, source):
    shape = tuple(np.broadcast_shapes(x.shape, mask.shape))
    mask = c.expand(mask, shape)
    x = c.expand(x, shape)
    _check_int32(c, max(source.numel, 1), "the source")
    if source.numel == 0:
        return x
    rank = _running_count(c, mask)   # the source element each set position takes
    picked = _gather_along(c, c.reshape(source, (source.numel,)), rank, 0)
    return c.where(mask, c.reshape(picked, shape), x)


@lowers(aten.masked_scatter_backward, doc="scan sum of the mask (each set element's rank), scatter of the gradient "
                                         "into zeros")
def _masked_scatter_backward(c, grad, mask, sizes):
    """The source's gradient: the gradient at the set positions of the mask, in their order, then
    zeros (positions the mask did not reach)."""
    sizes = tuple(int(s) for s in sizes)
    n = int(np.prod(sizes, dtype=np.int64))
    mask = c.expand(mask, grad.shape)
    rank = _running_count(c, mask)
    target = c.where(c.reshape(mask, (mask.numel,)), rank, n, np.int32)   # unset positions: past the end, dropped
    zeros = c.const(np.zeros(n), grad.dtype)
    out = _scatter_along(c, zeros, target, c.reshape(grad, (grad.numel,)), 0, False)
    return c.reshape(out, sizes)


@lowers(aten.nonzero_static, doc="scan sum of the mask (each nonzero's rank), scatter of the positions, "
                                 "div and remainder to coordinates")
def _nonzero_static(c, x, *, size, fill_value=-1):
    size, rank = int(size), len(x.shape)
    dtype = c.out_dtype()
    if size == 0 or x.numel == 0:
        return c.const(np.full((size, rank), fill_value), dtype)
    _check_int32(c, x.numel, "the tensor")
    flat = c.reshape(x, (x.numel,))
    nonzero = c.binary("ne", flat, 0, dtype=flat.dtype)
    count = _running_count(c, nonzero)
    # each nonzero writes its position at its rank; zeros and ranks past the output are dropped
    target = c.where(nonzero, count, size, np.int32)
    base = c.const(np.full(size, -1), np.int32)
    lin = _scatter_along(c, base, target, c.const(np.arange(x.numel), np.int32), 0, False)
    found = c.binary("ge", lin, 0, dtype=np.int32)
    coords = []
    stride = 1
    for d in reversed(range(rank)):
        above = lin if stride == 1 else c.binary(   # lin // stride, exactly
            "div", c.binary("sub", lin, c.binary("remainder", lin, stride, dtype=np.int32), dtype=np.int32), stride,
            dtype=np.int32)
        coord = c.binary("remainder", above, x.shape[d], dtype=np.int32)
        coords.append(c.reshape(coord, (size, 1)))
        stride *= x.shape[d]
    if not coords:   # a 0-d tensor: no coordinates
        return c.const(np.zeros((size, 0)), dtype)
    out = c.one("cat", coords[::-1], (size, rank), np.dtype(np.int32),
                keys=tuple((slice(None), slice(d, d + 1)) for d in range(rank)))
    found = c.expand(c.reshape(found, (size, 1)), (size, rank))
    return c.cast(c.where(found, out, fill_value), dtype)


# ---- products --------------------------------------------------------------------------------------
@lowers(aten.addbmm, doc="matmul (the batch folded into the contracted axis), add (a zero alpha or beta drops its "
                         "term)")
def _addbmm(c, bias, b1, b2, beta=1, alpha=1):
    B, n, k = b1.shape
    m = b2.shape[2]

    def product():
        a = c.reshape(c.transpose(b1, (1, 0, 2)), (n, B * k))
        return c.one("matmul", [a, c.reshape(b2, (B * k, m))], (n, m), c.out_dtype())
    return _scaled_sum(c, bias, product, beta, alpha, (n, m))
