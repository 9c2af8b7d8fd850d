"""ipusim.ops.ctc: CTC loss and its gradient against brute-force NumPy and torch autograd."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import ctc
from ipusim.device.program import Copy, Execute, walk

MODES = ["strict", "fast"]
TARGET = ip.Target.test(16, 64 * 1024)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def build(T, N, C, S, dtype="float32", reduction="mean", zero_infinity=False, blank=0, target=TARGET,
          lp_tile=None):
    g = ip.Graph(target)
    lp = g.addVariable(dtype, (T, N, C), "log_probs")
    if lp_tile is None:
        g.map_linearly(lp)
    else:
        g.setTileMapping(lp, lp_tile)
    tg = g.addVariable("int32", (N, S), "targets")
    il = g.addVariable("int32", (N,), "input_lengths")
    tl = g.addVariable("int32", (N,), "target_lengths")
    gl = g.addVariable(dtype, (), "grad_loss")
    for t in (tg, il, tl):
        g.map_linearly(t)
    g.setTileMapping(gl, target.num_tiles - 1)
    prog = ip.Sequence()
    kw = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    loss = ctc.ctc_loss(g, lp, tg, il, tl, prog, **kw)
    grad = ctc.ctc_loss_backward(g, lp, tg, il, tl, gl, prog, **kw)
    return g, prog, (lp, tg, il, tl, gl), (loss, grad)


def run(mode, lp, tg, il, tl, grad_loss=1.0, **kw):
    T, N, C = lp.shape
    g, prog, inputs, (loss, grad) = build(T, N, C, tg.shape[1], lp.dtype.name, **kw)
    e = ip.Engine(g, prog, mode=mode).load()
    for t, v in zip(inputs, (lp, tg, il, tl, np.asarray(grad_loss, lp.dtype))):
        e.writeTensor(t, v)
    cycles = e.run()
    return e.readTensor(loss), e.readTensor(grad), cycles, e


def torch_reference(lp, tg, il, tl, grad_loss=1.0, blank=0, reduction="mean", zero_infinity=False):
    x = torch.tensor(lp.astype(np.float64), requires_grad=True)
    loss = torch.nn.functional.ctc_loss(x, torch.tensor(tg, dtype=torch.long), torch.tensor(il, dtype=torch.long),
                                        torch.tensor(tl, dtype=torch.long), blank=blank, reduction=reduction,
                                        zero_infinity=zero_infinity)
    (loss * grad_loss).backward()
    return loss.item(), x.grad.numpy()


def brute_force(lp, label, tn, blank=0):
    """-log p(label) and torch's gradient for one sample by enumerating every alignment."""
    T, C = lp.shape
    total, through = 0.0, np.zeros((T, C))
    for path in itertools.product(range(C), repeat=tn):
        collapsed = [c for i, c in enumerate(path) if c != blank and (i == 0 or c != path[i - 1])]
        if collapsed == list(label):
            p = np.exp(sum(lp[t, c] for t, c in enumerate(path)))
            total += p
            for t, c in enumerate(path):
                through[t, c] += p
    grad = np.zeros((T, C))
    grad[:tn] = np.exp(lp[:tn]) - through[:tn] / total
    return -np.log(total), grad


# ---- numbers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_brute_force_enumeration(mode, reduction):
    rng = np.random.default_rng(0)
    T, N, C = 5, 3, 3
    lp = log_softmax(rng.standard_normal((T, N, C))).astype(np.float32)
    tg = np.array([[1, 2], [2, 2], [1, 0]], np.int32)
    il = np.array([5, 4, 3], np.int32)
    tl = np.array([2, 2, 1], np.int32)
    loss, grad, _, _ = run(mode, lp, tg, il, tl, grad_loss=0.5, reduction=reduction)
    nll, grads = zip(*(brute_force(lp[:, n].astype(np.float64), tg[n, :tl[n]], il[n]) for n in range(N)))
    if reduction == "mean":
        want = np.mean(np.array(nll) / tl)
        scale = 0.5 / tl / N
    else:
        want, scale = sum(nll), np.full(N, 0.5)
    assert loss.shape == () and loss == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(grad, np.stack(grads, 1) * scale[None, :, None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_matches_torch_including_impossible_alignments(reduction, zero_infinity):
    rng = np.random.default_rng(1)
    T, N, C, S = 7, 4, 5, 3
    lp = log_softmax(rng.standard_normal((T, N, C))).astype(np.float32)
    tg = np.array([[1, 2, 2], [3, 3, 3], [4, 1, 2], [2, 0, 0]], np.int32)
    il = np.array([7, 4, 6, 0], np.int32)  # sample 1 needs 5 frames for "3 3 3": impossible
    tl = np.array([3, 3, 0, 0], np.int32)  # sample 2 has an empty target, sample 3 no frames at all
    want_loss, want_grad = torch_reference(lp, tg, il, tl, 1.5, reduction=reduction, zero_infinity=zero_infinity)
    res = {m: run(m, lp, tg, il, tl, 1.5, reduction=reduction, zero_infinity=zero_infinity) for m in MODES}
    for loss, grad, _, _ in res.values():
        if np.isinf(want_loss):
            assert np.isinf(loss)
        else:
            assert loss == pytest.approx(want_loss, rel=1e-6)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert np.isnan(res["fast"][1][:4, 1]).all() != zero_infinity  # torch: NaN gradient unless zero_infinity
    assert not res["fast"][1][4:, 1].any() and not res["fast"][1][:, 3].any()  # past the input length
    np.testing.assert_array_equal(res["strict"][0], res["fast"][0])
    np.testing.assert_array_equal(res["strict"][1], res["fast"][1])
    assert res["strict"][2] == res["fast"][2]


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 12), N=st.integers(1, 4), C=st.integers(2, 6), S=st.integers(0, 5),
       reduction=st.sampled_from(["mean", "sum"]), zero_infinity=st.booleans(), tiles=st.sampled_from([2, 16]),
       seed=st.integers(0, 2**16), data=st.data())
def test_property_against_torch(T, N, C, S, reduction, zero_infinity, tiles, seed, data):
    rng = np.random.default_rng(seed)
    blank = data.draw(st.integers(0, C - 1))
    lp = log_softmax(2 * rng.standard_normal((T, N, C))).astype(np.float32)
    labels = [c for c in range(C) if c != blank]
    tg = rng.choice(labels, (N, S)).astype(np.int32)
    il = rng.integers(0, T + 1, N).astype(np.int32)
    tl = rng.integers(0, S + 1, N).astype(np.int32)
    kw = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    want_loss, want_grad = torch_reference(lp, tg, il, tl, 0.75, **kw)
    res = {}
    for mode in MODES:
        g, prog, inputs, (loss, grad) = build(T, N, C, S, target=ip.Target.test(tiles, 64 * 1024), **kw)
        e = ip.Engine(g, prog, mode=mode).load()
        for t, v in zip(inputs, (lp, tg, il, tl, np.float32(0.75))):
            e.writeTensor(t, v)
        cycles = e.run()
        res[mode] = (e.readTensor(loss), e.readTensor(grad), cycles)
    loss, grad, _ = res["strict"]
    if np.isfinite(want_loss):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    else:
        assert loss == want_loss
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5, equal_nan=True)
    np.testing.assert_array_equal(res["strict"][0], res["fast"][0])
    np.testing.assert_array_equal(res["strict"][1], res["fast"][1])
    assert res["strict"][2] == res["fast"][2]


def test_float16_storage():
    rng = np.random.default_rng(3)
    T, N, C = 6, 2, 4
    lp32 = log_softmax(rng.standard_normal((T, N, C))).astype(np.float32)
    lp16 = lp32.astype(np.float16)
    tg = np.array([[1, 2], [3, 1]], np.int32)
    il, tl = np.array([6, 5], np.int32), np.array([2, 2], np.int32)
    want_loss, want_grad = torch_reference(lp16.astype(np.float32), tg, il, tl)
    res = {m: run(m, lp16, tg, il, tl) for m in MODES}
    for loss, grad, _, _ in res.values():
        assert loss.dtype == np.float16 and grad.dtype == np.float16
        assert float(loss) == pytest.approx(want_loss, rel=1e-3)
        np.testing.assert_allclose(grad.astype(np.float32), want_grad, atol=2e-3)
    np.testing.assert_array_equal(res["strict"][1], res["fast"][1])


def test_lengths_are_clamped_to_the_padded_sizes():
    rng = np.random.default_rng(4)
    lp = log_softmax(rng.standard_normal((5, 2, 4))).astype(np.float32)
    tg = np.array([[1, 2], [3, 3]], np.int32)
    for mode in MODES:
        a, ga, _, _ = run(mode, lp, tg, np.array([5, 5], np.int32), np.array([2, 2], np.int32))
        b, gb, _, _ = run(mode, lp, tg, np.array([9, 5], np.int32), np.array([2, 7], np.int32))
        assert a == b
        np.testing.assert_array_equal(ga, gb)


# ---- mapping, exchange and cycles ----------------------------------------------------------------
def test_samples_get_their_data_by_exchange():
    """log_probs on one tile, samples on others: strict mode still right, and the exchange is paid."""
    rng = np.random.default_rng(5)
    T, N, C, S = 6, 3, 4, 2
    lp = log_softmax(rng.standard_normal((T, N, C))).astype(np.float32)
    tg = np.array([[1, 2], [2, 3], [3, 1]], np.int32)
    il, tl = np.full(N, T, np.int32), np.full(N, 2, np.int32)
    g, prog, inputs, (loss, grad) = build(T, N, C, S, lp_tile=15)
    assert sorted(set(ctc._sample_tiles(g, N).tolist())) == [0, 5, 10]
    e = ip.Engine(g, prog, mode="strict").load()
    for t, v in zip(inputs, (lp, tg, il, tl, np.float32(1.0))):
        e.writeTensor(t, v)
    e.run()
    want_loss, want_grad = torch_reference(lp, tg, il, tl)
    assert e.readTensor(loss) == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(e.readTensor(grad), want_grad, rtol=1e-5, atol=1e-6)
    # tile 15 sends every sample's [T, C] slice, once for the loss and once for the gradient
    assert e.last_run.per_ipu[0].exchange >= 2 * T * N * C * 4 // TARGET.exchange_bytes_per_cycle
    assert any(isinstance(p, Copy) and p.src.var is inputs[0].var for p in walk(prog))


def test_estimators_follow_the_popnn_formulas():
    assert ctc.alpha_instructions(1, 1) == 8 + 2 * 16 + 2 + 2 + 17
    assert ctc.alpha_instructions(7, 3) == 44 * 21 + 17
    assert ctc.grad_given_alpha_instructions(7, 3) == ctc.alpha_instructions(7, 3) + 40 * 21 + 17
    assert ctc.loss_instructions(7, 3) == 44 * 21 + 17 + 16
    assert ctc.gradient_instructions(7, 3, 5) == (44 * 21 + 17) * 2 + 40 * 21 + 17 + 10 * 35
    assert ctc.reduce_instructions(4) == 8 + 24


def test_compute_set_cycles_are_the_estimates():
    t = TARGET
    T, N, C, S = 7, 4, 5, 3
    g, prog, _, _ = build(T, N, C, S)
    e = ip.Engine(g, prog)
    cs = {p.compute_set.name: p for p in walk(prog) if isinstance(p, Execute)}
    over, sync = t.vertex_overhead_cycles, t.sync_cycles
    assert e.cost(cs["ctc_loss/loss"]).total == t.thread_cycles(ctc.loss_instructions(T, S)) + over + sync
    assert e.cost(cs["ctc_loss/reduce"]).total == t.thread_cycles(ctc.reduce_instructions(N)) + over + sync
    assert (e.cost(cs["ctc_loss_grad/gradient"]).total
            == t.thread_cycles(ctc.gradient_instructions(T, S, C)) + over + sync)
    # two samples per tile run on two workers at once: the tile takes one sample's time
    g2, prog2, _, _ = build(T, N, C, S, target=ip.Target.test(2, 64 * 1024))
    e2 = ip.Engine(g2, prog2)
    cs2 = {p.compute_set.name: p for p in walk(prog2) if isinstance(p, Execute)}
    assert e2.cost(cs2["ctc_loss/loss"]).total == e.cost(cs["ctc_loss/loss"]).total


# ---- errors ------------------------------------------------------------------------------------
def test_bad_inputs_are_named():
    g = ip.Graph(TARGET)
    lp = g.addVariable("float32", (5, 2, 4), "lp")
    lp2 = g.addVariable("float32", (5, 8), "lp2")
    lpi = g.addVariable("int32", (5, 2, 4), "lpi")
    tg = g.addVariable("int32", (2, 3), "tg")
    flat = g.addVariable("int32", (6,), "flat")
    tgf = g.addVariable("float32", (2, 3), "tgf")
    il = g.addVariable("int32", (2,), "il")
    il3 = g.addVariable("int32", (3,), "il3")
    tl = g.addVariable("int32", (2,), "tl")
    gl = g.addVariable("float32", (), "gl")
    gl2 = g.addVariable("float32", (2,), "gl2")
    empty = g.addVariable("float32", (5, 0, 4), "empty")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="'lp2' must be \\[T, N, C\\]"):
        ctc.ctc_loss(g, lp2, tg, il, tl, prog)
    with pytest.raises(TypeError, match="'lpi' is int32"):
        ctc.ctc_loss(g, lpi, tg, il, tl, prog)
    with pytest.raises(ValueError, match="concatenated 1-D targets are not supported"):
        ctc.ctc_loss(g, lp, flat, il, tl, prog)
    with pytest.raises(TypeError, match="targets 'tgf' is float32; it must be int32"):
        ctc.ctc_loss(g, lp, tgf, il, tl, prog)
    with pytest.raises(ValueError, match="input_lengths 'il3' must have shape \\(2,\\)"):
        ctc.ctc_loss(g, lp, tg, il3, tl, prog)
    with pytest.raises(ValueError, match="blank must be a class in \\[0, 4\\)"):
        ctc.ctc_loss(g, lp, tg, il, tl, prog, blank=4)
    with pytest.raises(ValueError, match="reduction must be one of \\['mean', 'sum'\\]"):
        ctc.ctc_loss(g, lp, tg, il, tl, prog, reduction="none")
    with pytest.raises(ValueError, match="empty batch"):
        ctc.ctc_loss(g, empty, g.addVariable("int32", (0, 3)), g.addVariable("int32", (0,)),
                     g.addVariable("int32", (0,)), prog)
    with pytest.raises(ValueError, match="grad_loss 'gl2' must be one float32 element"):
        ctc.ctc_loss_backward(g, lp, tg, il, tl, gl2, prog)
    ctc.ctc_loss_backward(g, lp, tg, il, tl, gl, prog)  # well-formed inputs build
