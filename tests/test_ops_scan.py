"""ipusim.ops.scan: cumulative sums, products, logsumexp, maxima and minima (with positions)
along an axis against torch, strict and fast modes bit for bit."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import scan as S

TARGET = ip.Target.test(16, 64 * 1024)


def run(x, axis, op, mode):
    g = ip.Graph(TARGET)
    t = g.addVariable(x.dtype, x.shape, "x")
    g.map_linearly(t)
    prog = ip.Sequence()
    out = S.scan(g, t, axis, op, prog)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(t, x)
    cycles = e.run()
    return e.readTensor(out), cycles


@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), axis=st.integers(0, 2), op=st.sampled_from(["sum", "prod"]),
       dtype=st.sampled_from(["float32", "float16", "int32"]), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_scan_is_torch_cumsum_and_cumprod_in_both_modes(shape, axis, op, dtype, seed):
    axis %= len(shape)
    rng = np.random.default_rng(seed)
    x = (rng.integers(-1, 2, shape) if dtype == "int32" else rng.uniform(0.5, 1.5, shape)).astype(dtype)
    (strict, c1), (fast, c2) = run(x, axis, op, "strict"), run(x, axis, op, "fast")
    np.testing.assert_array_equal(strict, fast)
    assert c1 == c2
    fn = torch.cumsum if op == "sum" else torch.cumprod
    expected = fn(torch.from_numpy(x.astype(np.float64)), axis).numpy()
    if dtype == "int32":
        np.testing.assert_array_equal(strict, expected.astype(np.int32))
    else:
        np.testing.assert_allclose(strict, expected, rtol=1e-3 if dtype == "float16" else 1e-6)


def run_positions(x, axis, op, mode):
    g = ip.Graph(TARGET)
    t = g.addVariable(x.dtype, x.shape, "x")
    g.map_linearly(t)
    prog = ip.Sequence()
    values, positions = S.scan_with_positions(g, t, axis, op, prog)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(t, x)
    cycles = e.run()
    return e.readTensor(values), e.readTensor(positions), cycles


@given(shape=st.lists(st.integers(1, 30), min_size=1, max_size=3), axis=st.integers(0, 2),
       dtype=st.sampled_from(["float32", "float16"]), scale=st.sampled_from([1.0, 1e4]), seed=st.integers(0, 2**16))
@settings(max_examples=20, deadline=None)
def test_logcumsumexp_is_torch_in_both_modes_without_overflow(shape, axis, dtype, scale, seed):
    axis %= len(shape)
    x = (np.random.default_rng(seed).standard_normal(shape) * (scale if dtype == "float32" else 5)).astype(dtype)
    (strict, c1), (fast, c2) = run(x, axis, "logsumexp", "strict"), run(x, axis, "logsumexp", "fast")
    np.testing.assert_array_equal(strict, fast)
    assert c1 == c2 and np.isfinite(strict).all()
    expected = torch.logcumsumexp(torch.from_numpy(x.astype(np.float64)), axis).numpy()
    np.testing.assert_allclose(strict, expected, rtol=1e-3 if dtype == "float16" else 1e-6,
                               atol=1e-3 if dtype == "float16" else 0)


def test_logcumsumexp_keeps_infinities_and_nan_like_torch():
    x = np.array([[-np.inf, -np.inf, 0.0, np.inf, 1.0], [np.inf, np.inf, -np.inf, 2.0, np.nan]], np.float32)
    want = torch.logcumsumexp(torch.from_numpy(x), 1).numpy()
    for mode in ("strict", "fast"):
        np.testing.assert_array_equal(run(x, 1, "logsumexp", mode)[0], want)


@given(shape=st.lists(st.integers(1, 30), min_size=1, max_size=3), axis=st.integers(0, 2),
       op=st.sampled_from(["max", "min"]), dtype=st.sampled_from(["float32", "float16", "int32"]),
       nans=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_cummax_and_cummin_are_torch_with_positions_in_both_modes(shape, axis, op, dtype, nans, seed):
    axis %= len(shape)
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, shape).astype(dtype)   # many ties: torch takes the last equal position
    if nans and dtype != "int32":
        x[rng.random(shape) < 0.1] = np.nan
    (sv, sp, c1), (fv, fp, c2) = run_positions(x, axis, op, "strict"), run_positions(x, axis, op, "fast")
    np.testing.assert_array_equal(sv, fv)
    np.testing.assert_array_equal(sp, fp)
    assert c1 == c2 and sp.dtype == np.int32 and sv.dtype == x.dtype
    fn = torch.cummax if op == "max" else torch.cummin
    want = fn(torch.from_numpy(x.astype(np.float64) if dtype == "float16" else x), axis)
    np.testing.assert_array_equal(sv, want.values.numpy().astype(dtype))
    np.testing.assert_array_equal(sp, want.indices.numpy())


def test_scan_refuses_bool_and_unknown_ops():
    g = ip.Graph(TARGET)
    with pytest.raises(TypeError, match="cast first"):
        S.scan(g, g.addVariable("bool", (3,), "i"), 0, "sum", ip.Sequence())
    with pytest.raises(TypeError, match="takes float32 or float16"):
        S.scan(g, g.addVariable("int32", (3,), "i"), 0, "logsumexp", ip.Sequence())
    with pytest.raises(ValueError, match="unknown scan op 'max'.*scan_with_positions"):
        S.scan(g, g.addVariable("float32", (3,), "f"), 0, "max", ip.Sequence())
    with pytest.raises(ValueError, match="unknown scan op 'sum' with positions"):
        S.scan_with_positions(g, g.addVariable("float32", (3,), "f"), 0, "sum", ip.Sequence())


def test_long_rows_cost_more_than_many_short_rows_spread_over_tiles():
    x = np.ones((256, 16), np.float32)
    across = run(x, 1, "sum", "fast")[1]
    down = run(x, 0, "sum", "fast")[1]
    assert down > across
