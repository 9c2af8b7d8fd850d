"""Layer norm and batch norm against torch (the reference here only), in both modes."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import ipusim as ip
from ipusim.ops import norm as N

TARGET = ip.Target.test(16, 64 * 1024)
EPS = 1e-5


def variable(g, value, name, mapping="linear"):
    t = g.addVariable(value.dtype, value.shape, name)
    if mapping == "linear":
        g.map_linearly(t, grain=4, min_elements_per_tile=8)
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


def t64(a, grad=False):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


def close(a, b, what, tol=2e-5):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=what)


def data(seed, *shapes, offset=0.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 2 + offset).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_forward_and_backward(affine):
    xv, dyv, wv, bv = data(0, (4, 3, 5, 6), (4, 3, 5, 6), (5, 6), (5, 6), offset=3.0)
    g = ip.Graph(TARGET)
    x, dy = variable(g, xv, "x"), variable(g, dyv, "dy", 2)
    w = variable(g, wv, "w", 9) if affine != "none" else None
    b = variable(g, bv, "b") if affine == "both" else None
    prog = ip.Sequence()
    y, mean, inv_std = N.layer_norm(g, x, 2, w, b, EPS, prog)
    dx, dw, db = N.layer_norm_backward(g, dy, x, mean, inv_std, w, b, 2, prog)
    assert mean.shape == (4, 3) and (dw is None) == (w is None) and (db is None) == (b is None)
    outs = [o for o in (y, mean, inv_std, dx, dw, db) if o is not None]
    inputs = {t: v for t, v in ((x, xv), (dy, dyv), (w, wv), (b, bv)) if t is not None}
    got = dict(zip(["y", "mean", "inv_std", "dx", "dw", "db"][:len(outs)], run_both(g, prog, inputs, outs)))
    xt, wt, bt = t64(xv, True), (t64(wv, True) if w is not None else None), (t64(bv, True) if b is not None else None)
    ref = F.layer_norm(xt, (5, 6), wt, bt, EPS)
    ref.backward(t64(dyv))
    close(got["y"], ref.detach().numpy(), "y")
    close(got["mean"], xv.astype(np.float64).mean((2, 3)), "mean")
    close(got["inv_std"], 1 / np.sqrt(xv.astype(np.float64).var((2, 3)) + EPS), "inv_std")
    close(got["dx"], xt.grad.numpy(), "dx")
    if w is not None:
        close(got["dw"], wt.grad.numpy(), "dweight")
    if b is not None:
        close(got["db"], bt.grad.numpy(), "dbias")
    assert (y.tiles() == x.tiles()).all()


def test_batch_norm_training_backward_and_running_stats():
    xv, dyv, wv, bv = data(1, (4, 3, 5, 6), (4, 3, 5, 6), (3,), (3,), offset=5.0)
    rm0, rv0 = np.array([0.5, -1, 2], np.float32), np.array([1, 2, 0.5], np.float32)
    g = ip.Graph(TARGET)
    x, dy, w, b = variable(g, xv, "x"), variable(g, dyv, "dy"), variable(g, wv, "w", 4), variable(g, bv, "b", 8)
    rm, rv = variable(g, rm0, "rm", 1), variable(g, rv0, "rv")
    prog = ip.Sequence()
    y, mean, var, inv_std = N.batch_norm2d_train(g, x, w, b, EPS, prog)
    dx, dw, db = N.batch_norm2d_backward(g, dy, x, mean, inv_std, w, prog)
    N.update_running_stats(g, rm, rv, mean, var, 0.1, 4 * 5 * 6, prog)
    got = run_both(g, prog, {x: xv, dy: dyv, w: wv, b: bv, rm: rm0, rv: rv0}, [y, mean, var, dx, dw, db, rm, rv])
    xt, wt, bt = t64(xv, True), t64(wv, True), t64(bv, True)
    rmt, rvt = t64(rm0), t64(rv0)
    ref = F.batch_norm(xt, rmt, rvt, wt, bt, training=True, momentum=0.1, eps=EPS)
    ref.backward(t64(dyv))
    close(got[0], ref.detach().numpy(), "y")
    close(got[1], xv.astype(np.float64).mean((0, 2, 3)), "mean")
    close(got[2], xv.astype(np.float64).var((0, 2, 3)), "biased var", tol=1e-4)
    close(got[3], xt.grad.numpy(), "dx")
    close(got[4], wt.grad.numpy(), "dweight", tol=1e-4)
    close(got[5], bt.grad.numpy(), "dbias")
    close(got[6], rmt.numpy(), "running_mean")
    close(got[7], rvt.numpy(), "running_var (unbiased update)", tol=1e-4)


def test_batch_norm_inference_and_without_affine():
    xv, = data(2, (3, 4, 2, 5))
    rmv, rvv, wv, bv = (np.array(v, np.float32) for v in ([0.1, -0.2, 0.3, 1], [1, 0.5, 2, 4], [1, 2, -1, 0.5],
                                                           [0, 1, 2, 3]))
    g = ip.Graph(TARGET)
    x, rm, rv, w, b = (variable(g, v, n) for v, n in ((xv, "x"), (rmv, "rm"), (rvv, "rv"), (wv, "w"), (bv, "b")))
    prog = ip.Sequence()
    y = N.batch_norm2d_inference(g, x, rm, rv, w, b, EPS, prog)
    y_plain = N.batch_norm2d_inference(g, x, rm, rv, None, None, EPS, prog)
    yt, _, _, _ = N.batch_norm2d_train(g, x, None, None, EPS, prog)
    got = run_both(g, prog, {x: xv, rm: rmv, rv: rvv, w: wv, b: bv}, [y, y_plain, yt])
    close(got[0], F.batch_norm(t64(xv), t64(rmv), t64(rvv), t64(wv), t64(bv), False, 0.1, EPS).numpy(), "eval")
    close(got[1], F.batch_norm(t64(xv), t64(rmv), t64(rvv), None, None, False, 0.1, EPS).numpy(), "eval plain")
    close(got[2], F.batch_norm(t64(xv), None, None, None, None, True, 0.1, EPS).numpy(), "train plain")


def test_float16_inputs_keep_float32_statistics():
    xv, = data(3, (6, 40), offset=100.0)
    x16 = xv.astype(np.float16)
    g = ip.Graph(TARGET)
    x = variable(g, x16, "x")
    prog = ip.Sequence()
    y, mean, inv_std = N.layer_norm(g, x, 1, None, None, EPS, prog)
    got = run_both(g, prog, {x: x16}, [y, mean, inv_std])
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    ref = F.layer_norm(t64(x16.astype(np.float32)), (40,), eps=EPS).numpy()
    np.testing.assert_allclose(got[0], ref, atol=4e-3)  # only the final float16 rounding
    close(got[1], x16.astype(np.float64).mean(1), "mean")


def test_errors_name_the_problem():
    g = ip.Graph(TARGET)
    x = variable(g, np.zeros((1, 3, 1, 1), np.float32), "x")
    x3 = variable(g, np.zeros((2, 3, 4), np.float32), "x3")
    w = variable(g, np.zeros(4, np.float32), "w")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        N.batch_norm2d_train(g, x, None, None, EPS, prog)
    with pytest.raises(ValueError, match="NCHW"):
        N.batch_norm2d_train(g, x3, None, None, EPS, prog)
    with pytest.raises(ValueError, match=r"weight 'w' has shape \(4,\), expected \(3,\)"):
        N.batch_norm_train(g, x3, w, None, EPS, prog)
    with pytest.raises(ValueError, match=r"normalized_ndim must be in \[1, 3\]"):
        N.layer_norm(g, x3, 4, None, None, EPS, prog)
    with pytest.raises(ValueError, match="momentum=None"):
        N.update_running_stats(g, w, w, w, w, 1.5, 10, prog)


def test_running_stats_estimator():
    t = ip.GC200
    vertex = N.RUNNING_STATS_VERTEX
    sizes = {"stat": np.array([10]), "running": np.array([10])}
    assert vertex.cycles(sizes, np.array([[0.1, 1.0]]), np.dtype("float32"), t).tolist() == [t.thread_cycles(6 + 5 * 3)]


@settings(max_examples=12, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=4), nd=st.integers(1, 2), seed=st.integers(0, 999))
@example(shape=[2, 4, 4, 2], nd=1, seed=506)  # a 2-element row of close values: 1/std is large
def test_property_layer_norm_shapes(shape, nd, seed):
    nd = min(nd, len(shape))
    xv, dyv = data(seed, tuple(shape), tuple(shape))
    wv, = data(seed + 1, tuple(shape[-nd:]))
    g = ip.Graph(TARGET)
    x, dy, w = variable(g, xv, "x"), variable(g, dyv, "dy"), variable(g, wv, "w", 0)
    prog = ip.Sequence()
    y, mean, inv_std = N.layer_norm(g, x, nd, w, None, EPS, prog)
    dx, dw, _ = N.layer_norm_backward(g, dy, x, mean, inv_std, w, None, nd, prog)
    got = run_both(g, prog, {x: xv, dy: dyv, w: wv}, [y, dx, dw])
    xt, wt = t64(xv, True), t64(wv, True)
    ref = F.layer_norm(xt, tuple(shape[-nd:]), wt, None, EPS)
    ref.backward(t64(dyv))
    close(got[0], ref.detach().numpy(), "y", tol=1e-4)
    # dx is a cancelling difference scaled by 1/std, and the float32 variance of a row of close
    # values is itself off by eps*(|x|/std)^2, so float32 rounding bounds dx's error per row by
    # eps * 1/std * max|w*dy| * (1 + (max|x|/std)^2); a flat tolerance fails on 2-element rows.
    red = tuple(range(len(shape) - nd, len(shape)))
    inv_std64 = 1 / np.sqrt(xv.astype(np.float64).var(axis=red, keepdims=True) + EPS)
    bound = inv_std64 * np.abs(dyv * wv).max(axis=red, keepdims=True) * (
        1 + (np.abs(xv).max(axis=red, keepdims=True) * inv_std64) ** 2)
    err = np.abs(got[1] - xt.grad.numpy())
    allowed = 1e-5 + 16 * np.finfo(np.float32).eps * bound
    assert (err <= allowed).all(), f"dx off by {err.max():.3g} where float32 rounding allows {allowed.min():.3g}"
    close(got[2], wt.grad.numpy(), "dweight", tol=1e-4)
