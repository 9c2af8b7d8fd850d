"""ATen lowerings composed from other ops, checked through the whole compiler against PyTorch:
transposed convolution, NLL loss with class weights, bernoulli with a probability per element;
and the errors of index ops (boolean masks, int32 positions)."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.api.strategies import PipelinedExecution
from poptorch_lite.compiler.aten import UnsupportedOpError, decompositions, to_ir
from poptorch_lite.compiler.export import capture_joint

from test_compiled_ops import run_op


@pytest.mark.parametrize("nd,stride,padding,output_padding,dilation,groups", [
    (2, 1, 0, 0, 1, 1), (2, 2, 1, 1, 1, 1), (2, 2, 0, 0, 2, 2), (1, 3, 1, 2, 1, 1), (1, 1, 0, 0, 1, 2)])
def test_transposed_convolution(nd, stride, padding, output_padding, dilation, groups):
    fn = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
    run_op(lambda x, w, b: fn(x, w, b, stride, padding, output_padding, groups, dilation),
           (2, 4) + (5,) * nd, (4, 6 // groups) + (3,) * nd, (6,), rtol=1e-4)


def test_instance_norm_without_affine_parameters():
    run_op(lambda x: F.instance_norm(x) * 1.0, (2, 3, 4, 4), rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_nll_loss_with_class_weights(reduction, ignore_index):
    labels = torch.tensor([1, 0, 3, 2, 2])
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0])
    run_op(lambda x: F.cross_entropy(x, labels, weight=weight, reduction=reduction, ignore_index=ignore_index),
           (5, 4), rtol=1e-4)


def test_bernoulli_draws_each_element_with_its_own_probability():
    class Coins(nn.Module):
        def forward(self, p):
            return torch.bernoulli(p), torch.empty_like(p).bernoulli_(p.flip(1))

    model = poptorch.inferenceModel(Coins(), poptorch.Options().randomSeed(5))
    p = torch.linspace(0, 1, 11).repeat(10000, 1)
    coins, flipped = model(p)
    assert set(coins.unique().tolist()) == {0.0, 1.0}
    np.testing.assert_allclose(coins.mean(0).numpy(), p[0].numpy(), atol=0.025)
    np.testing.assert_allclose(flipped.mean(0).numpy(), p[0].flip(0).numpy(), atol=0.025)
    assert (coins[:, 0] == 0).all() and (coins[:, -1] == 1).all()


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    """Kolmogorov-Smirnov: the largest distance between the samples' distribution function and `cdf`."""
    x = samples.double().sort().values
    f, n = cdf(x), x.numel()
    return float(torch.maximum(torch.arange(1, n + 1) / n - f, f - torch.arange(n) / n).max())


def test_in_place_samplers_follow_their_distributions():
    class Samplers(nn.Module):
        def forward(self, x):
            return (torch.empty_like(x).exponential_(2.5), torch.empty_like(x).cauchy_(-1.0, 0.5),
                    torch.empty_like(x).log_normal_(0.3, 0.6), torch.empty_like(x).geometric_(0.3),
                    torch.randint(3, 10, x.shape), torch.randint_like(x, 4))

    n = 20000
    x = torch.zeros(n)
    e, c, ln, g, ints, like = poptorch.inferenceModel(Samplers(), poptorch.Options().randomSeed(7))(x)
    limit = 1.95 / n ** 0.5     # the KS test's critical value at a 0.1% level
    assert e.min() > 0 and ks_statistic(e, lambda v: 1 - torch.exp(-2.5 * v)) < limit
    assert ks_statistic(c, lambda v: 0.5 + torch.atan((v + 1.0) / 0.5) / torch.pi) < limit
    normal = torch.distributions.Normal(0.3, 0.6)
    assert ln.min() > 0 and ks_statistic(ln, lambda v: normal.cdf(v.log())) < limit
    k = torch.arange(1, 13)
    expected = torch.cat([0.7 ** (k - 1) * 0.3, torch.tensor([0.7 ** 12])]) * n
    counts = torch.stack([(g == v).sum() for v in k] + [(g > 12).sum()])
    assert g.dtype == torch.float32 and g.min() >= 1 and ((counts - expected) ** 2 / expected).sum() < 35
    assert ints.dtype == torch.int32 and set(ints.unique().tolist()) == set(range(3, 10))
    counts = torch.bincount(ints - 3).double()
    assert ((counts - n / 7) ** 2 / (n / 7)).sum() < 25
    assert like.dtype == torch.float32 and set(like.unique().tolist()) == {0.0, 1.0, 2.0, 3.0}


def test_multinomial_draws_in_proportion_to_the_weights():
    class Draws(nn.Module):
        def forward(self, w):
            return torch.multinomial(w, 3), torch.multinomial(w[0], 2000, replacement=True)

    w = torch.tensor([1.0, 0.0, 2.0, 5.0, 2.0]).repeat(4000, 1)
    without, with_ = poptorch.inferenceModel(Draws(), poptorch.Options().randomSeed(3))(w)
    p = w[0] / w[0].sum()
    assert without.shape == (4000, 3) and with_.shape == (2000,)
    # without replacement: distinct categories, never a weight-0 one; the first is drawn with p
    assert (without.sort(1).values.diff(dim=1) > 0).all() and not (without == 1).any()
    np.testing.assert_allclose(torch.bincount(without[:, 0], minlength=5).numpy() / 4000, p.numpy(), atol=0.03)
    # the second given the first: P(second = j | first = 3) = p_j / (1 - p_3)
    second = without[without[:, 0] == 3, 1]
    np.testing.assert_allclose(torch.bincount(second, minlength=5).numpy() / second.numel(),
                               (p / (1 - p[3])).index_fill(0, torch.tensor(3), 0).numpy(), atol=0.04)
    np.testing.assert_allclose(torch.bincount(with_, minlength=5).numpy() / 2000, p.numpy(), atol=0.04)


def test_samplers_follow_options_random_seed():
    class Draw(nn.Module):
        def forward(self, x):
            return torch.empty_like(x).exponential_(), torch.multinomial(x.abs() + 1, 4), torch.randint(0, 100, x.shape)

    x = torch.zeros(2, 6)

    def draw(seed):
        return poptorch.inferenceModel(Draw(), poptorch.Options().randomSeed(seed))(x)

    first, again, other = draw(11), draw(11), draw(12)
    for a, b, c in zip(first, again, other):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_randint_beyond_int32_is_refused():
    class Draw(nn.Module):
        def forward(self, x):
            return torch.randint(0, 2 ** 33, x.shape)

    with pytest.raises(UnsupportedOpError, match=r"randint's range \[0, 8589934592\) is beyond int32"):
        poptorch.inferenceModel(Draw())(torch.zeros(3))


def lower(fn, *shapes):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])

        def forward(self, r):
            return poptorch.identity_loss((fn(*self.ps) * r).sum(), reduction="sum")
    joint = capture_joint(Model().train(), (torch.ones(()),), {}, training=True, decompositions=decompositions())
    return to_ir(joint, PipelinedExecution())[0]


def test_index_ops_become_int32_gathers_and_scatters():
    ir = lower(lambda x: x[torch.tensor([2, 0]), :, torch.tensor([1, -1])], (3, 2, 4))
    ops = [n.op for n in ir.nodes]
    assert "gather" in ops and "scatter" in ops   # the backward of indexing is index_put with accumulate
    gather = next(n for n in ir.nodes if n.op == "gather")
    assert gather.inputs[1].dtype == np.int32 and gather.attrs["axis"] == 1


def test_indices_beyond_int32_are_refused_naming_the_limit():
    class Huge(nn.Module):
        def forward(self, x, i):
            return x[i, i]

    x = torch.zeros(1).expand(2**16, 2**16)   # 2^32 elements, one stored
    joint = capture_joint(Huge(), (x, torch.tensor([1])), {}, training=False, decompositions=decompositions())
    with pytest.raises(UnsupportedOpError, match=r"2147483647: index fewer elements"):
        to_ir(joint, PipelinedExecution())


def test_int64_constants_beyond_int32_are_refused():
    class Big(nn.Module):
        def forward(self, x):
            return x + torch.tensor([2**40])

    joint = capture_joint(Big(), (torch.tensor([1]),), {}, training=False, decompositions=decompositions())
    with pytest.raises(UnsupportedOpError, match="values beyond int32, and the IPU has no int64"):
        to_ir(joint, PipelinedExecution())


@pytest.mark.parametrize("kernel,stride,padding,size", [(2, 2, 0, 5), (3, 2, 1, 6), (3, 3, 1, 7), (2, 1, 0, 4)])
def test_max_pooling_in_ceil_mode(kernel, stride, padding, size):
    run_op(lambda x: F.max_pool2d(x, kernel, stride, padding, ceil_mode=True), (2, 3, size, size + 1))


@pytest.mark.parametrize("size,scale", [(None, 2), ((5, 7), None), (None, 0.5), (None, 1.5)])
def test_nearest_interpolation_and_its_gradient(size, scale):
    run_op(lambda x: F.interpolate(x, size=size, scale_factor=scale), (2, 3, 6, 4))


@pytest.mark.parametrize("kernel,stride,padding,size,include_pad,divisor", [
    (2, 2, 0, 5, True, None), (3, 2, 1, 6, True, None), (3, 2, 1, 6, False, None), (3, 3, 1, 7, True, None),
    (3, 2, 1, 8, False, 4), (2, 1, 0, 4, True, 3)])
def test_average_pooling_in_ceil_mode_and_with_a_divisor(kernel, stride, padding, size, include_pad, divisor):
    run_op(lambda x: F.avg_pool2d(x, kernel, stride, padding, True, include_pad, divisor), (2, 3, size, size + 1))
    run_op(lambda x: F.avg_pool1d(x, kernel, stride, padding, True, include_pad), (2, 3, size))


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil", [
    (3, 1, 1, 2, False), (2, 2, 0, 2, True), ((3, 2), (2, 1), (1, 0), (2, 3), False), (3, 2, 1, 2, True)])
def test_dilated_max_pooling(kernel, stride, padding, dilation, ceil):
    run_op(lambda x: F.max_pool2d(x, kernel, stride, padding, dilation, ceil), (2, 3, 9, 8))
    k, s, p, d = (v if isinstance(v, int) else v[0] for v in (kernel, stride, padding, dilation))
    run_op(lambda x: F.max_pool1d(x, k, s, p, d, ceil), (2, 3, 9))


@pytest.mark.parametrize("size", [(2, 3), 1, (5, 4), (None, 2)])
def test_adaptive_max_pooling(size):
    run_op(lambda x: F.adaptive_max_pool2d(x, size), (2, 3, 5, 7))


def test_adaptive_max_pooling_1d_and_unbatched_pooling():
    run_op(lambda x: F.adaptive_max_pool1d(x, 3), (2, 3, 7))
    run_op(lambda x: F.max_pool2d(x, 2, 1) + F.avg_pool2d(x, 2, 1, ceil_mode=True), (3, 5, 4))


@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool3d(x, (2, 3, 2), (1, 2, 1), (1, 1, 0), (2, 1, 1), True),
    lambda x: F.avg_pool3d(x, 3, 2, 1, True, False),
    lambda x: F.avg_pool3d(x, (2, 2, 3), 1, 0, False, True, 5),
    lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)),
    lambda x: F.adaptive_max_pool3d(x, (3, 2, 2)),
    lambda x: F.max_pool3d(x[0], 2, 1)])     # unbatched
def test_three_dimensional_pooling_and_its_gradient(pool):
    run_op(pool, (2, 3, 5, 6, 7))


@pytest.mark.parametrize("pool", [lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True),
                                  lambda x: F.adaptive_max_pool3d(x, (2, 3, 2), return_indices=True)])
def test_three_dimensional_max_pooling_indices_are_torch_indices(pool):
    def op(x):
        values, indices = pool(rounded(x))
        return values + indices.float()
    run_op(op, (2, 2, 5, 6, 5))


@pytest.mark.parametrize("stride,padding,dilation,groups", [(1, 0, 1, 1), ((2, 1, 2), (1, 0, 2), (1, 2, 1), 2)])
def test_three_dimensional_convolution(stride, padding, dilation, groups):
    run_op(lambda x, w, b: F.conv3d(x, w, b, stride, padding, dilation, groups), (2, 4, 5, 6, 7),
           (6, 4 // groups, 3, 2, 3), (6,), rtol=1e-4)


@pytest.mark.parametrize("stride,padding,output_padding,groups", [(2, 0, 1, 1), ((1, 2, 2), (0, 1, 1), (0, 1, 0), 2)])
def test_three_dimensional_transposed_convolution(stride, padding, output_padding, groups):
    run_op(lambda x, w, b: F.conv_transpose3d(x, w, b, stride, padding, output_padding, groups),
           (2, 4, 3, 4, 3), (4, 6 // groups, 2, 3, 3), (6,), rtol=1e-4)


def rounded(t):
    """t rounded to integers (many equal values), with t's gradient (round's own is zero)."""
    return t + (t.round() - t).detach()


@pytest.mark.parametrize("fn", [torch.cummax, torch.cummin])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cummax_and_cummin_values_positions_and_gradient(fn, dim):
    def op(x):
        values, indices = fn(x, dim)
        return values * 2.0 + indices.float()
    run_op(op, (4, 5, 3))
    run_op(lambda x: fn(rounded(x), dim).values, (4, 5, 3))   # ties: the gradient goes to the last equal position


def test_cummax_of_integers_and_booleans():
    class Running(nn.Module):
        def forward(self, i, b):
            return torch.cummax(i, 1), torch.cummin(b, 0)

    i, b = torch.randint(-3, 4, (3, 6)), torch.rand(5, 2) > 0.5
    (vi, pi), (vb, pb) = poptorch.inferenceModel(Running())(i, b)
    (wi, qi), (wb, qb) = Running()(i, b)
    assert torch.equal(vi, wi.int()) and torch.equal(pi, qi.int()) and torch.equal(vb, wb) and torch.equal(pb, qb.int())


def test_cumulative_ops_and_scatters_of_a_zero_dim_tensor():
    # cummax's gradient is a scatter_add into a 0-d tensor
    run_op(lambda x: torch.cummax(x[0], 0).values * 2 + torch.logcumsumexp(x[0], 0), (1,))
    run_op(lambda x, s: x[0].scatter_reduce(0, torch.tensor(0), s[0], "amax", include_self=False), (1,), (1,))


@pytest.mark.parametrize("dim", [0, -1])
def test_logcumsumexp_and_its_gradient(dim):
    run_op(lambda x: torch.logcumsumexp(x, dim), (5, 4), rtol=1e-4)
    run_op(lambda x: torch.logcumsumexp(x * 100.0, dim), (5, 4), rtol=1e-4)   # exp would overflow float32


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size,scale", [(None, 2), ((7, 9), None), (None, 0.5), (None, 1.7), ((4, 3), None),
                                        ((1, 6), None)])
def test_bilinear_interpolation_and_its_gradient(size, scale, align_corners):
    run_op(lambda x: F.interpolate(x, size=size, scale_factor=scale, mode="bilinear", align_corners=align_corners),
           (2, 3, 4, 5), rtol=1e-4)


@pytest.mark.parametrize("align_corners", [False, True])
def test_linear_interpolation_and_its_gradient(align_corners):
    run_op(lambda x: F.interpolate(x, size=11, mode="linear", align_corners=align_corners), (2, 3, 5), rtol=1e-4)
    run_op(lambda x: F.interpolate(x, scale_factor=0.6, mode="linear", align_corners=align_corners), (2, 3, 5),
           rtol=1e-4)


@pytest.mark.parametrize("reduce", ["amax", "amin", "sum", "prod", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_reduce_and_its_gradient(reduce, include_self, dim):
    index = torch.tensor([[0, 1, 1, 3], [2, 2, 0, 0], [1, 1, 1, 1]])
    index = index if dim == 1 else index[:, :3].T.contiguous()   # some positions receive nothing
    shape = (3, 5) if dim == 1 else (4, 3)

    def op(x, s):   # rounded: ties between the base and the sources, which share the gradient
        return rounded(x).scatter_reduce(dim, index, rounded(s), reduce, include_self=include_self)
    run_op(op, shape, tuple(index.shape))


@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
    lambda x: F.max_pool2d(x, (3, 2), 1, (1, 0), 2, True, return_indices=True),
    lambda x: F.max_pool1d(x[0], 3, 2, 1, 2, True, return_indices=True),
    lambda x: F.adaptive_max_pool2d(x, (2, 3), return_indices=True),
    lambda x: F.adaptive_max_pool1d(x[0], 4, return_indices=True)])
def test_max_pooling_indices_are_torch_indices(pool):
    def op(x):
        values, indices = pool(rounded(x))   # ties: the first maximum of the window
        return values + indices.float()
    run_op(op, (2, 3, 7, 6))


def test_max_pooling_indices_of_windows_of_padding_only():
    class Pool(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, (2, 1), 1, (1, 0), (3, 1), return_indices=True)

    x = torch.tensor([[[[0.5], [-1.0]]]])
    values, indices = poptorch.inferenceModel(Pool())(x)
    want_values, want_indices = Pool()(x)
    assert torch.equal(values, want_values) and torch.equal(indices.long(), want_indices)


def test_a_constant_gradient_still_trains_its_weight():
    """floor's gradient is zeros, a constant: the weight still gets it (anchored) and its
    optimiser still applies weight decay, as in PyTorch."""
    class Floor(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.tensor([1.5, -2.25, 3.0]))
            self.q = nn.Parameter(torch.tensor([0.5, 1.0, 2.0]))

        def forward(self, x):
            return poptorch.identity_loss((torch.floor(self.p) * x + self.q * x).sum(), reduction="sum")

    model = Floor()
    ref = Floor()
    opts = poptorch.Options().anchorTensor("g", "Gradient___p")
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5))
    x = torch.tensor([1.0, 2.0, 3.0])
    training(x)
    assert torch.equal(training.getAnchoredTensor("g"), torch.zeros(3))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.5)
    ref(x).backward()
    optimizer.step()
    torch.testing.assert_close(model.p.detach(), ref.p.detach())
    torch.testing.assert_close(model.q.detach(), ref.q.detach())


@pytest.mark.parametrize("beta,alpha", [(0, 1.5), (0.5, 0), (0, 0), (0.5, 1.5)])
def test_addmm_and_addmv_ignore_the_term_of_a_zero_factor(beta, alpha):
    """As eager PyTorch: a zero beta ignores the input's NaNs, a zero alpha the product's."""
    class Add(nn.Module):
        def forward(self, bias, mat, vec, bias2d, mat2):
            return (torch.addmv(bias, mat, vec, beta=beta, alpha=alpha),
                    torch.addmm(bias2d, mat, mat2, beta=beta, alpha=alpha))

    torch.manual_seed(0)
    args = [torch.randn(4), torch.randn(4, 3), torch.randn(3), torch.randn(4, 5), torch.randn(3, 5)]
    for t in args:
        t.view(-1)[0] = float("nan")
    if beta != 0:
        args[0][0] = args[3][0, 0] = 1.0
    if alpha != 0:
        args[1][0, 0] = args[2][0] = args[4][0, 0] = 1.0
    for got, want in zip(poptorch.inferenceModel(Add())(*args), Add()(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [F.hardshrink, F.softshrink])
def test_shrink_gradients(fn):
    run_op(lambda x: fn(x, 0.3), (6, 5))


def test_rrelu_uses_the_mean_slope_in_inference():
    x = torch.randn(50)
    torch.testing.assert_close(poptorch.inferenceModel(nn.RReLU(0.1, 0.3).eval())(x), nn.RReLU(0.1, 0.3).eval()(x))


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_boolean_mask_assignment_broadcasts_its_value(accumulate):
    class Put(nn.Module):
        def forward(self, x, mask, v):
            return x.index_put((mask,), v, accumulate=accumulate), x.index_put((mask[:, 0],), v, accumulate=accumulate)

    torch.manual_seed(0)
    x, mask, v = torch.randn(2, 3, 4, 5), torch.rand(2, 3) > 0.5, torch.randn(5)
    for got, want in zip(poptorch.inferenceModel(Put())(x, mask, v), Put()(x, mask, v)):
        torch.testing.assert_close(got, want)


def test_a_value_per_masked_position_is_refused():
    class Put(nn.Module):
        def forward(self, x, mask, v):
            x[mask] = v
            return x

    mask = torch.tensor([True, False, True])
    with pytest.raises(UnsupportedOpError, match="count, which depends on the data"):
        poptorch.inferenceModel(Put())(torch.zeros(3, 2), mask, torch.ones(2, 2))


@pytest.mark.parametrize("dim,size,step", [(1, 3, 2), (0, 2, 1), (-1, 7, 3)])
def test_unfold_and_its_gradient(dim, size, step):
    run_op(lambda x: x.unfold(dim, size, step) * 1.0, (4, 7))


@pytest.mark.parametrize("shape,scale", [((1, 2, 5), 2), ((1, 2, 3, 2, 4), (2, 1, 3)), ((1, 1, 4, 3), 1.5)])
def test_nearest_upsampling_gradient_in_1_to_3_dimensions(shape, scale):
    run_op(lambda x: F.interpolate(x, scale_factor=scale, mode="nearest"), shape)


def test_bilinear_and_its_gradients():
    run_op(lambda x1, x2, w, b: F.bilinear(x1, x2, w, b), (4, 3), (4, 5), (2, 3, 5), (2,), rtol=1e-4)


@pytest.mark.parametrize("dim", [0, 1, None])
def test_weight_norm_trains_its_direction_and_magnitude(dim):
    torch.manual_seed(0)
    model = nn.utils.weight_norm(nn.Linear(6, 4), "weight", dim)
    ref = nn.utils.weight_norm(nn.Linear(6, 4), "weight", dim)
    ref.load_state_dict(model.state_dict())

    class Loss(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return poptorch.identity_loss((self.lin(x) ** 2).sum(), reduction="sum")

    x = torch.randn(3, 6)
    poptorch.trainingModel(Loss(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(x)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    Loss(ref)(x).backward()
    optimizer.step()
    for name in ("weight_g", "weight_v"):
        torch.testing.assert_close(getattr(model, name).detach(), getattr(ref, name).detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_offsets_padding_and_an_empty_bag(mode):
    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 3, mode=mode, padding_idx=2)

        def forward(self, x, offsets):
            return self.bag(x, offsets)

    torch.manual_seed(0)
    model = Bags()
    x, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 2]), torch.tensor([0, 3, 3, 8])
    torch.testing.assert_close(poptorch.inferenceModel(model)(x, offsets), model(x, offsets))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_gradient(mode):
    x = torch.tensor([[1, 2, 4], [4, 3, 9]])
    run_op(lambda w: F.embedding_bag(x, w, mode=mode), (10, 3))


@pytest.mark.parametrize("reduce", ["prod", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_prod_and_mean(reduce, include_self):
    class Scatter(nn.Module):
        def forward(self, x, i, s):
            return x.scatter_reduce(1, i, s, reduce, include_self=include_self)

    torch.manual_seed(0)
    x, i, s = torch.randn(3, 4), torch.randint(4, (3, 6)), torch.randn(3, 6)
    torch.testing.assert_close(poptorch.inferenceModel(Scatter())(x, i, s), Scatter()(x, i, s))


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize("boundaries", [[1.0, 2.5, 2.5, 4.0, 9.0], [1, 2, 3, 6, 4, 5], [0.5]])
def test_bucketize_is_torchs_binary_search(right, boundaries):
    class Buckets(nn.Module):
        def forward(self, x, b):
            return torch.bucketize(x, b, right=right)

    x = torch.tensor([[0.0, 1.0, 2.5, 3.0], [4.0, 5.0, 6.0, 10.0]])
    b = torch.tensor(boundaries)
    got, want = poptorch.inferenceModel(Buckets())(x, b), Buckets()(x, b)
    assert torch.equal(got.long(), want)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    class Reduce(nn.Module):
        def forward(self, x, i, s):
            return x.index_reduce(1, i, s, reduce, include_self=include_self)

    torch.manual_seed(0)
    x, i, s = torch.randn(3, 5, 2), torch.tensor([4, 0, 4, 1]), torch.randn(3, 4, 2)
    torch.testing.assert_close(poptorch.inferenceModel(Reduce())(x, i, s), Reduce()(x, i, s))


def test_batch_norm_without_affine_parameters_in_eval_mode():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, affine=False).eval()
    norm.running_mean.uniform_(-1, 1)
    norm.running_var.uniform_(0.5, 2)
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(poptorch.inferenceModel(norm)(x), norm(x))


def test_batch_norm_of_a_5d_input_and_its_gradient():
    run_op(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (2, 3, 2, 3, 4), (3,), (3,), rtol=1e-4)


def test_index_select_of_a_0d_tensor_and_index_reduce_gradient():
    index = torch.tensor([0, 0])
    run_op(lambda x, s: x.index_reduce(0, index, s, "amax"), (1,), (2,))
    run_op(lambda x: (x.sum() * 1.0).index_select(0, torch.tensor(0)) * 2.0, (3,))


@pytest.mark.parametrize("op", [torch.gt, torch.lt, torch.eq])
@pytest.mark.parametrize("int_type", [torch.int32, torch.int64])
@pytest.mark.parametrize("float_type", [torch.float16, torch.float32, torch.float64])
def test_comparisons_mixing_integer_and_float_tensors_promote_as_pytorch_does(op, int_type, float_type):
    """An integer tensor against a floating one compares in the floating dtype it has on the IPU
    (float64 arrives as float32), not in NumPy's float64, which the IPU does not have."""
    class Compare(nn.Module):
        def forward(self, x, y):
            return op(x, y), op(y, x)

    x = torch.tensor([1, -1, 2, 550, 3], dtype=int_type)
    y = torch.tensor([2.4, -2, 2.0, 32.4, 3.5], dtype=float_type)
    for got, want in zip(poptorch.inferenceModel(Compare())(x, y), Compare()(x, y)):
        assert got.dtype == torch.bool
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_normal_with_a_tensor_mean_or_std_and_in_place_uniform(dtype):
    """torch.normal(tensor mean, float std), torch.normal(float mean, tensor std) and
    x.uniform_(): drawn on the device in the tensor's dtype with the requested moments."""
    class Model(nn.Module):
        def forward(self, mean, std):
            return torch.normal(mean, 2.0), torch.normal(-1.0, std), (mean + 0).uniform_(3.0, 4.0)

    mean = torch.full((20000,), 5.0, dtype=dtype)
    std = torch.full((20000,), 0.5, dtype=dtype)
    by_mean, by_std, uniform = poptorch.inferenceModel(Model())(mean, std)
    assert by_mean.dtype == by_std.dtype == uniform.dtype == dtype
    assert abs(by_mean.float().mean() - 5.0) < 0.1 and abs(by_mean.float().std() - 2.0) < 0.1
    assert abs(by_std.float().mean() + 1.0) < 0.05 and abs(by_std.float().std() - 0.5) < 0.05
    assert uniform.min() >= 3.0 and uniform.max() <= 4.0 and abs(uniform.float().mean() - 3.5) < 0.05


def test_torch_distributions_sample_on_the_device_without_their_argument_checks():
    """A distribution's argument checks branch on tensor values, which the capture does not have:
    they are off while the model is traced (as in PopTorch) and on again after."""
    class Model(nn.Module):
        def forward(self, low, mean):
            uniform = torch.distributions.Uniform(low, torch.tensor([10.0])).sample((4000,))
            normal = torch.distributions.Normal(mean, 2.0).sample((4000,))
            return uniform, normal

    before = torch.distributions.Distribution._validate_args
    uniform, normal = poptorch.inferenceModel(Model())(torch.tensor([2.0]), torch.tensor([-3.0]))
    assert torch.distributions.Distribution._validate_args == before
    assert uniform.shape == normal.shape == (4000, 1)
    assert uniform.min() >= 2.0 and uniform.max() <= 10.0 and abs(uniform.mean() - 6.0) < 0.3
    assert abs(normal.mean() + 3.0) < 0.2 and abs(normal.std() - 2.0) < 0.2


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_small_integer_tensors_cross_in_their_dtype_and_convert_on_the_device(dtype):
    class Model(nn.Module):
        def forward(self, x):
            return x, x.float() + x.float(), x.int(), x.reshape(10, 10), x.half()

    x = torch.arange(100).to(dtype)
    for got, want in zip(poptorch.inferenceModel(Model())(x), Model()(x)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_arithmetic_on_or_into_small_integer_tensors_is_refused_naming_the_dtype():
    class Add(nn.Module):
        def forward(self, x):
            return x + x

    class Into(nn.Module):   # arithmetic whose result is int8 (a conversion into int8 is supported)
        def forward(self, x):
            return x.to(torch.int8) * x.to(torch.int8)

    with pytest.raises(UnsupportedOpError, match=r"aten.add.Tensor .* on or into torch.int8 tensors.*x.int\(\)"):
        poptorch.inferenceModel(Add())(torch.arange(10).to(torch.int8))
    with pytest.raises(UnsupportedOpError, match="aten.mul.Tensor .* on or into torch.int8 tensors"):
        poptorch.inferenceModel(Into())(torch.arange(10))


def test_conversions_into_small_ints_wrap_as_torch():
    class Convert(nn.Module):
        def forward(self, x, i, b):
            return x.byte(), x.char(), x.short(), i.byte(), i.char(), i.short(), b.byte(), x.char().short(), \
                i.short().byte(), torch.eye(4, dtype=torch.uint8)

    x = torch.tensor([-1.5, -0.7, 0.7, 255.9, 256.5, 300.7, -129.5, -200., 1e5, -1e5, 3e9, -3e9, 40000.,
                      float("nan"), float("inf"), float("-inf")])
    i = torch.tensor([-1, 255, 256, 300, -129, 70000, -70000, 2 ** 31 - 1], dtype=torch.int32)
    b = torch.tensor([True, False])
    got = poptorch.inferenceModel(Convert())(x, i, b)
    for g, want in zip(got, Convert()(x, i, b)):
        assert g.dtype == want.dtype and torch.equal(g, want), (g, want)


def test_a_weight_whose_gradient_is_zero_is_trained_and_anchored():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.ones(3))
            self.q = nn.Parameter(torch.full((2, 2), 2.0))

        def forward(self, x):
            filled = torch.fill(self.p, 4.0)             # no op reads p's values
            identity = torch.linalg.matrix_power(self.q, 0)
            return poptorch.identity_loss((filled * x).sum() + identity.sum(), reduction="sum")

    model = Model()
    opts = poptorch.Options().anchorTensor("gp", "Gradient___p").anchorTensor("gq", "Gradient___q")
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5))
    training(torch.ones(3))
    assert torch.equal(training.getAnchoredTensor("gp"), torch.zeros(3))
    assert torch.equal(training.getAnchoredTensor("gq"), torch.zeros(2, 2))
    # trained like any weight: weight decay alone moves it, p - lr * decay * p
    np.testing.assert_allclose(model.p.detach().numpy(), np.full(3, 0.95), rtol=1e-6)


def test_threshold_backward_with_a_threshold_other_than_zero():
    run_op(lambda x: F.threshold(x, 0.3, -2.0), (4, 5), rtol=1e-5)


def test_a_scalars_reduction_over_dimension_zero_is_itself():
    run_op(lambda x: torch.logsumexp(x.sum(), (0,), keepdim=True) * 2.0, (3,), rtol=1e-5)


@pytest.mark.parametrize("pad", [(2, 1), (1, 2, 0, 3), (-1, 2, 1, 0), (1, 0, 2, 1, 1, 1)])
def test_replication_pad_backward(pad):
    shape = (2, 3) + (5,) * (len(pad) // 2)
    run_op(lambda x: F.pad(x, pad, mode="replicate") * 1.0, shape, rtol=1e-5)


@pytest.mark.parametrize("p,weighted,reduction", [(1, False, "mean"), (2, True, "sum"), (1, True, "none")])
def test_multi_margin_loss_backward(p, weighted, reduction):
    target = torch.tensor([0, 3, 2, 3, 1])
    weight = torch.tensor([0.5, 2.0, 1.0, 1.5]) if weighted else None
    run_op(lambda x: F.multi_margin_loss(x, target, p=p, margin=0.8, weight=weight, reduction=reduction), (5, 4),
           rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss_backward(reduction):
    target = torch.tensor([[3, 0, -1, 1, 2], [1, 2, 4, -1, -1], [-1, 0, 0, 0, 0], [4, 3, 2, 1, 0]])
    run_op(lambda x: F.multilabel_margin_loss(x, target, reduction=reduction), (4, 5), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batch_chunked_linear_cross_entropy_trains_as_the_unchunked(reduction):
    """PyTorch's chunked form (a torch.library op precomputing its gradients) traced through its
    implementation; the gradient of an unbatched input is made after the backward (a view again)."""
    target = torch.tensor([2, 0, 4, 1, 4])
    run_op(lambda x, w, b: F.linear_cross_entropy(x, w, target, linear_bias=b, reduction=reduction,
                                                  options=nn.LinearCrossEntropyOptions(batch_chunk_size=2)),
           (5, 3), (6, 3), (6,), rtol=1e-5)
    run_op(lambda x, w: F.linear_cross_entropy(x, w, target[0], reduction=reduction,
                                               options=nn.LinearCrossEntropyOptions(batch_chunk_size=2)),
           (3,), (6, 3), rtol=1e-5)


def test_nll_loss_of_one_sample():
    run_op(lambda x: F.cross_entropy(x, torch.tensor(2)) * 1.0, (5,), rtol=1e-5)
    run_op(lambda x: F.cross_entropy(x, torch.tensor(1), reduction="none") * 1.0, (4,), rtol=1e-5)


@pytest.mark.parametrize("reduction,full", [("mean", False), ("sum", True), ("none", False)])
def test_gaussian_nll_loss_with_a_variance_tensor(reduction, full):
    target = torch.linspace(-1, 1, 12).reshape(4, 3)
    run_op(lambda x, v: F.gaussian_nll_loss(x, target, v.abs() + 0.1, full=full, reduction=reduction), (4, 3), (4, 3),
           rtol=1e-5)
    run_op(lambda x, v: F.gaussian_nll_loss(x, target, v.abs(), reduction=reduction), (4, 3), (4,), rtol=1e-5)
    run_op(lambda x: F.gaussian_nll_loss(x, target, 0.5, reduction=reduction), (4, 3), rtol=1e-5)


@pytest.mark.parametrize("add_zero_attn", [False, True])
def test_multi_head_attention_forward_without_dropout(add_zero_attn):
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    mask = torch.randn(3, 5)

    def mha(w, b, bias_k, bias_v, out_w, out_b):
        out, weights = F.multi_head_attention_forward(q, k, v, 4, 2, w, b, bias_k, bias_v, add_zero_attn, 0.0, out_w,
                                                      out_b, training=True, attn_mask=mask)
        return out * 1.0 + weights.sum() * 0.5

    run_op(mha, (12, 4), (12,), (1, 1, 4), (1, 1, 4), (4, 4), (4,), rtol=1e-4)


@pytest.mark.parametrize("is_causal,mask,kv_heads", [(False, None, 4), (True, None, 2), (True, None, 4),
                                                     (False, "float", 2)])
def test_cpu_flash_attention_op_gives_its_log_sum_exp(is_causal, mask, kv_heads):
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    torch.manual_seed(2)
    k, v = torch.randn(2, kv_heads, 5, 6), torch.randn(2, kv_heads, 5, 6)
    m = None if mask is None else torch.randn(2, 4, 3, 5)

    class Attention(nn.Module):
        def forward(self, q):
            return flash(q, k, v, is_causal=is_causal, attn_mask=m, scale=0.3)

    q = torch.randn(2, 4, 3, 6)
    got = poptorch.inferenceModel(Attention())(q)
    for g, want in zip(got, Attention()(q)):
        np.testing.assert_allclose(g.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    run_op(lambda q: flash(q, k, v, is_causal=is_causal, attn_mask=m, scale=0.3)[0] * 1.0, (2, 4, 3, 6), rtol=1e-4)


@pytest.mark.parametrize("correction", [0, 1])
def test_cov_and_corrcoef_with_their_gradients(correction):
    fw, aw = torch.tensor([1, 2, 1, 3, 1]), torch.tensor([0.5, 1.0, 2.0, 0.25, 1.0])
    run_op(lambda x: torch.cov(x, correction=correction), (3, 5), rtol=1e-4)
    run_op(lambda x: torch.cov(x, correction=correction, fweights=fw, aweights=aw), (3, 5), rtol=1e-4)
    run_op(lambda x: torch.corrcoef(x) * 1.0, (3, 5), rtol=1e-4)
    run_op(lambda x: x.cov(correction=correction), (5,), rtol=1e-4)


@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, float("inf")])
def test_pdist_and_its_gradient(p):
    run_op(lambda x: F.pdist(x, p), (5, 3), rtol=1e-4)


def test_triangle_indices_are_constants():
    class Triangles(nn.Module):
        def forward(self, x):
            return torch.triu_indices(4, 5, 1) + x, torch.tril_indices(3, 4, -1) + x

    x = torch.zeros((), dtype=torch.int32)
    for got, want in zip(poptorch.inferenceModel(Triangles())(x), Triangles()(x)):
        assert torch.equal(got.long(), want.long())
