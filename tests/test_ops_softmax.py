"""Softmax and log-softmax, forward and backward, against NumPy in both modes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ipusim as ip
from ipusim.ops import softmax as S
from ipusim.device.program import Copy, walk

TARGET = ip.Target.test(16, 64 * 1024)


def variable(g, dtype, shape, name, mapping="linear"):
    t = g.addVariable(dtype, shape, name)
    if mapping == "linear":
        g.map_linearly(t, grain=4, min_elements_per_tile=8)
    else:
        g.map_by_dimension(t, 0)
    return t


def run_both(g, prog, inputs, outputs):
    results, cycles = {}, {}
    for mode in ("strict", "fast"):
        e = ip.Engine(g, prog, mode=mode).load()
        for t, v in inputs.items():
            e.writeTensor(t, v)
        cycles[mode] = e.run()
        results[mode] = [e.readTensor(o) for o in outputs]
        last = e.last_run
    assert cycles["strict"] == cycles["fast"]
    for a, b in zip(results["strict"], results["fast"]):
        np.testing.assert_array_equal(a, b)
    return results["strict"], last


def references(x, dy, axis):
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    e = np.exp(x - x.max(axis, keepdims=True))
    sm = e / e.sum(axis, keepdims=True)
    lsm = x - x.max(axis, keepdims=True) - np.log(e.sum(axis, keepdims=True))
    return {"softmax": sm, "log_softmax": lsm,
            "softmax_backward": sm * (dy - (dy * sm).sum(axis, keepdims=True)),
            "log_softmax_backward": dy - sm * dy.sum(axis, keepdims=True)}


def build(g, x, dy, axis, prog):
    y, ly = S.softmax(g, x, axis, prog), S.log_softmax(g, x, axis, prog)
    return {"softmax": y, "log_softmax": ly, "softmax_backward": S.softmax_backward(g, y, dy, axis, prog),
            "log_softmax_backward": S.log_softmax_backward(g, ly, dy, axis, prog)}


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_forward_and_backward_match_numpy(axis):
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (7, 13, 3), "x")
    dy = variable(g, "float32", (7, 13, 3), "dy", "rows")
    prog = ip.Sequence()
    outs = build(g, x, dy, axis, prog)
    rng = np.random.default_rng(0)
    xv = (rng.standard_normal(x.shape) * 4).astype(np.float32)
    dyv = rng.standard_normal(x.shape).astype(np.float32)
    got, _ = run_both(g, prog, {x: xv, dy: dyv}, list(outs.values()))
    refs = references(xv, dyv, axis)
    for (k, o), v in zip(outs.items(), got):
        assert o.shape == x.shape
        # backward: y * (dy - sum(dy * y)) cancels, so float32 rounding of y shows as ~1e-7 absolute
        np.testing.assert_allclose(v, refs[k], rtol=2e-6, atol=1e-6 if "backward" in k else 1e-7, err_msg=k)


def test_outputs_are_mapped_like_their_inputs():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (6, 10), "x", "rows")
    dy = variable(g, "float32", (6, 10), "dy")
    prog = ip.Sequence()
    outs = build(g, x, dy, 1, prog)
    for o in outs.values():  # backward outputs follow the forward output y, mapped like x
        assert (o.tiles() == x.tiles()).all()


def test_large_logits_are_stable():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (2, 5), "x")
    prog = ip.Sequence()
    y, ly = S.softmax(g, x, 1, prog), S.log_softmax(g, x, 1, prog)
    xv = np.array([[1000, 999, 998, -1000, 0], [-1e4, -1e4, -1e4, -1e4, -1e4]], np.float32)
    (a, b), _ = run_both(g, prog, {x: xv}, [y, ly])
    refs = references(xv, xv, 1)
    assert np.isfinite(a).all() and np.isfinite(b[:, :3]).all()
    np.testing.assert_allclose(a, refs["softmax"], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(b, refs["log_softmax"], rtol=1e-6)


def test_float16_keeps_float32_statistics_and_rounds_once():
    g = ip.Graph(TARGET)
    x = variable(g, "float16", (8, 300), "x")
    prog = ip.Sequence()
    y, ly = S.softmax(g, x, 1, prog), S.log_softmax(g, x, 1, prog)
    xv = np.random.default_rng(1).standard_normal(x.shape).astype(np.float16)
    (a, b), _ = run_both(g, prog, {x: xv}, [y, ly])
    assert a.dtype == np.float16 and b.dtype == np.float16
    refs = references(xv, xv, 1)
    for got, ref in ((a, refs["softmax"]), (b, refs["log_softmax"])):
        ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp)  # float16 rounding, no float16 accumulation


def test_rows_on_one_tile_need_no_exchange_and_spread_rows_do():
    for mapping, exchanges in (("rows", False), ("linear", True)):
        g = ip.Graph(TARGET)
        x = variable(g, "float32", (16, 10), "x", mapping)
        prog = ip.Sequence()
        y = S.softmax(g, x, 1, prog)
        xv = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
        (got,), report = run_both(g, prog, {x: xv}, [y])
        np.testing.assert_allclose(got, references(xv, xv, 1)["softmax"], rtol=2e-6)
        assert any(isinstance(p, Copy) for p in walk(prog)) == exchanges
        assert (report.per_ipu[0].exchange > 0) == exchanges


def test_errors_name_the_problem():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (3, 4), "x")
    i = variable(g, "int32", (3, 4), "i")
    dy = variable(g, "float32", (4, 3), "dy")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        S.softmax(g, x, 2, prog)
    with pytest.raises(TypeError, match="'i' is int32"):
        S.log_softmax(g, i, 1, prog)
    with pytest.raises(ValueError, match="differ in shape"):
        S.softmax_backward(g, x, dy, 1, prog)


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_property_shapes_and_axes(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    mapping = data.draw(st.sampled_from(["linear", "rows"]))
    g = ip.Graph(TARGET)
    x = variable(g, "float32", tuple(shape), "x", mapping)
    dy = variable(g, "float32", tuple(shape), "dy")
    prog = ip.Sequence()
    outs = build(g, x, dy, axis, prog)
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    xv, dyv = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
    got, _ = run_both(g, prog, {x: xv, dy: dyv}, list(outs.values()))
    refs = references(xv, dyv, axis)
    for k, v in zip(outs, got):
        np.testing.assert_allclose(v, refs[k], rtol=5e-6, atol=1e-6, err_msg=k)
