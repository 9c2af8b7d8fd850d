"""Variables (storage with a tile mapping) and tensors (views of one variable).

A `Variable` owns `numel` elements of one dtype on one IPU; every element lives on exactly one
tile (`mapping[i]`, -1 until mapped). A `Tensor` is a view: an array of flat element indices
into its variable, shaped like the view. Slicing, reshaping, transposing and broadcasting only
rearrange that index array, so a view always knows which tile holds each of its elements.
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
        self.mapping = np.full(self.numel, -1, dtype=np.int32)

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self):
        return f"Variable({self.name!r}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"


class Tensor:
    """A view of a Variable. `index` holds flat element indices into the variable."""

    __slots__ = ("var", "_index", "shape", "_span")

    def __init__(self, var: Variable, index: np.ndarray | None = None, shape: tuple | None = None):
        self.var = var
        self._index = index
        self._span = None
        self.shape = tuple(index.shape) if index is not None else tuple(var.shape if shape is None else shape)

    # ---- properties -----------------------------------------------------------------------
    @property
    def index(self) -> np.ndarray:
        if self._index is None:
            self._index = np.arange(self.var.numel, dtype=index_dtype(self.var.numel)).reshape(self.var.shape)
        return self._index

    @property
    def is_whole(self) -> bool:
        """True when the view is the whole variable in its natural order."""
        return self._index is None

    @property
    def span(self) -> int | None:
        """First flat element when the view is a contiguous run of its variable in C order
        (then it reads and writes as a slice), else None. Computed once."""
        if self._span is None:
            if self.is_whole:
                self._span = 0
            else:
                idx = self.index.reshape(-1)
                contiguous = idx.size == 0 or (int(idx[-1]) - int(idx[0]) == idx.size - 1
                                               and bool((np.diff(idx) == 1).all()))
                self._span = int(idx[0]) if contiguous and idx.size else (0 if contiguous else -1)
        return None if self._span < 0 else self._span

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
        """Tile of every element, shaped like the view."""
        if self.is_whole:
            return self.var.mapping.reshape(self.shape)
        return self.var.mapping[self.index]

    def __repr__(self):
        kind = "" if self.is_whole else " view"
        return f"Tensor({self.var.name!r}{kind}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"

    # ---- views ----------------------------------------------------------------------------
    def _view(self, index: np.ndarray) -> "Tensor":
        return Tensor(self.var, np.ascontiguousarray(index))

    def __getitem__(self, key) -> "Tensor":
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
        index = self.index.reshape(shape)
        if self.is_whole and index.shape == tuple(self.var.shape):
            return self
        return self._view(index)

    def flatten(self) -> "Tensor":
        return self.reshape(self.numel)

    def transpose(self, *axes) -> "Tensor":
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None)
        return self._view(self.index.transpose(axes))

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    def broadcast(self, shape) -> "Tensor":
        """Broadcast to `shape`: repeated elements refer to the same storage (and tile)."""
        return self._view(np.broadcast_to(self.index, tuple(shape)))

    def expand_dims(self, axis: int) -> "Tensor":
        return self._view(np.expand_dims(self.index, axis))

