"""ipusim.ops.index: gather and scatter (writes, sums, maxima and minima) along an axis against
torch, strict and fast modes bit for bit; ipusim.ops.rows: the row plan."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import index as I
from ipusim.ops.rows import plan_rows

TARGET = ip.Target.test(16, 64 * 1024)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3)


def engine(build, values, mode):
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    tensors = {}
    for k, v in values.items():
        tensors[k] = g.addVariable(v.dtype, v.shape, k)
        g.map_linearly(tensors[k])
    out = build(g, prog, tensors)
    e = ip.Engine(g, prog, mode=mode).load()
    for k, v in values.items():
        e.writeTensor(tensors[k], v)
    cycles = e.run()
    return e.readTensor(out), cycles


@given(shape=shapes, m=st.integers(1, 7), axis=st.integers(0, 2), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_gather_is_torch_gather_in_both_modes(shape, m, axis, seed):
    rng = np.random.default_rng(seed)
    axis %= len(shape)
    x = rng.standard_normal(shape).astype(np.float32)
    ishape = list(shape)
    ishape[axis] = m
    n = shape[axis]
    idx = rng.integers(-n, n, ishape).astype(np.int32)
    results = [engine(lambda g, p, t: I.gather(g, t["x"], t["idx"], axis, p), {"x": x, "idx": idx}, mode)
               for mode in ("strict", "fast")]
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    expected = torch.gather(torch.from_numpy(x), axis, torch.from_numpy(idx % n).long()).numpy()
    np.testing.assert_array_equal(results[0][0], expected)


@given(shape=shapes, m=st.integers(1, 7), axis=st.integers(0, 2), accumulate=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_scatter_is_torch_scatter_in_both_modes(shape, m, axis, accumulate, seed):
    rng = np.random.default_rng(seed)
    axis %= len(shape)
    base = rng.standard_normal(shape).astype(np.float32)
    ishape = list(shape)
    ishape[axis] = m
    n = shape[axis]
    src = rng.standard_normal(ishape).astype(np.float32)
    if accumulate:
        idx = rng.integers(-n, n, ishape).astype(np.int32)
    else:   # distinct positions along the axis: torch leaves the order of duplicate writes open
        idx = np.argsort(rng.random((*ishape[:axis], n, *ishape[axis + 1:])), axis=axis).astype(np.int32)
        src = np.take(src, range(min(m, n)), axis=axis)
        idx = np.take(idx, range(min(m, n)), axis=axis)
    values = {"base": base, "idx": idx, "src": src}
    results = [engine(lambda g, p, t: I.scatter(g, t["base"], t["idx"], t["src"], axis, p, accumulate=accumulate),
                      values, mode) for mode in ("strict", "fast")]
    np.testing.assert_array_equal(results[0][0], results[1][0])
    b, i, s = torch.from_numpy(base), torch.from_numpy(idx % n).long(), torch.from_numpy(src)
    expected = (b.scatter_add(axis, i, s) if accumulate else b.scatter(axis, i, s)).numpy()
    np.testing.assert_allclose(results[0][0], expected, rtol=1e-6, atol=1e-6)


@given(shape=shapes, m=st.integers(1, 7), axis=st.integers(0, 2), reduce=st.sampled_from(["max", "min"]),
       dtype=st.sampled_from(["float32", "float16", "int32"]), nans=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_scatter_max_and_min_are_torch_scatter_reduce_in_both_modes(shape, m, axis, reduce, dtype, nans, seed):
    rng = np.random.default_rng(seed)
    axis %= len(shape)
    ishape = list(shape)
    ishape[axis] = m
    n = shape[axis]
    base = rng.integers(-3, 4, shape).astype(dtype)   # ties between base and src and among src
    src = rng.integers(-3, 4, ishape).astype(dtype)
    if nans and dtype != "int32":
        base[rng.random(shape) < 0.1] = np.nan
        src[rng.random(ishape) < 0.1] = np.nan
    idx = rng.integers(-n, n, ishape).astype(np.int32)
    values = {"base": base, "idx": idx, "src": src}
    results = [engine(lambda g, p, t: I.scatter(g, t["base"], t["idx"], t["src"], axis, p, reduce=reduce),
                      values, mode) for mode in ("strict", "fast")]
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    b, i, s = torch.from_numpy(base), torch.from_numpy(idx % n).long(), torch.from_numpy(src)
    if dtype == "float16":
        b, s = b.double(), s.double()
    expected = b.scatter_reduce(axis, i, s, "amax" if reduce == "max" else "amin").numpy().astype(dtype)
    np.testing.assert_array_equal(results[0][0], expected)


def test_out_of_range_indices_gather_zero_and_scatter_nothing():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    idx = np.array([[4, -5, 1], [0, 9, -1], [2, 2, -4]], np.int32)
    for mode in ("strict", "fast"):
        out, _ = engine(lambda g, p, t: I.gather(g, t["x"], t["idx"], 1, p), {"x": x, "idx": idx}, mode)
        np.testing.assert_array_equal(out, [[0, 0, 1], [4, 0, 7], [10, 10, 8]])
        ones = np.ones((3, 3), np.float32)
        out, _ = engine(lambda g, p, t: I.scatter(g, t["x"], t["idx"], t["s"], 1, p, accumulate=True),
                        {"x": x, "idx": idx, "s": ones}, mode)
        np.testing.assert_array_equal(out, x + [[0, 1, 0, 0], [1, 0, 0, 1], [1, 0, 2, 0]])


def test_gather_of_a_broadcast_index_selects_along_an_axis_and_int16_data_works():
    x = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float16)
    sel = np.array([299, 0, 7], np.int32)

    def build(g, p, t):
        return I.gather(g, t["x"], t["sel"].reshape(1, 3).broadcast((5, 3)), 1, p)
    for mode in ("strict", "fast"):
        out, _ = engine(build, {"x": x, "sel": sel}, mode)
        np.testing.assert_array_equal(out, x[:, sel])


def test_bad_indices_are_named():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (3, 4), "x")
    i64 = g.addVariable("float32", (3, 2), "i")
    with pytest.raises(TypeError, match="must be int32.*no int64"):
        I.gather(g, x, i64, 1, ip.Sequence())
    i = g.addVariable("int32", (2, 2), "j")
    with pytest.raises(ValueError, match="must match 'x'"):
        I.gather(g, x, i, 1, ip.Sequence())
    j, s = g.addVariable("int32", (3, 2), "k"), g.addVariable("float32", (3, 2), "s")
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        I.scatter(g, x, j, s, 1, ip.Sequence(), reduce="mean")
    with pytest.raises(ValueError, match="cannot be combined with reduce='max'"):
        I.scatter(g, x, j, s, 1, ip.Sequence(), accumulate=True, reduce="max")


def test_row_plan_spreads_rows_and_cuts_columns_only_when_rows_are_few():
    g = ip.Graph(ip.Target.test(64, 64 * 1024))
    many = plan_rows(g, 1000, 100, 100, split_columns=True)
    assert many.tile.size == 63 and (many.cols == 100).all() and many.rows.sum() == 1000   # 16 rows a block
    assert np.unique(many.tile).size == many.tile.size
    few = plan_rows(g, 2, 10000, 5000, split_columns=True)
    assert few.tile.size > 2 and np.unique(few.tile).size == few.tile.size
    assert sorted(set(zip(few.row, few.rows))) == [(0, 1), (1, 1)] and few.cols.sum() == 2 * 5000
    tiny = plan_rows(g, 3, 4, 4)
    assert tiny.tile.size == 1   # not worth a second tile


def test_gather_cost_grows_with_the_work_of_the_busiest_tile():
    x = np.zeros((64, 512), np.float32)
    short = engine(lambda g, p, t: I.gather(g, t["x"], t["i"], 1, p), {"x": x, "i": np.zeros((64, 8), np.int32)},
                   "fast")[1]
    long = engine(lambda g, p, t: I.gather(g, t["x"], t["i"], 1, p), {"x": x, "i": np.zeros((64, 256), np.int32)},
                  "fast")[1]
    assert long > short


@given(shape=shapes, m=st.integers(1, 7), axis=st.integers(0, 2), dtype=st.sampled_from(["float32", "int32"]),
       seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_scatter_mul_is_torch_scatter_reduce_prod_in_both_modes(shape, m, axis, dtype, seed):
    rng = np.random.default_rng(seed)
    axis %= len(shape)
    ishape = list(shape)
    ishape[axis] = m
    n = shape[axis]
    base = rng.choice([-2, -1, 1, 2, 3], shape).astype(dtype)
    src = rng.choice([-2, -1, 1, 2], ishape).astype(dtype)
    idx = rng.integers(0, n, ishape).astype(np.int32)
    values = {"base": base, "idx": idx, "src": src}
    results = [engine(lambda g, p, t: I.scatter(g, t["base"], t["idx"], t["src"], axis, p, reduce="mul"),
                      values, mode) for mode in ("strict", "fast")]
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    expected = torch.from_numpy(base).scatter_reduce(axis, torch.from_numpy(idx).long(), torch.from_numpy(src), "prod")
    np.testing.assert_array_equal(results[0][0], expected.numpy())
