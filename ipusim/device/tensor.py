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
            run = run_start(index)
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
        parsed = _parse_key(self._start, self.shape, key) if self._index is None else None
        if parsed is not None:  # a run indexed without making its indices
            first, axes = parsed
            run = _run_of(first, axes)
            if run is not None:
                return Tensor(self.var, None, run[1], run[0])
            return self._view(_gather(first, axes).astype(index_dtype(self.var.numel)))
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
        return Tensor(self.var, np.broadcast_to(self.index, tuple(shape)))

    def expand_dims(self, axis: int) -> "Tensor":
        rank = self.rank + 1
        if not -rank <= axis < rank:
            raise ValueError(f"axis {axis} is out of range for a new axis of a rank-{self.rank} view")
        axis %= rank
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])


def run_start(index: np.ndarray) -> int | None:
    """The first element when `index` (in C order) counts up by one (0 when it is empty), else
    None. Reads only the two ends unless they match, so a broadcast is not copied."""
    n = index.size
    if n == 0:
        return 0
    first = int(index.flat[0])
    if int(index.flat[-1]) - first != n - 1:
        return None
    if n > 2 and not (np.diff(index.reshape(-1)) == 1).all():
        return None
    return first


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


def _parse_key(start: int, shape: tuple, key) -> tuple[int, list] | None:
    """A key of integers and slices, or of slices and one integer array, applied to a run of
    `shape` from `start`: (first element, per result axis group (stride, positions kept: a range,
    or the array)), integers folded into the first element. None for other keys (None, Ellipsis,
    boolean masks, several arrays, integers next to an array), which index the run's
    materialised indices instead."""
    key = key if isinstance(key, tuple) else (key,)
    arrays = [k for k in key if isinstance(k, np.ndarray)]
    plain = [k for k in key if not isinstance(k, np.ndarray)]
    if (len(key) > len(shape) or len(arrays) > 1 or any(a.dtype.kind not in "iu" for a in arrays)
            or not all(isinstance(k, (slice, int, np.integer)) and not isinstance(k, (bool, np.bool_))
                       for k in plain)
            or (arrays and not all(isinstance(k, slice) for k in plain))):
        return None
    first, axes = start, []
    for d, size in enumerate(shape):
        k = key[d] if d < len(key) else slice(None)
        stride = math.prod(shape[d + 1:])
        if isinstance(k, slice):
            axes.append((stride, range(*k.indices(size))))
            continue
        bad = (k < -size) | (k >= size)
        if np.any(bad):
            raise IndexError(f"index {int(np.asarray(k)[bad].flat[0])} is out of bounds for axis {d} "
                             f"with size {size}")
        if isinstance(k, np.ndarray):
            axes.append((stride, np.where(k < 0, k + size, k).astype(np.int64)))
        else:
            first += (int(k) + (size if k < 0 else 0)) * stride
    return first, axes


def _run_of(first: int, axes: list) -> tuple[int, tuple] | None:
    """(first element, shape) when the kept ranges of every axis make one run, else None."""
    if not all(isinstance(kept, range) for _, kept in axes):
        return None
    shape = tuple(len(kept) for _, kept in axes)
    if math.prod(shape) == 0:
        return first, shape
    expected = 1
    for stride, kept in reversed(axes):
        if len(kept) > 1 and kept.step * stride != expected:
            return None
        expected *= len(kept)
    return first + sum(kept.start * stride for stride, kept in axes), shape


def _gather(first: int, axes: list) -> np.ndarray:
    """The flat indices `_parse_key` describes: first + the outer sum over axes of the kept
    positions x stride, in time and memory proportional to the result."""
    terms = [(np.arange(kept.start, kept.stop, kept.step, dtype=np.int64) if isinstance(kept, range) else kept)
             * stride for stride, kept in axes]
    rank = sum(t.ndim for t in terms)
    total = np.full((1,) * rank, first, np.int64)
    at = 0
    for t in terms:
        total = total + t.reshape((1,) * at + t.shape + (1,) * (rank - at - t.ndim))
        at += t.ndim
    return total
