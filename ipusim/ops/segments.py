"""Segments of a reduction, planned from the runs of a tensor's tile map.

For a reduction of `x` over `axes`, output o (C order over the kept axes) reduces the elements
(o, r), r in C order over the reduced axes. A *segment* is what one tile holds of one output:
its elements (o, r) in increasing r, which is increasing flat position. A plan lists segments by
tile, then output; PopLibs' reduction and the segment maps (softmax, norms, losses) run on them.

Geometry. With the kept axes that lie between reduced ones moved in front (which changes no
segment and no order inside one), the tensor is a view [A, R, C]: outer kept, reduced, inner
kept axes; element (o, r) with o = a * C + c sits at flat position a * R * C + r * C + c. A run
of the view's tile map (consecutive positions on one tile) covers, of each output it touches, a
contiguous range of r, and cut at row and plane boundaries it is at most five boxes. So a plan
is made of *parts*, rectangles (tile, outputs o0 .. o0 + k - 1, each holding r0 .. r0 + n - 1).
The parts of a tile are cut where another part of that tile begins or ends, so that the parts of
each output line up, and joined where their r ranges meet; what is left of one output on one
tile in several pieces (two separate stretches of its row on one tile) is one segment of several
parts. A *block* is a run of consecutive outputs on one tile whose segments have the same parts.

Work is per run of the map, per part and per block; the per-segment arrays (tile, output, count
of each segment) are per segment, which is per element only when a plan's segments hold one
element each.
"""
from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..device.mapping import TileMap, expand_runs, tile_counts
from ..device.tensor import Tensor

GRAIN = 4


@dataclass(frozen=True)
class Geometry:
    """A reduction's view [A, R, C] (see the module doc, flat) and how many outputs it has;
    `order` is the axis order of the tensor it transposes (None: not transposed)."""
    view: Tensor
    A: int
    R: int
    C: int
    order: tuple | None = None

    @property
    def num_out(self) -> int:
        return self.A * self.C

    def positions(self, out, r) -> np.ndarray:
        """Flat positions in the view of elements (out, r) (arrays)."""
        out = np.asarray(out, np.int64)
        return (out // self.C) * (self.R * self.C) + np.asarray(r, np.int64) * self.C + out % self.C


def geometry(x: Tensor, axes: tuple) -> Geometry:
    """The [A, R, C] view of a reduction of `x` over `axes` (sorted, non-negative)."""
    kept = [d for d in range(x.rank) if d not in axes]
    last = max(axes) if axes else -1
    front = [d for d in kept if d < last]  # kept axes before the last reduced one: outer, in front
    back = [d for d in kept if d > last]
    order = front + list(axes) + back
    view = x if order == list(range(x.rank)) else x.transpose(tuple(order))
    size = lambda dims: math.prod(x.shape[d] for d in dims)  # noqa: E731
    A, R, C = size(front), size(axes), size(back)
    return Geometry(view.reshape(A * R * C), A, R, C, None if view is x else tuple(order))


# ---- parts from the tile map -------------------------------------------------------------------
def _boxes(p0: np.ndarray, length: np.ndarray, tile: np.ndarray, R: int, C: int):
    """Runs of positions [p0, p0 + length) of an [A, R, C] array cut into boxes: per box
    (run, a0, a1, r0, r1, c0, c1); at most five per run (a row head and tail, a plane head and
    tail, whole planes)."""
    RC = R * C
    p1 = p0 + length
    out = []
    run = np.arange(p0.size)

    def add(mask, a0, a1, r0, r1, c0, c1):
        if mask.any():
            out.append(tuple(np.broadcast_to(v, mask.shape)[mask] for v in (run, a0, a1, r0, r1, c0, c1)))

    lo, hi = p0.copy(), p1.copy()
    # the head of a row
    c0 = lo % C
    head = (c0 != 0) & (lo < hi)
    end = np.minimum(lo - c0 + C, hi)
    a, r = lo // RC, (lo % RC) // C
    add(head, a, a + 1, r, r + 1, c0, c0 + (end - lo))
    lo = np.where(head, end, lo)
    # the tail of a row
    c1 = hi % C
    tail = (c1 != 0) & (lo < hi)
    a, r = hi // RC, (hi % RC) // C
    add(tail, a, a + 1, r, r + 1, 0, c1)
    hi = np.where(tail, hi - c1, hi)
    # the head of a plane (whole rows)
    r0 = (lo % RC) // C
    head = (r0 != 0) & (lo < hi)
    end = np.minimum(lo - r0 * C + RC, hi)
    a = lo // RC
    add(head, a, a + 1, r0, r0 + (end - lo) // C, 0, C)
    lo = np.where(head, end, lo)
    # the tail of a plane
    r1 = (hi % RC) // C
    tail = (r1 != 0) & (lo < hi)
    a = hi // RC
    add(tail, a, a + 1, 0, r1, 0, C)
    hi = np.where(tail, hi - r1 * C, hi)
    # whole planes
    add(lo < hi, lo // RC, hi // RC, 0, R, 0, C)
    if not out:
        return (np.zeros(0, np.int64),) * 7
    return tuple(np.concatenate(col) for col in zip(*out))


def _parts(tiles: TileMap, R: int, C: int):
    """Parts (tile, o0, k, r0, n) of an [A, R, C] array whose flat positions live on `tiles`."""
    run, a0, a1, r0, r1, c0, c1 = _boxes(tiles.starts, tiles.lengths, tiles.tiles.astype(np.int64), R, C)
    tile = tiles.tiles.astype(np.int64)[run]
    whole = (c0 == 0) & (c1 == C)  # rows of whole planes: their outputs run on across planes
    o0 = a0 * C + c0
    k = np.where(whole, (a1 - a0) * C, c1 - c0)
    return tile, o0, k, r0, r1 - r0


def _align(tile, o0, k, r0, n, num_out):
    """Cut each part where another part of its tile begins or ends, so that parts of one tile
    either cover the same outputs or none in common."""
    stride = num_out + 1
    keys = np.concatenate([tile * stride + o0, tile * stride + o0 + k])
    keys.sort()
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))] if keys.size else keys
    first = np.searchsorted(keys, tile * stride + o0, side="right")
    last = np.searchsorted(keys, tile * stride + o0 + k, side="left")
    pieces = last - first + 1  # the cuts strictly inside a part, plus one
    if (pieces == 1).all():
        return tile, o0, k, r0, n
    part = np.repeat(np.arange(tile.size), pieces)
    j = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cut = first[part] + j - 1  # index in keys of the cut a piece starts at (-1 step: the part's own start)
    begin = np.where(j == 0, o0[part], keys[np.minimum(cut, keys.size - 1)] - tile[part] * stride)
    end = np.where(j == pieces[part] - 1, o0[part] + k[part], keys[np.minimum(cut + 1, keys.size - 1)] - tile[part] * stride)
    return tile[part], begin, end - begin, r0[part], n[part]


def _join(tile, o0, k, r0, n):
    """Parts sorted by (tile, o0, r0), those that continue each other's r range joined."""
    order = np.lexsort((r0, o0, tile))
    tile, o0, k, r0, n = tile[order], o0[order], k[order], r0[order], n[order]
    same = np.zeros(tile.size, bool)
    same[1:] = (tile[1:] == tile[:-1]) & (o0[1:] == o0[:-1])
    joins = np.zeros(tile.size, bool)
    joins[1:] = same[1:] & (r0[1:] == r0[:-1] + n[:-1])
    if joins.any():
        head = np.flatnonzero(~joins)
        n = np.add.reduceat(n, head)
        tile, o0, k, r0, same = tile[head], o0[head], k[head], r0[head], same[head]
    return tile, o0, k, r0, n, same


# ---- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Segments in blocks (see the module doc). Block b: on tile `tile[b]`, outputs
    `out[b] .. out[b] + k[b] - 1`; each output holds `m[b]` segments in turn, the c-th made of the
    parts `part_first[tmpl[b] + c] .. part_first[tmpl[b] + c + 1] - 1` (r ranges `part_r0`,
    `part_n`). Segments are listed block by block, output by output, segment by segment."""
    geometry: Geometry
    tile: np.ndarray
    out: np.ndarray
    k: np.ndarray
    tmpl: np.ndarray
    m: np.ndarray
    part_first: np.ndarray
    part_r0: np.ndarray
    part_n: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.tile.size

    def of_geometry(self, g: Geometry) -> "SegmentPlan":
        """This plan for another view of the same structure, with the arrays it has derived."""
        if g is self.geometry:
            return self
        plan = copy.copy(self)
        object.__setattr__(plan, "geometry", g)
        return plan

    @cached_property
    def template_counts(self) -> np.ndarray:
        """Elements of each segment template."""
        ends = np.concatenate(([0], np.cumsum(self.part_n)))
        return ends[self.part_first[1:]] - ends[self.part_first[:-1]]

    @cached_property
    def block_segments(self) -> np.ndarray:
        """Segments of each block."""
        return self.k * self.m

    @cached_property
    def block_start(self) -> np.ndarray:
        """Index of each block's first segment (and the number of segments at the end)."""
        return np.concatenate(([0], np.cumsum(self.block_segments)))

    @property
    def num_segments(self) -> int:
        return int(self.block_start[-1])

    @cached_property
    def seg_block(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_blocks), self.block_segments)

    @cached_property
    def _within(self) -> tuple[np.ndarray, np.ndarray]:
        """(output offset j, segment c) of every segment inside its block."""
        b = self.seg_block
        rank = np.arange(self.num_segments) - self.block_start[b]
        return np.divmod(rank, self.m[b])

    @cached_property
    def seg_tile(self) -> np.ndarray:
        return self.tile[self.seg_block]

    @cached_property
    def seg_out(self) -> np.ndarray:
        return self.out[self.seg_block] + self._within[0]

    @cached_property
    def seg_template(self) -> np.ndarray:
        return self.tmpl[self.seg_block] + self._within[1]

    @cached_property
    def counts(self) -> np.ndarray:
        """Elements of each segment."""
        return self.template_counts[self.seg_template]

    def elements_on_tiles(self, num_tiles: int) -> np.ndarray:
        """Elements each tile holds."""
        return np.bincount(self.tile, weights=self.k * self.m_elements(), minlength=num_tiles).astype(np.int64)

    def m_elements(self) -> np.ndarray:
        """Elements of each output of each block (all its segments)."""
        ends = np.concatenate(([0], np.cumsum(self.template_counts)))
        return ends[self.tmpl + self.m] - ends[self.tmpl]

    def count_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The segments as runs of neighbours on one tile with one count: (tile, count, first
        segment, end segment) per run; from the blocks (a block of one segment per output is one
        run), segment by segment only in blocks of several segments per output."""
        one = self.m == 1
        b = np.flatnonzero(one)
        tile = [self.tile[b]]
        count = [self.template_counts[self.tmpl[b]]]
        begin = [self.block_start[:-1][b]]
        multi = np.flatnonzero(~one)
        if multi.size:  # several segments per output: segment by segment
            segments = expand_runs(self.block_start[:-1][multi], self.block_segments[multi])
            tile.append(self.seg_tile[segments])
            count.append(self.counts[segments])
            begin.append(segments)
        tile, count, begin = (np.concatenate(x) for x in (tile, count, begin))
        order = np.argsort(begin, kind="stable")
        tile, count, begin = tile[order], count[order], begin[order]
        new = np.ones(begin.size, bool)
        new[1:] = (tile[1:] != tile[:-1]) | (count[1:] != count[:-1])
        head = np.flatnonzero(new)
        return tile[head], count[head], begin[head], np.append(begin[head][1:], self.num_segments)

    def output_pairs(self, cuts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The outputs cut into *intervals* at every block's first and last output (and where
        `cuts`, a bool per output boundary, says), so that the blocks holding an interval's
        outputs are the same for all of them: (interval first outputs, sizes, and the (interval,
        block) pairs of blocks holding them, by interval, then block)."""
        num_out = self.geometry.num_out
        cut = np.zeros(num_out + 1, bool) if cuts is None else cuts.copy()
        cut[[0, num_out]] = True
        cut[self.out] = True
        cut[self.out + self.k] = True
        first = np.flatnonzero(cut[:-1])
        size = np.diff(np.append(first, num_out))
        lo = np.searchsorted(first, self.out)
        hi = np.searchsorted(first, self.out + self.k)
        block = np.repeat(np.arange(self.num_blocks), hi - lo)
        interval = expand_runs(lo, hi - lo)
        pair = np.lexsort((block, interval))
        return first, size, interval[pair], block[pair]

    def owners(self) -> np.ndarray:
        """Per output, the tile holding its largest segment (the first in plan order on ties)."""
        first, size, interval, block = self.output_pairs()
        ends = np.concatenate(([0], np.cumsum(self.template_counts)))
        largest = np.maximum.reduceat(self.template_counts, self.tmpl) if self.num_blocks else self.tmpl
        key = np.lexsort((block, -largest[block], interval))  # per interval: largest first, then plan order
        best = np.ones(key.size, bool)
        best[1:] = interval[key][1:] != interval[key][:-1]
        chosen = np.empty(first.size, np.int64)
        chosen[interval[key][best]] = self.tile[block[key][best]]
        return np.repeat(chosen, size)

    def counts_at(self, segments: np.ndarray) -> np.ndarray:
        """Elements of the given segments (without listing every segment's count)."""
        segments = np.asarray(segments, np.int64)
        b = np.searchsorted(self.block_start, segments, side="right") - 1
        c = (segments - self.block_start[b]) % self.m[b]
        return self.template_counts[self.tmpl[b] + c]

    def first_positions(self) -> np.ndarray:
        """The view's position of every segment's first element."""
        return self.geometry.positions(self.seg_out, self.part_r0[self.part_first[self.seg_template]])

    def segment_runs(self, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The elements of the given segments (in order) as progressions of the view's positions,
        one per part: (index in `segments` of each, first position, elements, step C)."""
        segments = np.asarray(segments, np.int64)
        t = self.seg_template[segments]
        first, count = self.part_first[t], np.diff(self.part_first)[t]
        i = np.repeat(np.arange(segments.size), count)
        part = expand_runs(first, count)
        g = self.geometry
        return i, g.positions(self.seg_out[segments[i]], self.part_r0[part]), self.part_n[part], np.full(i.size, g.C)


def plan_segments(g: Geometry, tiles: TileMap | None = None, *, workers: int | None = None,
                  split_parts: bool = False, num_tiles: int | None = None) -> SegmentPlan:
    """The segments of the [A, R, C] view `g` whose positions live on `tiles` (the view's tile map
    unless given).

    `workers`: split every segment into pieces of at most a worker's share of its tile's elements
    (rounded up to the vector grain), in order. `split_parts`: make each part a segment of its own,
    so that every segment is one contiguous range of the reduced axes (ops that use an element's
    index along the axis need it).

    A plan depends on nothing but the shape [A, R, C] and the tile map, so the repeated layers of
    a model (the same reductions of tensors mapped alike, on one IPU or several) share one: the
    last PLAN_CACHE_SIZE plans are kept by a digest of that structure."""
    tiles = g.view.tile_map() if tiles is None else tiles
    key = (g.A, g.R, g.C, g.order, workers, split_parts, num_tiles, structure(tiles))
    return remembered(_PLANS, key, lambda: _plan_segments(g, tiles, workers, split_parts, num_tiles)).of_geometry(g)


PLAN_CACHE_SIZE = 64
_PLANS: dict = {}


def structure(tiles: TileMap) -> tuple:
    """A key for a tile map: its size and a digest of its runs."""
    return tiles.size, hashlib.blake2b(tiles.starts.tobytes() + tiles.tiles.tobytes(), digest_size=16).digest()


def remembered(cache: dict, key, make):
    """cache[key], made by make() when missing; the PLAN_CACHE_SIZE most recently used are kept."""
    found = cache.pop(key, None)
    if found is None:
        found = make()
        if len(cache) >= PLAN_CACHE_SIZE:
            cache.pop(next(iter(cache)))  # the least recently used
    cache[key] = found  # the most recently used last
    return found


def _plan_segments(g: Geometry, tiles: TileMap, workers: int | None, split_parts: bool,
                   num_tiles: int | None) -> SegmentPlan:
    num_out = g.num_out
    tile, o0, k, r0, n = _parts(tiles, g.R, g.C)
    tile, o0, k, r0, n = _align(tile, o0, k, r0, n, num_out)
    tile, o0, k, r0, n, more = _join(tile, o0, k, r0, n)
    group_first = np.flatnonzero(~more)  # the parts of one (tile, outputs), in r order
    group_size = np.diff(np.append(group_first, tile.size))
    # blocks: consecutive groups of one tile whose outputs follow on, with the same parts
    g_tile, g_out, g_k = tile[group_first], o0[group_first], k[group_first]
    follows = np.zeros(group_first.size, bool)
    follows[1:] = ((g_tile[1:] == g_tile[:-1]) & (g_out[1:] == g_out[:-1] + g_k[:-1])
                   & (group_size[1:] == group_size[:-1]))
    candidates = np.flatnonzero(follows)
    if candidates.size:  # same parts: compare them one by one
        size = group_size[candidates]
        mine = expand_runs(group_first[candidates], size)
        theirs = expand_runs(group_first[candidates - 1], size)
        differ = np.repeat(np.arange(candidates.size), size)[(r0[mine] != r0[theirs]) | (n[mine] != n[theirs])]
        follows[candidates[np.unique(differ)]] = False
    head = np.flatnonzero(~follows)
    size = group_size[head]
    part = expand_runs(group_first[head], size)
    blocks = np.arange(head.size)
    plan = SegmentPlan(g, g_tile[head], g_out[head], np.add.reduceat(g_k, head) if head.size else g_k, blocks,
                       np.ones(head.size, np.int64), np.concatenate(([0], np.cumsum(size))), r0[part], n[part])
    if split_parts:  # every part a segment of its own
        plan = SegmentPlan(g, plan.tile, plan.out, plan.k, plan.part_first[:-1], size,
                           np.arange(plan.part_r0.size + 1), plan.part_r0, plan.part_n)
    if workers is not None and plan.num_blocks:
        plan = _split_by_workers(plan, workers, num_tiles)
    return plan


def _split_by_workers(plan: SegmentPlan, workers: int, num_tiles: int | None) -> SegmentPlan:
    """Each segment in pieces of at most `share` elements of its tile (see `plan_segments`): the
    templates of a block, each cut into templates of consecutive elements."""
    n_tiles = int(plan.tile.max(initial=0)) + 1 if num_tiles is None else num_tiles
    total = plan.elements_on_tiles(n_tiles)
    share = np.maximum(GRAIN, -(-(-(-total // workers)) // GRAIN) * GRAIN)
    owner = np.repeat(np.arange(plan.num_blocks), plan.m)  # block of each template (templates in block order)
    templates = expand_runs(plan.tmpl, plan.m)
    count = plan.template_counts[templates]
    t_share = share[plan.tile[owner]]
    pieces = np.maximum(1, -(-count // t_share))
    if (pieces == 1).all():
        return plan
    # piece c of template t: its elements [c * share, ...) among all templates' parts laid end to end
    t = np.repeat(np.arange(templates.size), pieces)
    c = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    base = np.cumsum(count) - count
    lo = base[t] + c * t_share[t]
    hi = base[t] + np.minimum((c + 1) * t_share[t], count[t])
    p_index = expand_runs(plan.part_first[templates], np.diff(plan.part_first)[templates])
    p_n = plan.part_n[p_index]
    at = np.cumsum(p_n) - p_n
    first = np.searchsorted(at, lo, side="right") - 1
    spans = np.searchsorted(at, hi - 1, side="right") - first
    whose = np.repeat(np.arange(t.size), spans)
    part = expand_runs(first, spans)
    start = np.maximum(at[part], lo[whose]) - at[part]
    stop = np.minimum(at[part] + p_n[part], hi[whose]) - at[part]
    m = np.bincount(owner, weights=pieces, minlength=plan.num_blocks).astype(np.int64)
    return SegmentPlan(plan.geometry, plan.tile, plan.out, plan.k, np.cumsum(m) - m, m,
                       np.concatenate(([0], np.cumsum(spans))), plan.part_r0[p_index][part] + start, stop - start)


# ---- vertices --------------------------------------------------------------------------------
def side_by_side(plan: SegmentPlan, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For vertices over segments `begin[v] .. end[v] - 1`: whether they take their segments side
    by side, element i of segment j at i * k + j (k segments): when the segments are neighbouring
    outputs of one block in one [R, C] plane, one segment each, with elements C apart (C > 1), so
    that each row of them is a run of the view."""
    g = plan.geometry
    if g.C == 1 or not begin.size:
        return np.zeros(begin.size, bool)
    block = plan.seg_block[begin]
    first = plan.seg_out[begin]
    return ((plan.seg_block[end - 1] == block) & (plan.m[block] == 1)
            & (first // g.C == (first + end - begin - 1) // g.C))


def vertex_element_runs(plan: SegmentPlan, begin: np.ndarray, end: np.ndarray, side: bool
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The elements of each vertex's segments as runs of the view's positions: (starts, lengths,
    offsets of each vertex's runs). `side`: the vertices take their segments side by side (see
    `side_by_side`): a run per element of a segment, across the segments; else segment after
    segment, a run per part (per element when the elements are C > 1 apart)."""
    g = plan.geometry
    k = end - begin
    if side:
        t = plan.tmpl[plan.seg_block[begin]]
        count = np.diff(plan.part_first)[t]
        vertex = np.repeat(np.arange(begin.size), count)
        part = expand_runs(plan.part_first[t], count)
        rows = plan.part_n[part]
        owner = np.repeat(vertex, rows)
        starts = g.positions(plan.seg_out[begin][owner], expand_runs(plan.part_r0[part], rows))
        lengths = k[owner]
        per_vertex = np.bincount(owner, minlength=begin.size)
    else:
        segments = expand_runs(begin, k)
        i, first, count, step = plan.segment_runs(segments)
        owner = np.repeat(np.arange(begin.size), k)[i]
        if g.C > 1:  # strided parts: one run per element
            owner = np.repeat(owner, count)
            run = np.repeat(np.arange(first.size), count)
            starts = np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)) * step[run]
            lengths = np.ones(starts.size, np.int64)
        else:
            starts, lengths = first, count
        per_vertex = np.bincount(owner, minlength=begin.size)
    return starts, lengths, np.concatenate(([0], np.cumsum(per_vertex)))
