"""ipusim.ops.pool: max / average / adaptive pooling and their gradients against direct NumPy
references (checked against torch) in both modes."""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import pool as P

MODES = ["strict", "fast"]
SMALL = ip.Target.test(16, 64 * 1024)
F = torch.nn.functional


def spatial(v, nd):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def out_size(n, k, s, p, d, ceil):
    span = n + 2 * p - d * (k - 1) - 1
    o = (-(-span // s) if ceil else span // s) + 1
    return o - 1 if ceil and (o - 1) * s >= n + p else o


def windows(n, o_count, k, s, p, d, adaptive):
    """Per output: (the real input positions of its window, its padded extent clipped as torch does)."""
    out = []
    for o in range(o_count):
        if adaptive:
            lo, hi = o * n // o_count, -(-(o + 1) * n // o_count)
            out.append((list(range(lo, hi)), hi - lo))
        else:
            start = o * s - p
            pos = [start + t * d for t in range(k)]
            out.append(([i for i in pos if 0 <= i < n], min(start + k, n + p) - start))
    return out


def reference(x, dy, kind, k=1, s=None, p=0, d=1, ceil=False, include_pad=True, divisor=None, out=None):
    """float64 pooling of x (2 or 3 spatial dimensions) and the gradient for dy, straight from
    torch's definitions; the max gradient goes to the first position (row-major) equal to the
    window's maximum."""
    x = x.astype(np.float64)
    n, c, *size = x.shape
    nd = len(size)
    k, p, d = (spatial(v, nd) for v in (k, p, d))
    s = spatial(s if s is not None else k, nd)
    adaptive = out is not None
    outs = spatial(out, nd) if adaptive else [out_size(*a, ceil) for a in zip(size, k, s, p, d)]
    wins = [windows(*a, adaptive) for a in zip(size, outs, k, s, p, d)]
    y = np.zeros((n, c, *outs))
    dx = np.zeros_like(x)
    planes = (slice(None), slice(None))
    for o in itertools.product(*(range(v) for v in outs)):
        dims = [wins[i][o[i]] for i in range(nd)]
        positions = list(itertools.product(*(pos for pos, _ in dims)))   # row-major window order
        win = np.stack([x[planes + q] for q in positions], axis=2) if positions else np.zeros((n, c, 0))
        if kind == "max":
            best = np.full((n, c), -np.inf)
            for t in range(win.shape[2]):
                v = win[:, :, t]
                best = np.where((v > best) | np.isnan(v), v, best)
            y[planes + o] = best  # -inf when dilation leaves only padding in the window (torch too)
            if dy is not None and positions:
                eq = (win == best[:, :, None]) | (np.isnan(win) & np.isnan(best)[:, :, None])
                first = np.argmax(eq, axis=2)
                for b in range(n):
                    for ch in range(c):
                        dx[(b, ch) + positions[first[b, ch]]] += dy[(b, ch) + o]
        else:
            div = divisor or (np.prod([e for _, e in dims]) if include_pad and not adaptive else len(positions))
            y[planes + o] = win.sum(axis=2) / div
            if dy is not None:
                for q in positions:
                    dx[planes + q] += dy[planes + o] / div
    return y, dx


def run(target, mode, kind, x_shape, dtype="float32", seed=0, x_values=None, **kw):
    """Build kind's forward and backward, run them; returns (y, dx), (X, DY), engine, graph."""
    rng = np.random.default_rng(seed)
    g = ip.Graph(target)
    x = g.addVariable(dtype, x_shape, "x")
    g.map_linearly(x)
    prog = ip.Sequence()
    if kind == "max":
        y = P.max_pool(g, x, kw["k"], prog, kw.get("s"), kw.get("p", 0), kw.get("d", 1), kw.get("ceil", False))
    elif kind == "avg":
        y = P.avg_pool(g, x, kw["k"], prog, kw.get("s"), kw.get("p", 0), kw.get("ceil", False),
                         kw.get("include_pad", True), kw.get("divisor"))
    elif kind == "adaptive_max":
        y = P.adaptive_max_pool(g, x, kw["out"], prog)
    else:
        y = P.adaptive_avg_pool(g, x, kw["out"], prog)
    dy = g.addVariable(dtype, y.shape, "dy")
    g.map_linearly(dy)
    if kind == "max":
        dx = P.max_pool_backward(g, x, y, dy, kw["k"], prog, kw.get("s"), kw.get("p", 0), kw.get("d", 1),
                                   kw.get("ceil", False))
    elif kind == "avg":
        dx = P.avg_pool_backward(g, dy, x_shape, kw["k"], prog, kw.get("s"), kw.get("p", 0), kw.get("ceil", False),
                                   kw.get("include_pad", True), kw.get("divisor"))
    elif kind == "adaptive_max":
        dx = P.adaptive_max_pool_backward(g, x, y, dy, prog)
    else:
        dx = P.adaptive_avg_pool_backward(g, dy, x_shape, prog)
    X = (rng.standard_normal(x_shape) if x_values is None else x_values).astype(dtype)
    DY = rng.standard_normal(y.shape).astype(dtype)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(x, X)
    e.writeTensor(dy, DY)
    e.run()
    return (e.readTensor(y), e.readTensor(dx)), (X, DY), e, g


CASES = [  # kind, input shape, arguments
    ("max", (2, 3, 9, 7), dict(k=3, s=2, p=1)),
    ("max", (1, 2, 8, 8), dict(k=2)),
    ("max", (2, 2, 9, 7), dict(k=(2, 3), s=(2, 1), p=(1, 0), ceil=True)),
    ("max", (1, 3, 10, 9), dict(k=3, s=1, p=1, d=2)),
    ("max", (1, 1, 5, 5), dict(k=2, s=2, ceil=True)),
    ("avg", (2, 3, 9, 7), dict(k=3, s=2, p=1)),
    ("avg", (2, 3, 9, 7), dict(k=3, s=2, p=1, include_pad=False)),
    ("avg", (1, 2, 7, 7), dict(k=(3, 2), s=(2, 3), p=(1, 1), ceil=True)),
    ("avg", (1, 2, 6, 6), dict(k=2, divisor=3)),
    ("adaptive", (2, 3, 9, 7), dict(out=(4, 5))),
    ("adaptive", (1, 2, 3, 5), dict(out=(5, 7))),    # more outputs than inputs: windows repeat
    ("adaptive", (2, 3, 7, 7), dict(out=1)),         # global average pooling
    ("adaptive_max", (2, 3, 9, 7), dict(out=(4, 5))),
    ("adaptive_max", (1, 2, 3, 5), dict(out=(5, 7))),
    ("adaptive_max", (2, 1, 6, 5), dict(out=1)),     # global max pooling
    ("max", (2, 2, 5, 6, 7), dict(k=(2, 3, 2), s=(1, 2, 2), p=(1, 1, 0), d=(2, 1, 1))),   # 3-D
    ("max", (1, 3, 4, 5, 5), dict(k=2, ceil=True)),
    ("avg", (2, 2, 5, 6, 7), dict(k=(3, 2, 3), s=(2, 1, 2), p=(1, 1, 0), ceil=True)),
    ("avg", (1, 2, 5, 5, 4), dict(k=3, s=2, p=1, include_pad=False)),
    ("avg", (1, 2, 4, 4, 4), dict(k=2, divisor=5)),
    ("adaptive", (2, 2, 5, 7, 6), dict(out=(3, 4, 2))),
    ("adaptive_max", (2, 2, 5, 7, 6), dict(out=(2, 3, 4))),
]


def ref_kind(kind):
    return {"adaptive": "avg", "adaptive_max": "max"}.get(kind, kind)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,shape,args", CASES)
def test_pooling_and_gradients_match_the_reference(mode, kind, shape, args):
    (y, dx), (X, DY), _, _ = run(SMALL, mode, kind, shape, **args)
    want_y, want_dx = reference(X, DY.astype(np.float64), ref_kind(kind), **{k: v for k, v in args.items()})
    if ref_kind(kind) == "max":
        assert (y == want_y).all()  # a maximum is exact
    else:
        np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
    assert y.dtype == dx.dtype == np.float32


def test_reference_agrees_with_torch():
    """The test reference, checked against torch (float64) including tied maxima."""
    rng = np.random.default_rng(0)
    for kind, shape, args in CASES:
        X = rng.integers(-2, 3, size=shape).astype(np.float64)  # many ties
        xt = torch.tensor(X, requires_grad=True)
        nd = len(shape) - 2
        fn = {kind_: getattr(F, f"{name}{nd}d") for kind_, name in
              (("max", "max_pool"), ("adaptive_max", "adaptive_max_pool"), ("avg", "avg_pool"),
               ("adaptive", "adaptive_avg_pool"))}[kind]
        if kind == "max":
            yt = fn(xt, args["k"], args.get("s"), args.get("p", 0), args.get("d", 1), args.get("ceil", False))
        elif kind == "avg":
            yt = fn(xt, args["k"], args.get("s"), args.get("p", 0), args.get("ceil", False), args.get("include_pad", True),
                    args.get("divisor"))
        else:
            yt = fn(xt, args["out"])
        DY = rng.standard_normal(tuple(yt.shape))
        yt.backward(torch.tensor(DY))
        y, dx = reference(X, DY, ref_kind(kind), **args)
        np.testing.assert_allclose(y, yt.detach().numpy(), atol=1e-12)
        np.testing.assert_allclose(dx, xt.grad.numpy(), atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_max_gradient_goes_to_the_first_maximum_like_torch(mode):
    X = np.array([[[[1, 3, 3, 0], [3, 2, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]]], dtype=np.float32)
    (y, dx), (_, DY), _, _ = run(ip.Target.test(4, 64 * 1024), mode, "max", X.shape, x_values=X, k=2, s=1)
    xt = torch.tensor(X, requires_grad=True)
    F.max_pool2d(xt, 2, 1).backward(torch.tensor(DY))
    np.testing.assert_array_equal(dx, xt.grad.numpy())
    # window (0, 0) = [[1, 3], [3, 2]] ties at (0, 1) and (1, 0): the first one in row-major order wins
    assert dx[0, 0, 0, 1] == DY[0, 0, 0, 0] + DY[0, 0, 0, 1] and dx[0, 0, 1, 0] == DY[0, 0, 1, 0]


@pytest.mark.parametrize("mode", MODES)
def test_nan_propagates_and_takes_the_gradient(mode):
    X = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    X[0, 0, 0, 1] = X[0, 0, 1, 0] = np.nan
    (y, dx), (_, DY), _, _ = run(ip.Target.test(4, 64 * 1024), mode, "max", X.shape, x_values=X, k=2)
    assert np.isnan(y[0, 0, 0, 0]) and not np.isnan(y[0, 0, 1, 1])
    # the first NaN of the window gets its gradient (torch's CPU kernel would pick the last one)
    assert dx[0, 0, 0, 1] == DY[0, 0, 0, 0] and dx[0, 0, 1, 0] == 0


@pytest.mark.parametrize("mode", MODES)
def test_window_of_padding_only_is_minus_infinity_like_torch(mode):
    """Dilation can leave a max window with padding only: torch gives -inf and no gradient."""
    X = np.array([[[[0.5], [-1.0]]]], dtype=np.float32)
    (y, dx), (_, DY), _, _ = run(ip.Target.test(4, 64 * 1024), mode, "max", X.shape, x_values=X, k=(2, 1), s=1,
                                 p=(1, 0), d=(3, 1))
    xt = torch.tensor(X, requires_grad=True)
    yt = F.max_pool2d(xt, (2, 1), 1, (1, 0), (3, 1))
    yt.backward(torch.tensor(DY))
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(dx, xt.grad.numpy())
    assert np.isneginf(y).any()


@st.composite
def pool_problems(draw):
    """2-D and 3-D poolings (3-D ones smaller, so each example stays fast)."""
    kind = draw(st.sampled_from(["max", "avg", "adaptive", "adaptive_max"]))
    nd = draw(st.integers(2, 3))
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    size = tuple(draw(st.integers(1, 9 if nd == 2 else 5)) for _ in range(nd))
    if kind.startswith("adaptive"):
        return kind, (n, c) + size, dict(out=tuple(draw(st.integers(1, 6 if nd == 2 else 4)) for _ in range(nd)))
    k = tuple(draw(st.integers(1, 4 if nd == 2 else 3)) for _ in range(nd))
    args = dict(k=k, s=tuple(draw(st.integers(1, 3)) for _ in range(nd)),
                p=tuple(draw(st.integers(0, kk // 2)) for kk in k), ceil=draw(st.booleans()))
    d = (1,) * nd
    if kind == "max":
        d = args["d"] = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    else:
        args["include_pad"] = draw(st.booleans())
    assume(all(i + 2 * pp >= dd * (kk - 1) + 1 for i, pp, dd, kk in zip(size, args["p"], d, k)))
    return kind, (n, c) + size, args


@settings(max_examples=25, deadline=None)
@given(problem=pool_problems(), tiles=st.sampled_from([1, 4, 16]))
def test_pool_property_both_modes(problem, tiles):
    kind, shape, args = problem
    target = ip.Target.test(tiles, 256 * 1024)
    strict, (X, DY), e1, _ = run(target, "strict", kind, shape, **args)
    fast, _, e2, _ = run(target, "fast", kind, shape, **args)
    want_y, want_dx = reference(X, DY.astype(np.float64), ref_kind(kind), **args)
    for got in (strict, fast):
        np.testing.assert_allclose(got[0], want_y, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[1], want_dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(strict[0], fast[0])  # same window order in both modes: same bits
    np.testing.assert_allclose(strict[1], fast[1], rtol=1e-6, atol=1e-7)
    assert e1.costs[0].total == e2.costs[0].total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,shape,args", [CASES[0], CASES[5], CASES[9], CASES[12]])
def test_float16(mode, kind, shape, args):
    """Sums accumulate in float64 and round once, passing through float32 (as the device does):
    within one float16 ulp of the exact value, rounded or not."""
    (y, dx), (X, DY), _, _ = run(SMALL, mode, kind, shape, "float16", **args)
    want_y, want_dx = reference(X, DY.astype(np.float64), ref_kind(kind), **args)
    assert y.dtype == dx.dtype == np.float16
    for got, want in ((y, want_y), (dx, want_dx)):
        ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
        assert (np.abs(got.astype(np.float64) - want) <= ulp).all()


# ---- plans and exchanges ---------------------------------------------------------------------
def test_plans_spread_planes_and_rows():
    geom = P.pool_geometry("max", (8, 64, 112, 112), 3, 2, 1)
    fwd = P.plan_pool(ip.GC200, "max", geom, 8 * 64)
    bwd = P.plan_pool(ip.GC200, "max_grad", geom, 8 * 64)
    assert fwd.fits and bwd.fits and fwd.tiles_used > 1000 and bwd.tiles_used > 1000
    few_planes = P.plan_pool(SMALL, "avg", P.pool_geometry("avg", (1, 1, 64, 8), 2), 1)
    assert few_planes.splits[0] == 1 and few_planes.splits[1] > 1  # one plane: split over rows


@pytest.mark.parametrize("mode", MODES)
def test_input_on_one_tile_is_exchanged(mode):
    g = ip.Graph(SMALL)
    x = g.addVariable("float32", (2, 4, 8, 8), "x")
    g.setTileMapping(x, 3)
    prog = ip.Sequence()
    y = P.max_pool(g, x, 3, prog, 2, 1)
    X = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(x, X)
    e.run()
    np.testing.assert_array_equal(e.readTensor(y), reference(X, None, "max", 3, 2, 1)[0])
    assert len({tile for cs in g.compute_sets for t in cs.tables for tile in t.tiles.tolist()}) > 1
    assert e.costs[0].per_ipu[0].exchange >= math.ceil(X.nbytes * 15 / 16 / SMALL.exchange_bytes_per_cycle)


def test_strict_mode_needs_the_exchange():
    g = ip.Graph(SMALL)
    x = g.addVariable("float32", (2, 4, 8, 8), "x")
    g.map_linearly(x)
    prog = ip.Sequence()
    y = P.avg_pool(g, x, 2, prog)
    without_exchange = ip.Sequence(*[p for p in prog.programs[0].body.programs if not isinstance(p, ip.Copy)])
    X = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32) + 3
    e = ip.Engine(g, [prog, without_exchange], mode="strict").load()
    e.writeTensor(x, X)
    e.run(1)
    assert (e.readTensor(y) == 0).all()
    e.run(0)
    np.testing.assert_allclose(e.readTensor(y), reference(X, None, "avg", 2)[0], rtol=1e-6)


# ---- cycle estimators ------------------------------------------------------------------------
def test_estimator_formulas():
    t = ip.GC200
    for kind, base, per_row, per_elem, per_tap in [("max", 10, 1, 1, 1), ("avg", 10, 3, 3, 2),
                                                   ("max_grad", 10, 5, 5, 3), ("avg_grad", 10, 2, 4, 1)]:
        for dtype, v in (("float32", 2), ("float16", 4)):
            rows, elements, taps = 3, 21, 77
            instructions = base + per_row * rows + per_elem * math.ceil(elements / v) + per_tap * math.ceil(taps / v)
            want = t.thread_cycles(instructions)
            assert P.pool_cycles(kind, rows, elements, taps, dtype, t) == want


def test_vertex_estimates_count_the_real_window_positions():
    g = ip.Graph(ip.Target.test(1, 64 * 1024))
    x = g.addVariable("float32", (1, 2, 7, 6), "x")
    g.map_linearly(x)
    prog = ip.Sequence()
    y = P.max_pool(g, x, 3, prog, 2, 1)
    dy = g.addVariable("float32", y.shape, "dy")
    g.map_linearly(dy)
    P.max_pool_backward(g, x, y, dy, 3, prog, 2, 1)
    geom = P.pool_geometry("max", x.shape, 3, 2, 1)
    rows_h = [[r for r in range(o * 2 - 1, o * 2 + 2) if 0 <= r < 7] for o in range(geom.dims[0].out_size)]
    per_col = sum(len([c for c in range(o * 2 - 1, o * 2 + 2) if 0 <= c < 6]) for o in range(geom.dims[1].out_size))
    fwd_cs, bwd_cs = g.compute_sets
    (fwd,), (bwd,) = fwd_cs.tables, bwd_cs.tables
    got = P.POOL_VERTEX.cycles(fwd.sizes(), fwd.params, np.dtype("float32"), g.target)
    for v, (params, out) in enumerate(zip(fwd.params.astype(int).tolist(), fwd.sizes()["out"])):
        planes, row0, rows = params[2], params[3], params[4]
        taps = planes * sum(len(rows_h[o]) for o in range(row0, row0 + rows)) * per_col
        assert got[v] == P.pool_cycles("max", planes * rows, out, taps, "float32", g.target)
    got = P.MAX_GRAD_VERTEX.cycles(bwd.sizes(), bwd.params, np.dtype("float32"), g.target)
    for v, (params, dx) in enumerate(zip(bwd.params.astype(int).tolist(), bwd.sizes()["dx"])):
        planes, row0, rows, out0, outs = (params[i] for i in (1, 2, 3, 6, 7))
        pairs = planes * sum(len([r for r in rows_h[o] if row0 <= r < row0 + rows]) for o in range(out0, out0 + outs))
        assert got[v] == P.pool_cycles("max_grad", planes * rows, dx, pairs * per_col, "float32", g.target)


# ---- geometry and errors ---------------------------------------------------------------------
def test_output_sizes_follow_torch():
    x = torch.zeros(1, 1, 11, 10)
    for k, s, p, d, ceil in [(3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, 3, 1, 2, True), (4, 4, 2, 1, True)]:
        want = F.max_pool2d(x, k, s, p, d, ceil).shape[2:]
        geom = P.pool_geometry("max", x.shape, k, s, p, d, ceil)
        assert (geom.dims[0].out_size, geom.dims[1].out_size) == tuple(want)
    assert P.adaptive_geometry((1, 1, 11, 10), (None, 3)).dims[0].out_size == 11


def test_bad_arguments_are_clear_errors():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (1, 2, 5, 5), "x")
    with pytest.raises(ValueError, match="pad should be at most half of kernel size"):
        P.max_pool(g, x, 2, ip.Sequence(), padding=2)
    with pytest.raises(ValueError, match="output size .* is too small"):
        P.avg_pool(g, x, 7, ip.Sequence())
    with pytest.raises(ValueError, match="4-D input"):
        P.max_pool(g, x.reshape(2, 5, 5), 2, ip.Sequence())
    with pytest.raises(ValueError, match="output_size must be positive"):
        P.adaptive_avg_pool(g, x, 0, ip.Sequence())
    with pytest.raises(TypeError, match="int32"):
        P.max_pool(g, g.addVariable("int32", (1, 1, 4, 4), "i"), 2, ip.Sequence())
    dy = g.addVariable("float32", (1, 2, 3, 3), "dy")
    with pytest.raises(ValueError, match="gives \\[1, 2, 2, 2\\]"):
        P.avg_pool_backward(g, dy, (1, 2, 5, 5), 2, ip.Sequence())
    y = P.adaptive_max_pool(g, x, 2, ip.Sequence())
    with pytest.raises(ValueError, match="differ in shape"):
        P.adaptive_max_pool_backward(g, x, y, dy, ip.Sequence())


@pytest.mark.parametrize("spatial_shape", [(6, 6), (4, 6, 6)], ids=["2d", "3d"])
def test_vertex_state_holds_the_parameters_of_the_ops_own_rank(spatial_shape):
    """The general-form pooling vertices take three spatial dimensions' parameters; a 2-D op's
    vertices hold only their own two dimensions' (Poplar instantiates the vertex for the rank)."""
    g = ip.Graph(ip.Target.test(16, 64 * 1024))
    x = g.addVariable("float32", (2, 3) + spatial_shape, "x")
    g.map_linearly(x)
    prog = ip.Sequence()
    y = P.max_pool(g, x, 2, prog)
    P.max_pool_backward(g, x, y, y, 2, prog)
    unit = len(P.DIM_PARAMS) * (3 - len(spatial_shape))
    seen = {t.type: t.state_params for cs in g.compute_sets for t in cs.tables
            if t.type in (P.POOL_VERTEX, P.MAX_GRAD_VERTEX)}
    assert seen == {P.POOL_VERTEX: P.POOL_VERTEX.num_params - unit,
                    P.MAX_GRAD_VERTEX: P.MAX_GRAD_VERTEX.num_params - unit}
