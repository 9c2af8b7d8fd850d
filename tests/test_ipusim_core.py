"""ipusim core: targets, mapping and views, vertices and locality, programs, engine, cycles, memory."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ipusim as ip
from ipusim.device.cost import exchange_cycles
from ipusim.device.kernels import JIT, ld, st
from ipusim.ops import elementwise as ew
from ipusim.device.vertex import tile_makespans

MODES = ["strict", "fast"]


# ---- targets -------------------------------------------------------------------------------
def test_presets_hold_the_published_numbers():
    assert (ip.GC200.num_tiles, ip.GC200.bytes_per_tile, ip.GC200.clock_hz) == (1472, 624 * 1024, 1.33e9)
    assert ip.GC200.bytes_per_ipu == 1472 * 624 * 1024  # ~900 MB
    assert (ip.GC2.num_tiles, ip.GC2.bytes_per_tile, ip.GC2.clock_hz) == (1216, 256 * 1024, 1.6e9)
    assert ip.BOW.clock_hz == 1.85e9 and ip.BOW.num_tiles == 1472
    assert ip.GC200.fp16_flops_per_cycle == 128 and ip.GC200.fp32_flops_per_cycle == 32
    # 32 FLOPs/cycle/tile * 1472 tiles * 1.33 GHz is the published 62.5 TFLOPS fp32 peak
    assert ip.GC200.fp32_flops_per_cycle * 1472 * 1.33e9 == pytest.approx(62.6e12, rel=0.01)
    # 4 B/cycle/tile exchange is about 8 TB/s per chip
    assert 4 * 1472 * 1.33e9 == pytest.approx(7.8e12, rel=0.02)
    assert ip.get_target("Mk1") is ip.GC2
    with pytest.raises(ValueError, match="unknown target"):
        ip.get_target("Mk9")


def test_target_formulas():
    t = ip.GC200
    for n in (1, 2, 4, 8, 16):
        assert t.global_sync_cycles(n) == math.ceil(15e-9 * 1.33e9 * (1 + n // 4) * 2)
    assert t.inter_ipu_cycles(32e9 * 0.85) == math.ceil(1.33e9)  # one second of one link
    assert t.host_cycles(0) == 0
    assert t.host_cycles(64e9) == t.host_copy_latency_cycles + math.ceil(1.33e9)
    assert t.thread_cycles(10) == 60
    assert t.flop_cycles(32 * 100, "float32") == 600 and t.flop_cycles(128 * 100, "float16") == 600
    small = ip.Target.test(4, 1024)
    assert small.num_tiles == 4 and small.bytes_per_tile == 1024 and small.clock_hz == t.clock_hz


# ---- tensors, mapping, views ---------------------------------------------------------------
def test_views_keep_the_mapping():
    g = ip.Graph(ip.Target.test(8))
    t = g.addVariable("float32", (4, 6), "t")
    g.map_by_dimension(t, 0, tiles=range(4))
    assert (t.tiles() == np.arange(4)[:, None]).all()
    assert (t[1:3].tiles() == [[1] * 6, [2] * 6]).all()
    assert (t.transpose().tiles() == np.arange(4)[None, :]).all()
    assert (t.reshape(2, 12).tiles()[1] == [2] * 6 + [3] * 6).all()
    assert (t[2].broadcast((3, 6)).tiles() == 2).all()
    assert t.slice(1, 3, dim=1).shape == (4, 2)
    assert g.getTileMapping(t)[3] == [(18, 24)]


@hs.composite
def _view_chains(draw):
    """A shape and a chain of view operations on it (basic and advanced indexing, reshape,
    transpose, broadcast, expand_dims), each valid for the shape it applies to."""
    shape = tuple(draw(hs.lists(hs.integers(1, 5), min_size=1, max_size=4)))
    return shape, draw(hs.lists(hs.integers(0, 2 ** 31), min_size=1, max_size=4))


def _apply(step: int, view, ref: np.ndarray, rng: np.random.Generator):
    """One view operation chosen by `step`, applied to the ipusim view and to a NumPy array of
    the same element indices."""
    kind = step % 6
    if kind == 0 and ref.ndim:  # basic indexing: an integer or a slice (any step) per axis
        key = []
        for size in ref.shape[:rng.integers(1, ref.ndim + 1)]:
            if size and rng.random() < 0.3:
                key.append(int(rng.integers(-size, size)))
            else:
                b, e = sorted(rng.integers(-size - 1, size + 2, 2).tolist())
                key.append(slice(b, e, int(rng.choice([1, 1, 2, -1, 3]))))
        return view[tuple(key)], ref[tuple(key)]
    if kind == 1 and ref.size:  # positions: flat, or along one axis (with Ellipsis and None)
        if ref.ndim > 1 and rng.random() < 0.4:
            d = int(rng.integers(0, ref.ndim))
            key = (slice(None),) * d + (rng.integers(-ref.shape[d], ref.shape[d], 3),)
            key = key + (Ellipsis,) if rng.random() < 0.5 else (None,) + key
            return view[key], ref[key]
        positions = rng.integers(0, ref.size, int(rng.integers(1, ref.size + 1)))
        if rng.random() < 0.5:
            b = int(rng.integers(0, ref.size))
            positions = np.arange(b, int(rng.integers(b + 1, ref.size + 1)))
        return view.flatten()[positions], ref.reshape(-1)[positions]
    if kind == 2:
        shape = (-1,) + ((ref.shape[-1],) if ref.ndim and ref.shape[-1] else ())
        return view.reshape(shape), ref.reshape(shape)
    if kind == 3:
        axes = tuple(rng.permutation(ref.ndim).tolist())
        return view.transpose(axes), ref.transpose(axes)
    if kind == 4:
        return view.broadcast((2,) + ref.shape), np.broadcast_to(ref, (2,) + ref.shape)
    axis = int(rng.integers(-ref.ndim - 1, ref.ndim + 1))
    return view.expand_dims(axis), np.expand_dims(ref, axis)


@settings(max_examples=300, deadline=None)
@given(_view_chains())
def test_property_views_index_like_numpy(case):
    """Every chain of views names the elements NumPy's indexing of the same array names; every
    view NumPy makes without a copy is strided (its strides NumPy's) and holds no index array,
    and applied to a per-element array it reads what NumPy's view reads."""
    shape, steps = case
    g = ip.Graph(ip.Target.test(4))
    view = g.addVariable("float32", shape, "t")
    base = np.arange(view.numel)
    ref = base.reshape(shape)
    rng = np.random.default_rng(steps[0])
    for step in steps:
        view, ref = _apply(step, view, ref, rng)
        assert view.shape == ref.shape
        assert np.array_equal(view.index, ref)
        assert np.array_equal(view.on(base), ref)
        assert np.array_equal(view.elements_at(np.arange(ref.size)), ref.reshape(-1))
        if ref.size and np.shares_memory(ref, base):
            assert view.strided
            assert all(s * base.itemsize == r for n, s, r in zip(ref.shape, view.strides, ref.strides) if n > 1)
        flat = ref.reshape(-1)
        is_run = flat.size > 0 and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size))
        assert (view.span is not None) == (is_run or flat.size == 0)
        if is_run:
            assert view.span == flat[0] and view.strided
        assert view.is_whole == (is_run and flat[0] == 0 and flat.size == view.var.numel)
        unique = np.unique(flat).size == flat.size
        assert view.distinct == unique if view.strided else (unique or not view.distinct)


def test_runs_keep_no_index_and_map_by_slices():
    g = ip.Graph(ip.Target.test(8))
    t = g.addVariable("float32", (64, 1000), "t")
    g.map_linearly(t)
    rows = t[10:20]
    assert rows.span == 10_000 and rows.strided
    assert rows.reshape(-1)[500:1500].span == 10_500
    column = t[:, 3]
    assert column.strided and column.span is None and (column.offset, column.strides) == (3, (1000,))
    assert (column.tiles() == t.tiles()[:, 3]).all()
    assert t.T[::2].strided and t.T[::2].strides == (2, 1000)
    assert (rows.tiles() == t.tiles()[10:20]).all()
    g.setTileMapping(rows, 7)
    assert (t.tiles()[10:20] == 7).all() and (t.tiles()[20] != 7).any()
    with pytest.raises(ValueError, match=r"cannot reshape a view of shape \(10, 1000\)"):
        rows.reshape(3, -1)
    with pytest.raises(IndexError, match="out of bounds"):
        t[64]


def test_mapping_helpers():
    g = ip.Graph(ip.Target.test(4))
    t = g.addVariable("float16", (10,), "t")
    g.map_linearly(t, grain=4)
    assert t.tiles().tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    g.setTileMappingIntervals(t, [(3, 0, 2)])
    assert t.tiles()[:3].tolist() == [3, 3, 0]
    with pytest.raises(ValueError, match="tile 4 does not exist"):
        g.setTileMapping(t, 4)
    with pytest.raises(ValueError, match="outside tensor"):
        g.setTileMappingIntervals(t, [(0, 5, 11)])
    with pytest.raises(TypeError, match="unsupported dtype"):
        g.addVariable("complex64", (2,))


def test_unmapped_tensor_is_a_compile_error():
    g = ip.Graph(ip.Target.test(4))
    t = g.addVariable("float32", (8,), "loose")
    g.setTileMapping(t[:4], 0)
    with pytest.raises(ip.MappingError, match="'loose'.*4 of 8 elements"):
        ip.Engine(g, ip.Sequence()).load()


# ---- vertices and locality -----------------------------------------------------------------
def test_vertex_reading_another_tile_is_rejected_at_build_time():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (8,), "x")
    y = g.addVariable("float32", (8,), "y")
    g.map_linearly(x)
    g.setTileMapping(y, 0)
    cs = g.addComputeSet("cs")
    with pytest.raises(ip.LocalityError, match=r"tensor 'x'.*lives on tile 1.*runs on tile 0"):
        g.addVertex(cs, ew.UNARY_VERTEX, 0, {"x": x, "out": y}, (2, 1.0, 0.0))
    with pytest.raises(ValueError, match="not connected"):
        g.addVertex(cs, ew.UNARY_VERTEX, 0, {"x": x[:2]}, (2, 1.0, 0.0))
    with pytest.raises(ValueError, match="takes 3 parameters"):
        g.addVertex(cs, ew.UNARY_VERTEX, 0, {"x": x[:2], "out": y[:2]}, (2,))


def test_strict_mode_computes_from_tile_memory_only():
    """A vertex wired to its tile's copy of the data sees only what the exchange put there."""
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (4,), "x")
    g.setTileMapping(x, 1)
    local = g.addVariable("float32", (4,), "local")
    g.setTileMapping(local, 0)
    out = g.addVariable("float32", (4,), "out")
    g.setTileMapping(out, 0)
    cs = g.addComputeSet("neg")
    g.addVertex(cs, ew.UNARY_VERTEX, 0, {"x": local, "out": out}, (0, 1.0, 0.0))
    with_copy = ip.Sequence(ip.Copy(x, local), ip.Execute(cs))
    without_copy = ip.Sequence(ip.Execute(cs))
    for mode in MODES:
        e = ip.Engine(g, [with_copy, without_copy], mode=mode).load()
        e.writeTensor(x, [1, 2, 3, 4])
        e.run(1)
        assert e.readTensor(out).tolist() == [0, 0, 0, 0]  # nothing was exchanged yet
        e.run(0)
        assert e.readTensor(out).tolist() == [-1, -2, -3, -4]


def test_strict_layout_gives_each_tile_its_own_segment():
    from ipusim.device.storage import IpuMemory
    g = ip.Graph(ip.Target.test(4))
    a = g.addVariable("float32", (8,), "a")
    b = g.addVariable("float32", (8,), "b")
    g.map_linearly(a, grain=2)
    g.map_linearly(b, grain=4)
    mem = IpuMemory(g, "strict")
    seg = mem.tile_segments["float32"]
    for t in (a, b):
        addr = mem.addresses(t)
        tiles = t.tiles()
        assert ((addr >= seg[tiles]) & (addr < seg[tiles + 1])).all()


@pytest.mark.parametrize("layout", ["strict", "fast"])
def test_strided_views_read_and_write_in_place(layout):
    """In the fast layout a strided view reads as a NumPy view of its storage, not a copy; in
    both layouts strided reads, writes and copies touch the elements NumPy's view names."""
    from ipusim.device.storage import IpuMemory
    g = ip.Graph(ip.Target.test(4))
    a = g.addVariable("float32", (6, 8), "a")
    b = g.addVariable("float32", (4, 6), "b")
    g.map_linearly(a)
    g.map_linearly(b)
    mem = IpuMemory(g, layout)
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    mem.write(a, values)
    view = a.T[::2, 1:]
    got = mem.read(view)
    assert np.array_equal(got, values.T[::2, 1:])
    assert np.shares_memory(got, mem.arena(np.float32)) == (layout == "fast")
    mem.write(view, -got)
    expected = values.copy()
    expected.T[::2, 1:] *= -1
    assert np.array_equal(mem.read(a), expected)
    mem.write(b, 0)
    mem.write(b.T[::-1], np.arange(24, dtype=np.float32).reshape(6, 4))
    assert np.array_equal(mem.read(b), np.arange(24, dtype=np.float32).reshape(6, 4)[::-1].T)
    row = a[2]
    assert np.array_equal(mem.read(row.broadcast((3, 8))), np.broadcast_to(expected[2], (3, 8)))


# ---- programs and engine -------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_engine_reruns_and_streams(mode):
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (2, 3), "x")
    acc = g.addVariable("float32", (2, 3), "acc")
    g.map_linearly(x)
    g.map_linearly(acc)
    inp = g.addHostToDeviceFIFO("in", "float32", (2, 3))
    outp = g.addDeviceToHostFIFO("out", "float32", (2, 3))
    prog = ip.Sequence(ip.StreamCopy(inp, x))
    ew.binary(g, "add", acc, x, prog, out=acc)
    prog.add(ip.StreamCopy(acc, outp))
    e = ip.Engine(g, prog, mode=mode).load()
    data = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    e.connectStream("in", data)
    results = []
    e.connectStream("out", results.append)
    c1 = e.run()
    c2 = e.run()
    e.run()
    assert c1 == c2 > 0 and e.total_cycles == 3 * c1
    np.testing.assert_array_equal(results[0], data[0])
    np.testing.assert_array_equal(results[1], data[0] + data[1])
    np.testing.assert_array_equal(results[2], 2 * data[0] + data[1])  # array streams wrap around
    assert e.last_run.per_ipu[0].host > 0


def test_stream_errors():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (3,), "x")
    g.map_linearly(x)
    s = g.addHostToDeviceFIFO("in", "float32", (3,))
    e = ip.Engine(g, ip.Sequence(ip.StreamCopy(s, x))).load()
    with pytest.raises(RuntimeError, match="stream 'in' on IPU 0 is not connected"):
        e.run()
    with pytest.raises(TypeError, match="carries float32"):
        e.connectStream("in", np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"shape \(3,\) or \(N"):
        e.connectStream("in", np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="cannot be used as destination"):
        ip.StreamCopy(x, s)
    with pytest.raises(KeyError, match="no stream named 'nope'"):
        e.connectStream("nope", np.zeros(3, np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_repeat_and_if(mode):
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (4,), "x")
    flag = g.addVariable("bool", (1,), "flag")
    g.map_linearly(x)
    g.setTileMapping(flag, 0)
    double = ip.Sequence()
    ew.binary(g, "add", x, x, double, out=x)
    negate = ip.Sequence()
    ew.unary(g, "neg", x, negate, out=x)
    prog = ip.Sequence(ip.Repeat(3, double), ip.If(flag, negate))
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(x, [1, 2, 3, 4])
    e.writeTensor(flag, [False])
    skipped = e.run()
    assert e.readTensor(x).tolist() == [8, 16, 24, 32]
    e.writeTensor(flag, [True])
    taken = e.run()
    assert e.readTensor(x).tolist() == [-64, -128, -192, -256]
    assert taken > skipped  # the engine charges the branch it ran
    with pytest.raises(ValueError, match="non-negative integer"):
        ip.Repeat(-1, double)


@pytest.mark.parametrize("mode", MODES)
def test_inter_ipu_copy_moves_data_between_separate_memories(mode):
    dev = ip.Device(ip.Target.test(4), 2)
    a = dev[0].addVariable("float32", (6,), "a")
    b = dev[1].addVariable("float32", (6,), "b")
    dev[0].map_linearly(a)
    dev[1].map_linearly(b)
    with pytest.raises(ValueError, match="crosses IPUs: use InterIpuCopy"):
        ip.Copy(a, b)
    prog = ip.Sequence(ip.InterIpuCopy(a, b))
    e = ip.Engine(dev, prog, mode=mode).load()
    e.writeTensor(a, np.arange(6))
    assert e.readTensor(b).tolist() == [0] * 6
    cycles = e.run()
    assert e.readTensor(b).tolist() == list(range(6))
    t = dev.target
    assert cycles == t.inter_ipu_cycles(24) + t.global_sync_cycles(2)
    assert e.last_run.per_ipu[1].inter_ipu == t.inter_ipu_cycles(24)


@pytest.mark.parametrize("mode", MODES)
def test_transposing_copies_of_large_views(mode):
    """A copy between views that run along different axes (fast mode: in blocks) moves every
    element to its place: a transposed matrix and a 3-d view with two axes swapped, whose
    extents are not multiples of a block."""
    g = ip.Graph(ip.Target.test(128))
    w = g.addVariable("float32", (300, 700), "w")
    x = g.addVariable("float32", (3, 400, 290), "x")
    wt = g.addVariable("float32", (700, 300), "wt")
    xt = g.addVariable("float32", (290, 400, 3), "xt")
    for t in (w, x, wt, xt):
        g.map_linearly(t)
    e = ip.Engine(g, ip.Sequence(ip.Copy(w.transpose(), wt), ip.Copy(x.transpose((2, 1, 0)), xt)), mode=mode).load()
    values_w = np.arange(w.numel, dtype=np.float32).reshape(w.shape)
    values_x = -np.arange(x.numel, dtype=np.float32).reshape(x.shape)
    e.writeTensor(w, values_w)
    e.writeTensor(x, values_x)
    e.run()
    assert np.array_equal(e.readTensor(wt), values_w.T)
    assert np.array_equal(e.readTensor(xt), values_x.transpose(2, 1, 0))


def test_parallel_requires_disjoint_ipus():
    dev = ip.Device(ip.Target.test(4), 2)
    x = dev[0].addVariable("float32", (4,), "x")
    dev[0].map_linearly(x)
    p1, p2 = ip.Sequence(), ip.Sequence()
    ew.unary(dev[0], "neg", x, p1)
    ew.unary(dev[0], "neg", x, p2)
    with pytest.raises(ValueError, match="share IPUs"):
        ip.Parallel(p1, p2)


@pytest.mark.parametrize("threads", [1, 2])
def test_ipu_links_are_full_duplex(threads):
    """Copies in opposite directions between two IPUs overlap in a Parallel; two copies leaving one
    IPU, or a copy reading what another writes, do not run in parallel."""
    dev = ip.Device(ip.Target.test(4), 2)
    t = dev.target
    a = [dev[i].addVariable("float32", (400,), f"a{i}") for i in range(2)]
    b = [dev[i].addVariable("float32", (400,), f"b{i}") for i in range(2)]
    for i in range(2):
        dev[i].map_linearly(a[i])
        dev[i].map_linearly(b[i])
    both = ip.Parallel(ip.InterIpuCopy(a[0], b[1]), ip.InterIpuCopy(a[1][:100], b[0][:100]))
    e = ip.Engine(dev, [both], threads=threads).load()
    e.writeTensor(a[0], np.arange(400.0))
    e.writeTensor(a[1], -np.arange(400.0))
    one = t.inter_ipu_cycles(1600)
    assert e.run() == one + t.global_sync_cycles(2)
    assert {i: c.inter_ipu for i, c in e.last_run.per_ipu.items()} == {0: one, 1: one}
    assert e.cost(both).inter_ipu_bytes == 2000
    np.testing.assert_array_equal(e.readTensor(b[1]), np.arange(400.0))
    np.testing.assert_array_equal(e.readTensor(b[0])[:100], -np.arange(100.0))
    e.close()
    with pytest.raises(ValueError, match="two inter-IPU copies from IPU 0"):
        ip.Parallel(ip.InterIpuCopy(a[0], b[1]), ip.InterIpuCopy(b[0], a[1]))
    with pytest.raises(ValueError, match="another copy of the same Parallel writes"):
        ip.Parallel(ip.InterIpuCopy(a[0], b[1]), ip.InterIpuCopy(b[1], a[0]))


@pytest.mark.parametrize("threads", [1, 2])
def test_parallel_programs_take_the_slowest_ipu(threads):
    dev = ip.Device(ip.Target.test(4), 2)
    small = dev[0].addVariable("float32", (8,), "small")
    big = dev[1].addVariable("float32", (4000,), "big")
    dev[0].map_linearly(small)
    dev[1].map_linearly(big)
    p0, p1 = ip.Sequence(), ip.Sequence()
    ew.unary(dev[0], "tanh", small, p0)
    ew.unary(dev[1], "tanh", big, p1)
    e = ip.Engine(dev, [ip.Parallel(p0, p1)], threads=threads).load()
    e.writeTensor(big, np.linspace(-1, 1, 4000))
    total = e.run()
    busy = {i: c.total for i, c in e.last_run.per_ipu.items()}
    assert total == max(busy.values()) == busy[1] > busy[0]
    e.close()


# ---- cycles --------------------------------------------------------------------------------
def test_exchange_cycles_follow_the_busiest_tile():
    t = ip.Target.test(4)
    g = ip.Graph(t)
    src = g.addVariable("float32", (12,), "src")
    dst = g.addVariable("float32", (12,), "dst")
    g.setTileMapping(src, 0)                     # tile 0 sends 12 elements...
    g.setTileMappingIntervals(dst, [(1, 0, 8), (2, 8, 10), (0, 10, 12)])  # ...2 of them stay local
    cycles, moved = exchange_cycles(src, dst, t)
    assert moved == 10 * 4
    assert cycles == math.ceil(40 / t.exchange_bytes_per_cycle) + math.ceil(8 / t.local_copy_bytes_per_cycle)
    e = ip.Engine(g, ip.Sequence(ip.Copy(src, dst))).load()
    assert e.run() == cycles + t.sync_cycles


def test_exchange_broadcast_sends_each_element_once():
    t = ip.Target.test(16)
    g = ip.Graph(t)
    src = g.addVariable("float32", (4,), "src")
    g.setTileMapping(src, 0)
    dst = g.addVariable("float32", (15, 4), "dst")
    g.map_by_dimension(dst, 0, tiles=range(1, 16))   # 15 tiles each receive all 4 elements
    cycles, moved = exchange_cycles(src.broadcast((15, 4)), dst, t)
    assert moved == 15 * 16
    assert cycles == math.ceil(16 / t.exchange_bytes_per_cycle)  # tile 0 sends 16 bytes once


def test_compute_set_takes_its_slowest_tile_over_six_workers():
    def makespan(cycles):
        return int(tile_makespans(np.zeros(len(cycles)), cycles, 6, 1)[0])
    assert makespan([10] * 6) == 10
    assert makespan([10] * 7) == 20
    assert makespan([9, 5, 4, 3, 3, 3, 2]) == 9
    assert makespan([]) == 0
    t = ip.Target.test(4)
    g = ip.Graph(t)
    x = g.addVariable("float32", (64,), "x")
    g.map_linearly(x, grain=4)  # 16 elements per tile, 4 vertices of 4 elements each
    prog = ip.Sequence()
    y = ew.unary(g, "relu", x, prog)
    assert (y.tiles() == x.tiles()).all()  # no exchange needed
    per_vertex = t.thread_cycles(math.ceil(4 / 2) * 1 + 6) + t.vertex_overhead_cycles
    e = ip.Engine(g, prog).load()
    assert e.run() == per_vertex + t.sync_cycles
    assert e.last_run.per_ipu[0].exchange == 0


def lpt_reference(cycles, workers):
    """Longest processing time first with a heap, vertex by vertex."""
    import heapq
    if len(cycles) <= workers:
        return max(cycles, default=0)
    loads = [0] * workers
    for c in sorted(cycles, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return max(loads)


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 5), hs.integers(0, 500)), max_size=60), hs.integers(1, 7))
def test_tile_makespans_are_the_longest_processing_time_schedule_of_each_tile(vertices, workers):
    tiles = np.array([t for t, _ in vertices], dtype=np.int64)
    cycles = np.array([c for _, c in vertices], dtype=np.int64)
    got = tile_makespans(tiles, cycles, workers, 6)
    assert got.tolist() == [lpt_reference([c for t, c in vertices if t == tile], workers) for tile in range(6)]


# ---- vertex tables -------------------------------------------------------------------------
def test_fields_hold_the_elements_of_the_views_they_connect():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (6, 5), "x")
    views = [x[1:3], x.T[2], x[::2, 1:4], x[0:0], x.flatten()[np.array([7, 3, 4, 5, 29])]]
    f = ip.Field.concat([ip.Field.of(v) for v in views])
    assert f.sizes().tolist() == [v.numel for v in views]
    assert f.elements().tolist() == [int(i) for v in views for i in v.index.reshape(-1)]
    assert f.starts.size == 1 + 6 + 3 + 0 + 3  # runs: one; six single elements; three rows; none; [7], [3..5], [29]
    strided = ip.Field.strided(x, [2, 11], [2, 3], [3, 2], [5, 10])
    assert strided.elements().tolist() == [2, 3, 4, 7, 8, 9, 11, 12, 21, 22, 31, 32]
    assert strided.sizes().tolist() == [6, 6]


def test_a_table_of_vertices_is_checked_and_accounted_as_its_rows():
    t = ip.Target.test(4)
    g = ip.Graph(t)
    x = g.addVariable("float32", (16,), "x")
    y = g.addVariable("float32", (16,), "y")
    g.map_linearly(x)  # 4 elements per tile
    g.map_linearly(y)
    cs = g.addComputeSet("relu")
    starts = np.array([0, 2, 4, 8, 12, 14])
    lengths = np.array([2, 2, 4, 4, 2, 2])
    fields = {"x": ip.Field.strided(x, starts, 1, lengths), "out": ip.Field.strided(y, starts, 1, lengths)}
    table = g.addVertices(cs, ew.UNARY_VERTEX, [0, 0, 1, 2, 3, 3], fields, [ew.UNARY["relu"][0], 1.0, 0.0])
    assert table.num_vertices == cs.num_vertices == 6 and table.params.shape == (6, 3)
    cycles = table.cycles(t)
    assert cycles.tolist() == [t.thread_cycles(math.ceil(n / 2) + 6) + t.vertex_overhead_cycles
                               for n in lengths]
    assert cs.tile_cycles(t).tolist() == [cycles[0], cycles[2], cycles[3], cycles[4]]  # two vertices: two workers
    (report,) = ip.Engine(g, ip.Sequence(ip.Execute(cs))).memory
    assert report.vertex_state.tolist() == [2 * 28, 28, 28, 2 * 28]  # per vertex: 2 fields x 8 B + 3 params x 4 B
    assert report.code.tolist() == [256] * 4  # one codelet per tile
    bad = {"x": ip.Field.strided(x, [3], 1, [2]), "out": ip.Field.strided(y, [0], 1, [2])}
    with pytest.raises(ip.LocalityError, match=r"popops::UnaryOp.x: element 1 of tensor 'x' lives on tile 1, but "
                                               r"the vertex runs on tile 0 \(1 of 2 elements are not local\)"):
        g.addVertices(cs, ew.UNARY_VERTEX, [0], bad, [0, 1.0, 0.0])
    with pytest.raises(ValueError, match="takes 3 parameters, got 2"):
        g.addVertices(cs, ew.UNARY_VERTEX, [0, 0, 1, 2, 3, 3], fields, np.zeros((6, 2)))
    with pytest.raises(ValueError, match=r"parameter matrix of shape \(2, 3\) for 6 vertices"):
        g.addVertices(cs, ew.UNARY_VERTEX, [0, 0, 1, 2, 3, 3], fields, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="tile 9 does not exist"):
        g.addVertices(cs, ew.UNARY_VERTEX, [0, 0, 1, 2, 3, 9], fields, [0, 1.0, 0.0])


def test_a_tile_runs_its_supervisor_vertices_one_after_another_and_its_worker_vertices_on_its_workers():
    t = ip.Target.test(2)
    g = ip.Graph(t)
    x = g.addVariable("float32", (64,), "x")
    g.setTileMapping(x, 0)
    fixed = lambda c: (lambda sizes, params, dtype, target: np.full(len(params), c, np.int64))  # noqa: E731
    worker = ip.VertexType("Worker", ("x",), (), ew.UNARY_VERTEX.kernel, fixed(100))
    supervisor = ip.VertexType("Supervisor", ("x",), (), ew.UNARY_VERTEX.kernel, fixed(1000), supervisor=True)
    cs = g.addComputeSet("mixed")
    g.addVertices(cs, worker, [0] * 7, {"x": ip.Field.strided(x, np.arange(7) * 8, 1, 8)}, np.zeros((7, 0)))
    g.addVertices(cs, supervisor, [0, 0], {"x": ip.Field.strided(x, [0, 32], 1, 32)}, np.zeros((2, 0)))
    overhead = t.vertex_overhead_cycles
    # seven workers' vertices on six workers: two rounds; two supervisor vertices: one after the other
    assert cs.tile_cycles(t).tolist() == [2 * (100 + overhead) + 2 * (1000 + overhead), 0]


def test_one_vertex_and_a_table_of_one_row_are_the_same():
    t = ip.Target.test(2)
    g = ip.Graph(t)
    x = g.addVariable("float32", (8,), "x")
    g.setTileMapping(x, 1)
    y = g.addVariable("float32", (8,), "y")
    g.setTileMapping(y, 1)
    one, bulk = g.addComputeSet("one"), g.addComputeSet("bulk")
    g.addVertex(one, ew.UNARY_VERTEX, 1, {"x": x[::2], "out": y[:4]}, (2, 1.0, 0.0))
    g.addVertices(bulk, ew.UNARY_VERTEX, [1], {"x": ip.Field.strided(x, [0], 4, 1, 2),
                                                "out": ip.Field.strided(y, [0], 1, 4)}, [2, 1.0, 0.0])
    (a,), (b,) = one.tables, bulk.tables
    for f in ("x", "out"):
        assert a.fields[f].elements().tolist() == b.fields[f].elements().tolist()
    assert a.cycles(t).tolist() == b.cycles(t).tolist()
    assert one.tile_cycles(t).tolist() == bulk.tile_cycles(t).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_vertices_of_one_type_may_connect_different_variables(mode):
    t = ip.Target.test(3)
    g = ip.Graph(t)
    xs = [g.addVariable("float32", (4,), f"x{i}") for i in range(3)]
    ys = [g.addVariable("float32", (4,), f"y{i}") for i in range(3)]
    for i, (x, y) in enumerate(zip(xs, ys)):
        g.setTileMapping(x, i)
        g.setTileMapping(y, i)
    cs = g.addComputeSet("neg")
    for i in (2, 0, 1):
        g.addVertex(cs, ew.UNARY_VERTEX, i, {"x": xs[i], "out": ys[i]}, (ew.UNARY["neg"][0], 1.0, 0.0))
    (table,) = cs.tables
    assert [v.name for v in table.fields["x"].variables] == ["x2", "x0", "x1"]
    with pytest.raises(ip.LocalityError, match="tensor 'x1' lives on tile 1, but the vertex runs on tile 2"):
        g.addVertices(cs, ew.UNARY_VERTEX, [1, 2], {"x": ip.Field.concat([ip.Field.of(xs[1]), ip.Field.of(xs[1])]),
                                                    "out": ip.Field.concat([ip.Field.of(ys[1]), ip.Field.of(ys[2])])},
                      [0, 1.0, 0.0])
    e = ip.Engine(g, ip.Sequence(ip.Execute(cs)), mode=mode).load()
    for i, x in enumerate(xs):
        e.writeTensor(x, np.arange(4, dtype=np.float32) + 10 * i)
    e.run()
    for i, y in enumerate(ys):
        assert e.readTensor(y).tolist() == (-(np.arange(4) + 10 * i)).tolist()


# ---- memory --------------------------------------------------------------------------------
def test_memory_report_and_liveness():
    t = ip.Target.test(4, 4096)
    g = ip.Graph(t)
    w = g.addVariable("float32", (256,), "w", category="weights")
    g.map_linearly(w)
    prog = ip.Sequence()
    y = ew.unary(g, "tanh", w, prog)      # activations, not always live
    ew.unary(g, "relu", y, prog)
    e = ip.Engine(g, prog)
    (r,) = e.memory
    assert r.always_live.sum() == 1024
    assert r.by_category["weights"].sum() == 1024
    assert r.by_category["activations"].sum() == 2048
    assert r.not_always_live_peak.sum() == 2048  # y and z overlap at the second op
    assert r.vertex_state.sum() > 0 and r.code.sum() == 4 * 2 * 256 // 2
    assert r.fits and "IPU 0" in r.summary()
    assert r.to_dict()["per_tile_bytes"] == r.peak.tolist()


def test_out_of_memory_names_the_worst_tiles_and_tensors():
    t = ip.Target.test(4, 1024)
    g = ip.Graph(t)
    big = g.addVariable("float32", (300,), "big_weights", category="weights")
    g.setTileMapping(big, 2)
    small = g.addVariable("float32", (8,), "small")
    g.setTileMapping(small, 0)
    with pytest.raises(ip.OutOfMemoryError) as err:
        ip.Engine(g, ip.Sequence())
    msg = str(err.value)
    assert "IPU 0 tile 2: 1200 B" in msg and "big_weights (1200 B)" in msg and "1024 bytes" in msg
    assert err.value.reports[0].max_tile == 1200
    assert ip.Engine(g, ip.Sequence(), check_memory=False).memory[0].max_tile == 1200


# ---- kernels and numerics ------------------------------------------------------------------
def test_half_stores_round_like_numpy():
    from numba import njit

    @njit(**JIT)
    def roundtrip(src, dst):
        for i in range(src.size):
            st(dst, i, ld(src, i))

    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000),
                           [0.0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                            np.inf, -np.inf]]).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = vals.astype(np.float16)
    out = np.zeros(vals.size, np.uint16)
    roundtrip(vals, out)
    np.testing.assert_array_equal(out.view(np.float16), expected)
    back = np.zeros(vals.size, np.float32)
    roundtrip(out, back)
    np.testing.assert_array_equal(back, expected.astype(np.float32))


def test_same_program_same_bits_across_runs_and_modes():
    results = []
    for mode in MODES * 2:
        g = ip.Graph(ip.Target.test(4))
        x = g.addVariable("float32", (5, 7), "x")
        g.map_linearly(x)
        prog = ip.Sequence()
        y = ew.unary(g, "gelu", ew.binary(g, "mul", x, x, prog), prog)
        e = ip.Engine(g, prog, mode=mode).load()
        e.writeTensor(x, np.linspace(-3, 3, 35).reshape(5, 7))
        e.run()
        results.append(e.readTensor(y))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_fast_mode_stores_only_what_its_kernels_touch():
    """An op's internal exchange buffers get no host storage in the fast mode (its kernel never
    reads them); reading one is a clear error there, and works in the strict mode."""
    from ipusim.ops import matmul as mm
    results, internal = {}, {}
    for mode in MODES:
        g = ip.Graph(ip.Target.test(16))
        a, b = g.addVariable("float32", (24, 32), "a"), g.addVariable("float32", (32, 16), "b")
        g.map_linearly(a)
        g.map_linearly(b)
        prog = ip.Sequence()
        c = mm.matmul(g, a, b, prog)
        e = ip.Engine(g, prog, mode=mode).load()
        e.writeTensor(a, np.arange(24 * 32).reshape(24, 32) % 7)
        e.writeTensor(b, np.arange(32 * 16).reshape(32, 16) % 5)
        e.run()
        results[mode] = e.readTensor(c)
        stored = sum(arena.size for arena in e.mem[0].arenas.values())
        internal[mode] = [v for v in g.variables if v not in (a.var, b.var, c.var)]
        assert internal[mode], "the matmul exchanges its operands into tile-local buffers"
        total = sum(v.numel for v in g.variables)
        if mode == "fast":
            assert stored == total - sum(v.numel for v in internal[mode])
            with pytest.raises(ValueError, match=r"internal to op 'matmul'.*mode='strict'"):
                e.readTensor(ip.Tensor(internal[mode][0]))
        else:
            assert stored == total
            e.readTensor(ip.Tensor(internal[mode][0]))
    np.testing.assert_array_equal(results["fast"], results["strict"])


@pytest.mark.parametrize("mode", MODES)
def test_remote_buffers_keep_tensors_off_chip_between_uses(mode):
    t = ip.Target.test(4, 4096)
    g = ip.Graph(t)
    state = g.addVariable("float32", (256,), "state", category="optimiser_state", always_live=False)
    g.map_linearly(state)
    other = g.addVariable("float32", (256,), "other", always_live=False)
    g.map_linearly(other)
    buf = g.addRemoteBuffer("state_store", "float32", (256,), repeats=2)
    update = ip.Sequence(ip.RemoteCopy(buf, state, 1))
    ew.binary(g, "add", state, state, update, out=state)
    update.add(ip.RemoteCopy(state, buf, 1))
    work = ip.Sequence()
    ew.unary(g, "relu", other, work, out=other)
    e = ip.Engine(g, [update, work], mode=mode).load()
    e.writeRemoteBuffer(buf, np.arange(256), slot=1)
    cycles = e.run(0)
    np.testing.assert_array_equal(e.readRemoteBuffer(buf, 1), 2 * np.arange(256))
    np.testing.assert_array_equal(e.readRemoteBuffer(buf, 0), 0)
    e.run(0)
    np.testing.assert_array_equal(e.readRemoteBuffer(buf, 1), 4 * np.arange(256))
    assert e.last_run.per_ipu[0].host == 2 * t.streaming_memory_cycles(1024)
    assert cycles > 2 * t.streaming_memory_cycles(1024)
    (r,) = e.memory
    assert r.off_chip_bytes == 2 * 1024
    assert r.always_live.sum() == 0
    assert r.not_always_live_peak.sum() == 1024  # state and other are never live at the same time
