"""Variables (storage with a tile mapping) and tensors (views of one variable).

A `Variable` owns `numel` elements of one dtype on one IPU; every element lives on exactly one
tile, held as runs (`mapping`, a `TileMap`; -1 until mapped). A `Tensor` is a view: (variable,
offset, shape, strides) as NumPy's, so slicing (with steps), transposing, broadcasting and
reshaping contiguous data derive new numbers, not indices; only gathers (integer-array and mask
indexing, reshapes no strides express) hold an index array. Either way a view knows which
elements it names as runs (`Tensor.runs`) and which tiles hold them (`Tensor.tile_map`), in work
proportional to those runs.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .mapping import TileMap, as_runs, distinct_exchange, expand_runs, runs_of

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


def _layout(numel: int) -> np.ndarray:
    """A one-byte-per-element array of `numel` elements whose memory is never read: views of it
    made by basic indexing, transposes, broadcasts and reshapes carry the arithmetic of a view's
    offset and strides, which NumPy does for us (`Tensor._strided`)."""
    return as_strided(np.zeros(1, np.uint8), (numel,), (1,), writeable=False)


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
    host_access: bool = False   # the host reads or writes it between programs (not only through streams)

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown tensor category {self.category!r}; use one of {CATEGORIES}")
        self._mapping = TileMap(self.numel)

    @property
    def mapping(self) -> TileMap:
        """The tile of every element, as runs."""
        return self._mapping

    @mapping.setter
    def mapping(self, mapping: TileMap) -> None:
        if not isinstance(mapping, TileMap) or mapping.size != self.numel:
            raise ValueError(f"variable {self.name!r} has {self.numel} elements: its mapping must be a TileMap of "
                             f"as many, got {mapping!r}")
        self._mapping = mapping

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

    Two forms. A *strided* view (`strided`) is NumPy's: element `i` of the view is the
    variable's flat element `offset + sum(i[d] * strides[d])`, held as a few numbers. Slices
    (with steps), transposes, broadcasts (stride 0) and reshapes that NumPy can make without a
    copy stay strided; a C-contiguous one is a *run* (`span`). A reshape that no strides
    express keeps the strided view it reshapes and reads its elements in that view's order. An
    *explicit* view lists its elements, in order, as runs of consecutive variable elements
    (starts and lengths; for a gather of scattered elements, the element indices alone): what
    integer-array and mask indexing select and the blocks of a tile grid gathered one after
    another (`of_runs`). An explicit view whose elements turn out to be strided becomes a
    strided view, so a graph keeps lists only where they say something.
    """

    __slots__ = ("var", "shape", "offset", "strides", "_starts", "_lengths", "_flat", "_distinct", "_blocks")

    def __init__(self, var: Variable, index: np.ndarray | None = None, shape: tuple | None = None,
                 offset: int = 0, strides: tuple | None = None):
        self.var = var
        self._starts = self._lengths = self._flat = self._blocks = None
        self._distinct = False
        if index is not None:
            layout = strides_of(index)
            if layout is None:
                self._explicit(np.asarray(index).reshape(-1), None, index.shape)
                return
            shape, (offset, strides) = index.shape, layout
        self.shape = tuple(var.shape if shape is None else shape)
        self.offset = int(offset)
        self.strides = c_strides(self.shape) if strides is None else tuple(int(s) for s in strides)
        if 0 in self.shape:  # an empty view names no element: keep one form of it
            self.offset, self.strides = 0, c_strides(self.shape)

    @classmethod
    def of_runs(cls, var: Variable, starts, lengths, shape=None, *, distinct: bool = False) -> "Tensor":
        """The explicit view of element runs of `var`, one after another (shape: flat by default);
        `distinct`: the caller knows that no element appears twice (a permutation of partials)."""
        starts, lengths = as_runs(starts, lengths)
        keep = lengths > 0
        if not keep.all():
            starts, lengths = starts[keep], lengths[keep]
        total = int(lengths.sum())
        shape = (total,) if shape is None else tuple(shape)
        if math.prod(shape) != total:
            raise ValueError(f"runs of {total} elements cannot have shape {shape}")
        if starts.size <= 1:
            return cls(var, None, shape, int(starts[0]) if starts.size else 0)
        t = cls.__new__(cls)
        t.var, t._flat, t._distinct, t._blocks = var, None, bool(distinct), None
        t._explicit(starts, lengths, shape)
        return t

    @classmethod
    def of_blocks(cls, var: Variable, starts, lengths, block_offsets, sequence, shape=None) -> "Tensor":
        """The explicit view of blocks of element runs, some named more than once: block b is the
        runs `block_offsets[b] .. block_offsets[b+1] - 1` of (`starts`, `lengths`), and the view is
        blocks `sequence[0]`, `sequence[1]`, ... one after another (the operand blocks of a tile
        grid, each sent to several tiles). Its runs are only listed when something asks for them."""
        starts, lengths = as_runs(starts, lengths)
        block_offsets = np.asarray(block_offsets, np.int64)
        sequence = np.asarray(sequence, np.int64)
        ends = np.concatenate(([0], np.cumsum(lengths)))
        sizes = ends[block_offsets[1:]] - ends[block_offsets[:-1]]
        total = int(sizes[sequence].sum())
        shape = (total,) if shape is None else tuple(shape)
        if math.prod(shape) != total:
            raise ValueError(f"blocks of {total} elements cannot have shape {shape}")
        t = cls.__new__(cls)
        t.var, t._flat, t._distinct = var, None, False
        t._starts, t._lengths, t._blocks = starts, lengths, (block_offsets, sequence, sizes)
        t.shape, t.offset, t.strides = shape, None, None
        return t

    @property
    def blocks(self) -> tuple | None:
        """(runs' starts, lengths, block offsets, sequence, block sizes) of a view `of_blocks`, else None."""
        if self._blocks is None:
            return None
        return (self._starts, self._lengths) + self._blocks

    def _list(self) -> tuple[np.ndarray, np.ndarray | None]:
        """An explicit view's elements: (starts, lengths) of its runs in order, or (indices, None)."""
        if self._blocks is None:
            return self._starts, self._lengths
        offsets, sequence, _ = self._blocks
        count = np.diff(offsets)[sequence]
        run = expand_runs(offsets[sequence], count)
        return self._starts[run], self._lengths[run]

    @classmethod
    def _reshaped(cls, flat: "Tensor", shape) -> "Tensor":
        """The elements of the strided view `flat` in its order, in another shape (a reshape no
        strides express): kept as that view, so its elements and runs come from its strides."""
        t = cls.__new__(cls)
        t.var, t._flat, t._starts, t._lengths, t._distinct, t._blocks = flat.var, flat, None, None, False, None
        t.shape, t.offset, t.strides = tuple(shape), None, None
        return t

    def _explicit(self, starts: np.ndarray, lengths: np.ndarray | None, shape) -> None:
        """Become the explicit view of `starts` (element indices when `lengths` is None) in
        `shape`: runs kept as runs when there are few enough, else the indices, compactly."""
        if lengths is None:
            run_starts, run_lengths = runs_of(starts)
            if 2 * run_starts.size <= starts.size:
                starts, lengths = run_starts, run_lengths
        if lengths is None:
            starts = starts.astype(index_dtype(self.var.numel), copy=False)
        self._starts, self._lengths = starts, lengths
        self.shape, self.offset, self.strides = tuple(shape), None, None

    # ---- properties -----------------------------------------------------------------------
    @property
    def strided(self) -> bool:
        return self._starts is None and self._flat is None and self._blocks is None

    @property
    def index(self) -> np.ndarray:
        """Flat element indices into the variable, shaped like the view (made on each call
        unless the view keeps them)."""
        if self._flat is not None:
            return self._flat.index.reshape(self.shape)
        if not self.strided:
            starts, lengths = self._list()
            flat = starts if lengths is None else expand_runs(starts, lengths)
            return flat.reshape(self.shape)
        total = np.full((1,) * self.rank, self.offset, index_dtype(self.var.numel))
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            total = total + (np.arange(n, dtype=total.dtype) * s).reshape((1,) * d + (n,) + (1,) * (self.rank - d - 1))
        return total

    def elements(self) -> slice | np.ndarray:
        """The view's flat elements, in order, as something that indexes a per-element array of
        the variable (its storage): a slice for a run, else a 1-d index array."""
        span = self.span
        if span is not None:
            return slice(span, span + self.numel)
        return self.index.reshape(-1)

    def elements_at(self, positions: np.ndarray) -> np.ndarray:
        """The variable elements (int64) at flat `positions` of the view, in time proportional to
        the positions."""
        positions = np.asarray(positions, np.int64)
        span = self.span
        if span is not None:
            return positions + span
        if self._flat is not None:
            return self._flat.elements_at(positions)
        if not self.strided:
            starts, lengths = self._list()
            if lengths is None:
                return starts[positions].astype(np.int64)
            first = np.cumsum(lengths) - lengths
            run = np.searchsorted(first, positions, side="right") - 1
            return starts[run] + positions - first[run]
        out = np.full(positions.shape, self.offset, np.int64)
        rest = positions
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            rest, i = np.divmod(rest, n)
            out += i * s
        return out

    def on(self, array: np.ndarray, base: int = 0) -> np.ndarray:
        """The view applied to a per-element array of the variable (its fast-layout storage from
        `base`): a NumPy view of `array`, never a copy, when the view is strided (writeable
        unless it repeats elements); the listed values of an explicit view otherwise."""
        if self._flat is not None:
            return self._flat.on(array, base).reshape(self.shape)
        if not self.strided:
            index = self.index
            return array[np.add(index, base, dtype=np.int64)] if base else array[index]
        step = array.itemsize
        writeable = 0 not in (s for n, s in zip(self.shape, self.strides) if n > 1)
        return as_strided(array[base + self.offset:], self.shape, tuple(s * step for s in self.strides),
                          writeable=writeable)

    @property
    def distinct(self) -> bool:
        """True when no element of the variable appears twice in the view (known without
        indices for a strided view; an explicit view is not assumed distinct)."""
        if self._flat is not None:
            return self._flat.distinct
        if not self.strided:
            return self._distinct
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
        if not self.strided:
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

    def axis_steps(self) -> tuple | None:
        """Per axis, how far apart in the variable two elements are that differ by one along it
        (the innermost step of an axis a reshape merged); None for an explicit view or a reshape
        that mixes axes."""
        if self.strided:
            return self.strides
        if self._flat is None:
            return None
        grouped = _grouping(self._flat.shape, self.shape)
        if grouped is None:
            return None
        finer, groups = grouped
        strides = self._flat.reshape(finer).strides
        return tuple(strides[g[-1]] if g else 0 for g in groups)

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The view's elements in order as runs of consecutive variable elements: (starts,
        lengths). A strided view gives one run per row of its innermost contiguous block (one
        per element when its last axis is not contiguous); a gather its index cut where it
        stops counting up by one."""
        if self._flat is not None:
            return self._flat.runs()
        if not self.strided:
            starts, lengths = self._list()
            if lengths is None:
                return runs_of(starts)
            return starts.astype(np.int64, copy=False), lengths
        dims = [(n, s) for n, s in zip(self.shape, self.strides) if n != 1]
        if not dims or 0 in self.shape:
            return np.full(min(self.numel, 1), self.offset, np.int64), np.full(min(self.numel, 1), self.numel, np.int64)
        length = 1
        while dims and dims[-1][1] == length:  # the innermost axes that make one contiguous block
            length *= dims.pop()[0]
        starts = np.full((1,) * len(dims), self.offset, np.int64)
        for d, (n, s) in enumerate(dims):
            starts = starts + (np.arange(n, dtype=np.int64) * s).reshape((1,) * d + (n,) + (1,) * (len(dims) - d - 1))
        starts = starts.reshape(-1)
        return starts, np.full(starts.size, length, np.int64)

    def runs_at(self, starts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs of the view's flat positions (`starts`, `lengths`) as runs of variable elements:
        per element run (the position run k it belongs to, first element, length), in order; work
        proportional to the result."""
        starts, lengths = as_runs(starts, lengths)
        span = self.span
        if span is not None:
            keep = np.flatnonzero(lengths > 0)
            return keep, starts[keep] + span, lengths[keep]
        if self._flat is not None:
            return self._flat.runs_at(starts, lengths)
        if not self.strided:  # cut where the view's own runs end
            own_starts, own_lengths = self.runs()
            k, first, length, run = TileMap.from_lengths(own_lengths, np.arange(own_starts.size)).pieces(starts, lengths)
            own_first = np.cumsum(own_lengths) - own_lengths
            return k, own_starts[run] + first - own_first[run], length
        dims = [(n, s) for n, s in zip(self.shape, self.strides) if n != 1]
        row = 1
        while dims and dims[-1][1] == row:
            row *= dims.pop()[0]
        keep = lengths > 0
        lo = np.where(keep, starts // row, 0)
        count = np.where(keep, (starts + lengths - 1) // row - lo + 1, 0)
        k = np.repeat(np.arange(starts.size), count)
        r = np.repeat(lo - np.cumsum(count) + count, count) + np.arange(count.sum())  # row of each piece
        first = np.maximum(r * row, starts[k])
        length = np.minimum((r + 1) * row, starts[k] + lengths[k]) - first
        element = np.full(r.shape, self.offset, np.int64)
        rest = r
        for n, s in reversed(dims):
            rest, i = np.divmod(rest, n)
            element += i * s
        return k, element + first - r * row, length

    def map_positions(self, starts, lengths, tiles) -> None:
        """Map runs of the view's flat positions to tiles: positions `starts[k] .. starts[k] +
        lengths[k] - 1` to `tiles[k]` (where the view names an element twice, the later position
        wins, as in NumPy's assignment). `Graph.map_positions` checks the tiles first."""
        starts, lengths = as_runs(starts, lengths)
        tiles = np.broadcast_to(np.asarray(tiles), starts.shape)
        run, first, length = self.runs_at(starts, lengths)
        v = self.var
        if self.distinct:
            v.mapping = v.mapping.assign(first, length, tiles[run])
        else:
            v.mapping = v.mapping.assign_elements(expand_runs(first, length), np.repeat(tiles[run], length))

    def deliveries(self, tiles: TileMap) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The view's elements cut where `tiles` (a map of the view's flat positions) changes:
        per run of consecutive elements that one tile receives, (the view's own run it is part
        of, first element, length, that tile)."""
        starts, lengths = self.runs()
        at = np.cumsum(lengths) - lengths  # flat position of each of the view's runs
        k, first, length, tile = tiles.pieces(at, lengths)
        return k, starts[k] + first - at[k], length, tile

    def lives_on(self, tiles: TileMap) -> bool:
        """True when the element at each flat position of the view lives on the tile `tiles`
        (a map of the positions) gives it."""
        if tiles.size != self.numel:
            raise ValueError(f"a map of {tiles.size} positions for a view of {self.numel} elements")
        by_block = self.block_deliveries(tiles)
        if by_block is not None:
            _, local, _ = by_block
            return bool((local == self._blocks[2][self._blocks[1]]).all())
        m = self.var.mapping
        if not (m.mapped and tiles.mapped):
            return False
        starts, lengths = self.runs()
        num_tiles = int(max(m.tiles.max(initial=0), tiles.tiles.max(initial=0))) + 1
        _, received, _ = distinct_exchange(starts, lengths, m.starts, m.tiles, m.size, tiles.starts, tiles.tiles,
                                           tiles.size, num_tiles)
        return not received.any()  # nothing would move

    def block_deliveries(self, tiles: TileMap):
        """For a view `of_blocks` whose every block (each time it is named) lands on one tile of
        `tiles` (a map of the positions): (that tile per block named, how many of the block's
        elements already live there, the blocks' runs cut where their tiles change as (block,
        first, length, tile)); None otherwise. Work per distinct block, not per time it is named."""
        if self._blocks is None:
            return None
        offsets, sequence, sizes = self._blocks
        count = sizes[sequence]
        at = np.cumsum(count) - count
        k, _, _, dst_tile = tiles.pieces(at, count)
        if k.size != np.count_nonzero(count) or not np.array_equal(k, np.flatnonzero(count)):
            return None
        named = np.zeros(sequence.size, np.int64)
        named[k] = dst_tile
        run, first, length, tile = self.var.mapping.pieces(self._starts, self._lengths)
        block = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))[run]
        digits = int(max(tile.max(initial=0), named.max(initial=0))) + 2  # tile + 1 as a digit of a key
        keys = block * digits + tile + 1
        order = np.argsort(keys, kind="stable")
        keys, summed = keys[order], length[order]
        head = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if keys.size else np.zeros(0, np.int64)
        keys, sums = keys[head], (np.add.reduceat(summed, head) if head.size else summed[:0])
        want = sequence * digits + named + 1
        hit = np.searchsorted(keys, want).clip(max=max(keys.size - 1, 0))
        local = np.where((keys.size > 0) & (keys[hit] == want) if keys.size else np.zeros(want.size, bool),
                         sums[hit] if keys.size else 0, 0)
        return named, local, (block, first, length, tile)

    def take(self, positions, *, distinct: bool = False) -> "Tensor":
        """The elements at flat `positions` of the view, as a 1-D explicit view (of runs where the
        positions run on); `distinct`: the positions repeat no element."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        starts, lengths = runs_of(positions)
        _, first, length = self.runs_at(starts, lengths)
        return Tensor.of_runs(self.var, first, length, distinct=distinct)

    def tile_map(self) -> TileMap:
        """The tiles of the view's flat positions, as runs."""
        span = self.span
        if span is not None:
            return self.var.mapping.slice(span, span + self.numel)
        return self.var.mapping.take(*self.runs())

    def tiles(self) -> np.ndarray:
        """Tile of every element (int32, -1 where unmapped), shaped like the view."""
        return self.tile_map().dense().reshape(self.shape)

    def __repr__(self):
        kind = "" if self.is_whole else " view"
        return f"Tensor({self.var.name!r}{kind}, {self.dtype.name}, {self.shape}, ipu={self.ipu})"

    # ---- views ----------------------------------------------------------------------------
    def _gather(self, index: np.ndarray) -> "Tensor":
        return Tensor(self.var, np.asarray(index, order="C"))

    def _numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """(a layout array of the variable (`_layout`), the view applied to it)."""
        base = _layout(self.var.numel)
        return base, self.on(base)

    def _strided(self, base: np.ndarray, mapped: np.ndarray) -> "Tensor":
        """The strided view whose application to the layout array `base` is `mapped`, a NumPy
        view made from `_numpy()` by basic indexing, a transpose, a broadcast or a reshape:
        NumPy did the arithmetic, its offset and strides (one byte per element) are read back."""
        offset = mapped.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return Tensor(self.var, None, mapped.shape, offset, mapped.strides)

    def __getitem__(self, key) -> "Tensor":
        if self.strided and _is_basic(key):
            key = key if isinstance(key, tuple) else (key,)
            if not any(k is Ellipsis for k in key):
                key += (Ellipsis,)  # so that integers alone still give a (0-d) view, not a scalar
            base, view = self._numpy()
            return self._strided(base, view[key])
        if not self.strided:
            sub = self.index[key]
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
        if self.strided:
            try:
                base, view = self._numpy()
                return self._strided(base, view.reshape(shape, copy=False))
            except ValueError:  # no strides express it: the same view in the new shape
                return Tensor._reshaped(self, shape)
        if self._flat is not None:
            return self._flat.reshape(shape)
        if self._blocks is not None:
            return Tensor.of_blocks(self.var, self._starts, self._lengths, *self._blocks[:2], shape)
        if self._lengths is None:
            return self._gather(self._starts.reshape(shape))
        return Tensor.of_runs(self.var, self._starts, self._lengths, shape, distinct=self._distinct)

    def flatten(self) -> "Tensor":
        return self.reshape(self.numel)

    def transpose(self, *axes) -> "Tensor":
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None)
        if self.strided:
            base, view = self._numpy()
            return self._strided(base, view.transpose(axes))
        if self._flat is not None:
            grouped = _grouping(self._flat.shape, self.shape)
            if grouped is not None:  # permute the groups of the finer shape both are reshapes of
                finer, groups = grouped
                axes = tuple(range(self.rank))[::-1] if axes is None else tuple(a % self.rank for a in axes)
                return self._flat.reshape(finer).transpose([d for a in axes for d in groups[a]]).reshape(
                    tuple(self.shape[a] for a in axes))
        return self._gather(self.index.transpose(axes))

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    def broadcast(self, shape) -> "Tensor":
        """Broadcast to `shape`: repeated elements refer to the same storage (and tile), by
        stride 0 (an explicit view lists the repeats)."""
        if self.strided:
            base, view = self._numpy()
            return self._strided(base, np.broadcast_to(view, tuple(shape)))
        return self._gather(np.broadcast_to(self.index, tuple(shape)))

    def expand_dims(self, axis: int) -> "Tensor":
        rank = self.rank + 1
        if not -rank <= axis < rank:
            raise ValueError(f"axis {axis} is out of range for a new axis of a rank-{self.rank} view")
        axis %= rank
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])


def _grouping(shape_a: tuple, shape_b: tuple) -> tuple[tuple, list[list[int]]] | None:
    """The finest shape that both shapes (of one size) are reshapes of by merging neighbouring
    axes, and for each axis of `shape_b` the axes of that shape it merges; None when there is
    none (a reshape that mixes axes, such as (2, 3) into (3, 2))."""
    def cuts(shape):
        out, p = set(), 1
        for n in shape:
            p *= n
            out.add(p)
        return out
    points = sorted(cuts(shape_a) | cuts(shape_b))
    if any(b % a for a, b in zip(points, points[1:])):
        return None
    finer = tuple(b // a for a, b in zip([1] + points, points) if b // a > 1)
    groups, d = [], 0
    for n in shape_b:  # every axis of shape_b is a product of consecutive axes of the finer shape
        group = []
        while n > 1:
            group.append(d)
            n //= finer[d]
            d += 1
        groups.append(group)
    return finer, groups


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
