"""Variables (storage with a tile mapping) and tensors (views of one variable).

A `Variable` owns `numel` elements of one dtype on one IPU; every element lives on exactly one
tile (`mapping[i]`, -1 until mapped). A `Tensor` is a view: the flat element indices of its
variable it covers, shaped like the view, kept as a run (first element and shape) when they are
consecutive and as an index array otherwise. Slicing, reshaping, transposing and broadcasting
only derive new indices, so a view always knows which tile holds each of its elements.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.bool_,
          "uint32": np.uint32}

CATEGORIES = ("weights", "activations", "stashed_activations", "optimiser_state", "gradients",
              "accumulators", "constants", "temporaries", "host_io", "other")

_ids = itertools.count()

#: A variable's tile mapping holds one tile number (or -1, unmapped) per element: int16 holds
#: every tile of every target (at most 1,472 tiles per IPU) in half the memory of int32.
TILE_DTYPE = np.int16


def index_dtype(numel: int) -> type:
    """Element indices are int32 when they fit (half the memory of int64 for the index arrays of
    every view of a large graph), else int64."""
    return np.int32 if numel < 2**31 else np.int64


def as_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise TypeError(f"unsupported dtype {dt.name!r}: ipusim supports {sorted(DTYPES)}")
    return dt


@dataclass(eq=False)
class Variable:
    name: str
    dtype: np.dtype
    shape: tuple
    ipu: int
    always_live: bool = True
    category: str = "other"
    constant: np.ndarray | None = None
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown tensor category {self.category!r}; use one of {CATEGORIES}")
        self.mapping = np.full(self.numel, -1, dtype=TILE_DTYPE)

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self):
        return f"Variable({self.name!r}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"


class Tensor:
    """A view of a Variable: which of its elements, in which shape.

    Two forms. A *run* (`_index is None`) is `numel` consecutive elements of the variable from
    `_start`, in C order: the whole variable, and every reshape or slice of a run that stays
    contiguous, held as two numbers. Any other view (strided slices, transposes, broadcasts,
    gathers) holds an explicit array of flat element indices shaped like the view. An explicit
    index that turns out contiguous becomes a run, so a graph keeps index arrays only where they
    say something.
    """

    __slots__ = ("var", "shape", "_index", "_start")

    def __init__(self, var: Variable, index: np.ndarray | None = None, shape: tuple | None = None,
                 start: int = 0):
        self.var = var
        if index is not None:
            run = _run_start(index)
            if run is not None:
                start, shape, index = run, index.shape, None
        self._index = index
        self._start = None if index is not None else int(start)
        self.shape = tuple(index.shape) if index is not None else tuple(var.shape if shape is None else shape)

    # ---- properties -----------------------------------------------------------------------
    @property
    def index(self) -> np.ndarray:
        """Flat element indices into the variable, shaped like the view (a run's are made on
        each call, not kept)."""
        if self._index is not None:
            return self._index
        return np.arange(self._start, self._start + self.numel,
                         dtype=index_dtype(self.var.numel)).reshape(self.shape)

    def elements(self) -> slice | np.ndarray:
        """The view's flat elements, in order, as something that indexes a per-element array of
        the variable (its mapping, its storage): a slice for a run, else a 1-d index array."""
        if self._index is None:
            return slice(self._start, self._start + self.numel)
        return self._index.reshape(-1)

    @property
    def is_whole(self) -> bool:
        """True when the view is every element of its variable in natural order (any shape)."""
        return self._index is None and self._start == 0 and self.numel == self.var.numel

    @property
    def span(self) -> int | None:
        """First flat element when the view is a run (it reads and writes as a slice), else None."""
        return self._start

    @property
    def dtype(self) -> np.dtype:
        return self.var.dtype

    @property
    def name(self) -> str:
        return self.var.name

    @property
    def ipu(self) -> int:
        return self.var.ipu

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def tiles(self) -> np.ndarray:
        """Tile of every element (int32, -1 where unmapped), shaped like the view."""
        return self.var.mapping[self.elements()].astype(np.int32).reshape(self.shape)

    def __repr__(self):
        kind = "" if self.is_whole else " view"
        return f"Tensor({self.var.name!r}{kind}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"

    # ---- views ----------------------------------------------------------------------------
    def _view(self, index: np.ndarray) -> "Tensor":
        return Tensor(self.var, np.asarray(index, order="C"))

    def __getitem__(self, key) -> "Tensor":
        if self._index is None:
            run = _slice_run(self._start, self.shape, key)
            if run is not None:
                return Tensor(self.var, None, run[1], run[0])
            return self._view(_index_run(self._start, self.shape, key).astype(index_dtype(self.var.numel)))
        sub = self.index[key]
        if not isinstance(sub, np.ndarray):
            sub = np.asarray(sub).reshape(())
        return self._view(sub)

    def slice(self, begin: int, end: int, dim: int = 0) -> "Tensor":
        key = [slice(None)] * self.rank
        key[dim] = slice(begin, end)
        return self[tuple(key)]

    def reshape(self, *shape) -> "Tensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if self._index is None:
            shape = _resolve_shape(shape, self.numel, self.shape)
            return self if shape == self.shape else Tensor(self.var, None, shape, self._start)
        return self._view(self._index.reshape(shape))

    def flatten(self) -> "Tensor":
        return self.reshape(self.numel)

    def transpose(self, *axes) -> "Tensor":
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None)
        return self._view(self.index.transpose(axes))

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    def broadcast(self, shape) -> "Tensor":
        """Broadcast to `shape`: repeated elements refer to the same storage (and tile). The
        index is NumPy's read-only broadcast view, as small as the source's."""
        index = np.broadcast_to(self.index, tuple(shape))
        if index.size == 0 or not any(n > 1 and s == 0 for n, s in zip(index.shape, index.strides)):
            return self._view(index)
        view = Tensor(self.var, None, index.shape)  # a repeat is never a run
        view._index, view._start = index, None
        return view

    def expand_dims(self, axis: int) -> "Tensor":
        rank = self.rank + 1
        if not -rank <= axis < rank:
            raise ValueError(f"axis {axis} is out of range for a new axis of a rank-{self.rank} view")
        axis %= rank
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])


def _run_start(index: np.ndarray) -> int | None:
    """The first element when `index` (in C order) counts up by one (0 when it is empty), else
    None."""
    flat = index.reshape(-1)
    n = flat.size
    if n == 0:
        return 0
    if int(flat[-1]) - int(flat[0]) != n - 1:
        return None
    if n > 2 and not (np.diff(flat) == 1).all():
        return None
    return int(flat[0])


def _resolve_shape(shape: tuple, numel: int, current: tuple) -> tuple:
    """`shape` with its -1 (if any) filled in, checked against `numel` as NumPy's reshape does."""
    shape = tuple(int(s) for s in shape)
    free = [d for d, s in enumerate(shape) if s == -1]
    known = math.prod(s for s in shape if s != -1)
    if len(free) == 1 and known and numel % known == 0:
        shape = shape[:free[0]] + (numel // known,) + shape[free[0] + 1:]
    if any(s < 0 for s in shape) or math.prod(shape) != numel:
        raise ValueError(f"cannot reshape a view of shape {current} ({numel} elements) into {shape}")
    return shape


def _slice_run(start: int, shape: tuple, key) -> tuple[int, tuple] | None:
    """(first element, shape) when basic indexing (integers and slices) of a run of `shape`
    from `start` gives a run again; None otherwise (strided results, arrays, None, Ellipsis)."""
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > len(shape) or not all(isinstance(k, (slice, int, np.integer))
                                        and not isinstance(k, (bool, np.bool_)) for k in key):
        return None
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first, dims, axes = start, [], []
    for d, size in enumerate(shape):
        k = key[d] if d < len(key) else slice(None)
        if isinstance(k, slice):
            b, e, step = k.indices(size)
            length = len(range(b, e, step))
            first += b * strides[d] if length else 0
            dims.append(length)
            axes.append(step * strides[d])
        else:
            i = int(k) + (size if k < 0 else 0)
            if not 0 <= i < size:
                raise IndexError(f"index {int(k)} is out of bounds for axis {d} with size {size}")
            first += i * strides[d]
    if math.prod(dims) == 0:
        return start, tuple(dims)
    expected = 1
    for length, stride in zip(reversed(dims), reversed(axes)):
        if length > 1 and stride != expected:
            return None
        expected *= length
    return first, tuple(dims)


def _index_run(start: int, shape: tuple, key) -> np.ndarray:
    """`arange(start, start + prod(shape)).reshape(shape)[key]` in time and memory proportional
    to the result when `key` is slices and integers, or slices and one integer array (a run's
    flat index is start + sum over axes of i_d * stride_d, so each axis contributes its own
    coordinates); other keys index the run's materialised indices."""
    key = key if isinstance(key, tuple) else (key,)
    arrays = [k for k in key if isinstance(k, np.ndarray)]
    basic = all(isinstance(k, (slice, int, np.integer)) and not isinstance(k, (bool, np.bool_))
                for k in key if not isinstance(k, np.ndarray))
    simple = basic and len(key) <= len(shape) and (
        not arrays or (len(arrays) == 1 and arrays[0].dtype.kind in "iu"
                       and not any(isinstance(k, (int, np.integer)) for k in key)))
    if not simple:
        return np.arange(start, start + math.prod(shape), dtype=np.int64).reshape(shape)[key]
    terms = []  # per result axis group: (coordinates x stride, number of result axes)
    first = start
    for d, size in enumerate(shape):
        k = key[d] if d < len(key) else slice(None)
        stride = math.prod(shape[d + 1:])
        if isinstance(k, slice):
            terms.append((np.arange(*k.indices(size), dtype=np.int64) * stride, 1))
        elif isinstance(k, np.ndarray):
            bad = (k < -size) | (k >= size)
            if bad.any():
                raise IndexError(f"index {int(k[bad].flat[0])} is out of bounds for axis {d} with size {size}")
            terms.append((np.where(k < 0, k + size, k).astype(np.int64) * stride, k.ndim))
        else:
            i = int(k) + (size if k < 0 else 0)
            if not 0 <= i < size:
                raise IndexError(f"index {int(k)} is out of bounds for axis {d} with size {size}")
            first += i * stride
    rank = sum(n for _, n in terms)
    total = np.full((1,) * rank, first, np.int64)
    at = 0
    for values, n in terms:
        total = total + values.reshape((1,) * at + values.shape + (1,) * (rank - at - n))
        at += n
    return total
