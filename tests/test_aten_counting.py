"""Sort-like and counting ops (compiler/counting.py) through the whole compiler against eager
PyTorch: searchsorted, histc, histogram, histogramdd, mode, nanmedian and segment_reduce with its
gradient."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from torch.utils._pytree import tree_flatten

import poptorch_lite as poptorch

from test_compiled_ops import Fn, run_op


def check(fn, *xs, exact=True):
    """The first output (counts, values) exactly, the others (a histogram's edges: PyTorch's linspace
    rounds once where the device rounds twice) within float32 rounding."""
    got, want = tree_flatten(poptorch.inferenceModel(Fn(fn))(*xs))[0], tree_flatten(fn(*xs))[0]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        if exact and k == 0:
            torch.testing.assert_close(g.to(w.dtype), w, equal_nan=True, rtol=0, atol=0)
        else:
            torch.testing.assert_close(g.to(w.dtype), w, equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_per_row_with_a_sorter(right):
    seq = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.5, 4.0, -1.0, 9.0]])
    sorter = torch.argsort(seq, dim=1, stable=True)
    x = torch.tensor([[2.0, 0.0, 5.0], [4.0, -3.0, 9.0]])
    check(lambda s, x, o: torch.searchsorted(s, x, right=right, sorter=o), seq, x, sorter)
    check(lambda s, x: torch.searchsorted(s, x, side="right" if right else "left"), seq.sort(1).values, x)
    check(lambda s: torch.searchsorted(s, 2.0, right=right), torch.tensor([1.0, 2.0, 2.0, 3.0]))


@given(data=st.lists(st.integers(-20, 20), min_size=1, max_size=30), bins=st.integers(1, 7))
@settings(max_examples=15, deadline=None)
def test_histc_and_histogram_count_as_torch(data, bins):
    x = torch.tensor(data, dtype=torch.float32) / 4
    check(lambda x: torch.histc(x, bins), x)
    check(lambda x: torch.histc(x, bins, min=-2, max=3), x)
    check(lambda x: torch.histogram(x, bins), x)
    check(lambda x: torch.histogram(x, bins, range=(-1.0, 2.0)), x)


def test_histogram_with_weights_density_and_given_edges():
    torch.manual_seed(0)
    x, w = torch.randn(40), torch.rand(40)
    edges = torch.tensor([-2.0, -0.5, 0.0, 0.25, 3.0])
    check(lambda x, w: torch.histogram(x, 6, weight=w, density=True), x, w, exact=False)
    check(lambda x, e, w: torch.histogram(x, e, weight=w), x, edges, w, exact=False)


def test_histogramdd():
    torch.manual_seed(0)
    x = torch.randn(30, 2)
    check(lambda x: torch.histogramdd(x, [3, 4]), x, exact=False)
    check(lambda x: torch.histogramdd(x, [2, 2], range=[-1.0, 1.0, -2.0, 2.0], density=True), x, exact=False)


def test_mode_takes_the_smallest_most_frequent_value_and_its_last_position():
    x = torch.tensor([[1.0, 3.0, 3.0, 1.0, 2.0], [5.0, 5.0, 4.0, 4.0, 4.0], [7.0, 6.0, 7.0, 6.0, 0.0]])
    check(lambda x: torch.mode(x, 1), x)
    check(lambda x: torch.mode(x, 0, keepdim=True), x)
    run_op(lambda x: torch.mode(x.round(), 1).values, (4, 6))


def test_nanmedian():
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 3.0, 0.0], [5.0, nan, nan, nan], [2.0, 2.0, nan, -1.0]])
    check(lambda x: torch.nanmedian(x, 1), x)
    check(lambda x: torch.nanmedian(x), x)
    # a row of NaN only: NaN (its position is where PyTorch's selection algorithm leaves it)
    values = poptorch.inferenceModel(Fn(lambda x: torch.nanmedian(x, 1).values))(torch.full((2, 4), nan))
    assert values.isnan().all()
    run_op(lambda x: torch.nanmedian(x, 0).values, (5, 3))


@pytest.mark.parametrize("reduce", ["max", "min", "sum", "mean", "prod"])
@pytest.mark.parametrize("initial", [None, 0.5])
@pytest.mark.parametrize("by", ["lengths", "offsets"])
def test_segment_reduce_and_its_gradient(reduce, initial, by):
    segments = {"lengths": torch.tensor([2, 0, 3, 1]), "offsets": torch.tensor([0, 2, 2, 5, 6])}[by]
    kwargs = {by: segments, "initial": initial}
    if reduce in ("max", "min"):   # distinct values: the gradient of a tie is PyTorch's own rule
        fn = lambda x: torch.segment_reduce(x, reduce, **kwargs)
    else:
        fn = lambda x: torch.segment_reduce(x, reduce, **kwargs)
    x = torch.tensor([[0.5, -1.0], [2.0, 0.0], [1.5, 3.0], [-0.5, 0.25], [0.0, 1.0], [4.0, -2.0]])
    check(fn, x, exact=False)
    run_op(lambda x: torch.nan_to_num(fn(x), 0.0), (6, 3), rtol=1e-5)
