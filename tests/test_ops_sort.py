"""ipusim.ops.sort: sort and top-k along an axis with positions, against torch (stable order),
strict and fast modes alike."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import sort as S

TARGET = ip.Target.test(16, 64 * 1024)


def run(x, k, axis, largest, mode):
    g = ip.Graph(TARGET)
    t = g.addVariable(x.dtype, x.shape, "x")
    g.map_linearly(t)
    prog = ip.Sequence()
    values, positions = S.topk(g, t, k, axis, prog, largest=largest)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(t, x)
    cycles = e.run()
    return e.readTensor(values), e.readTensor(positions), cycles


@given(shape=st.lists(st.integers(1, 30), min_size=1, max_size=3), axis=st.integers(0, 2), largest=st.booleans(),
       ties=st.booleans(), dtype=st.sampled_from(["float32", "float16", "int32", "bool"]), data=st.data())
@settings(max_examples=30, deadline=None)
def test_topk_and_sort_are_torchs_stable_sort_in_both_modes(shape, axis, largest, ties, dtype, data):
    axis %= len(shape)
    k = data.draw(st.integers(0, shape[axis]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    x = (rng.integers(-3, 3, shape) if ties or dtype == "bool" else rng.standard_normal(shape) * 100).astype(dtype)
    strict, fast = run(x, k, axis, largest, "strict"), run(x, k, axis, largest, "fast")
    for a, b in zip(strict, fast):
        np.testing.assert_array_equal(a, b)
    values, order = torch.sort(torch.from_numpy(x), dim=axis, descending=largest, stable=True)
    np.testing.assert_array_equal(strict[0], values.narrow(axis, 0, k).numpy())
    np.testing.assert_array_equal(strict[1], order.narrow(axis, 0, k).numpy())


def test_nan_sorts_as_the_largest_value():
    x = np.array([[1.0, np.nan, -2.0, np.inf]], np.float32)
    for mode in ("strict", "fast"):
        values, positions, _ = run(x, 4, 1, False, mode)
        np.testing.assert_array_equal(positions, [[2, 0, 3, 1]])
        values, positions, _ = run(x, 1, 1, True, mode)
        np.testing.assert_array_equal(positions, [[1]])


def test_bad_k_is_named():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (3, 4), "x")
    with pytest.raises(ValueError, match=r"k = 5 must be within \[0, 4\]"):
        S.topk(g, x, 5, 1, ip.Sequence())


def test_sorting_long_rows_costs_more_per_element():
    short = run(np.zeros((64, 8), np.float32), 8, 1, False, "fast")[2]
    long = run(np.zeros((2, 256), np.float32), 256, 1, False, "fast")[2]
    assert long > short
