"""Reductions and segment maps: numbers against NumPy in both modes, planning, exchanges, cycles."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ipusim as ip
from ipusim.device.mapping import expand_runs
from ipusim.ops import reduce as R
from ipusim.ops.segments import geometry, plan_segments
from ipusim.device.program import Copy, walk

TARGET = ip.Target.test(16, 64 * 1024)
REFS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min,
        "sum_squares": lambda a, axis: np.sum(a * a, axis=axis), "sum_abs": lambda a, axis: np.sum(abs(a), axis=axis)}


def variable(g, dtype, shape, name, mapping="linear", rng=None):
    t = g.addVariable(dtype, shape, name)
    if mapping == "linear":
        g.map_linearly(t, grain=4, min_elements_per_tile=8)
    elif mapping == "rows":
        g.map_by_dimension(t, 0)
    elif mapping == "tile0":
        g.setTileMapping(t, 0)
    else:  # random runs of elements on random tiles
        n, i, intervals = t.numel, 0, []
        while i < n:
            j = min(n, i + int(rng.integers(1, 9)))
            intervals.append((int(rng.integers(0, g.target.num_tiles)), i, j))
            i = j
        g.setTileMappingIntervals(t, intervals)
    return t


def run_both(g, prog, inputs, outputs):
    """Run in strict and fast mode; require identical bits and cycles; return the strict results."""
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
    return results["strict"], cycles["strict"]


@pytest.mark.parametrize("axes", [(1,), (0, 2), None, (), (2, 0)])
def test_every_op_matches_numpy(axes):
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (6, 37, 5), "x")
    prog = ip.Sequence()
    ops = list(REFS)
    outs = [R.reduce(g, x, axes, op, prog) for op in ops]
    xv = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    got, _ = run_both(g, prog, {x: xv}, outs)
    ax = tuple(sorted(axes)) if axes is not None else None
    for op, o in zip(ops, got):
        np.testing.assert_allclose(o, REFS[op](xv.astype(np.float64), axis=ax), rtol=1e-6, atol=1e-6, err_msg=op)


def test_keepdims_scale_and_convenience_functions():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 6), "x")
    prog = ip.Sequence()
    a = R.reduce(g, x, (1,), "sum", prog, keepdims=True, scale=0.5)
    b, c, d = R.reduce_sum(g, x, 0, prog), R.reduce_mean(g, x, None, prog), R.reduce_max(g, x, -1, prog)
    assert a.shape == (4, 1) and b.shape == (6,) and c.shape == () and d.shape == (4,)
    xv = np.arange(24, dtype=np.float32).reshape(4, 6)
    (ga, gb, gc, gd), _ = run_both(g, prog, {x: xv}, [a, b, c, d])
    np.testing.assert_array_equal(ga, xv.sum(1, keepdims=True) * 0.5)
    np.testing.assert_array_equal(gb, xv.sum(0))
    assert gc == pytest.approx(xv.mean())
    np.testing.assert_array_equal(gd, xv.max(1))


def test_float16_accumulates_in_float32():
    g = ip.Graph(TARGET)
    x = variable(g, "float16", (3000,), "x", "tile0")
    prog = ip.Sequence()
    s16 = R.reduce_sum(g, x, None, prog)
    s32 = R.reduce(g, x, None, "sum", prog, out_dtype="float32")
    xv = np.ones(3000, np.float16)
    (a, b), _ = run_both(g, prog, {x: xv}, [s16, s32])
    # a float16 accumulator would stop at 2048 (2049 rounds back to 2048)
    assert a.dtype == np.float16 and a == 3000
    assert b.dtype == np.float32 and b == 3000


def test_float16_outputs_round_once():
    g = ip.Graph(TARGET)
    x = variable(g, "float16", (8, 50), "x")
    prog = ip.Sequence()
    m = R.reduce_mean(g, x, 1, prog)
    xv = np.random.default_rng(2).standard_normal(x.shape).astype(np.float16)
    (got,), _ = run_both(g, prog, {x: xv}, [m])
    ref = xv.astype(np.float64).mean(1)
    # one rounding of a float64-accurate value: within half an ulp of float16 (plus float32 partials)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= np.spacing(np.abs(ref).astype(np.float16)) * 0.5 + 1e-6)


def test_integer_and_bool_reductions():
    g = ip.Graph(TARGET)
    i = variable(g, "int32", (5, 9), "i")
    b = variable(g, "bool", (5, 9), "b")
    prog = ip.Sequence()
    outs = [R.reduce_sum(g, i, 1, prog), R.reduce_max(g, i, 0, prog), R.reduce(g, i, None, "min", prog),
            R.reduce_sum(g, b, None, prog), R.reduce(g, b, 1, "sum", prog, out_dtype="float32"),
            R.reduce_max(g, b, 1, prog)]
    rng = np.random.default_rng(3)
    iv = rng.integers(-1000, 1000, (5, 9)).astype(np.int32)
    bv = rng.random((5, 9)) < 0.4
    got, _ = run_both(g, prog, {i: iv, b: bv}, outs)
    np.testing.assert_array_equal(got[0], iv.sum(1))
    np.testing.assert_array_equal(got[1], iv.max(0))
    assert got[2] == iv.min()
    assert got[3].dtype == np.int32 and got[3] == bv.sum()
    np.testing.assert_array_equal(got[4], bv.sum(1).astype(np.float32))
    assert got[5].dtype == np.bool_ and (got[5] == bv.any(1)).all()


def test_nan_propagates_through_max_and_min():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 10), "x")
    prog = ip.Sequence()
    mx, mn = R.reduce_max(g, x, 1, prog), R.reduce(g, x, 1, "min", prog)
    xv = np.arange(40, dtype=np.float32).reshape(4, 10)
    xv[1, 3] = np.nan
    (a, b), _ = run_both(g, prog, {x: xv}, [mx, mn])
    assert np.isnan(a[1]) and np.isnan(b[1])
    assert a[[0, 2, 3]].tolist() == [9, 29, 39] and b[[0, 2, 3]].tolist() == [0, 20, 30]


def test_empty_reductions_follow_torch():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (3, 0), "x")
    prog = ip.Sequence()
    s, m = R.reduce_sum(g, x, 1, prog), R.reduce_mean(g, x, 1, prog)
    (a, b), _ = run_both(g, prog, {}, [s, m])
    assert a.tolist() == [0, 0, 0] and np.isnan(b).all()
    with pytest.raises(ValueError, match="reduced size is 0"):
        R.reduce_max(g, x, 1, prog)
    empty_out = R.reduce_sum(g, x, 0, prog)
    assert empty_out.shape == (0,)


def test_identity_copy_with_empty_axes():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (3, 5), "x", "rows")
    prog = ip.Sequence()
    c, sq = R.reduce_sum(g, x, (), prog), R.reduce(g, x, (), "sum_squares", prog)
    xv = np.random.default_rng(4).standard_normal((3, 5)).astype(np.float32)
    (a, b), cycles = run_both(g, prog, {x: xv}, [c, sq])
    np.testing.assert_array_equal(a, xv)
    np.testing.assert_array_equal(b, (xv.astype(np.float64) ** 2).astype(np.float32))
    # a copy stays on the input's tiles: no exchange at all
    assert not any(isinstance(p, Copy) for p in walk(prog))
    assert (c.tiles() == x.tiles()).all()


def test_bad_arguments_are_named():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (3, 4), "x")
    i = variable(g, "int32", (3, 4), "i")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="unknown reduction 'prod'"):
        R.reduce(g, x, 0, "prod", prog)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        R.reduce_sum(g, x, (2,), prog)
    with pytest.raises(ValueError, match="repeat an axis"):
        R.reduce_sum(g, x, (1, -1), prog)
    with pytest.raises(TypeError, match="mean of int32 tensor 'i'"):
        R.reduce_mean(g, i, 0, prog)


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), data=st.data())
def test_property_random_shapes_axes_and_mappings(shape, data):
    rank = len(shape)
    axes = tuple(data.draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank)))
    op = data.draw(st.sampled_from(sorted(REFS)))
    mapping = data.draw(st.sampled_from(["linear", "rows", "random"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    g = ip.Graph(TARGET)
    x = variable(g, "float32", tuple(shape), "x", mapping, rng)
    prog = ip.Sequence()
    out = R.reduce(g, x, axes, op, prog)
    xv = rng.standard_normal(shape).astype(np.float32)
    (got,), _ = run_both(g, prog, {x: xv}, [out])
    np.testing.assert_allclose(got, REFS[op](xv.astype(np.float64), axis=tuple(sorted(axes))), rtol=1e-6, atol=1e-6)


# ---- planning, exchanges, cycles --------------------------------------------------------------
def _op_program(prog):
    (op,) = prog.programs
    return op


def test_rows_on_one_tile_reduce_in_one_stage_without_exchange():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (16, 40), "x", "rows")
    prog = ip.Sequence()
    out = R.reduce_sum(g, x, 1, prog)
    xv = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    (got,), _ = run_both(g, prog, {x: xv}, [out])
    np.testing.assert_allclose(got, xv.astype(np.float64).sum(1), rtol=1e-6)
    assert not any(isinstance(p, Copy) for p in walk(prog))
    assert (out.tiles() == np.arange(16)).all()  # each row's sum where the row lives
    e = ip.Engine(g, prog).load()
    e.run()
    assert e.last_run.per_ipu[0].exchange == 0


def test_strict_mode_really_moves_the_partials():
    """Rows spread over tiles: the final stage reads partials that only an exchange brings; without
    that exchange the strict mode computes wrong numbers while the fast mode cannot tell."""
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 64), "x")  # 8 elements per tile: every row spans 8 tiles
    prog = ip.Sequence()
    out = R.reduce_sum(g, x, 1, prog)
    xv = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32) + 1
    (got,), _ = run_both(g, prog, {x: xv}, [out])
    np.testing.assert_allclose(got, xv.astype(np.float64).sum(1), rtol=1e-6)
    e = ip.Engine(g, prog).load()
    e.run()
    assert e.last_run.per_ipu[0].exchange > 0
    body = _op_program(prog).body
    copies = [i for i, p in enumerate(body.programs) if isinstance(p, Copy)]
    assert len(copies) == 1
    body.programs[copies[0]] = ip.Sequence()
    strict = ip.Engine(g, prog, mode="strict").load()
    strict.writeTensor(x, xv)
    strict.run()
    assert not np.allclose(strict.readTensor(out), got)


def test_an_input_on_one_tile_reduces_on_that_tile():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (12, 10), "x", "tile0")
    g.setTileMapping(x[5], 9)
    prog = ip.Sequence()
    out = R.reduce_sum(g, x, 0, prog)
    xv = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
    (got,), _ = run_both(g, prog, {x: xv}, [out])
    np.testing.assert_allclose(got, xv.astype(np.float64).sum(0), rtol=1e-6)


def test_reduce_estimator_formula():
    # float32 sum: w = 4, 2 instructions per vector; 3 outputs of 10 elements, scaled
    assert R.reduce_instructions(3, 10, 2, R.SUM, True, False) == 26 + 3 * (8 + 2 * 2 + 2 + 1)
    # float16 max: w = 4, 1 instruction per vector, converted output
    assert R.reduce_instructions(2, 9, 4, R.MAX, False, True) == 26 + 2 * (8 + 2 + 1 + 1)
    t = ip.GC200
    vertex_cycles = R.REDUCE_VERTEX.cycles({"x": np.array([30]), "out": np.array([3])}, np.array([[0, 10, 0.5, 0]]),
                                           np.dtype("float32"), t)
    assert vertex_cycles.tolist() == [t.thread_cycles(26 + 3 * (8 + 2 * 2 + 2 + 1))]
    assert R.segment_map_instructions(3, 10, 2, 6) == 17 + 3 * 4 + 3 * 5 * 2
    assert R.segment_map_instructions(2, 7, 4, 0) == 17 + 2 * 4 + 2 * 7 * 16  # exp is not vectorised


def test_plan_cost_is_the_engine_cost():
    for mapping, shape, axes in [("rows", (16, 40), (1,)), ("linear", (4, 64), (1,)), ("linear", (24, 30), (0,)),
                                 ("linear", (600,), None)]:
        g = ip.Graph(TARGET)
        x = variable(g, "float32", shape, "x", mapping)
        prog = ip.Sequence()
        R.reduce(g, x, axes, "mean", prog)
        ax = R.normalize_axes(axes, x.rank, "t")
        plan = R.plan_reduction(geometry(x, ax), TARGET, R.SUM, np.float32, np.float32, np.float32, True)
        e = ip.Engine(g, prog).load()
        assert e.run() == plan.cycles, (mapping, shape, plan.description)


def test_planner_spreads_the_final_stage_when_outputs_have_many_partials():
    g = ip.Graph(ip.GC200)
    x = g.addVariable("float32", (64, 128), "x")
    g.map_linearly(x, grain=4, min_elements_per_tile=64)  # one half row per tile
    plan = R.plan_reduction(geometry(x, (0,)), ip.GC200, R.SUM, np.float32, np.float32, np.float32, False)
    owner_tiles = np.unique(plan.partial.seg_tile[np.unique(plan.partial.seg_out, return_index=True)[1]])
    assert "spread" in plan.description and np.unique(plan.out_tiles).size == 32 and owner_tiles.size <= 2


def test_vertex_groups_split_work_over_workers():
    tiles = np.array([0] * 12 + [1] * 2)
    counts = np.array([10] * 12 + [3, 5])
    groups = list(zip(*(a.tolist() for a in R.vertex_groups(tiles, counts, 6))))
    assert [(t, a, b) for t, a, b in groups if t == 0] == [(0, 0, 2), (0, 2, 4), (0, 4, 6), (0, 6, 8), (0, 8, 10),
                                                          (0, 10, 12)]
    assert [(t, a, b) for t, a, b in groups if t == 1] == [(1, 12, 13), (1, 13, 14)]  # unequal counts never share


def test_segment_plan_splits_long_segments_and_parts():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (40,), "x")
    g.setTileMapping(x, 0)
    plan = plan_segments(geometry(x, (0,)), workers=6)
    assert plan.counts.tolist() == [8] * 5  # ceil(40 / 6) = 7, rounded up to the vector grain
    y = g.addVariable("float32", (5,), "y")
    y.var.mapping = ip.TileMap.from_tiles([0, 0, 1, 0, 0])
    gaps = plan_segments(geometry(y, (0,)), split_parts=True)
    _, first, count, _ = gaps.segment_runs(np.arange(gaps.num_segments))
    assert gaps.counts.tolist() == [2, 2, 1] and expand_runs(first, count).tolist() == [0, 1, 3, 4, 2]


# ---- segment maps ----------------------------------------------------------------------------
def test_segment_map_ops_match_numpy():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (5, 12), "x")
    b = variable(g, "float32", (5, 12), "b", "rows")
    w = variable(g, "float32", (12,), "w", "tile0")
    r = variable(g, "float32", (5,), "r", "tile0")
    q = variable(g, "float32", (5,), "q")
    prog = ip.Sequence()
    outs = {"sub": R.segment_map(g, "sub", x, 1, prog, "sub", r=r),
            "normalise": R.segment_map(g, "normalise", x, 1, prog, "n", r=r, q=q),
            "norm_affine": R.segment_map(g, "norm_affine", x, 1, prog, "na", r=r, q=q, b=w, c=b),
            "mul": R.segment_map(g, "mul", x, 1, prog, "m", b=b),
            "norm_grad": R.segment_map(g, "norm_grad", x, 1, prog, "ng", r=r, q=q, s=q, b=b),
            "nll_pick": R.segment_map(g, "nll_pick", x, 1, prog, "pick", r=r, param=-100.0)}
    rng = np.random.default_rng(8)
    xv, bv, wv = (rng.standard_normal(s).astype(np.float32) for s in ((5, 12), (5, 12), (12,)))
    rv, qv = np.array([3, 0, 11, -100, 20], np.float32), rng.random(5).astype(np.float32) + 0.5
    got, _ = run_both(g, prog, {x: xv, b: bv, w: wv, r: rv, q: qv}, list(outs.values()))
    X, B, W, Rr, Q = (a.astype(np.float64) for a in (xv, bv, wv, rv[:, None], qv[:, None]))
    cols = np.arange(12)[None, :]
    refs = {"sub": X - Rr, "normalise": (X - Rr) * Q, "norm_affine": (X - Rr) * Q * W + B, "mul": X * B,
            "norm_grad": Q * (X - Rr - B * Q), "nll_pick": np.where(cols == Rr, -X, 0.0)}
    for (k, ref), o in zip(refs.items(), got):
        np.testing.assert_allclose(o, ref, rtol=1e-6, atol=1e-7, err_msg=k)
    assert (outs["sub"].tiles() == x.tiles()).all()


def test_segment_map_argument_errors():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (5, 12), "x")
    r = variable(g, "float32", (4,), "r")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="unknown segment op"):
        R.segment_map(g, "tan", x, 1, prog, "bad", r=r)
    with pytest.raises(ValueError, match="needs r="):
        R.segment_map(g, "sub", x, 1, prog, "bad")
    with pytest.raises(ValueError, match="statistics 'r'"):
        R.segment_map(g, "sub", x, 1, prog, "bad", r=r)
    with pytest.raises(ValueError, match="indexes along one axis"):
        R.segment_map(g, "nll_pick", x, (0, 1), prog, "bad", r=r.reshape(4)[0])


def test_segment_map_exchanges_statistics_once_per_segment():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 64), "x")  # 16 elements per tile: each row on 4 tiles
    r = variable(g, "float32", (4,), "r", "tile0")
    prog = ip.Sequence()
    R.segment_map(g, "sub", x, 1, prog, "sub", r=r)
    copies = [p for p in walk(prog) if isinstance(p, Copy)]
    # 4 rows x 4 tiles, not 256 elements, though each tile's 16 elements run on 4 workers
    assert len(copies) == 1 and copies[0].dst.numel == 16
    (cs,) = [p.compute_set for p in walk(prog) if isinstance(p, ip.Execute)]
    assert cs.num_vertices == 64



def test_planner_prefers_a_plan_that_fits_the_tile_memory():
    tiles = np.array([0, 3, 2, 3, 3, 2, 2, 3, 3, 2, 2, 2, 3, 1, 3, 1, 3, 0, 3, 1, 2, 0, 1, 0, 2, 3, 0, 1, 3, 0, 0, 0, 2,
                      2, 2, 0, 2, 1, 3, 3, 0, 1, 2, 0, 1, 1, 2, 2, 2, 1, 2, 3, 2, 3, 2, 2, 1, 2, 1, 1, 0, 2, 2, 3, 2, 0,
                      0, 1, 3, 0, 2, 1, 2, 0, 3, 3, 1, 3, 1, 2, 1, 1, 0, 1, 2, 3, 3, 0, 2, 1, 1, 1, 2, 2, 2, 0, 3, 3, 1,
                      2])  # a (5, 20) tensor scattered over 4 tiles, reduced over axis 0
    x = ip.Graph(ip.Target.test(4)).addVariable("float32", (5, 20), "x")
    x.var.mapping = ip.TileMap.from_tiles(tiles)
    roomy = R.plan_reduction(geometry(x, (0,)), ip.Target.test(4, 64 * 1024), R.SUM, np.float32, np.float32,
                             np.float32, False)
    tight_target = ip.Target.test(4, 288)
    tight = R.plan_reduction(geometry(x, (0,)), tight_target, R.SUM, np.float32, np.float32, np.float32, False)
    assert "owner" in roomy.description and "owner" not in tight.description
    assert tight.cycles > roomy.cycles  # the cheapest plan would not fit a 288-byte tile
    n, per = 4, np.bincount
    working = (per(tiles, minlength=n) + per(tight.partial.seg_tile, minlength=n)
               + per(tight.final.element_tiles(), minlength=n) + per(tight.out_tiles, minlength=n)) * 4
    assert working.max() <= 288


# ---- accumulation order and the fast mode's plans ---------------------------------------------
def lane_order(values, op, rounded=False):
    """The documented accumulation order, in plain Python floats (IEEE float64)."""
    def combine(o, acc, v):
        if o == R.MAX:
            return v if (v > acc or v != v) else acc
        if o == R.MIN:
            return v if (v < acc or v != v) else acc
        if o == R.SUM_SQUARES:
            return acc + (float(np.float32(v * v)) if rounded else v * v)
        return acc + (abs(v) if o == R.SUM_ABS else v)
    lanes = [R.identity_value(op)] * R.LANES
    for i, v in enumerate(values):
        lanes[i % R.LANES] = combine(op, lanes[i % R.LANES], float(v))
    lane_op = op if op in (R.MAX, R.MIN) else R.SUM
    w = R.LANES // 2
    while w:
        for lane in range(w):
            lanes[lane] = combine(lane_op, lanes[lane], lanes[lane + w])
        w //= 2
    return lanes[0]


def segment_table(kind, positions, starts):
    """A stage of one segment per [starts[s], starts[s + 1]) of `positions`: a ROWS or COLUMNS
    block each (contiguous or strided), or GATHERED from the positions."""
    counts = np.diff(starts)
    rows = []
    for s, (a, n) in enumerate(zip(starts[:-1], counts)):
        if kind == "gathered":
            rows.append([a, n, 1, 1, 0, s, R.GATHERED])
        else:
            step = 3 if kind == "strided" else 1
            rows.append([positions[a], n, step, 1, 0, s, R.COLUMNS if step > 1 else R.ROWS])
    return R.StageBlocks.of(np.array(rows), positions if kind == "gathered" else np.zeros(0, np.int64), len(counts))


@pytest.mark.parametrize("op", [R.SUM, R.MAX, R.MIN, R.SUM_SQUARES, R.SUM_ABS])
def test_fast_kernels_follow_the_documented_lane_order(op):
    """Contiguous (vector, also ending at the array's end), strided, side-by-side and gathered
    segments all give the bits of the lane order, for lengths around multiples of the lane count,
    with NaN and signed zeros."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(4000) * 10 ** rng.uniform(-3, 3, 4000)).astype(np.float32)
    x[[5, 700]] = [-0.0, 0.0]
    x[1500:1503] = [0.0, -0.0, 0.0]
    x[[3001, 3995]] = np.nan
    lengths = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100]
    starts = np.cumsum([0] + lengths)
    cases = {"contiguous": np.arange(starts[-1]), "contiguous up to the end": np.arange(4000 - starts[-1], 4000),
             "strided": np.concatenate([1000 + s * 3 + np.arange(n) * 3 for s, n in zip(starts[:-1], lengths)]),
             "gathered": np.sort(rng.choice(np.arange(1500, 4000), starts[-1], replace=False))}
    for rounded in ([False, True] if op == R.SUM_SQUARES else [False]):
        for kind, positions in cases.items():
            got = R.run_stage(x, segment_table(kind, positions, starts), op, 1.0, rounded)
            want = [lane_order(x[positions[a:b]], op, rounded) for a, b in zip(starts[:-1], starts[1:])]
            np.testing.assert_array_equal(got.view(np.int64), np.array(want).view(np.int64), err_msg=kind)
        # 40 columns of a (70, 40) block side by side; the same bits per column
        block = x[1000:3800]
        cols = R.StageBlocks.of(np.array([[0, 70, 40, 40, 1, 0, R.COLUMNS]]), np.zeros(0, np.int64), 40)
        got = R.run_stage(block, cols, op, 1.0, rounded)
        want = [lane_order(block.reshape(70, 40)[:, k], op, rounded) for k in range(40)]
        np.testing.assert_array_equal(got.view(np.int64), np.array(want).view(np.int64))


def test_stage_blocks_read_the_blocks_of_a_plan():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (4, 6), "x")
    g.setTileMapping(x, 0)
    rows = R.stage_blocks(plan_segments(geometry(x, (1,))))  # 4 rows of 6, one after another
    assert rows.blocks.tolist() == [[0, 6, 1, 4, 6, 0, R.ROWS]]
    cols = R.stage_blocks(plan_segments(geometry(x, (0,))))  # 6 columns of 4, side by side
    assert cols.blocks.tolist() == [[0, 4, 6, 6, 1, 0, R.COLUMNS]]
    y = g.addVariable("float32", (2, 5), "y")
    y.var.mapping = ip.TileMap.from_tiles([0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    odd = R.stage_blocks(plan_segments(geometry(y, (1,))))
    # row 0 on tile 0 is (0, 1, 3, 4): two parts, read from the gathered elements; then row 1; then (2) on tile 1
    assert odd.blocks.tolist() == [[5, 5, 1, 1, 5, 1, R.ROWS], [2, 1, 1, 1, 5, 2, R.ROWS],
                                   [0, 4, 1, 1, 0, 0, R.GATHERED]]
    assert odd.gather.tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_one_element_partials_skip_the_partial_stage_with_the_same_bits(dtype):
    """Rows on their own tiles reduced over the rows: every partial holds one element, so the
    fast mode reads the elements directly; squares are rounded to float32 as partials are."""
    g = ip.Graph(TARGET)
    x = variable(g, dtype, (16, 40), "x", "rows")
    prog = ip.Sequence()
    ops = ["sum", "max", "sum_squares", "sum_abs", "mean"]
    outs = [R.reduce(g, x, 0, op, prog, out_dtype="float32") for op in ops]
    plan = R.plan_reduction(geometry(x, (0,)), TARGET, R.SUM_SQUARES, np.dtype(dtype), np.float32, np.float32, False)
    assert plan.final is not None and (plan.partial.counts == 1).all()
    assert len(R.fast_reduction(plan, R.SUM_SQUARES, np.dtype(dtype), np.float32, 1.0, x.shape).stages) == 1
    xv = (np.random.default_rng(11).standard_normal(x.shape) * 3).astype(dtype)
    got, _ = run_both(g, prog, {x: xv}, outs)
    for op, o in zip(ops, got):
        np.testing.assert_allclose(o, REFS[op](xv.astype(np.float64), axis=0), rtol=2e-6, atol=1e-6, err_msg=op)


def test_neighbouring_blocks_that_continue_one_another_are_joined():
    rows = [[0, 4, 1, 2, 4, 0, R.ROWS], [8, 4, 1, 3, 4, 2, R.ROWS],        # continues: joined
            [40, 4, 1, 1, 4, 5, R.ROWS],                                   # starts elsewhere
            [0, 3, 1, 1, 3, 6, R.GATHERED], [3, 3, 1, 1, 3, 7, R.GATHERED],  # gathered: never joined
            [100, 8, 16, 4, 1, 8, R.COLUMNS], [104, 8, 16, 4, 1, 12, R.COLUMNS]]
    assert R.coalesced(np.array(rows, np.int64)).tolist() == [
        [0, 4, 1, 5, 4, 0, R.ROWS], [40, 4, 1, 1, 4, 5, R.ROWS], [0, 3, 1, 1, 3, 6, R.GATHERED],
        [3, 3, 1, 1, 3, 7, R.GATHERED], [100, 8, 16, 8, 1, 8, R.COLUMNS]]
    # a run longer than BLOCK_ELEMENTS is cut into blocks of whole segments, the kernel threads' shares
    n = R.BLOCK_ELEMENTS // 4
    long = np.array([[k * 2 * n, n, 1, 2, n, 2 * k, R.ROWS] for k in range(8)], np.int64)
    joined = R.coalesced(long)
    assert joined[:, 3].tolist() == [4, 4, 4, 4] and joined[:, 0].tolist() == [0, 4 * n, 8 * n, 12 * n]


def test_stages_read_through_a_gather_only_when_every_block_stays_evenly_spaced():
    stage = R.StageBlocks.of(np.array([[0, 3, 1, 2, 3, 0, R.ROWS]], np.int64), np.zeros(0, np.int64), 2)
    spread = np.array([10, 11, 12, 20, 21, 22])   # two rows, each contiguous in the source
    assert R.read_through(stage, spread).blocks.tolist() == [[10, 3, 1, 2, 10, 0, R.ROWS]]
    assert R.read_through(stage, np.array([10, 12, 14, 20, 22, 24])) is None   # a ROWS block must stay contiguous
    assert R.read_through(stage, np.array([10, 11, 13, 20, 21, 22])) is None   # not evenly spaced


@pytest.mark.parametrize("shape, axes", [((8, 6, 5, 5), (0, 2, 3)), ((64, 48), (0,)), ((4, 12, 10), (0, 1))])
def test_bias_gradient_reductions_read_the_input_in_place(shape, axes):
    """Reductions over the leading axes (a bias gradient) read x itself, through neither a
    transposed copy nor a gather, with the strict mode's bits."""
    g = ip.Graph(TARGET)
    x = variable(g, "float32", shape, "x")
    prog = ip.Sequence()
    ops = ["sum", "max", "sum_squares", "mean"]
    outs = [R.reduce(g, x, axes, op, prog) for op in ops]
    plan = R.plan_reduction(geometry(x, axes), TARGET, R.SUM, np.dtype("float32"), np.float32, np.float32, False)
    fast = R.fast_reduction(plan, R.SUM, np.dtype("float32"), np.float32, 1.0, x.shape)
    assert fast.order is None and (fast.gather is None or len(fast.stages) == 2)
    xv = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    got, _ = run_both(g, prog, {x: xv}, outs)
    for op, o in zip(ops, got):
        np.testing.assert_allclose(o, REFS[op](xv.astype(np.float64), axis=axes), rtol=2e-6, atol=1e-6, err_msg=op)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "bool"])
def test_column_reductions_match_strict_bits(dtype):
    """(64, 48) spread linearly: each tile holds whole rows, so reducing over the rows gives
    strided segments of neighbouring columns (read side by side in the fast mode)."""
    g = ip.Graph(TARGET)
    x = variable(g, dtype, (64, 48), "x")
    prog = ip.Sequence()
    ops = ["sum", "max", "min"] + (["sum_squares", "sum_abs"] if dtype != "bool" else [])
    outs = [R.reduce(g, x, 0, op, prog, out_dtype="float32" if dtype in ("bool", "float16") else None) for op in ops]
    rng = np.random.default_rng(12)
    xv = (rng.standard_normal(x.shape) * 100).astype(dtype) if dtype != "bool" else rng.random(x.shape) < 0.3
    got, _ = run_both(g, prog, {x: xv}, outs)
    for op, o in zip(ops, got):
        np.testing.assert_allclose(o, REFS[op](xv.astype(np.float64), axis=0), rtol=1e-6, err_msg=op)


def test_exp64_is_within_two_ulp_and_handles_the_edges():
    rng = np.random.default_rng(13)
    z = np.concatenate([rng.uniform(-745, 709.7, 200_000), rng.uniform(-1, 1, 50_000)])
    got = np.array([R.exp64(v) for v in z[:2000]])  # the scalar function
    want = np.exp(z[:2000])
    normal = want > np.finfo(np.float64).tiny
    assert np.max(np.abs(got - want)[normal] / np.spacing(want[normal])) <= 2
    edges = np.array([0.0, -0.0, 709.78, 709.79, 1e300, np.inf, -np.inf, np.nan, -745.2, -1e300, -720.0, 88.72])
    with np.errstate(over="ignore"):
        want = np.exp(edges)
    got = np.array([R.exp64(v) for v in edges])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    assert np.all((got[fin] == want[fin]) | (np.abs(got[fin] - want[fin]) <= np.spacing(want[fin])))


def test_row_layout_describes_runs_of_inner_dims():
    rows = R.row_layout((12, 10), (1,), column=True)
    assert (rows.rows, rows.length, rows.stat_step, rows.col_step) == (12, 10, 0, 1)
    assert rows.stat_row.tolist() == list(range(12)) and not rows.col_row.any()
    kept = R.row_layout((4, 1, 6, 5), (0,), column=True)
    assert (kept.rows, kept.length, kept.stat_step, kept.col_step) == (4, 30, 1, 0)
    assert kept.stat_row.tolist() == [0] * 4 and kept.col_row.tolist() == [0, 1, 2, 3]
    mixed = R.row_layout((2, 3, 4), (0, 2), column=False)
    assert (mixed.rows, mixed.length, mixed.stat_step) == (6, 4, 0) and mixed.stat_row.tolist() == [0, 1, 2] * 2


def test_segment_maps_on_every_layout_match_strict_bits():
    """Stats along kept inner dims, reduced inner dims split by kept ones, column ops away from the
    last axis, b with contiguous and with repeated runs, float16 and float32 outputs."""
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (12, 10), "x")
    x3 = variable(g, "float32", (4, 6, 5), "x3")
    h = variable(g, "float16", (6, 20), "h")
    w = variable(g, "float32", (10,), "w", "tile0")
    col = variable(g, "float32", (12, 1), "col")
    r0, q0 = variable(g, "float32", (10,), "r0"), variable(g, "float32", (10,), "q0")
    r1 = variable(g, "float32", (12,), "r1")
    r3 = variable(g, "float32", (6,), "r3")
    rh = variable(g, "float32", (6,), "rh")
    lab = variable(g, "float32", (4, 5), "lab")
    prog = ip.Sequence()
    outs = {"kept": R.segment_map(g, "normalise", x, 0, prog, "kept", r=r0, q=q0),
            "split": R.segment_map(g, "exp_sub", x3, (0, 2), prog, "split", r=r3),
            "weight": R.segment_map(g, "norm_scale", x, 1, prog, "weight", r=r1, q=r1, b=w),
            "repeat": R.segment_map(g, "softmax_grad", x, 1, prog, "repeat", r=r1, b=col),
            "column": R.segment_map(g, "softmax_xent_grad", x3, 1, prog, "column", r=lab, q=lab, param=2.0),
            "half": R.segment_map(g, "sub", h, 1, prog, "half", r=rh),
            "half32": R.segment_map(g, "log_softmax_grad", h, 1, prog, "half32", r=rh, b=h, out_dtype="float32")}
    rng = np.random.default_rng(14)
    vals = {t: rng.standard_normal(t.shape).astype(t.dtype) for t in (x, x3, h, w, col, r0, q0, r1, r3, rh)}
    vals[lab] = rng.integers(0, 7, lab.shape).astype(np.float32)
    got, _ = run_both(g, prog, vals, list(outs.values()))
    X, X3, H = (vals[t].astype(np.float64) for t in (x, x3, h))
    E = lambda t: vals[t].astype(np.float64)  # noqa: E731
    onehot = np.arange(6)[None, :, None] == E(lab)[:, None, :]
    refs = {"kept": (X - E(r0)) * E(q0), "split": np.exp(X3 - E(r3)[None, :, None]),
            "weight": (X - E(r1)[:, None]) * E(r1)[:, None] * E(w), "repeat": X * (E(col) - E(r1)[:, None]),
            "column": np.where(E(lab)[:, None, :] == 2, 0.0, (np.exp(X3) - onehot) * E(lab)[:, None, :]),
            "half": H - E(rh)[:, None], "half32": H - np.exp(H) * E(rh)[:, None]}
    for (k, ref), o in zip(refs.items(), got):
        tol = 1e-3 if o.dtype == np.float16 else 2e-6
        np.testing.assert_allclose(o, ref, rtol=tol, atol=tol * 1e-1, err_msg=k)
    assert got[5].dtype == np.float16 and got[6].dtype == np.float32


def test_fast_outputs_are_written_straight_into_storage():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4, 8), "x")
    h = variable(g, "float16", (4, 8), "h")
    fast = ip.Engine(g, ip.Sequence()).load()
    view = R.output_storage(fast.mem, x)
    view[:] = np.arange(32)
    np.testing.assert_array_equal(fast.readTensor(x).reshape(-1), np.arange(32))
    assert R.output_storage(fast.mem, h) is None  # float16 is stored through a float32 result
    strict = ip.Engine(g, ip.Sequence(), mode="strict").load()
    assert R.output_storage(strict.mem, x) is None  # tile-major memory: a read is a copy


def test_fast_kernels_give_the_same_bits_on_more_kernel_threads():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (64, 48), "x")
    prog = ip.Sequence()
    outs = [R.reduce_sum(g, x, 0, prog), R.reduce_max(g, x, 1, prog),
            R.segment_map(g, "exp_sub", x, 1, prog, "e", r=R.reduce_max(g, x, 1, prog, name="m"))]
    xv = np.random.default_rng(15).standard_normal(x.shape).astype(np.float32)
    got = []
    for threads in (1, 2):
        e = ip.Engine(g, prog, kernel_threads=threads).load()
        e.writeTensor(x, xv)
        e.run()
        got.append([e.readTensor(o) for o in outs])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op", ["sum", "max", "sum_squares"])
@pytest.mark.parametrize("key, axes", [((slice(None), slice(2, 3)), (0, 1)), ((slice(None), 2), (0,)),
                                       ((slice(None, None, 2), slice(None, None, -1)), (1,)), ((Ellipsis, 1), None)])
def test_strided_views_reduce_as_numpy_in_both_modes(op, key, axes):
    """A fast-mode read of a strided view is a view of the storage, not a copy: the reduction
    kernels, which load runs as contiguous memory, must still see the view's elements."""
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (6, 5), "x")
    prog = ip.Sequence()
    out = R.reduce(g, x[key], axes, op, prog)
    values = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
    (got,), _ = run_both(g, prog, {x: values}, [out])
    np.testing.assert_allclose(got, REFS[op](values[key].astype(np.float64), axis=axes), rtol=1e-5)


def test_reductions_of_one_structure_share_their_plans():
    """Two tensors of one shape and tile map (a model's repeated layers) plan once; another tile
    map plans anew; each keeps its own view and gives its own results."""
    g = ip.Graph(TARGET)
    a, b = (variable(g, "float32", (12, 40), n) for n in "ab")
    c = variable(g, "float32", (12, 40), "c", "rows")
    plans = [R.planned_reduction(geometry(t, (0,)), TARGET, R.SUM, np.dtype("float32"), np.float32, np.float32, 1.0,
                                 t.shape) for t in (a, b, c)]
    assert plans[0][1] is plans[1][1] and plans[2][1] is not plans[0][1]
    assert plans[0][0].partial.geometry.view.var is a.var and plans[1][0].partial.geometry.view.var is b.var
    prog = ip.Sequence()
    outs = [R.reduce(g, t, 0, "sum", prog) for t in (a, b, c)]
    rng = np.random.default_rng(9)
    values = {t: rng.standard_normal(t.shape).astype(np.float32) for t in (a, b, c)}
    got, _ = run_both(g, prog, values, outs)
    for t, o in zip((a, b, c), got):
        np.testing.assert_allclose(o, values[t].astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
