"""ipusim.ops.segments: segments planned from tile-map runs in blocks, against the definition
element by element (group the positions by tile and output, split by workers' shares)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs

import ipusim as ip
from ipusim.device.mapping import TileMap, expand_runs
from ipusim.ops.segments import GRAIN, geometry, plan_segments


def reference(tiles, out, workers=None, split_parts=False, stride=None):
    """Segments (tile, output, positions) by the definition: positions grouped by (tile, output)
    in position order; split where the positions stop being `stride` apart; split in pieces of a
    worker's share of the tile's elements."""
    n = tiles.size
    pos = np.arange(n)
    order = np.lexsort((pos, out, tiles))
    t, o = tiles[order], out[order]
    new = np.ones(n, bool)
    new[1:] = (t[1:] != t[:-1]) | (o[1:] != o[:-1])
    if split_parts:
        new[1:] |= np.diff(order) != stride
    if workers is not None and n:
        share = -(-np.bincount(t) // workers)
        share = np.maximum(GRAIN, -(-share // GRAIN) * GRAIN)
        first = np.flatnonzero(new)
        rank = pos - first[np.cumsum(new) - 1]
        new |= rank % share[t] == 0
    begins = np.append(np.flatnonzero(new), n)
    return [(int(t[a]), int(o[a]), order[a:b].tolist()) for a, b in zip(begins[:-1], begins[1:])]


@hs.composite
def reductions(draw):
    shape = tuple(draw(hs.lists(hs.integers(1, 5), min_size=1, max_size=4)))
    axes = tuple(sorted(draw(hs.sets(hs.integers(0, len(shape) - 1), min_size=1))))
    numel = int(np.prod(shape))
    kind = draw(hs.sampled_from(["runs", "random", "blocks"]))
    if kind == "random":
        tiles = np.asarray(draw(hs.lists(hs.integers(0, 3), min_size=numel, max_size=numel)))
    else:
        cuts = sorted(set(draw(hs.lists(hs.integers(1, max(numel - 1, 1)), max_size=6))) - {numel})
        lengths = np.diff([0] + cuts + [numel])
        tiles = np.repeat(np.asarray(draw(hs.lists(hs.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))),
                          lengths)
    workers = draw(hs.sampled_from([None, 1, 2, 6]))
    split = draw(hs.booleans()) and len(axes) == 1
    return shape, axes, tiles, workers, split


@settings(max_examples=300, deadline=None)
@given(reductions())
def test_a_plan_holds_the_segments_of_the_definition(case):
    shape, axes, tiles, workers, split = case
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", shape, "x")
    x.var.mapping = TileMap.from_tiles(tiles)
    kept = [d for d in range(len(shape)) if d not in axes]
    out = np.ravel_multi_index(np.indices(shape)[kept], [shape[d] for d in kept]) if kept else np.zeros(shape, int)
    stride = int(np.prod(shape[axes[0] + 1:])) if split else None
    want = reference(tiles, out.reshape(-1), workers, split, stride)
    geo = geometry(x, axes)
    plan = plan_segments(geo, workers=workers, split_parts=split, num_tiles=4)
    element_of = expand_runs(*geo.view.runs())  # x's flat element at each position of the view
    seg, first, count, step = plan.segment_runs(np.arange(plan.num_segments))
    positions = [[] for _ in range(plan.num_segments)]
    for s, f, c, st in zip(seg, first, count, step):
        positions[s] += element_of[f + st * np.arange(c)].tolist()
    got = [(int(t), int(o), p) for t, o, p in zip(plan.seg_tile, plan.seg_out, positions)]
    assert got == want
    assert plan.counts.tolist() == [len(p) for _, _, p in want]


def test_a_row_reduction_of_a_linearly_mapped_tensor_is_a_few_blocks():
    g = ip.Graph(ip.Target.test(24))
    x = g.addVariable("float32", (512, 768), "x")
    g.map_linearly(x, grain=4, min_elements_per_tile=64)  # 16,384 elements a tile: boundaries inside rows
    plan = plan_segments(geometry(x, (1,)))
    assert plan.num_segments == 512 + 16  # the rows, and 16 of the 23 tile boundaries fall inside a row
    assert plan.num_blocks <= 3 * 24


def test_a_column_reduction_of_row_pieces_is_one_block_per_tile():
    """Each tile holding a [rows, columns] box of a row-major tensor: its columns are one block
    of segments of `rows` elements, not one segment per element."""
    g = ip.Graph(ip.Target.test(16))
    x = g.addVariable("float32", (64, 96), "x")
    for i in range(16):  # 4 x 4 boxes of 16 rows by 24 columns
        r, c = divmod(i, 4)
        g.setTileMapping(x[16 * r:16 * r + 16, 24 * c:24 * c + 24], i)
    plan = plan_segments(geometry(x, (0,)))
    assert plan.num_blocks == 16 and plan.num_segments == 16 * 24 and set(plan.counts.tolist()) == {16}


def test_tensors_mapped_alike_share_one_plan_bound_to_their_own_view():
    g = ip.Graph(ip.Target.test(8))
    x, y, z = (g.addVariable("float32", (32, 48), n) for n in "xyz")
    for t in (x, y):
        g.map_linearly(t, grain=4, min_elements_per_tile=64)
    g.map_linearly(z, grain=4, min_elements_per_tile=512)
    px, py, pz = (plan_segments(geometry(t, (1,)), workers=6, num_tiles=8) for t in (x, y, z))
    assert py.geometry.view.var is y.var and px.geometry.view.var is x.var
    assert py.tile is px.tile and py.part_r0 is px.part_r0  # the structure, computed once
    assert not np.array_equal(pz.seg_tile, px.seg_tile)
