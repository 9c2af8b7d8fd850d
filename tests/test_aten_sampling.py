"""Sampling grids and resizing through the whole compiler against eager PyTorch, with their
gradients: the interpolations' backward ops (nearest-exact, bicubic, trilinear), grid sampling in
2-D and 3-D, antialiased bilinear resizing."""
import pytest
import torch
import torch.nn.functional as F

from test_compiled_ops import run_op


@pytest.mark.parametrize("mode,shape,size,align", [
    ("nearest-exact", (2, 3, 5), (7,), None), ("nearest-exact", (1, 2, 4, 5), (3, 8), None),
    ("nearest-exact", (1, 1, 3, 4, 2), (5, 2, 3), None),
    ("bicubic", (2, 2, 4, 5), (7, 3), False), ("bicubic", (1, 2, 4, 4), (3, 9), True),
    ("trilinear", (1, 2, 3, 4, 4), (5, 3, 6), False), ("trilinear", (1, 1, 3, 3, 4), (4, 4, 2), True)])
def test_interpolation_gradients(mode, shape, size, align):
    run_op(lambda x: F.interpolate(x, size=size, mode=mode, align_corners=align), shape, rtol=1e-4)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_3d_and_its_gradients(mode, padding, align):
    run_op(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align),
           (2, 3, 3, 4, 5), (2, 2, 3, 4, 3), rtol=1e-4)


@pytest.mark.parametrize("mode,padding", [("bilinear", "zeros"), ("bilinear", "border"), ("nearest", "zeros"),
                                          ("bicubic", "zeros"), ("bilinear", "reflection")])
def test_grid_sample_2d_gradients(mode, padding):
    run_op(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=False),
           (2, 3, 4, 5), (2, 3, 6, 2), rtol=1e-4)


@pytest.mark.parametrize("shape,size,align", [((2, 3, 10, 20), (3, 3), False), ((1, 2, 5, 4), (9, 3), False),
                                              ((1, 2, 7, 6), (4, 8), True), ((1, 1, 6, 6), (6, 6), False)])
def test_antialiased_bilinear_resize_and_its_gradient(shape, size, align):
    run_op(lambda x: F.interpolate(x, size=size, mode="bilinear", align_corners=align, antialias=True), shape,
           rtol=1e-4)


@pytest.mark.parametrize("nd,shape,kernel,out", [(2, (2, 3, 9, 7), 3, (4, 3)), (2, (3, 6, 6), (2, 3), 2),
                                                 (3, (2, 2, 5, 6, 5), 2, (3, 2, 3))])
def test_fractional_max_pool_with_given_samples(nd, shape, kernel, out):
    """The windows from fixed samples (a model input: PyTorch's own draw cannot be matched), their
    largest values and positions exactly as PyTorch's, and the gradient through them."""
    pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    torch.manual_seed(1)
    batch = shape[0] if len(shape) == nd + 2 else 1
    samples = torch.rand(batch, shape[-nd - 1], nd)
    x = torch.randn(shape)

    class Pool(torch.nn.Module):
        def forward(self, x, u):
            return pool(x, kernel, output_size=out, return_indices=True, _random_samples=u)

    import poptorch_lite as poptorch
    got, want = poptorch.inferenceModel(Pool())(x, samples), Pool()(x, samples)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(got[1].long(), want[1])
    run_op(lambda x: pool(x, kernel, output_size=out, _random_samples=samples), shape)
