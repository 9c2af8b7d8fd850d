"""ipusim.ops.conv: conv forward and gradients against direct NumPy references in both modes."""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops.conv import (CONV_VERTEX, P, ConvDim, backward_input_geometry, backward_weights_geometry, conv,
                             conv_backward_input, conv_backward_input_numpy, conv_backward_weights,
                             conv_backward_weights_numpy, conv_numpy, conv_output_shape, forward_geometry,
                             plan_conv)

MODES = ["strict", "fast"]
SMALL = ip.Target.test(16, 64 * 1024)


def spatial(v, nd):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def reference(x, w, dy, stride, padding, dilation, groups):
    """Direct float64 convolution (any number of spatial dimensions) and its two gradients, from
    the definition y[n, o, i...] = sum_{c, a...} xpad[n, g c, i s + a d ...] w[o, c, a...]."""
    nd = x.ndim - 2
    s, p, d = (spatial(v, nd) for v in (stride, padding, dilation))
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, *size = x.shape
    o, cg, *k = w.shape
    og = o // groups
    out = [(size[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(nd)]
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple((v, v) for v in p))
    y = np.zeros((n, o, *out))
    dxp = np.zeros_like(xp)
    dwt = np.zeros_like(w)
    dy = None if dy is None else dy.astype(np.float64)
    for g in range(groups):
        ci, co = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
        for taps in itertools.product(*(range(v) for v in k)):
            window = tuple(slice(t * dd, t * dd + ss * (oo - 1) + 1, ss) for t, dd, ss, oo in zip(taps, d, s, out))
            patch = xp[(slice(None), ci) + window]
            tap = w[(co, slice(None)) + taps]
            y[:, co] += np.einsum("nc...,oc->no...", patch, tap)
            if dy is not None:
                dxp[(slice(None), ci) + window] += np.einsum("no...,oc->nc...", dy[:, co], tap)
                summed = [0] + list(range(2, 2 + nd))   # batch and positions
                dwt[(co, slice(None)) + taps] += np.tensordot(dy[:, co], patch, (summed, summed))
    return y, dxp[(slice(None),) * 2 + tuple(slice(v, v + size_) for v, size_ in zip(p, size))], dwt


TORCH_CONV = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


def build(target, x_shape, w_shape, stride, padding, dilation, groups, dtype="float32", **kw):
    g = ip.Graph(target)
    x = g.addVariable(dtype, x_shape, "x")
    w = g.addVariable(dtype, w_shape, "w")
    dy = g.addVariable(dtype, conv_output_shape(x_shape, w_shape, stride, padding, dilation, groups), "dy")
    for t in (x, w, dy):
        g.map_linearly(t)
    prog = ip.Sequence()
    y = conv(g, x, w, prog, stride, padding, dilation, groups, **kw)
    dx = conv_backward_input(g, dy, w, x_shape, prog, stride, padding, dilation, groups, **kw)
    dw = conv_backward_weights(g, dy, x, w_shape, prog, stride, padding, dilation, groups, **kw)
    return g, (x, w, dy), (y, dx, dw), prog


def run_all(target, mode, x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, dtype=np.float32, seed=0,
            **kw):
    rng = np.random.default_rng(seed)
    g, (x, w, dy), outs, prog = build(target, x_shape, w_shape, stride, padding, dilation, groups, np.dtype(dtype).name,
                                      **kw)
    X = rng.standard_normal(x_shape).astype(dtype)
    W = rng.standard_normal(w_shape).astype(dtype)
    DY = rng.standard_normal(dy.shape).astype(dtype)
    e = ip.Engine(g, prog, mode=mode).load()
    for t, v in ((x, X), (w, W), (dy, DY)):
        e.writeTensor(t, v)
    cycles = e.run()
    return [e.readTensor(t) for t in outs], (X, W, DY), cycles, e, g


def scales(X, W, DY, stride, padding, dilation, groups):
    """Per-element sums of |terms| of each result (the scale of its accumulation error)."""
    return reference(np.abs(X), np.abs(W), np.abs(DY), stride, padding, dilation, groups)


def assert_close(got, want, scale, rtol):
    assert got.shape == want.shape
    assert (np.abs(got.astype(np.float64) - want) <= rtol * scale + 1e-30).all(), \
        np.max(np.abs(got - want) / np.maximum(scale, 1e-30))


CASES = [  # x shape, w shape, stride, padding, dilation, groups
    ((2, 3, 7, 6), (4, 3, 3, 3), 1, 0, 1, 1),
    ((1, 3, 9, 9), (4, 3, 3, 3), 2, 1, 1, 1),
    ((2, 4, 7, 6), (6, 2, 3, 2), (1, 2), (1, 0), (1, 2), 2),
    ((1, 4, 10, 8), (4, 4, 3, 3), 2, 2, 2, 1),
    ((2, 6, 5, 5), (6, 1, 3, 3), 1, 1, 1, 6),      # depthwise
    ((1, 32, 6, 6), (8, 32, 3, 3), 1, 1, 1, 1),    # forward splits the input channels (reduction)
    ((2, 16, 8, 8), (4, 16, 3, 3), 1, 1, 1, 1),    # weight gradient splits the kernel rows (reduction)
    ((1, 2, 5, 4), (3, 2, 1, 1), 3, 0, 1, 1),      # 1x1 kernel, stride larger than the kernel
    ((2, 3, 9), (4, 3, 3), 2, 1, 2, 1),            # 1-D
    ((2, 4, 9), (4, 2, 4), 1, 2, 1, 2),
    ((2, 2, 5, 6, 4), (4, 2, 3, 2, 3), (1, 2, 1), (1, 0, 1), (2, 1, 1), 1),   # 3-D
    ((1, 4, 4, 5, 6), (6, 2, 2, 3, 3), 2, 1, 1, 2),
    ((2, 2, 8, 8, 8), (4, 2, 3, 3, 3), 1, 1, 1, 1),   # weight gradient splits the kernel planes (reduction)
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_conv_and_gradients_match_the_reference(mode, case):
    x_shape, w_shape, s, p, d, groups = case
    got, (X, W, DY), cycles, _, _ = run_all(SMALL, mode, x_shape, w_shape, s, p, d, groups)
    want = reference(X, W, DY, s, p, d, groups)
    for g_, w_, sc in zip(got, want, scales(X, W, DY, s, p, d, groups)):
        assert g_.dtype == np.float32
        assert_close(g_, w_, sc, 1e-5)
    assert cycles > 0


def test_reference_agrees_with_torch():
    """The test reference itself, checked once against torch's autograd (float64)."""
    rng = np.random.default_rng(0)
    for x_shape, w_shape, s, p, d, groups in CASES:
        X, W = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        xt = torch.tensor(X, requires_grad=True)
        wt = torch.tensor(W, requires_grad=True)
        yt = TORCH_CONV[len(x_shape) - 2](xt, wt, stride=s, padding=p, dilation=d, groups=groups)
        DY = rng.standard_normal(tuple(yt.shape))
        yt.backward(torch.tensor(DY))
        y, dx, dw = reference(X, W, DY, s, p, d, groups)
        np.testing.assert_allclose(y, yt.detach().numpy(), atol=1e-12)
        np.testing.assert_allclose(dx, xt.grad.numpy(), atol=1e-12)
        np.testing.assert_allclose(dw, wt.grad.numpy(), atol=1e-12)


@st.composite
def conv_problems(draw):
    """1-D to 3-D convolutions (3-D ones smaller, so each example stays fast)."""
    nd = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    cg, og = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    k = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    s = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    d = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    p = tuple(draw(st.integers(0, 2)) for _ in range(nd))
    size = tuple(draw(st.integers(1, 9 if nd < 3 else 5)) for _ in range(nd))
    assume(all(i + 2 * pp >= dd * (kk - 1) + 1 for i, pp, dd, kk in zip(size, p, d, k)))
    n = draw(st.integers(1, 2))
    tiles = draw(st.sampled_from([1, 4, 16]))
    return (n, groups * cg) + size, (groups * og, cg) + k, s, p, d, groups, tiles


@settings(max_examples=20, deadline=None)
@given(problem=conv_problems())
def test_conv_property_both_modes_and_adjoint(problem):
    x_shape, w_shape, s, p, d, groups, tiles = problem
    target = ip.Target.test(tiles, 256 * 1024)
    strict, (X, W, DY), c1, _, _ = run_all(target, "strict", x_shape, w_shape, s, p, d, groups)
    fast, _, c2, _, _ = run_all(target, "fast", x_shape, w_shape, s, p, d, groups)
    want = reference(X, W, DY, s, p, d, groups)
    sc = scales(X, W, DY, s, p, d, groups)
    for a, b, r, scale in zip(strict, fast, want, sc):
        assert_close(a, r, scale, 1e-5)
        assert_close(b, r, scale, 1e-5)
        assert_close(a, b.astype(np.float64), scale, 1e-6)
    assert c1 == c2
    # the gradients are the adjoints of the convolution: <y, dy> = <x, dx> = <w, dw>
    y, dx, dw = (v.astype(np.float64) for v in strict)
    inner = np.vdot(y, DY)
    bound = 1e-5 * np.vdot(sc[0], np.abs(DY)) + 1e-12
    assert abs(np.vdot(X, dx) - inner) <= bound and abs(np.vdot(W, dw) - inner) <= bound


@pytest.mark.parametrize("mode", MODES)
def test_float16(mode):
    """float16 results are each float32-accumulated sum rounded once to float16: within one
    float16 ulp of the exact value plus (terms + 1) * 2^-24 * sum |terms| (see test_ops_matmul)."""
    x_shape, w_shape, s, p, d, groups = (2, 4, 7, 6), (6, 2, 3, 2), (1, 2), (1, 0), (1, 2), 2
    got, (X, W, DY), _, _, _ = run_all(SMALL, mode, x_shape, w_shape, s, p, d, groups, dtype=np.float16)
    want = reference(X, W, DY, s, p, d, groups)
    terms = [2 * 3 * 2, 3 * 3 * 2, 2 * 7 * 6]  # a bound on the terms of each output's sum
    for got_, want_, scale, k in zip(got, want, scales(X, W, DY, s, p, d, groups), terms):
        assert got_.dtype == np.float16
        ulp = np.spacing(np.abs(want_).astype(np.float16)).astype(np.float64)
        assert (np.abs(got_.astype(np.float64) - want_) <= ulp + (k + 1) * 2.0 ** -24 * scale).all()


@pytest.mark.parametrize("mode", MODES)
def test_view_operands(mode):
    """A flattened activation reshaped back (as a compiler produces) and a sliced weight."""
    rng = np.random.default_rng(9)
    g = ip.Graph(SMALL)
    flat = g.addVariable("float32", (2, 3 * 6 * 5), "flat")
    big_w = g.addVariable("float32", (6, 3, 3, 3), "big_w")
    g.map_linearly(flat)
    g.map_linearly(big_w)
    prog = ip.Sequence()
    y = conv(g, flat.reshape(2, 3, 6, 5), big_w[1:5], prog, 1, 1)
    F_, W = rng.standard_normal(flat.shape).astype(np.float32), rng.standard_normal(big_w.shape).astype(np.float32)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(flat, F_)
    e.writeTensor(big_w, W)
    e.run()
    want = reference(F_.reshape(2, 3, 6, 5), W[1:5], None, 1, 1, 1, 1)[0]
    np.testing.assert_allclose(e.readTensor(y), want, rtol=1e-5, atol=1e-5)


# ---- plans -----------------------------------------------------------------------------------
def test_reduction_splits_are_planned_and_correct():
    fwd = plan_conv(SMALL, forward_geometry((1, 32, 6, 6), (8, 32, 3, 3), 1, 1, 1, 1))
    wu = plan_conv(SMALL, backward_weights_geometry((2, 16, 8, 8), (4, 16, 3, 3), 1, 1, 1, 1))
    assert fwd.as_dict()["in_channels"] > 1 and fwd.reduction_split > 1
    assert wu.as_dict()["kernel_rows"] > 1 and wu.reduction_split > 1
    wu3 = plan_conv(SMALL, backward_weights_geometry((2, 2, 8, 8, 8), (4, 2, 3, 3, 3), 1, 1, 1, 1))
    assert wu3.as_dict()["kernel_planes"] > 1 and wu3.reduction_split > 1
    # too little memory for whole reductions forces a split where there was none
    geom = forward_geometry((2, 16, 8, 8), (4, 16, 3, 3), 1, 1, 1, 1)
    assert plan_conv(SMALL, geom).reduction_split == 1
    tight = plan_conv(SMALL, geom, available_memory_proportion=0.04)
    assert tight.reduction_split > 1 and tight.fits


@pytest.mark.parametrize("mode", MODES)
def test_memory_bound_reduction_split_is_correct(mode):
    x_shape, w_shape = (2, 16, 8, 8), (4, 16, 3, 3)
    got, (X, W, DY), _, e, g = run_all(SMALL, mode, x_shape, w_shape, 1, 1, 1, 1, available_memory_proportion=0.04)
    assert "conv/reduce" in {cs.name for cs in g.compute_sets}
    for got_, want_, scale in zip(got, reference(X, W, DY, 1, 1, 1, 1), scales(X, W, DY, 1, 1, 1, 1)):
        assert_close(got_, want_, scale, 1e-5)


def test_plans_on_a_full_ipu():
    for geom in (forward_geometry((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1),
                 backward_input_geometry((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1),
                 backward_weights_geometry((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1),
                 forward_geometry((16, 1, 28, 28), (32, 1, 3, 3), 1, 0, 1, 1)):
        plan = plan_conv(ip.GC200, geom)
        assert plan.fits and plan.tiles_used <= 1472
        assert all(math.ceil(s / b) == p for s, b, p in zip(geom.dims, plan.blocks, plan.splits))
    assert plan_conv(ip.GC200, forward_geometry((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1)).tiles_used > 1000


@pytest.mark.parametrize("mode", MODES)
def test_outputs_reading_only_padding(mode):
    """Padding wider than the kernel's reach: border outputs read no input at all (empty windows)."""
    got, (X, W, DY), _, _, _ = run_all(SMALL, mode, (1, 1, 2, 2), (2, 1, 1, 1), 1, 2, 1, 1)
    want = reference(X, W, DY, 1, 2, 1, 1)
    assert got[0].shape == (1, 2, 6, 6) and (got[0][:, :, 0] == 0).all()
    for got_, want_ in zip(got, want):
        np.testing.assert_allclose(got_, want_, rtol=1e-6, atol=1e-7)


# ---- geometry --------------------------------------------------------------------------------
def test_general_form_reads_the_right_inputs():
    # forward: output 2 at tap 1 with stride 2, dilation 2, padding 1 reads input 2*2 + 1*2 - 1 = 5
    assert ConvDim(9, 3, 5, stride=2, padding=1, dilation=2).inputs(2, 1) == 5
    assert ConvDim(9, 3, 5, stride=2, padding=1, dilation=2).inputs(0, 0) == -1  # padding
    # gradient to the input: dx[h] gathers dy[(h + p - t d) / s] with weight tap t, for taps where
    # that is integral (the general form flips the kernel and dilates dy by the stride)
    dim = backward_input_geometry((1, 1, 9, 9), (1, 1, 3, 3), 2, 1, 2, 1).h
    assert dim.flip and dim.in_dilation == 2
    for h in range(9):
        for t in range(3):
            u = h + 1 - t * 2
            want = u // 2 if u >= 0 and u % 2 == 0 and u // 2 < dim.in_size else -1
            assert dim.inputs(h, t) == want
    # gradient to the weights: output (kernel tap) a, tap (output row) i reads x[i s - p + a d]
    dim = backward_weights_geometry((1, 1, 9, 9), (1, 1, 3, 3), 2, 1, 2, 1).h
    assert dim.inputs(1, 3) == 3 * 2 - 1 + 1 * 2
    assert dim.span(0, 3, 0, dim.kernel) == (1, 8)  # i * 2 - 1 + a * 2: only odd rows 1..7 are read


# ---- exchanges -------------------------------------------------------------------------------
def test_input_on_one_tile_is_exchanged_and_strict_mode_needs_the_exchange():
    g = ip.Graph(SMALL)
    x = g.addVariable("float32", (2, 3, 8, 8), "x")
    w = g.addVariable("float32", (4, 3, 3, 3), "w")
    g.setTileMapping(x, 5)
    g.map_linearly(w)
    prog = ip.Sequence()
    y = conv(g, x, w, prog, 1, 1)
    body = prog.programs[0].body
    without_exchange = ip.Sequence(*[p for p in body.programs if not isinstance(p, ip.Copy)])
    rng = np.random.default_rng(7)
    X, W = rng.standard_normal(x.shape).astype(np.float32), rng.standard_normal(w.shape).astype(np.float32)
    e = ip.Engine(g, [prog, without_exchange], mode="strict").load()
    e.writeTensor(x, X)
    e.writeTensor(w, W)
    e.run(1)
    want = reference(X, W, None, 1, 1, 1, 1)[0]
    assert not np.allclose(e.readTensor(y), want, atol=1e-3)
    e.run(0)
    np.testing.assert_allclose(e.readTensor(y), want, rtol=1e-5, atol=1e-5)
    assert len({tile for cs in g.compute_sets for t in cs.tables for tile in t.tiles.tolist()}) > 1
    exchange = e.costs[0].per_ipu[0].exchange
    assert exchange >= math.ceil(X.nbytes * 15 / 16 / SMALL.exchange_bytes_per_cycle)  # tile 5 sends x out


def test_windows_include_the_halo():
    """A block of output rows receives the input rows its 3x3 windows read, one more on each side."""
    g = ip.Graph(ip.Target.test(4, 64 * 1024))
    x = g.addVariable("float32", (1, 1, 16, 4), "x")
    w = g.addVariable("float32", (1, 1, 3, 3), "w")
    g.map_linearly(x)
    g.map_linearly(w)
    conv(g, x, w, ip.Sequence(), 1, 1)
    plan = plan_conv(g.target, forward_geometry(x.shape, w.shape, 1, 1, 1, 1))
    assert plan.as_dict()["out_rows"] == 4  # 4 blocks of 4 rows
    windows = sorted(n for cs in g.compute_sets for t in cs.tables if t.type is CONV_VERTEX
                     for n in t.sizes()["x"].tolist())
    assert windows[0] == 5 * 4 and windows[-1] == 6 * 4  # edge blocks: 4 + 1 rows, inner: 4 + 2


# ---- cycle estimator -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,amp", [("float32", 8), ("float16", 16)])
def test_conv_vertex_estimator_counts_real_multiply_accumulates(dtype, amp):
    g = ip.Graph(ip.Target.test(1, 256 * 1024))
    x = g.addVariable(dtype, (1, 3, 6, 5), "x")
    w = g.addVariable(dtype, (2, 3, 3, 3), "w")
    g.map_linearly(x)
    g.map_linearly(w)
    conv(g, x, w, ip.Sequence(), 2, 1)
    t = g.target
    geom = forward_geometry(x.shape, w.shape, 2, 1)
    (cs,) = g.compute_sets
    lines_seen = 0
    (table,) = cs.tables
    got = CONV_VERTEX.cycles(table.sizes(), table.params, np.dtype(dtype), t)
    for v, row in enumerate(table.params.astype(int).tolist()):
        params = dict(zip(("groups", "batch", "in_ch", "out_ch"), row[:4]))
        line0, lines = row[P["line0"]], row[P["lines"]]
        macs = 0  # brute force: real (output, tap) pairs of the vertex's lines
        for line in range(line0, line0 + lines):
            oh = line % geom.h.out_size
            for a in range(3):
                for ow in range(geom.w.out_size):
                    for b in range(3):
                        macs += geom.h.inputs(oh, a) >= 0 and geom.w.inputs(ow, b) >= 0
        macs *= params["in_ch"]
        want = t.flop_cycles(2 * macs, dtype) + t.thread_cycles(20 + 3 * 3 * math.ceil(3 / amp) * (6 + lines))
        assert got[v] == want
        lines_seen += lines
    assert lines_seen == 2 * geom.h.out_size  # every output line of the 2 channels, once


# ---- errors ----------------------------------------------------------------------------------
def test_bad_arguments_are_clear_errors():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (1, 4, 5, 5), "x")
    w = g.addVariable("float32", (6, 2, 3, 3), "w")
    with pytest.raises(ValueError, match="expected input \\[1, 4, 5, 5\\] to have 2 channels, but got 4"):
        conv(g, x, w, ip.Sequence())
    with pytest.raises(ValueError, match="expected weight to be divisible by 4"):
        conv(g, x, w, ip.Sequence(), groups=4)
    with pytest.raises(ValueError, match="too small"):
        conv(g, x, g.addVariable("float32", (2, 4, 7, 7)), ip.Sequence())
    with pytest.raises(ValueError, match="stride must be positive"):
        conv(g, x, w, ip.Sequence(), stride=0, groups=2)
    with pytest.raises(TypeError, match="different dtypes"):
        conv(g, x, g.addVariable("float16", (6, 2, 3, 3)), ip.Sequence(), groups=2)
    with pytest.raises(ValueError, match="expected 3-D weights \\[O, C/groups, \\*kernel\\] for a 3-D input"):
        conv(g, x.reshape(4, 5, 5), w, ip.Sequence(), groups=2)
    with pytest.raises(ValueError, match="1 to 3 spatial dimensions"):
        conv(g, x.reshape(1, 4, 5, 5, 1, 1), w, ip.Sequence(), groups=2)
    dy = g.addVariable("float32", (1, 6, 4, 4), "dy")
    with pytest.raises(ValueError, match="gives \\[1, 6, 3, 3\\]"):
        conv_backward_input(g, dy, w, (1, 4, 5, 5), ip.Sequence(), groups=2)
    with pytest.raises(ValueError, match="gives \\[1, 6, 3, 3\\]"):
        conv_backward_weights(g, dy, x, (6, 2, 3, 3), ip.Sequence(), groups=2)


@pytest.mark.parametrize("x_shape, w_shape, s, p, d, groups", [
    ((6, 2, 20, 20), (4, 1, 3, 3), 1, 1, 1, 2),       # a product per sample; the weight gradient's cut in two
    ((8, 1, 28, 28), (10, 1, 5, 5), 1, 0, 1, 1),      # the tutorial's first layer: cut in four
    ((3, 4, 17, 15), (6, 4, 3, 2), (2, 1), (2, 0), (1, 2), 1),
    ((5, 3, 6, 6), (3, 3, 3, 3), 1, 0, 1, 1)])        # few positions per sample: one product for the batch
def test_whole_array_kernels_at_sizes_that_take_their_other_paths(x_shape, w_shape, s, p, d, groups):
    """The fast mode's kernels against torch (float64), at sizes the both-modes tests do not reach."""
    rng = np.random.default_rng(3)
    X, W = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    xt = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, stride=s, padding=p, dilation=d, groups=groups)
    DY = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.tensor(DY, dtype=torch.float64))
    y = conv_numpy(X, W, s, p, d, groups)
    out = np.full(y.shape, np.nan, np.float32)
    assert conv_numpy(X, W, s, p, d, groups, out=out) is out and np.array_equal(out, y)
    strided = np.full(y.shape[:1] + (2 * y.shape[1],) + y.shape[2:], np.nan, np.float32)[:, ::2]
    assert conv_numpy(X, W, s, p, d, groups, out=strided) is strided and np.array_equal(strided, y)
    dx = conv_backward_input_numpy(DY, W, x_shape, s, p, d, groups)
    into = np.full(x_shape, np.nan, np.float32)
    np.testing.assert_array_equal(conv_backward_input_numpy(DY, W, x_shape, s, p, d, groups, out=into), dx)
    if p == 0:  # summed in place (with padding, in a padded array, then cut)
        np.testing.assert_array_equal(into, dx)
    dw = conv_backward_weights_numpy(DY, X, w_shape, s, p, d, groups)
    for got, want in ((y, yt), (dx, xt.grad), (dw, wt.grad)):
        want = want.detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("x_shape, k, s, p, d", [
    ((3, 2, 12, 12), (5, 5), (1, 1), (0, 0), (1, 1)),   # rows of 8: through the offsets table
    ((2, 3, 13, 11), (3, 2), (2, 3), (0, 0), (2, 1)),   # strided and dilated short rows
    ((2, 2, 9, 9), (3, 3), (1, 1), (1, 1), (1, 1)),     # padded: row by row, whatever the length
    ((2, 1, 28, 28), (5, 5), (1, 1), (0, 0), (1, 1))])  # rows of 24: row by row
def test_patches_match_sliding_windows(x_shape, k, s, p, d):
    """Both patch kernels of the fast mode give the patches NumPy's sliding windows give."""
    from ipusim.ops.conv import _im2col
    X = np.random.default_rng(5).standard_normal(x_shape).astype(np.float32)
    n, c = x_shape[:2]
    padded = np.pad(X, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    extent = ((k[0] - 1) * d[0] + 1, (k[1] - 1) * d[1] + 1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, extent, axis=(2, 3))[:, :, ::s[0], ::s[1], ::d[0], ::d[1]]
    oh, ow = windows.shape[2:4]
    want = windows.transpose(1, 4, 5, 0, 2, 3).reshape(1, c * k[0] * k[1], n * oh * ow)
    np.testing.assert_array_equal(_im2col(X[:, :, None], (1,) + k, (1, oh, ow), (1,) + s, (0,) + p, (1,) + d, 1), want)


@pytest.mark.parametrize("spatial_shape, kernel", [((6,), (3,)), ((6, 5), (3, 3)), ((4, 6, 5), (2, 3, 3))],
                         ids=["1d", "2d", "3d"])
def test_vertex_state_holds_the_parameters_of_the_ops_own_rank(spatial_shape, kernel):
    """The general-form vertex takes parameters for three spatial dimensions; a 1-D or 2-D
    convolution's vertices hold those of a two-dimensional vertex (as Poplar instantiates the vertex
    for the op's rank), a 3-D one's all of them, and the memory report counts that state."""
    from ipusim.device.memory import FIELD_BYTES, PARAM_BYTES, memory_reports
    from ipusim.ops.conv import DEPTH_PARAMS, PARAMS
    g = ip.Graph(SMALL)
    x = g.addVariable("float32", (2, 3) + spatial_shape, "x")
    w = g.addVariable("float32", (4, 3) + kernel, "w")
    g.map_linearly(x)
    g.map_linearly(w)
    prog = ip.Sequence()
    conv(g, x, w, prog)
    tables = [t for cs in g.compute_sets for t in cs.tables if t.type is CONV_VERTEX]
    want = len(PARAMS) - (len(DEPTH_PARAMS) if len(spatial_shape) < 3 else 0)
    assert tables and {t.state_params for t in tables} == {want}
    state = sum(t.tiles.size * (FIELD_BYTES * len(CONV_VERTEX.fields) + PARAM_BYTES * want) for t in tables)
    others = sum(t.tiles.size * (FIELD_BYTES * len(t.type.fields) + PARAM_BYTES * t.state_params)
                 for cs in g.compute_sets for t in cs.tables if t.type is not CONV_VERTEX)
    assert int(memory_reports([g], [prog])[0].vertex_state.sum()) == state + others


def test_state_params_outside_the_vertex_parameters_are_an_error():
    g = ip.Graph(SMALL)
    x = g.addVariable("float32", (4,), "x")
    g.map_linearly(x)
    cs = g.addComputeSet("c")
    with pytest.raises(ValueError, match="state_params=40 is outside 0..32"):
        g.addVertices(cs, CONV_VERTEX, [0], {}, np.zeros((1, len(P))), state_params=40)
