"""Tile mappings as runs.

A `TileMap` says which tile holds each of `size` consecutive elements (a variable's elements, or
the flat positions of a view) as runs: elements `starts[r] .. starts[r + 1] - 1` live on
`tiles[r]` (-1: not mapped yet). Runs are kept in normal form (none empty, neighbours on
different tiles), so two maps are equal exactly when their arrays are. Work on a map grows with
its runs, not with its elements: a tensor spread linearly over 1,472 tiles has 1,472 runs
whatever its size, a matmul result one run per row of each tile's block.

Element runs (`starts`, `lengths` arrays: elements `starts[k] .. starts[k] + lengths[k] - 1`, run
after run) are how views, vertex fields and exchanges name elements; `TileMap.pieces` cuts them
where the tile changes.
"""
from __future__ import annotations

import hashlib

import numpy as np
from numba import njit

#: Tile numbers in a map's arrays (a map holds one per run, not per element).
TILE_DTYPE = np.int32


def tile_counts(tiles: np.ndarray, num_tiles: int) -> np.ndarray:
    """How many entries of `tiles` (tile numbers, none negative) name each tile, as
    np.bincount(tiles, minlength=num_tiles): on the numbers widened to intp first, since NumPy's
    bincount of narrower integers takes over ten times as long as the widening."""
    return np.bincount(np.asarray(tiles).reshape(-1).astype(np.intp, copy=False), minlength=num_tiles)


def merged(*sorted_arrays) -> np.ndarray:
    """The distinct values of increasing integer arrays, in order: one merge (a stable sort finds
    the sorted stretches), not a hash of every value."""
    values = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in sorted_arrays])
    values.sort(kind="stable")
    keep = np.ones(values.size, bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


def as_runs(starts, lengths) -> tuple[np.ndarray, np.ndarray]:
    starts = np.asarray(starts, np.int64).reshape(-1)
    return starts, np.broadcast_to(np.asarray(lengths, np.int64), starts.shape)


def runs_of(elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat element indices (in order) as runs of consecutive elements: (starts, lengths)."""
    elements = np.asarray(elements, np.int64).reshape(-1)
    if not elements.size:
        return elements, np.zeros(0, np.int64)
    first = np.flatnonzero(np.concatenate(([True], np.diff(elements) != 1)))
    return elements[first], np.diff(np.append(first, elements.size))


def expand_runs(starts, lengths) -> np.ndarray:
    """starts[k], starts[k] + 1, ..., starts[k] + lengths[k] - 1 for every run k, run after run."""
    starts, lengths = as_runs(starts, lengths)
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(lengths.sum(), dtype=np.int64)


class TileMap:
    """The tiles of `size` consecutive elements, as runs (see the module doc). Immutable: the
    methods that change a mapping return a new map."""

    __slots__ = ("size", "starts", "tiles", "_digest")

    def __init__(self, size: int, starts=None, tiles=None):
        """A map of `size` elements with runs beginning at `starts` (increasing, the first 0)
        on `tiles`; unmapped when no runs are given. Normalised."""
        self.size = int(size)
        if starts is None:
            starts, tiles = ([0], [-1]) if self.size else ([], [])
        starts = np.asarray(starts, np.int64).reshape(-1)
        tiles = np.asarray(tiles, TILE_DTYPE).reshape(-1)
        if starts.size and (starts[0] != 0 or starts[-1] > self.size):
            raise ValueError(f"tile map runs {starts[:3]}... do not cover elements 0..{self.size - 1}")
        ends = np.append(starts[1:], self.size)
        keep = ends > starts
        keep[1:] &= tiles[1:] != tiles[:-1]
        if not keep.all():  # drop empty runs, then merge neighbours on one tile
            starts, tiles = starts[ends > starts], tiles[ends > starts]
            new = np.ones(starts.size, bool)
            new[1:] = tiles[1:] != tiles[:-1]
            starts, tiles = starts[new], tiles[new]
        self.starts, self.tiles = starts, tiles
        self._digest = None

    @property
    def digest(self) -> bytes:
        """A digest of the runs: equal maps have equal digests (op templates, remembered costs)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(self.size.to_bytes(8, "little"))
            h.update(np.ascontiguousarray(self.starts).data)
            h.update(np.ascontiguousarray(self.tiles).data)
            self._digest = h.digest()
        return self._digest

    # ---- making maps ------------------------------------------------------------------------
    @classmethod
    def uniform(cls, size: int, tile: int) -> "TileMap":
        return cls(size, [0] if size else [], [tile] if size else [])

    @classmethod
    def from_lengths(cls, lengths, tiles) -> "TileMap":
        """Consecutive runs of `lengths[k]` elements on `tiles[k]` (zero lengths allowed)."""
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        tiles = np.broadcast_to(np.asarray(tiles, TILE_DTYPE), lengths.shape)
        ends = np.cumsum(lengths)
        return cls(int(ends[-1]) if ends.size else 0, ends - lengths, tiles)

    @classmethod
    def from_tiles(cls, tiles) -> "TileMap":
        """The map of a tile number per element."""
        tiles = np.asarray(tiles).reshape(-1)
        if not tiles.size:
            return cls(0)
        first = np.flatnonzero(np.concatenate(([True], tiles[1:] != tiles[:-1])))
        return cls(tiles.size, first, tiles[first])

    @classmethod
    def concat(cls, maps: list["TileMap"]) -> "TileMap":
        if len(maps) == 1:
            return maps[0]
        base = np.cumsum([0] + [m.size for m in maps[:-1]])
        return cls(int(base[-1] + maps[-1].size) if maps else 0,
                   np.concatenate([m.starts + b for m, b in zip(maps, base)]) if maps else [],
                   np.concatenate([m.tiles for m in maps]) if maps else [])

    # ---- reading ----------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.append(self.starts, self.size))

    @property
    def num_runs(self) -> int:
        return self.starts.size

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:
        return (isinstance(other, TileMap) and self.size == other.size and np.array_equal(self.starts, other.starts)
                and np.array_equal(self.tiles, other.tiles))

    def __repr__(self):
        runs = ", ".join(f"{s}:{t}" for s, t in zip(self.starts[:6], self.tiles[:6]))
        more = ", ..." if self.num_runs > 6 else ""
        return f"TileMap({self.size} elements, {self.num_runs} runs [{runs}{more}])"

    def __getstate__(self):
        return self.size, self.starts, self.tiles

    def __setstate__(self, state):
        self.size, self.starts, self.tiles = state

    @property
    def mapped(self) -> bool:
        """True when every element has a tile."""
        return bool((self.tiles >= 0).all())

    def unmapped(self) -> int:
        """How many elements have no tile."""
        return int(self.lengths[self.tiles < 0].sum())

    def dense(self, dtype=np.int32) -> np.ndarray:
        """The tile of every element."""
        return np.repeat(self.tiles.astype(dtype, copy=False), self.lengths)

    def at(self, elements) -> np.ndarray:
        """Tiles of the given elements (any shape)."""
        elements = np.asarray(elements, np.int64)
        return self.tiles[np.searchsorted(self.starts, elements, side="right") - 1]

    def counts(self, num_tiles: int) -> np.ndarray:
        """Mapped elements on each tile."""
        on = self.tiles >= 0
        return np.bincount(self.tiles[on], weights=self.lengths[on], minlength=num_tiles).astype(np.int64)

    def used_tiles(self) -> np.ndarray:
        """The tiles holding at least one element, increasing."""
        return np.unique(self.tiles[self.tiles >= 0])

    # ---- runs of elements -----------------------------------------------------------------
    def pieces(self, starts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The element runs cut where the tile changes: per piece (its run k, first element,
        length, tile), pieces of one run in order, runs in order. Empty runs give no piece."""
        starts, lengths = as_runs(starts, lengths)
        keep = lengths > 0
        if not keep.all():
            k = np.flatnonzero(keep)
            run, first, length, tile = self.pieces(starts[k], lengths[k])
            return k[run], first, length, tile
        if starts.size and (starts.min() < 0 or (starts + lengths).max() > self.size):
            raise IndexError(f"element runs reach outside the {self.size} elements of the map")
        return _pieces(readonly(self.starts), readonly(self.tiles, TILE_DTYPE), self.size, readonly(starts),
                       readonly(lengths))

    def take(self, starts, lengths) -> "TileMap":
        """The map of the concatenation of element runs (in order)."""
        _, _, length, tile = self.pieces(starts, lengths)
        return TileMap.from_lengths(length, tile)

    def slice(self, begin: int, end: int) -> "TileMap":
        return self.take([begin], [end - begin])

    def covers(self, starts, lengths, tiles) -> np.ndarray:
        """Per element run: True when all its elements live on `tiles[k]` (empty runs: True)."""
        starts, lengths = as_runs(starts, lengths)
        if not self.num_runs:
            return lengths == 0
        tiles = np.broadcast_to(np.asarray(tiles, np.int64), starts.shape)
        return _covers(self.starts, self.tiles, self.size, np.ascontiguousarray(starts), np.ascontiguousarray(lengths),
                       np.ascontiguousarray(tiles))

    # ---- changing ---------------------------------------------------------------------------
    def assign(self, starts, lengths, tiles) -> "TileMap":
        """This map with element runs k (disjoint) set to `tiles[k]`."""
        starts, lengths = as_runs(starts, lengths)
        tiles = np.broadcast_to(np.asarray(tiles, TILE_DTYPE), starts.shape)
        keep = lengths > 0
        starts, lengths, tiles = starts[keep], lengths[keep], tiles[keep]
        if not starts.size:
            return self
        order = np.argsort(starts, kind="stable")
        starts, lengths, tiles = starts[order], lengths[order], tiles[order]
        ends = starts + lengths
        if starts[0] < 0 or ends[-1] > self.size:
            raise IndexError(f"element runs reach outside the {self.size} elements of the map")
        if (starts[1:] < ends[:-1]).any():
            raise ValueError("assigned element runs overlap; give each element one tile")
        cuts = merged(self.starts, starts, ends[ends < self.size])
        new = np.searchsorted(starts, cuts, side="right") - 1
        inside = (new >= 0) & (cuts < ends[np.maximum(new, 0)])
        old = self.tiles[np.searchsorted(self.starts, cuts, side="right") - 1]
        return TileMap(self.size, cuts, np.where(inside, tiles[np.maximum(new, 0)], old))

    def assign_elements(self, elements, tiles) -> "TileMap":
        """This map with each of `elements` set to its entry of `tiles` (a later entry wins
        where an element repeats)."""
        elements = np.asarray(elements, np.int64).reshape(-1)
        tiles = np.broadcast_to(np.asarray(tiles, TILE_DTYPE), elements.shape).reshape(-1)
        if not elements.size:
            return self
        order = np.argsort(elements, kind="stable")
        e, t = elements[order], tiles[order]
        last = np.append(e[1:] != e[:-1], True)  # of a repeated element, its last entry
        e, t = e[last], t[last]
        cut = np.concatenate(([True], (np.diff(e) != 1) | (t[1:] != t[:-1])))
        first = np.flatnonzero(cut)
        return self.assign(e[first], np.diff(np.append(first, e.size)), t[first])


def align(a: TileMap, b: TileMap) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two maps of the same elements cut at the tile changes of both: per segment (first
    element, length, tile in `a`, tile in `b`)."""
    if a.size != b.size:
        raise ValueError(f"cannot align maps of {a.size} and {b.size} elements")
    cuts = merged(a.starts, b.starts)
    lengths = np.diff(np.append(cuts, a.size))
    return (cuts, lengths, a.tiles[np.searchsorted(a.starts, cuts, side="right") - 1],
            b.tiles[np.searchsorted(b.starts, cuts, side="right") - 1])


def union_length(starts, lengths, groups, num_groups: int) -> np.ndarray:
    """Per group, how many distinct elements its runs cover (runs of different groups never
    share an element): sort, merge overlapping runs, count."""
    starts, lengths = as_runs(starts, lengths)
    groups = np.asarray(groups, np.int64)
    if not starts.size:
        return np.zeros(num_groups, np.int64)
    order = np.argsort(starts, kind="stable")
    s, e, g = starts[order], (starts + lengths)[order], groups[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, bool)
    new[1:] = s[1:] >= reach[:-1]  # a run that starts past every earlier end opens a block
    first = np.flatnonzero(new)
    ends = np.maximum.reduceat(e, first)
    return np.bincount(g[first], weights=ends - s[first], minlength=num_groups).astype(np.int64)


# ---- kernels (a walk per run: find its first map run, then forward) ----------------------------
KERNEL = dict(cache=True, nogil=True)


@njit(inline="always", **KERNEL)
def run_holding(map_starts, x, hint):
    """The map run holding position x (the last run starting at or before x). Runs of a view
    mostly follow each other, so the run `hint` and the one after it are tried before a binary
    search."""
    n = map_starts.size
    if 0 <= hint < n and map_starts[hint] <= x:
        if hint + 1 == n or x < map_starts[hint + 1]:
            return hint
        if hint + 2 == n or x < map_starts[hint + 2]:
            return hint + 1
    return np.searchsorted(map_starts, x, side="right") - 1


@njit(**KERNEL)
def _pieces(map_starts, map_tiles, size, starts, lengths):
    n = starts.size
    first_run = np.empty(n, np.int64)
    count = np.empty(n, np.int64)
    total = 0
    last = 0  # the map run where the previous run ended
    for i in range(n):
        r = run_holding(map_starts, starts[i], last)
        end = starts[i] + lengths[i]
        c = 1
        while r + c < map_starts.size and map_starts[r + c] < end:
            c += 1
        last = r + c - 1
        first_run[i] = r
        count[i] = c
        total += c
    run = np.empty(total, np.int64)
    first = np.empty(total, np.int64)
    length = np.empty(total, np.int64)
    tile = np.empty(total, map_tiles.dtype)
    j = 0
    for i in range(n):
        end = starts[i] + lengths[i]
        for c in range(count[i]):
            r = first_run[i] + c
            a = max(map_starts[r], starts[i])
            b = min(map_starts[r + 1] if r + 1 < map_starts.size else size, end)
            run[j] = i
            first[j] = a
            length[j] = b - a
            tile[j] = map_tiles[r]
            j += 1
    return run, first, length, tile


@njit(**KERNEL)
def _covers(map_starts, map_tiles, size, starts, lengths, tiles):
    out = np.empty(starts.size, np.bool_)
    r = 0
    for i in range(starts.size):
        if lengths[i] == 0:
            out[i] = True
            continue
        if starts[i] < 0 or starts[i] + lengths[i] > size:
            out[i] = False
            continue
        r = run_holding(map_starts, starts[i], r)
        end = map_starts[r + 1] if r + 1 < map_starts.size else size
        out[i] = starts[i] + lengths[i] <= end and map_tiles[r] == tiles[i]
    return out


def readonly(a, dtype=np.int64) -> np.ndarray:
    """`a` as a contiguous, read-only array of `dtype` (a view when it already is one). The
    compile-time kernels take their inputs so: Numba compiles (and loads from its cache) one
    version of a kernel per combination of writeable and read-only arguments."""
    a = np.ascontiguousarray(a, dtype=dtype)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def distinct_exchange(starts, lengths, map_starts, map_tiles, map_size, dst_starts, dst_tiles, dst_size, num_tiles):
    """Elements sent, received and copied on each tile by a copy of the runs (`starts`,
    `lengths`) of a variable (mapped by `map_*`), no element twice, to positions mapped by
    `dst_*`: the positions advance with the runs, so the destination's runs are walked once."""
    return _distinct_exchange(readonly(starts), readonly(lengths), readonly(map_starts),
                              readonly(map_tiles, TILE_DTYPE), map_size, readonly(dst_starts),
                              readonly(dst_tiles, TILE_DTYPE), dst_size, num_tiles)


@njit(**KERNEL)
def _distinct_exchange(starts, lengths, map_starts, map_tiles, map_size, dst_starts, dst_tiles, dst_size, num_tiles):
    sent = np.zeros(num_tiles, np.int64)
    recv = np.zeros(num_tiles, np.int64)
    local = np.zeros(num_tiles, np.int64)
    d = 0  # the destination run holding the current position
    position = 0
    r = 0
    for i in range(starts.size):
        element, left = starts[i], lengths[i]
        if left == 0:
            continue
        r = run_holding(map_starts, element, r)
        while left > 0:
            while d + 1 < dst_starts.size and dst_starts[d + 1] <= position:
                d += 1
            dst_end = dst_starts[d + 1] if d + 1 < dst_starts.size else dst_size
            while r + 1 < map_starts.size and map_starts[r + 1] <= element:
                r += 1
            src_end = map_starts[r + 1] if r + 1 < map_starts.size else map_size
            step = min(left, dst_end - position, src_end - element)
            t, u = map_tiles[r], dst_tiles[d]
            if t == u:
                local[u] += step
            else:
                sent[t] += step
                recv[u] += step
            element += step
            position += step
            left -= step
    return sent, recv, local
