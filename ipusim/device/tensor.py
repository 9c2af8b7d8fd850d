"""Variables (storage with a tile mapping) and tensors (views of one variable).

A `Variable` owns `numel` elements of one dtype on one IPU; every element lives on exactly one
tile (`mapping[i]`, -1 until mapped). A `Tensor` is a view: (variable, offset, shape, strides)
as NumPy's, so slicing (with steps), transposing, broadcasting and reshaping contiguous data
derive new numbers, not indices; only gathers (integer-array and mask indexing, reshapes no
strides express) hold an index array. Either way a view knows which tile holds each of its
elements: applied to the variable's mapping (`Tensor.on`) it is a NumPy view of it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.bool_,
          "uint32": np.uint32}

CATEGORIES = ("weights", "activations", "stashed_activations", "optimiser_state", "gradients",
              "accumulators", "constants", "temporaries", "host_io", "other")

_ids = itertools.count()

#: A variable's tile mapping holds one tile number (or -1, unmapped) per element: int16 holds
#: every tile of every target (at most 1,472 tiles per IPU) in half the memory of int32.
TILE_DTYPE = np.int16


def tile_counts(tiles: np.ndarray, num_tiles: int) -> np.ndarray:
    """How many entries of `tiles` (tile numbers as stored: int16, int32; none negative) name
    each tile, as np.bincount(tiles, minlength=num_tiles): on the numbers widened to intp first,
    since NumPy's bincount of narrower integers takes over ten times as long as the widening."""
    return np.bincount(np.asarray(tiles).reshape(-1).astype(np.intp, copy=False), minlength=num_tiles)


def tile_runs(mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A tile mapping as runs of elements on one tile: (tile of each run, its length), in order."""
    if not mapping.size:
        return mapping[:0], np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate(([True], mapping[1:] != mapping[:-1])))
    return mapping[starts], np.diff(np.append(starts, mapping.size))


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

    Two forms. A *strided* view (`_index is None`) is NumPy's: element `i` of the view is the
    variable's flat element `offset + sum(i[d] * strides[d])`, held as a few numbers. Slices
    (with steps), transposes, broadcasts (stride 0) and reshapes that NumPy can make without a
    copy stay strided; a C-contiguous one is a *run* (`span`). A *gather* holds an explicit array
    of flat element indices shaped like the view: what integer-array and mask indexing select,
    and reshapes of non-contiguous views that no strides express. A gather whose indices turn
    out to be strided becomes a strided view, so a graph keeps index arrays only where they say
    something.
    """

    __slots__ = ("var", "shape", "offset", "strides", "_index")

    def __init__(self, var: Variable, index: np.ndarray | None = None, shape: tuple | None = None,
                 offset: int = 0, strides: tuple | None = None):
        self.var = var
        if index is not None:
            layout = strides_of(index)
            if layout is not None:
                shape, (offset, strides), index = index.shape, layout, None
        if index is not None:  # kept in the compact dtype: a large graph holds many gathers
            self._index = index.astype(index_dtype(var.numel), copy=False)
            self.shape, self.offset, self.strides = tuple(index.shape), None, None
            return
        self._index = None
        self.shape = tuple(var.shape if shape is None else shape)
        self.offset = int(offset)
        self.strides = c_strides(self.shape) if strides is None else tuple(int(s) for s in strides)
        if 0 in self.shape:  # an empty view names no element: keep one form of it
            self.offset, self.strides = 0, c_strides(self.shape)

    # ---- properties -----------------------------------------------------------------------
    @property
    def index(self) -> np.ndarray:
        """Flat element indices into the variable, shaped like the view (a strided view's are
        made on each call, not kept)."""
        if self._index is not None:
            return self._index
        total = np.full((1,) * self.rank, self.offset, index_dtype(self.var.numel))
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            total = total + (np.arange(n, dtype=total.dtype) * s).reshape((1,) * d + (n,) + (1,) * (self.rank - d - 1))
        return total

    def elements(self) -> slice | np.ndarray:
        """The view's flat elements, in order, as something that indexes a per-element array of
        the variable (its mapping, its storage): a slice for a run, else a 1-d index array."""
        span = self.span
        if span is not None:
            return slice(span, span + self.numel)
        return self.index.reshape(-1)

    def elements_at(self, positions: np.ndarray) -> np.ndarray:
        """The variable elements (int64) at flat `positions` of the view, in time proportional to
        the positions (or to the view, when they are as many: then its indices are cheaper to
        make than one division per axis and position)."""
        positions = np.asarray(positions, np.int64)
        span = self.span
        if span is not None:
            return positions + span
        if self._index is not None or 2 * positions.size >= self.numel:
            return self.index.reshape(-1)[positions].astype(np.int64)
        out = np.full(positions.shape, self.offset, np.int64)
        rest = positions
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            rest, i = np.divmod(rest, n)
            out += i * s
        return out

    def on(self, array: np.ndarray, base: int = 0) -> np.ndarray:
        """The view applied to a per-element array of the variable (its mapping, its fast-layout
        storage from `base`): a NumPy view of `array`, never a copy, when the view is strided
        (writeable unless it repeats elements); a gather's values otherwise."""
        if self._index is not None:
            return array[np.add(self._index, base, dtype=np.int64)] if base else array[self._index]
        step = array.itemsize
        writeable = 0 not in (s for n, s in zip(self.shape, self.strides) if n > 1)
        return as_strided(array[base + self.offset:], self.shape, tuple(s * step for s in self.strides),
                          writeable=writeable)

    @property
    def distinct(self) -> bool:
        """True when no element of the variable appears twice in the view (known without
        indices for a strided view; a gather is not assumed distinct)."""
        if self._index is not None:
            return False
        reach = 0
        for n, s in sorted(((n, abs(s)) for n, s in zip(self.shape, self.strides) if n > 1), key=lambda a: a[1]):
            if s <= reach:
                return False
            reach += s * (n - 1)
        return True

    @property
    def is_whole(self) -> bool:
        """True when the view is every element of its variable in natural order (any shape)."""
        return self.span == 0 and self.numel == self.var.numel

    @property
    def span(self) -> int | None:
        """First flat element when the view is a run (C-contiguous: it reads and writes as a
        slice), else None."""
        if self._index is not None:
            return None
        if self.numel == 0:
            return 0
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and s != expected:
                return None
            expected *= n
        return self.offset

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
        return self.on(self.var.mapping).astype(np.int32)

    def __repr__(self):
        kind = "" if self.is_whole else " view"
        return f"Tensor({self.var.name!r}{kind}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"

    # ---- views ----------------------------------------------------------------------------
    def _gather(self, index: np.ndarray) -> "Tensor":
        return Tensor(self.var, np.asarray(index, order="C"))

    def _strided(self, mapped: np.ndarray) -> "Tensor":
        """The strided view whose application to the variable's mapping is `mapped`, a NumPy
        view that `on(mapping)` was turned into by basic indexing, a transpose, a broadcast or
        a reshape: NumPy did the arithmetic, its offset and strides are read back."""
        mapping = self.var.mapping
        step = mapping.itemsize
        offset = (mapped.__array_interface__["data"][0] - mapping.__array_interface__["data"][0]) // step
        return Tensor(self.var, None, mapped.shape, offset, tuple(s // step for s in mapped.strides))

    def __getitem__(self, key) -> "Tensor":
        if self._index is None and _is_basic(key):
            key = key if isinstance(key, tuple) else (key,)
            if not any(k is Ellipsis for k in key):
                key += (Ellipsis,)  # so that integers alone still give a (0-d) view, not a scalar
            return self._strided(self.on(self.var.mapping)[key])
        if self._index is not None:
            sub = self._index[key]
        else:  # a gather from a strided view: per axis its term, indexed by the key (NumPy's
            # fancy indexing of a broadcast, so the work is proportional to the result)
            dtype = index_dtype(self.var.numel)
            sub = np.broadcast_to(np.asarray(self.offset, dtype), self.shape)[key]
            for d, (n, s) in enumerate(zip(self.shape, self.strides)):
                term = (np.arange(n, dtype=dtype) * s).reshape((1,) * d + (n,) + (1,) * (self.rank - d - 1))
                sub = sub + np.broadcast_to(term, self.shape)[key]
        return self._gather(np.asarray(sub).reshape(np.shape(sub)))

    def slice(self, begin: int, end: int, dim: int = 0) -> "Tensor":
        key = [slice(None)] * self.rank
        key[dim] = slice(begin, end)
        return self[tuple(key)]

    def reshape(self, *shape) -> "Tensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = _resolve_shape(shape, self.numel, self.shape)
        if shape == self.shape:
            return self
        if self._index is None:
            try:
                return self._strided(self.on(self.var.mapping).reshape(shape, copy=False))
            except ValueError:  # no strides express it: the indices say it
                pass
        return self._gather(self.index.reshape(shape))

    def flatten(self) -> "Tensor":
        return self.reshape(self.numel)

    def transpose(self, *axes) -> "Tensor":
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None)
        if self._index is None:
            return self._strided(self.on(self.var.mapping).transpose(axes))
        return self._gather(self._index.transpose(axes))

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    def broadcast(self, shape) -> "Tensor":
        """Broadcast to `shape`: repeated elements refer to the same storage (and tile), by
        stride 0 (a gather's index is NumPy's read-only broadcast view, as small as the source's)."""
        if self._index is None:
            return self._strided(np.broadcast_to(self.on(self.var.mapping), tuple(shape)))
        return Tensor(self.var, np.broadcast_to(self._index, tuple(shape)))

    def expand_dims(self, axis: int) -> "Tensor":
        rank = self.rank + 1
        if not -rank <= axis < rank:
            raise ValueError(f"axis {axis} is out of range for a new axis of a rank-{self.rank} view")
        axis %= rank
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])


def c_strides(shape: tuple) -> tuple:
    """Strides (in elements) of a C-contiguous array of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def strides_of(index: np.ndarray) -> tuple[int, tuple] | None:
    """(offset, strides) when `index` (flat element indices) is `offset + sum(i[d] * strides[d])`
    for every position i, else None. Reads a few elements unless they fit, so a gather that is
    not strided costs little to reject."""
    if index.size == 0:
        return 0, c_strides(index.shape)
    offset = int(index.flat[0])
    corner = (0,) * index.ndim
    strides = tuple(int(index[corner[:d] + (1,) + corner[d + 1:]]) - offset if n > 1 else 0
                    for d, n in enumerate(index.shape))
    last = offset + sum((n - 1) * s for n, s in zip(index.shape, strides))
    if int(index.flat[-1]) != last:
        return None
    if index.size > 2:
        expected = np.full((1,) * index.ndim, offset, np.int64)
        for d, (n, s) in enumerate(zip(index.shape, strides)):
            expected = expected + (np.arange(n, dtype=np.int64) * s).reshape((1,) * d + (n,) + (1,) * (index.ndim - d - 1))
        if not np.array_equal(index, expected):
            return None
    return offset, strides


def _is_basic(key) -> bool:
    """True for keys NumPy answers with a view: integers, slices, None and Ellipsis."""
    key = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, slice)
               or (isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))) for k in key)


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
