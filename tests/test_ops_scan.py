"""ipusim.ops.scan: cumulative sums and products along an axis against torch, strict and fast
modes bit for bit."""
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


def test_scan_refuses_bool_and_unknown_ops():
    g = ip.Graph(TARGET)
    with pytest.raises(TypeError, match="cast first"):
        S.scan(g, g.addVariable("bool", (3,), "i"), 0, "sum", ip.Sequence())
    with pytest.raises(ValueError, match="unknown scan op 'max'"):
        S.scan(g, g.addVariable("float32", (3,), "f"), 0, "max", ip.Sequence())


def test_long_rows_cost_more_than_many_short_rows_spread_over_tiles():
    x = np.ones((256, 16), np.float32)
    across = run(x, 1, "sum", "fast")[1]
    down = run(x, 0, "sum", "fast")[1]
    assert down > across
