"""Index and view ops with positions computed at compile time (compiler/indexing.py), through the
whole compiler against eager PyTorch: strided views and their scatters, put, masked_scatter,
nonzero_static, resize, narrow_copy, unbind_copy, addbmm; and their gradients."""
import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import poptorch_lite as poptorch
from poptorch_lite.compiler.aten import UnsupportedOpError
from poptorch_lite.compiler.indexing import strided_positions

from test_compiled_ops import Fn, run_op


def infer(fn, *xs):
    return poptorch.inferenceModel(Fn(fn))(*xs)


@given(size=st.lists(st.integers(1, 4), min_size=0, max_size=3), data=st.data())
@settings(max_examples=30, deadline=None)
def test_strided_positions_are_torchs(size, data):
    stride = [data.draw(st.integers(0, 5)) for _ in size]
    offset = data.draw(st.integers(0, 3))
    base = torch.arange(200)
    want = base.as_strided(size, stride, offset)
    assert np.array_equal(strided_positions(size, stride, offset), want.numpy())


@pytest.mark.parametrize("size,stride,offset", [((2, 2), (1, 2), 0), ((3, 2), (2, 1), 1), ((2, 3), (0, 3), 2)])
def test_as_strided_and_its_gradient(size, stride, offset):
    # overlapping views (stride 0, or windows sharing elements) add their gradients
    run_op(lambda x: torch.as_strided(x, size, stride, offset) * 1.0, (10,), rtol=1e-5)


def test_as_strided_scatter():
    x, src = torch.randn(4, 3), torch.randn(2, 2)
    got = infer(lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (3, 1), 1), x, src)
    torch.testing.assert_close(got, torch.as_strided_scatter(x, src, (2, 2), (3, 1), 1))


def test_as_strided_beyond_the_tensor_names_the_element():
    with pytest.raises(UnsupportedOpError, match="reaches element 11 of a tensor of 10 elements"):
        infer(lambda x: torch.as_strided(x, (2, 2), (1, 10), 0), torch.randn(10))


def test_resize_keeps_the_first_elements_and_refuses_growing():
    x = torch.randn(4, 5)
    torch.testing.assert_close(infer(lambda x: x.clone().resize_(3, 2) * 1.0, x), x.reshape(-1)[:6].reshape(3, 2))
    with pytest.raises(UnsupportedOpError, match="uninitialised"):
        infer(lambda x: x.clone().resize_(5, 5) * 1.0, x)


def test_narrow_copy_and_unbind_copy():
    x = torch.randn(3, 4, 5)
    got = infer(lambda x: (torch.narrow_copy(x, 1, 1, 2), *torch.unbind_copy(x, 2)), x)
    want = (torch.narrow_copy(x, 1, 1, 2), *torch.unbind_copy(x, 2))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("accumulate", [False, True])
def test_put_and_take_with_gradients(accumulate):
    index = torch.tensor([[5, -1], [0, 5]])
    run_op(lambda x, s: x.put(index, s, accumulate=accumulate) * 1.0, (3, 4), (2, 2))
    run_op(lambda x: torch.take(x, index), (3, 4))


def test_masked_scatter_and_its_gradient():
    mask = torch.tensor([[True, False, True], [False, False, True]])
    run_op(lambda x, s: x.masked_scatter(mask, s), (2, 3), (4, 2))
    run_op(lambda x, s: x.masked_scatter(mask[1], s), (2, 3), (3,))   # a broadcast mask


@pytest.mark.parametrize("size,fill", [(3, -1), (8, 7), (0, -1)])
def test_nonzero_static(size, fill):
    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    got = infer(lambda x: torch.nonzero_static(x, size=size, fill_value=fill), x)
    assert torch.equal(got.long(), torch.nonzero_static(x, size=size, fill_value=fill))


def test_combinations():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0])
    got = infer(lambda x: torch.combinations(x, 2), x)
    torch.testing.assert_close(got, torch.combinations(x, 2))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0)])
def test_addbmm(beta, alpha):
    run_op(lambda b, x, y: torch.addbmm(b, x, y, beta=beta, alpha=alpha), (3, 4), (5, 3, 2), (5, 2, 4), rtol=1e-4)


@pytest.mark.parametrize("fn,hint", [(torch.nonzero, "nonzero_static"), (lambda x: x.masked_select(x > 0), "where"),
                                     (torch.unique, "fixed number of bins")])
def test_ops_with_data_dependent_shapes_are_refused_saying_why(fn, hint):
    with pytest.raises(Exception, match=f"shape depends on the input's values.*{hint}"):
        infer(fn, torch.tensor([0.0, 1.0, 2.0]))
