"""ipusim.ops.dynamic: slices and updates at an offset read on the device, against NumPy, strict
and fast modes bit for bit; and the liveness of tensors that cross a loop (ipusim.device.memory)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.device.memory import live_ranges, loop_spans, supersteps
from ipusim.ops import dynamic as D
from ipusim.ops import elementwise as ew

TARGET = ip.Target.test(16, 64 * 1024)


def expected_rows(offset: int, size: int, n: int) -> np.ndarray:
    """PopLibs' rule: an offset outside [0, n) starts at row 0; a slice past the end wraps round."""
    return (np.arange(size) + (offset if 0 <= offset < n else 0)) % n


def run(shape, dim, size, offset, mode, dtype="float32", sliceable_base=False):
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    if sliceable_base:
        x = D.sliceable(g, dtype, shape, dim, "x", always_live=True)
    else:
        x = g.addVariable(dtype, shape, "x")
        g.map_linearly(x)
    o = g.addVariable("int32", (1,), "offset")
    g.setTileMapping(o, 5)
    y = D.dynamic_slice(g, x, o, dim, size, prog)
    src = g.addVariable(dtype, y.shape, "src")
    g.map_linearly(src)
    D.dynamic_update(g, x, src, o, dim, prog)
    e = ip.Engine(g, prog, mode=mode).load()
    rng = np.random.default_rng(0)
    xv = (rng.standard_normal(shape) * 10).astype(dtype)
    sv = (rng.standard_normal(y.shape) * 10).astype(dtype)
    e.writeTensor(x, xv)
    e.writeTensor(o, [offset])
    e.writeTensor(src, sv)
    cycles = e.run()
    return xv, sv, e.readTensor(y), e.readTensor(x), cycles


@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), dim=st.integers(0, 2), data=st.data(),
       dtype=st.sampled_from(["float32", "float16", "int32"]), sliceable_base=st.booleans())
@settings(max_examples=30, deadline=None)
def test_slice_and_update_follow_poplibs_in_both_modes(shape, dim, data, dtype, sliceable_base):
    dim %= len(shape)
    n = shape[dim]
    size = data.draw(st.integers(1, n))
    offset = data.draw(st.integers(-3, n + 3))
    results = [run(tuple(shape), dim, size, offset, mode, dtype, sliceable_base) for mode in ("strict", "fast")]
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(a, b)
    xv, sv, y, updated, _ = results[0]
    rows = expected_rows(offset, size, n)
    np.testing.assert_array_equal(y, np.take(xv, rows, axis=dim))
    want = xv.copy()
    want[(slice(None),) * dim + (rows,)] = sv
    np.testing.assert_array_equal(updated, want)


def test_a_sliceable_tensor_is_sliced_where_it_lives():
    g = ip.Graph(TARGET)
    x = D.sliceable(g, "float32", (32, 4, 24), 0, "x")
    assert D.is_sliceable(x, 0, TARGET.num_tiles)
    assert not D.is_sliceable(x, 2, TARGET.num_tiles)
    o = g.addVariable("int32", (1,), "offset")
    g.setTileMapping(o, 0)
    prog = ip.Sequence()
    y = D.dynamic_slice(g, x, o, 0, 1, prog)
    copies = [p for p in ip.device.program.walk(prog) if isinstance(p, ip.Copy)]
    assert [c.dst.name for c in copies] == ["dynamic_slice/offset"]   # only the offset moves
    # each tile holds whole columns of all 32 rows, and the slice's columns on the same tiles
    assert (x.reshape(32, 96).tile_map().tiles.reshape(32, -1) == y.reshape(1, 96).tile_map().tiles).all()


def test_cycles_follow_the_rows_and_columns_copied():
    _, _, _, _, small = run((8, 64), 0, 1, 2, "fast", sliceable_base=True)
    _, _, _, _, large = run((8, 64), 0, 4, 2, "fast", sliceable_base=True)
    assert large > small


def test_errors_name_the_problem():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (4, 3), "x")
    g.map_linearly(x)
    f = g.addVariable("float32", (1,), "f")
    o = g.addVariable("int32", (2,), "o")
    g.map_linearly(o)
    g.setTileMapping(f, 0)
    with pytest.raises(TypeError, match="must be an integer"):
        D.dynamic_slice(g, x, f, 0, 1, ip.Sequence())
    with pytest.raises(ValueError, match="must hold one element"):
        D.dynamic_slice(g, x, o, 0, 1, ip.Sequence())
    one = o[:1]
    with pytest.raises(ValueError, match="1 to 4 rows"):
        D.dynamic_slice(g, x, one, 0, 5, ip.Sequence())
    with pytest.raises(ValueError, match="same number of dimensions"):
        D.dynamic_update(g, x, x[0], one, 0, ip.Sequence())


def test_tensors_crossing_a_loop_stay_live_for_its_whole_body():
    g = ip.Graph(TARGET)
    a, b = (g.addVariable("float32", (64,), n, always_live=False) for n in "ab")
    for t in (a, b):
        g.map_linearly(t)
    body = ip.Sequence()
    x = ew.unary(g, "exp", a, body, "first")        # reads `a`, made before the loop, first in the body
    y = ew.unary(g, "exp", x, body, "second")
    ew.unary(g, "exp", y, body, "third", out=b)     # writes `b`, read after the loop
    init = ip.Sequence()
    ew.unary(g, "fill", a, init, "init", out=a, scale=1.0)
    prog = ip.Sequence(init, ip.Repeat(3, body))
    ew.unary(g, "neg", b, prog, "after")
    steps = supersteps(prog)
    spans = loop_spans([prog])
    assert len(spans) == 1
    first, last = spans[0]
    ranges = live_ranges(steps, spans)
    assert first == 1 and ranges[a.var.id] == [[0, last]]   # read at the body's start, live to its end
    assert ranges[b.var.id][0][0] == first           # written at its end, live from its start
    inner = ranges[x.var.id][0]
    assert first <= inner[0] and inner[1] < last     # a temporary of one iteration is not widened
