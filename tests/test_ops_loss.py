"""Losses against torch's definitions (torch is the reference here only), in both modes."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import ipusim as ip
from ipusim.ops import loss as L

TARGET = ip.Target.test(16, 64 * 1024)
REDUCTIONS = ["mean", "sum", "none"]


def variable(g, dtype, shape, name, mapping="linear"):
    t = g.addVariable(dtype, shape, name)
    if mapping == "linear":
        g.map_linearly(t, grain=4, min_elements_per_tile=8)
    elif mapping == "spread":
        g.map_linearly(t, grain=1, min_elements_per_tile=1)
    else:
        g.setTileMapping(t, mapping)
    return t


def run_both(g, prog, inputs, outputs):
    results, cycles = {}, {}
    for mode in ("strict", "fast"):
        e = ip.Engine(g, prog, mode=mode).load()
        for t, v in inputs.items():
            e.writeTensor(t, v)
        cycles[mode] = e.run()
        results[mode] = [e.readTensor(o) for o in outputs]
    assert cycles["strict"] == cycles["fast"]
    for a, b in zip(results["strict"], results["fast"]):
        np.testing.assert_array_equal(a, b)
    return results["strict"]


def torch_grads(fn, x, *args, grad, **kw):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    loss = fn(xt, *args, **kw)
    loss.backward(torch.as_tensor(grad, dtype=torch.float64))
    return loss.detach().numpy(), xt.grad.numpy()


def close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nll_and_cross_entropy_match_torch(reduction):
    N, C = 9, 7
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((N, C)).astype(np.float32)
    labels = rng.integers(0, C, N).astype(np.int32)
    labels[2] = -100
    upstream = rng.standard_normal(N).astype(np.float32) if reduction == "none" else np.float32(1.7)
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (N, C), "x")
    y = variable(g, "int32", (N,), "y", "spread")
    gr = variable(g, "float32", upstream.shape, "g", 3)
    prog = ip.Sequence()
    loss, lp = L.cross_entropy(g, x, y, prog, reduction)
    outs = [loss, lp, L.cross_entropy_backward(g, gr, x, y, prog, reduction, log_probs=lp),
            L.cross_entropy_backward(g, gr, x, y, prog, reduction),
            L.nll_loss(g, x, y, prog, reduction), L.nll_loss_backward(g, gr, x, y, prog, reduction)]
    got = run_both(g, prog, {x: logits, y: labels, gr: upstream}, outs)
    target = torch.tensor(labels, dtype=torch.long)
    ce, dce = torch_grads(F.cross_entropy, logits, target, grad=upstream, reduction=reduction)
    nll, dnll = torch_grads(F.nll_loss, logits, target, grad=upstream, reduction=reduction)
    assert got[0].shape == ce.shape
    close(got[0], ce, "cross_entropy")
    close(got[1], F.log_softmax(torch.tensor(logits, dtype=torch.float64), 1).numpy(), "log_probs")
    close(got[2], dce, "cross_entropy_backward")
    close(got[3], dce, "cross_entropy_backward recomputing log_softmax")
    close(got[4], nll, "nll_loss")
    close(got[5], dnll, "nll_loss_backward")


def test_nll_with_spatial_dimensions_and_custom_ignore_index():
    N, C, D = 3, 5, 4
    rng = np.random.default_rng(1)
    lp = rng.standard_normal((N, C, D)).astype(np.float32)
    labels = rng.integers(0, C, (N, D)).astype(np.int32)
    labels[0, 1] = labels[2, 3] = 3  # ignore_index is a real class here
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (N, C, D), "x")
    y = variable(g, "int32", (N, D), "y")
    gr = variable(g, "float32", (), "g", 0)
    prog = ip.Sequence()
    outs = [L.nll_loss(g, x, y, prog, "mean", ignore_index=3), L.nll_loss(g, x, y, prog, "none", ignore_index=3),
            L.nll_loss_backward(g, gr, x, y, prog, "mean", ignore_index=3)]
    got = run_both(g, prog, {x: lp, y: labels, gr: np.float32(1)}, outs)
    t = torch.tensor(labels, dtype=torch.long)
    mean, d = torch_grads(F.nll_loss, lp, t, grad=1.0, reduction="mean", ignore_index=3)
    close(got[0], mean, "mean")
    none = F.nll_loss(torch.tensor(lp, dtype=torch.float64), t, reduction="none", ignore_index=3)
    close(got[1], none.numpy(), "none")
    close(got[2], d, "backward")


def test_single_sample_and_all_ignored():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4,), "x")  # [C] input, scalar label
    y = variable(g, "int32", (), "y", 0)
    x2 = variable(g, "float32", (3, 4), "x2")
    y2 = variable(g, "int32", (3,), "y2")
    prog = ip.Sequence()
    outs = [L.nll_loss(g, x, y, prog), L.nll_loss(g, x2, y2, prog, "mean"), L.nll_loss(g, x2, y2, prog, "sum")]
    xv = np.array([-1.0, -2.0, -3.0, -4.0], np.float32)
    got = run_both(g, prog, {x: xv, y: np.int32(2), x2: np.ones((3, 4), np.float32), y2: np.full(3, -100, np.int32)},
                   outs)
    assert got[0] == 3.0
    assert np.isnan(got[1]) and got[2] == 0.0  # torch: mean over no targets is nan, the sum 0


def test_out_of_range_labels_on_device_match_no_class():
    """A vertex cannot raise: such a label's loss is 0 but it counts in the mean (documented)."""
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (2, 3), "x")
    y = variable(g, "int32", (2,), "y")
    gr = variable(g, "float32", (), "g", 0)
    prog = ip.Sequence()
    outs = [L.nll_loss(g, x, y, prog, "mean"), L.nll_loss_backward(g, gr, x, y, prog, "mean"),
            L.cross_entropy_backward(g, gr, x, y, prog, "mean")]
    xv = np.log(np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], np.float32))
    loss, dnll, dce = run_both(g, prog, {x: xv, y: np.array([1, 7], np.int32), gr: np.float32(1)}, outs)
    assert loss == pytest.approx(-np.log(0.3) / 2)
    np.testing.assert_allclose(dnll, [[0, -0.5, 0], [0, 0, 0]])
    np.testing.assert_allclose(dce[1], np.exp(xv[1]) / 2, rtol=1e-6)


def test_validate_labels_on_the_host():
    L.validate_labels(np.array([0, 4, -100]), 5)
    with pytest.raises(IndexError, match=r"Target 5 is out of bounds: label at index \(1,\)"):
        L.validate_labels(np.array([0, 5, 1]), 5)
    with pytest.raises(IndexError, match="Target -1"):
        L.validate_labels(np.array([[0, 1], [-1, 2]]), 5, ignore_index=0)
    with pytest.raises(TypeError, match="integer class indices"):
        L.validate_labels(np.array([0.5]), 5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["mse", "l1"])
def test_pointwise_losses_match_torch(kind, reduction):
    shape = (5, 11)
    rng = np.random.default_rng(2)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    b[0, :3] = a[0, :3]  # zero differences: l1's gradient is sign(0) = 0
    upstream = rng.standard_normal(shape).astype(np.float32) if reduction == "none" else np.float32(0.7)
    g = ip.Graph(TARGET)
    x = variable(g, "float32", shape, "x")
    t = variable(g, "float32", shape, "t", 5)
    gr = variable(g, "float32", upstream.shape, "g")
    prog = ip.Sequence()
    fwd, bwd = (L.mse_loss, L.mse_loss_backward) if kind == "mse" else (L.l1_loss, L.l1_loss_backward)
    loss, dx = fwd(g, x, t, prog, reduction), bwd(g, gr, x, t, prog, reduction)
    got = run_both(g, prog, {x: a, t: b, gr: upstream}, [loss, dx])
    ref, dref = torch_grads(F.mse_loss if kind == "mse" else F.l1_loss, a, torch.tensor(b, dtype=torch.float64),
                            grad=upstream, reduction=reduction)
    close(got[0], ref, f"{kind} {reduction}")
    close(got[1], dref, f"{kind} {reduction} backward")
    assert (dx.tiles() == x.tiles()).all()


def test_float16_losses_keep_the_input_dtype():
    g = ip.Graph(TARGET)
    x = variable(g, "float16", (6, 5), "x")
    y = variable(g, "int32", (6,), "y")
    gr = variable(g, "float16", (), "g", 0)
    prog = ip.Sequence()
    loss, lp = L.cross_entropy(g, x, y, prog)
    d = L.cross_entropy_backward(g, gr, x, y, prog, log_probs=lp)
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((6, 5)).astype(np.float16)
    yv = rng.integers(0, 5, 6).astype(np.int32)
    got = run_both(g, prog, {x: xv, y: yv, gr: np.float16(1)}, [loss, d])
    assert got[0].dtype == np.float16 and got[1].dtype == np.float16
    ref, dref = torch_grads(F.cross_entropy, xv.astype(np.float32), torch.tensor(yv, dtype=torch.long), grad=1.0)
    np.testing.assert_allclose(got[0], ref, rtol=2e-3)
    np.testing.assert_allclose(got[1], dref, rtol=1e-2, atol=2e-3)


def test_bad_arguments_are_named():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 3), "x")
    y = variable(g, "int32", (4,), "y")
    yf = variable(g, "float32", (4,), "yf")
    y5 = variable(g, "int32", (5,), "y5")
    gr = variable(g, "float32", (4,), "gr")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        L.nll_loss(g, x, y, prog, "avg")
    with pytest.raises(TypeError, match="pass int32 class indices"):
        L.cross_entropy(g, x, yf, prog)
    with pytest.raises(ValueError, match=r"must have shape \(4,\)"):
        L.nll_loss(g, x, y5, prog)
    with pytest.raises(ValueError, match="must be a scalar"):
        L.nll_loss_backward(g, gr, x, y, prog, "mean")
    with pytest.raises(ValueError, match="same shape"):
        L.mse_loss(g, x, gr, prog)


def test_loss_gradient_estimator():
    t = ip.GC200
    assert L.loss_grad_instructions(10, 2, L.MSE) == 6 + 5 * 3
    assert L.loss_grad_instructions(10, 4, L.L1) == 6 + 3 * 4
    got = L.LOSS_GRAD_VERTEX.cycles({"out": np.array([10])}, np.array([[L.MSE, 1.0]]), np.dtype("float32"), t)
    assert got.tolist() == [t.thread_cycles(21)]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 12), c=st.integers(1, 9), reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 999))
def test_property_cross_entropy_shapes(n, c, reduction, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, c)) * 3).astype(np.float32)
    labels = rng.integers(-1, c, n).astype(np.int32)  # -1 plays ignore_index
    upstream = rng.standard_normal(n).astype(np.float32) if reduction == "none" else np.float32(1)
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (n, c), "x")
    y = variable(g, "int32", (n,), "y", "spread")
    gr = variable(g, "float32", upstream.shape, "g")
    prog = ip.Sequence()
    loss, lp = L.cross_entropy(g, x, y, prog, reduction, ignore_index=-1)
    d = L.cross_entropy_backward(g, gr, x, y, prog, reduction, ignore_index=-1, log_probs=lp)
    got = run_both(g, prog, {x: logits, y: labels, gr: upstream}, [loss, d])
    ref, dref = torch_grads(F.cross_entropy, logits, torch.tensor(labels, dtype=torch.long), grad=upstream,
                            reduction=reduction, ignore_index=-1)
    if reduction == "mean" and (labels == -1).all():
        assert math.isnan(got[0]) and np.isnan(ref)
    else:
        close(got[0], ref, "loss")
    close(got[1], np.nan_to_num(dref), "gradient")
