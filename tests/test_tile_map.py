"""ipusim.device.mapping: tile mappings as runs, against the same operations on a tile per element,
and the runs of views (`Tensor.runs`, `runs_at`, `tile_map`) against NumPy's own views."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ipusim as ip
from ipusim.device.mapping import TileMap, align, expand_runs, runs_of, union_length

tile_lists = hs.lists(hs.integers(-1, 3), min_size=0, max_size=40)


def dense_map(tiles):
    return TileMap.from_tiles(np.asarray(tiles, np.int64))


def random_runs(draw, size, max_runs=6):
    runs = []
    for _ in range(draw(hs.integers(0, max_runs))):
        a = draw(hs.integers(0, size))
        b = draw(hs.integers(a, size))
        runs.append((a, b - a))
    starts = np.array([r[0] for r in runs], np.int64)
    return starts, np.array([r[1] for r in runs], np.int64)


@settings(max_examples=100, deadline=None)
@given(tile_lists)
def test_a_map_is_its_runs_in_normal_form(tiles):
    m = dense_map(tiles)
    assert m.dense().tolist() == tiles
    assert (np.diff(m.tiles) != 0).all() and (m.lengths > 0).all()
    assert m == TileMap.from_lengths(np.ones(len(tiles), np.int64), tiles)
    assert m.unmapped() == tiles.count(-1) and m.mapped == (-1 not in tiles)
    assert m.counts(4).tolist() == np.bincount([t for t in tiles if t >= 0], minlength=4).tolist()


@settings(max_examples=150, deadline=None)
@given(hs.data())
def test_pieces_take_and_covers_read_the_map_element_by_element(data):
    tiles = data.draw(tile_lists.filter(len))
    m, dense = dense_map(tiles), np.asarray(tiles)
    starts, lengths = random_runs(data.draw, len(tiles))
    run, first, length, tile = m.pieces(starts, lengths)
    elements = expand_runs(starts, lengths)
    assert expand_runs(first, length).tolist() == elements.tolist()
    assert np.repeat(tile, length).tolist() == dense[elements].tolist()
    assert np.repeat(run, length).tolist() == np.repeat(np.arange(starts.size), lengths).tolist()
    assert (np.diff(tile)[np.diff(run) == 0] != 0).all()  # a run is cut only where the tile changes
    assert m.take(starts, lengths).dense().tolist() == dense[elements].tolist()
    want = np.array([len(set(dense[s:s + n].tolist()) | {t}) == 1 or n == 0 for s, n, t in
                     zip(starts, lengths, np.resize(np.arange(-1, 3), starts.size))], bool)
    assert m.covers(starts, lengths, np.resize(np.arange(-1, 3), starts.size)).tolist() == want.tolist()


@settings(max_examples=150, deadline=None)
@given(hs.data())
def test_assign_sets_disjoint_runs_and_assign_elements_any_elements(data):
    tiles = data.draw(tile_lists.filter(len))
    m, dense = dense_map(tiles), np.asarray(tiles)
    cuts = sorted(set(data.draw(hs.lists(hs.integers(0, len(tiles)), max_size=6))) | {0, len(tiles)})
    pick = data.draw(hs.lists(hs.booleans(), min_size=len(cuts) - 1, max_size=len(cuts) - 1))
    starts = np.array([a for a, p in zip(cuts, pick) if p], np.int64)
    lengths = np.array([b - a for a, b, p in zip(cuts, cuts[1:], pick) if p], np.int64)
    new = np.arange(starts.size) % 4
    want = dense.copy()
    for s, n, t in zip(starts, lengths, new):
        want[s:s + n] = t
    assert m.assign(starts, lengths, new).dense().tolist() == want.tolist()
    elements = np.array(data.draw(hs.lists(hs.integers(0, len(tiles) - 1), max_size=20)), np.int64)
    values = np.arange(elements.size) % 3
    want = dense.copy()
    want[elements] = values
    assert m.assign_elements(elements, values).dense().tolist() == want.tolist()


def test_assigning_overlapping_runs_is_an_error():
    with pytest.raises(ValueError, match="overlap"):
        TileMap(10).assign([0, 3], [5, 5], [1, 2])


@settings(max_examples=100, deadline=None)
@given(hs.data())
def test_align_cuts_two_maps_where_either_changes(data):
    a = data.draw(tile_lists.filter(len))
    b = data.draw(hs.lists(hs.integers(0, 3), min_size=len(a), max_size=len(a)))
    start, length, ta, tb = align(dense_map(a), dense_map(b))
    assert np.repeat(ta, length).tolist() == a and np.repeat(tb, length).tolist() == b
    assert start.tolist() == (np.cumsum(length) - length).tolist()


@settings(max_examples=100, deadline=None)
@given(hs.data())
def test_union_length_counts_distinct_elements_per_group(data):
    tiles = np.asarray(data.draw(hs.lists(hs.integers(0, 2), min_size=1, max_size=30)))
    m = dense_map(tiles)
    starts, lengths = random_runs(data.draw, tiles.size, 8)
    run, first, length, tile = m.pieces(starts, lengths)
    got = union_length(first, length, tile, 3)
    covered = np.zeros(tiles.size, bool)
    covered[expand_runs(starts, lengths)] = True
    assert got.tolist() == np.bincount(tiles[covered], minlength=3).tolist()


def test_runs_of_cuts_where_elements_stop_counting_up():
    starts, lengths = runs_of(np.array([3, 4, 5, 9, 2, 3]))
    assert starts.tolist() == [3, 9, 2] and lengths.tolist() == [3, 1, 2]


# ---- views ------------------------------------------------------------------------------------
@hs.composite
def views(draw):
    """A variable, a view of it made by NumPy-style slicing, transposing, broadcasting and
    reshaping, and the same view of an arange (what the view's flat positions name)."""
    shape = tuple(draw(hs.lists(hs.integers(1, 4), min_size=1, max_size=3)))
    g = ip.Graph(ip.Target.test(num_tiles=8))
    t = g.addVariable("float32", shape, "x")
    ref = np.arange(int(np.prod(shape))).reshape(shape)
    for _ in range(draw(hs.integers(0, 4))):
        kind = draw(hs.sampled_from(["slice", "transpose", "broadcast", "reshape", "gather"]))
        if kind == "slice" and ref.ndim:
            d = draw(hs.integers(0, ref.ndim - 1))
            a = draw(hs.integers(0, ref.shape[d]))
            step = draw(hs.integers(1, 2))
            key = (slice(None),) * d + (slice(a, None, step),)
            t, ref = t[key], ref[key]
        elif kind == "transpose":
            axes = draw(hs.permutations(range(ref.ndim)))
            t, ref = t.transpose(tuple(axes)), ref.transpose(axes)
        elif kind == "broadcast":
            shape = (draw(hs.integers(1, 3)),) + ref.shape
            t, ref = t.broadcast(shape), np.broadcast_to(ref, shape)
        elif kind == "reshape" and ref.size:
            a = draw(hs.sampled_from([d for d in range(1, ref.size + 1) if ref.size % d == 0]))
            shape = draw(hs.sampled_from([(ref.size,), (a, ref.size // a), (ref.size // a, 1, a)]))
            t, ref = t.reshape(shape), ref.reshape(shape)
        elif kind == "gather" and ref.size:
            idx = np.array(draw(hs.lists(hs.integers(0, ref.shape[0] - 1), min_size=1, max_size=4)))
            t, ref = t[idx], ref[idx]
    return g, t, ref


@settings(max_examples=150, deadline=None)
@given(views(), hs.data())
def test_a_views_runs_and_tile_map_are_its_elements_and_their_tiles(case, data):
    g, t, ref = case
    numel = t.var.numel
    tiles = np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=numel, max_size=numel)))
    t.var.mapping = TileMap.from_tiles(tiles)
    assert t.shape == ref.shape
    assert expand_runs(*t.runs()).tolist() == ref.ravel().tolist()
    assert t.tile_map().dense().tolist() == tiles[ref.ravel()].tolist()
    assert t.tiles().tolist() == tiles[ref].tolist()
    starts, lengths = random_runs(data.draw, ref.size)
    k, first, length = t.runs_at(starts, lengths)
    positions = expand_runs(starts, lengths)
    assert expand_runs(first, length).tolist() == ref.ravel()[positions].tolist()
    assert np.repeat(k, length).tolist() == np.repeat(np.arange(starts.size), lengths).tolist()


@settings(max_examples=80, deadline=None)
@given(views(), hs.data())
def test_mapping_positions_of_a_view_maps_the_elements_they_name(case, data):
    g, t, ref = case
    starts, lengths = random_runs(data.draw, ref.size)
    keep = np.ones(starts.size, bool)  # disjoint position runs, so each position gets one tile
    taken = np.zeros(ref.size, bool)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        keep[i] = not taken[s:s + n].any()
        taken[s:s + n] |= keep[i]
    starts, lengths = starts[keep], lengths[keep]
    tiles = np.arange(starts.size) % 8
    want = np.full(t.var.numel, -1)
    flat = ref.ravel()
    for s, n, tile in zip(starts, lengths, tiles):
        want[flat[s:s + n]] = tile  # later positions win where the view repeats an element
    g.map_positions(t, starts, lengths, tiles)
    assert t.var.mapping.dense().tolist() == want.tolist()


def test_mapping_a_tile_that_does_not_exist_names_it():
    g = ip.Graph(ip.Target.test(num_tiles=4))
    t = g.addVariable("float32", (8,), "x")
    with pytest.raises(ValueError, match="tile 4 does not exist"):
        g.map_positions(t, [0], [8], [4])
    with pytest.raises(ValueError, match="must be a TileMap of"):
        t.var.mapping = TileMap(7)


def exchange_reference(src, dst, target):
    """The exchange cost element by element: each source element sent once by its tile however
    many destinations receive it, each destination element received unless already on its tile."""
    s, d = src.tiles().reshape(-1), dst.tiles().reshape(-1)
    moved = s != d
    elements = src.index.reshape(-1)
    sent = np.zeros(target.num_tiles, np.int64)
    for tile in range(target.num_tiles):
        sent[tile] = np.unique(elements[moved & (s == tile)]).size
    recv = np.bincount(d[moved], minlength=target.num_tiles)
    local = np.bincount(d[~moved], minlength=target.num_tiles)
    size = src.dtype.itemsize
    cycles = -(-int(max(sent.max(), recv.max())) * size // target.exchange_bytes_per_cycle)
    cycles += -(-int(local.max()) * size // target.local_copy_bytes_per_cycle)
    return cycles, int(moved.sum()) * size


@settings(max_examples=150, deadline=None)
@given(views(), hs.data())
def test_exchange_cycles_are_the_element_by_element_count(case, data):
    from ipusim.device.cost import exchange_cycles
    g, t, ref = case
    target = g.target
    numel = t.var.numel
    t.var.mapping = TileMap.from_tiles(np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=numel,
                                                                     max_size=numel))))
    dst = g.addVariable("float32", ref.shape, "dst")
    dst.var.mapping = TileMap.from_tiles(np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=ref.size,
                                                                       max_size=ref.size))))
    assert exchange_cycles(t, dst, target) == exchange_reference(t, dst, target)
    assert t.lives_on(dst.var.mapping) == bool((t.tiles().reshape(-1) == dst.tiles().reshape(-1)).all())


@settings(max_examples=150, deadline=None)
@given(hs.data())
def test_blocks_named_many_times_cost_and_locate_like_their_elements(data):
    """A view of blocks of runs, blocks named several times (operand blocks sent to many tiles):
    its elements, the exchange that gathers it and whether it already lives on given tiles are
    those of the same elements listed one by one, whether each block lands on one tile or not."""
    from ipusim.device.cost import exchange_cycles
    g = ip.Graph(ip.Target.test(num_tiles=8))
    n = data.draw(hs.integers(1, 30))
    x = g.addVariable("float32", (n,), "x")
    x.var.mapping = TileMap.from_tiles(np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=n, max_size=n))))
    blocks = data.draw(hs.lists(hs.lists(hs.tuples(hs.integers(0, n - 1), hs.integers(1, 4)), min_size=1, max_size=3),
                                min_size=1, max_size=4))
    starts = [min(a, n - 1) for b in blocks for a, _ in b]
    lengths = [min(m, n - a) for b in blocks for a, m in b]
    offsets = np.cumsum([0] + [len(b) for b in blocks])
    sequence = data.draw(hs.lists(hs.integers(0, len(blocks) - 1), min_size=1, max_size=6))
    view = ip.Tensor.of_blocks(x.var, starts, lengths, offsets, sequence)
    elements = np.concatenate([expand_runs(starts[offsets[b]:offsets[b + 1]], lengths[offsets[b]:offsets[b + 1]])
                               for b in sequence])
    assert view.index.tolist() == elements.tolist()
    sizes = [int(sum(lengths[offsets[b]:offsets[b + 1]])) for b in sequence]
    whole = data.draw(hs.booleans())
    if whole:  # each block named lands on one tile
        tiles = np.repeat(np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=len(sizes), max_size=len(sizes)))),
                          sizes)
    else:
        tiles = np.asarray(data.draw(hs.lists(hs.integers(0, 7), min_size=elements.size, max_size=elements.size)))
    dst = g.addVariable("float32", (elements.size,), "dst")
    dst.var.mapping = TileMap.from_tiles(tiles)
    assert exchange_cycles(view, dst, g.target) == exchange_reference(view, dst, g.target)
    assert view.lives_on(dst.var.mapping) == bool((x.var.mapping.dense()[elements] == tiles).all())

