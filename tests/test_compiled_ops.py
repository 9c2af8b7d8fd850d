"""Every supported op through the whole compiler (capture, IR, autodiff, lowering, engine): the
forward value and the gradient against PyTorch autograd.

The op's input is a parameter; the loss is sum(op(x) * r) for a random r. One SGD step with
lr=1 leaves x - grad on the device, so the gradient comes back through the weights.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import poptorch_lite as poptorch


class Fn(nn.Module):
    """A model whose forward is `fn` of its inputs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class OpModel(nn.Module):
    def __init__(self, fn, *shapes):
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])

    def forward(self, r, labels=None):
        args = list(self.params) if labels is None else list(self.params) + [labels.view(-1)]
        y = self.fn(*args)
        return y, poptorch.identity_loss(y * r, reduction="sum")


def run_op(fn, *shapes, labels=None, atol=1e-5, rtol=1e-5):
    torch.manual_seed(0)
    model = OpModel(fn, *shapes)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        y_ref = fn(*ref.params, *(() if labels is None else (labels,)))
    r = torch.randn(y_ref.shape)
    opts = poptorch.Options()
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1.0))
    args = (r[None],) if labels is None else (r[None], labels[None])
    y, _ = training(*args)
    y = y.reshape(y_ref.shape)
    np.testing.assert_allclose(y.detach().numpy(), y_ref.detach().numpy(), rtol=rtol, atol=atol)
    # reference gradient
    out, loss = ref(r, labels[None]) if labels is not None else ref(r)
    loss.backward()
    for p_dev, p_ref in zip(model.params, ref.params):
        grad_dev = (p_ref.detach() - p_dev.detach())  # x_new = x - grad
        np.testing.assert_allclose(grad_dev.numpy(), p_ref.grad.numpy(), rtol=rtol * 10, atol=atol * 10)


shape_2d = st.tuples(st.integers(1, 5), st.integers(1, 7))
SETTINGS = settings(max_examples=6, deadline=None)


@pytest.mark.parametrize("fn", [torch.relu, torch.tanh, torch.sigmoid, F.gelu, torch.exp,
                                lambda x: x.abs().add(0.5).log(), lambda x: x.abs().add(0.1).sqrt(),
                                lambda x: -x, lambda x: x * x, lambda x: x.pow(2), lambda x: x * 2.5 + 1.0,
                                lambda x: 3.0 - x, lambda x: x / 4.0])
@given(shape=shape_2d)
@SETTINGS
def test_unary(fn, shape):
    run_op(fn, shape)


@pytest.mark.parametrize("fn", [torch.add, torch.sub, torch.mul, lambda a, b: a / (b.abs() + 1.0),
                                lambda a, b: torch.matmul(a, b.T)])
@given(shape=shape_2d)
@SETTINGS
def test_binary(fn, shape):
    run_op(fn, shape, shape)


@pytest.mark.parametrize("fn", [torch.erfc, torch.special.erfcx, torch.special.i0e, torch.special.i1,
                                lambda x: torch.polygamma(1, x.abs() + 0.5), lambda a: torch.copysign(a, a - 0.3),
                                lambda x: torch.round(x, decimals=1) * x])
def test_special_functions_and_their_gradients(fn):
    run_op(fn, (3, 5), rtol=1e-4, atol=1e-5)


def test_float_tests_frexp_and_integer_not_in_inference():
    class Tests(nn.Module):
        def forward(self, x, n):
            mantissa, exponent = torch.frexp(x)
            return (torch.isinf(x), torch.signbit(x), torch.logical_xor(x, n.float()), mantissa, exponent, ~n,
                    torch.logical_not(n), torch.fmax(x, n.float()))

    x = torch.tensor([1.5, -0.0, float("inf"), -3.0, float("nan"), 1024.0])
    n = torch.tensor([0, 1, -2, 3, 0, 7], dtype=torch.int32)
    got = poptorch.inferenceModel(Tests())(x, n)
    for g, want in zip(got, Tests()(x, n)):
        assert g.dtype == want.dtype
        np.testing.assert_array_equal(g.numpy(), want.numpy())


def test_broadcasting_binary():
    run_op(lambda a, b: a * b + b, (3, 4, 5), (4, 1))


@pytest.mark.parametrize("fn", [lambda x: x.sum(), lambda x: x.mean(), lambda x: x.sum(dim=1),
                                lambda x: x.mean(dim=(0, 2), keepdim=True), lambda x: torch.softmax(x, -1),
                                lambda x: torch.log_softmax(x, 1), lambda x: x.view(-1), lambda x: x.permute(2, 0, 1),
                                lambda x: x.transpose(0, 1), lambda x: torch.flatten(x, 1), lambda x: x[:, 1:3]])
def test_reductions_softmax_views(fn):
    run_op(fn, (2, 4, 3))


@pytest.mark.parametrize("stride,padding,dilation,groups", [(1, 0, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1), (1, 1, 1, 2)])
def test_conv2d(stride, padding, dilation, groups):
    run_op(lambda x, w, b: F.conv2d(x, w, b, stride, padding, dilation, groups), (2, 4, 7, 6), (6, 4 // groups, 3, 3),
           (6,), rtol=1e-4)


@pytest.mark.parametrize("fn", [lambda x: F.max_pool2d(x, 2), lambda x: F.max_pool2d(x, 3, 2, 1),
                                lambda x: F.avg_pool2d(x, 2), lambda x: F.avg_pool2d(x, 3, 1, 1),
                                lambda x: F.adaptive_avg_pool2d(x, (2, 3))])
def test_pooling(fn):
    run_op(fn, (2, 3, 6, 6))


def test_linear_and_layer_norm():
    run_op(lambda x, w, b: F.linear(x, w, b), (3, 5), (4, 5), (4,))
    run_op(lambda x, w, b: F.layer_norm(x, (5,), w, b), (3, 5), (5,), (5,), rtol=1e-4)


def test_losses():
    labels = torch.tensor([1, 0, 3])
    run_op(lambda x, y: F.nll_loss(torch.log_softmax(x, 1), y), (3, 4), labels=labels)
    run_op(lambda x, y: F.cross_entropy(x, y, reduction="sum"), (3, 4), labels=labels)
    run_op(lambda x, t: F.mse_loss(x, t), (3, 4), (3, 4))
    run_op(lambda x, t: F.l1_loss(x, t, reduction="sum"), (3, 4), (3, 4))


def test_unsupported_op_fails_at_compile_time():
    model = OpModel(lambda x: torch.nextafter(x.half(), (x + 1).half()).float(), (3, 4))
    training = poptorch.trainingModel(model, poptorch.Options())
    with pytest.raises(poptorch.UnsupportedOpError, match=r"nextafter.*test_compiled_ops\.py:\d+"):
        training(torch.randn(1, 3, 4))


def test_embedding():
    idx = torch.tensor([3, 0, 3, 5])
    run_op(lambda w, i: F.embedding(i, w), (6, 4), labels=idx)


def test_ctc_loss():
    T, N, C, S = 6, 2, 5, 3
    targets = torch.tensor([[1, 2, 2], [3, 1, 0]])
    lengths_in = torch.tensor([6, 5])
    lengths_t = torch.tensor([3, 2])

    class CTC(nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = nn.Parameter(torch.randn(T, N, C))

        def forward(self, targets, input_lengths, target_lengths):
            lp = torch.log_softmax(self.logits, 2)
            loss = F.ctc_loss(lp, targets.view(N, S), input_lengths.view(N), target_lengths.view(N))
            return loss

    torch.manual_seed(0)
    model = CTC()
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=1.0))
    loss = training(targets[None], lengths_in[None], lengths_t[None])
    ref_loss = ref(targets, lengths_in, lengths_t)
    ref_loss.backward()
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    np.testing.assert_allclose((ref.logits - model.logits).detach().numpy(), ref.logits.grad.numpy(),
                               rtol=1e-4, atol=1e-5)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x, target):
        y = self.bn(self.conv(x))
        return y, F.mse_loss(y, target)


def test_batch_norm_trains_and_updates_running_statistics():
    torch.manual_seed(0)
    model = BatchNormNet()
    ref = copy.deepcopy(model)
    x, t = torch.randn(4, 2, 6, 6), torch.randn(4, 3, 4, 4)
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=0.1))
    y, loss = training(x, t)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ry, rloss = ref(x, t)
    rloss.backward()
    ropt.step()
    np.testing.assert_allclose(y.detach().numpy(), ry.detach().numpy(), rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert not torch.equal(model.bn.running_mean, torch.zeros(3))


def test_batch_norm_on_a_later_pipeline_stage_updates_its_statistics_on_that_ipu():
    """A buffer's update runs on the IPU of the op that makes the new value (BatchNorm's running
    statistics on the BatchNorm's stage), not on the first IPU."""
    torch.manual_seed(0)
    model = BatchNormNet()
    poptorch.BeginBlock(model.bn, "bn", ipu_id=1)
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    x, t = torch.randn(6, 2, 6, 6), torch.randn(6, 3, 4, 4)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    training(x, t)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        (ref(x[2 * k:2 * k + 2], t[2 * k:2 * k + 2])[1] / 3).backward()
    ropt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assigns = [n for n in training._executable.ir.nodes if n.op == "assign"]
    assert assigns and {n.ipu for n in assigns} == {1}


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, 64))
        self.drop = nn.Dropout(0.25)

    def forward(self, r):
        y = self.drop(self.w)
        return y, poptorch.identity_loss(y * r, reduction="sum")


def test_dropout_masks_scales_and_backpropagates_through_the_mask():
    model = DropoutNet()
    training = poptorch.trainingModel(model, poptorch.Options().randomSeed(7),
                                      torch.optim.SGD(model.parameters(), lr=1.0))
    r = torch.full((1, 64, 64), 2.0)
    y, _ = training(r)
    kept = y != 0
    assert 0.70 < kept.float().mean().item() < 0.80
    np.testing.assert_allclose(y[kept].numpy(), 1 / 0.75, rtol=1e-6)
    grad = 1.0 - model.w.detach()          # w was all ones, lr = 1
    np.testing.assert_allclose(grad[kept].numpy(), 2.0 / 0.75, rtol=1e-6)
    assert (grad[~kept] == 0).all()
    y2, _ = training(r)
    assert not torch.equal(y2 != 0, kept)   # a new mask every step


class HalfNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x, labels):
        out = torch.log_softmax(self.fc2(torch.relu(self.fc1(x))), 1)
        return out, F.nll_loss(out, labels)


def test_half_model_computes_in_float16_at_the_float16_rate():
    torch.manual_seed(0)
    x, labels = torch.randn(8, 64), torch.randint(0, 10, (8,))
    full = HalfNet()
    half = copy.deepcopy(full).half()
    models = [poptorch.inferenceModel(m, poptorch.Options()) for m in (full, half)]
    ref = full(x, labels)[0]
    out_full = models[0](x, labels)[0]
    out_half = models[1](x.half(), labels)[0]
    assert out_half.dtype == torch.float16
    np.testing.assert_allclose(out_full.numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_half.float().numpy(), ref.detach().numpy(), rtol=2e-2, atol=2e-2)
    assert models[1].last_run.cycles < models[0].last_run.cycles
