"""ipusim.ops.common: the vectorised work splits and boxes ops build their vertex tables from."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs

from ipusim import TileMap
from ipusim.ops.common import box_positions, by_distinct_rows, region_work, split_ranges


def split_reference(n, parts, grain):
    """range(n) in at most `parts` contiguous pieces of a whole number of grains, one by one."""
    if n <= 0:
        return []
    grains = -(-n // grain)
    per = -(-grains // max(1, min(parts, grains))) * grain
    return [(b, min(b + per, n)) for b in range(0, n, per)]


@settings(max_examples=80, deadline=None)
@given(hs.lists(hs.integers(0, 70), max_size=12), hs.integers(1, 8), hs.sampled_from([1, 2, 4]))
def test_split_ranges_splits_every_range_like_one_at_a_time(sizes, parts, grain):
    index, begin, end = split_ranges(sizes, parts, grain)
    want = [(i, b, e) for i, n in enumerate(sizes) for b, e in split_reference(n, parts, grain)]
    assert list(zip(index.tolist(), begin.tolist(), end.tolist())) == want


@settings(max_examples=80, deadline=None)
@given(hs.lists(hs.integers(0, 5), max_size=80), hs.integers(1, 7), hs.sampled_from([1, 4]))
def test_region_work_gives_each_tile_its_elements_split_over_the_workers(tiles, workers, grain):
    tiles = np.asarray(tiles, dtype=np.int64)
    work = region_work(TileMap.from_tiles(tiles), workers, grain)
    want = []
    for tile in sorted(set(tiles.tolist())):
        positions = np.flatnonzero(tiles == tile)
        want += [(tile, positions[b:e].tolist()) for b, e in split_reference(positions.size, workers, grain)]
    at = work.element_offsets
    got = [(int(t), work.positions[a:b].tolist()) for t, a, b in zip(work.tiles, at[:-1], at[1:])]
    assert got == want


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda shape: hs.tuples(hs.just(tuple(shape)),
                            hs.lists(hs.tuples(*(hs.tuples(hs.integers(0, s), hs.integers(0, s)) for s in shape)),
                                     max_size=5))))
def test_box_positions_are_the_flat_positions_numpy_slicing_gives(case):
    shape, boxes = case
    first = np.array([[min(a, b) for a, b in box] for box in boxes], dtype=np.int64).reshape(-1, len(shape))
    extent = np.array([[abs(a - b) for a, b in box] for box in boxes], dtype=np.int64).reshape(-1, len(shape))
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    want = [int(i) for f, e in zip(first, extent) for i in grid[tuple(slice(a, a + n) for a, n in zip(f, e))].ravel()]
    assert box_positions(first, extent, shape).tolist() == want


@settings(max_examples=40, deadline=None)
@given(hs.lists(hs.lists(hs.sampled_from([0.0, 1.0, 2.5, -3.0]), min_size=3, max_size=3), max_size=30))
def test_by_distinct_rows_computes_each_distinct_row_once(rows):
    params = np.array(rows, dtype=np.float64).reshape(-1, 3)
    calls = []

    def fn(row):
        calls.append(row)
        return int(row[0] * 100 + row[1] * 10 + row[2] * 2)
    got = by_distinct_rows(params, fn)
    assert got.tolist() == [int(a * 100 + b * 10 + c * 2) for a, b, c in params.tolist()]
    assert len(calls) == len({tuple(r) for r in params.tolist()})
