"""ipusim.ops.matmul: plans, K-split reduction, numerics in both modes, exchanges, cycle estimators."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops.matmul import (MATMUL_VERTEX, REDUCE_VERTEX, MatMulPlan, amp_partial_cycles, matmul, plan_matmul,
                               split_candidates, split_grid)

MODES = ["strict", "fast"]
ROOMY = ip.Target.test(16, 1024 * 1024)


def build(target, a_shape, b_shape, dtype="float32", map_a=None, **kw):
    g = ip.Graph(target)
    a = g.addVariable(dtype, a_shape, "a")
    b = g.addVariable(dtype, b_shape, "b")
    (g.map_linearly(a) if map_a is None else g.setTileMapping(a, map_a))
    g.map_linearly(b)
    prog = ip.Sequence()
    c = matmul(g, a, b, prog, **kw)
    return g, a, b, c, prog


def run(g, prog, mode, inputs, out):
    e = ip.Engine(g, prog, mode=mode).load()
    for t, v in inputs.items():
        e.writeTensor(t, v)
    cycles = e.run()
    return e.readTensor(out), cycles, e


def operands(rng, a_shape, b_shape, dtype=np.float32):
    return rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)


def assert_float32_close(got, a, b):
    """Within 1e-5 of the float64 product, relative to sum |a_ik| |b_kj| (the scale the
    accumulation error is proportional to; plain relative error is meaningless where the
    products cancel)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    scale = np.abs(a64) @ np.abs(b64)
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert (np.abs(got - exact) <= 1e-5 * scale).all(), np.max(np.abs(got - exact) / scale)


def assert_float16_close(got, a, b):
    """float16 results are the float32-accumulated sum rounded once to float16 (as NumPy rounds).
    Rounding the exact sum s to float16 is off by at most half a float16 ulp of |s|; values pass
    through float32 first (another 2^-24 |s|) and the float32 accumulation adds at most
    K * 2^-24 * sum |a||b|. So |got - s| <= ulp16(s) + (K + 1) * 2^-24 * sum |a||b|."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    k = a.shape[-1]
    ulp16 = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    tol = ulp16 + (k + 1) * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64))
    assert got.dtype == np.float16
    assert (np.abs(got.astype(np.float64) - exact) <= tol).all()


# ---- numerics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("a_shape,b_shape", [((8, 12), (12, 10)), ((33, 70), (70, 20)), ((1, 300), (300, 1)),
                                             ((3, 5, 9), (3, 9, 7))])
def test_matmul_matches_numpy(mode, a_shape, b_shape):
    rng = np.random.default_rng(1)
    g, a, b, c, prog = build(ip.Target.test(16, 64 * 1024), a_shape, b_shape)
    A, B = operands(rng, a_shape, b_shape)
    got, cycles, _ = run(g, prog, mode, {a: A, b: B}, c)
    assert_float32_close(got, A, B)
    assert cycles > 0


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 24), k=st.integers(1, 40), n=st.integers(1, 24), batch=st.sampled_from([None, 1, 3]),
       tiles=st.sampled_from([1, 4, 16]))
def test_matmul_property_both_modes_agree(m, k, n, batch, tiles):
    a_shape = (m, k) if batch is None else (batch, m, k)
    b_shape = (k, n) if batch is None else (batch, k, n)
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    g, a, b, c, prog = build(ip.Target.test(tiles, 64 * 1024), a_shape, b_shape)
    A, B = operands(rng, a_shape, b_shape)
    strict, cs, _ = run(g, prog, "strict", {a: A, b: B}, c)
    fast, cf, _ = run(g, prog, "fast", {a: A, b: B}, c)
    assert_float32_close(strict, A, B)
    assert_float32_close(fast, A, B)
    assert cs == cf  # cycles are static: the same in both modes
    scale = np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64))
    assert (np.abs(strict.astype(np.float64) - fast) <= 1e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("memory", [6 * 1024, 1024 * 1024])  # K-split and whole-K plans
def test_matmul_float16(mode, memory):
    rng = np.random.default_rng(2)
    target = ip.Target.test(16, memory)
    g, a, b, c, prog = build(target, (32, 64), (64, 32), "float16")
    A, B = operands(rng, (32, 64), (64, 32), np.float16)
    got, _, _ = run(g, prog, mode, {a: A, b: B}, c)
    assert_float16_close(got, A, B)


@pytest.mark.parametrize("mode", MODES)
def test_float16_operands_with_float32_output(mode):
    rng = np.random.default_rng(3)
    g, a, b, c, prog = build(ip.Target.test(4, 64 * 1024), (6, 40), (40, 5), "float16", out_dtype="float32")
    A, B = operands(rng, (6, 40), (40, 5), np.float16)
    got, _, _ = run(g, prog, mode, {a: A, b: B}, c)
    assert c.dtype == np.float32
    exact = A.astype(np.float64) @ B.astype(np.float64)
    assert np.allclose(got, exact, rtol=0, atol=41 * 2.0 ** -24 * np.abs(exact).max() + 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_view_operands(mode):
    """Transposed and sliced views (as a backward pass uses W.T) read the right elements."""
    rng = np.random.default_rng(8)
    g = ip.Graph(ip.Target.test(16, 64 * 1024))
    w = g.addVariable("float32", (20, 12), "w")
    h = g.addVariable("float32", (9, 30), "h")
    g.map_linearly(w)
    g.map_linearly(h)
    prog = ip.Sequence()
    c = matmul(g, h[:, 5:25], w, prog, "hw")            # h[:, 5:25] @ w
    d = matmul(g, w.transpose(), h[1:5, 5:25].T, prog, "wt")  # w.T @ h[1:5, 5:25].T
    W, H = rng.standard_normal(w.shape).astype(np.float32), rng.standard_normal(h.shape).astype(np.float32)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(w, W)
    e.writeTensor(h, H)
    e.run()
    assert_float32_close(e.readTensor(c), H[:, 5:25], W)
    assert_float32_close(e.readTensor(d), W.T, H[1:5, 5:25].T)


# ---- plans and the K-split reduction ---------------------------------------------------------
def test_plan_is_a_grid_within_the_tiles_and_memory():
    for target in (ip.GC200, ip.GC2):
        for a_shape, b_shape in [((512, 512), (512, 512)), ((64, 784), (784, 10)), ((8, 128, 64), (8, 64, 128))]:
            p = plan_matmul(target, a_shape, b_shape)
            assert isinstance(p, MatMulPlan)
            assert p.tiles_used <= target.num_tiles
            assert all(1 <= s <= d for s, d in zip(p.splits, p.shape))
            # the blocks cover each dimension with exactly `split` blocks
            assert all(math.ceil(d / b) == s for d, b, s in zip(p.shape, p.blocks, p.splits))
            assert p.fits and p.bytes_per_tile <= 0.6 * target.bytes_per_tile
    big = plan_matmul(ip.GC200, (1024, 1024), (1024, 1024))
    assert big.tiles_used > 1000  # a large matmul uses most of the IPU


def test_a_matmul_too_big_for_the_target_is_an_out_of_memory_error():
    tiny = ip.Target.test(16, 4 * 1024)
    plan = plan_matmul(tiny, (64, 256), (256, 48))
    assert not plan.fits
    g, *_, prog = build(tiny, (64, 256), (256, 48))
    with pytest.raises(ip.OutOfMemoryError, match="matmul/"):
        ip.Engine(g, prog)


def test_k_split_is_taken_when_whole_k_blocks_do_not_fit():
    small = ip.Target.test(16, 12 * 1024)
    roomy_plan = plan_matmul(ROOMY, (96, 64), (64, 32))
    small_plan = plan_matmul(small, (96, 64), (64, 32))
    assert roomy_plan.k_split == 1 and roomy_plan.partials_dtype == "float32"
    assert small_plan.k_split > 1 and small_plan.fits and small_plan.partials_dtype == "float32"
    assert small_plan.bytes_per_tile <= 0.6 * small.bytes_per_tile < roomy_plan.bytes_per_tile
    # a tighter memory proportion forces the split on the roomy target too
    assert plan_matmul(ROOMY, (96, 64), (64, 32), available_memory_proportion=0.005).k_split > 1


@pytest.mark.parametrize("mode", MODES)
def test_k_split_path_is_correct_and_reduces_partials(mode):
    small = ip.Target.test(16, 6 * 1024)
    rng = np.random.default_rng(4)
    g, a, b, c, prog = build(small, (32, 64), (64, 32))
    names = [cs.name for cs in g.compute_sets]
    assert names == ["matmul/product", "matmul/reduce"]
    partials = next(v for v in g.variables if v.name == "matmul/partials")
    assert partials.dtype == np.float32 and partials.numel == 32 * 32 * plan_matmul(small, (32, 64), (64, 32)).k_split
    A, B = operands(rng, (32, 64), (64, 32))
    got, _, e = run(g, prog, mode, {a: A, b: B}, c)
    assert_float32_close(got, A, B)
    assert e.memory[0].fits


@pytest.mark.parametrize("out_dtype", ["float16", "float32"])
def test_half_partials_halve_the_k_splits_bytes_and_round_each_slice(out_dtype):
    """PopLibs' partialsType "half": the K-split's partials are float16 (half the bytes written,
    exchanged and held), the reduction reads 4 a vector, each slice's sum is rounded to float16;
    with half partials both modes give the same bits (float ones: each within float32 rounding)."""
    target = ip.Target.test(16, 64 * 1024)
    shapes = ((48, 256), (256, 32))
    rng = np.random.default_rng(7)
    A, B = operands(rng, *shapes, dtype=np.float16)
    got, cycles, peaks = {}, {}, {}
    for partials in ("float", "half"):
        plan = plan_matmul(target, *shapes, "float16", out_dtype, k_split=4, partials=partials)
        assert plan.partials_dtype == ("float16" if partials == "half" else "float32")
        for mode in MODES:
            g, a, b, c, prog = build(target, *shapes, "float16", out_dtype=out_dtype, k_split=4, partials=partials)
            part = next(v for v in g.variables if v.name == "matmul/partials")
            assert part.dtype == np.dtype(plan.partials_dtype)
            got[partials, mode], cycles[partials, mode], e = run(g, prog, mode, {a: A, b: B}, c)
            peaks[partials] = e.memory[0].not_always_live_peak.max()
        assert cycles[partials, "strict"] == cycles[partials, "fast"]
    np.testing.assert_array_equal(got["half", "strict"], got["half", "fast"])
    assert cycles["half", "fast"] < cycles["float", "fast"] and peaks["half"] < peaks["float"]
    # each K slice's sum rounded to float16, the slices added exactly, rounded once to the output
    a64, b64 = A.astype(np.float64), B.astype(np.float64)
    step = 256 // 4
    want = sum((a64[:, k:k + step] @ b64[k:k + step]).astype(np.float16).astype(np.float64) for k in range(0, 256, step))
    np.testing.assert_array_equal(got["half", "strict"], want.astype(out_dtype))
    assert not np.array_equal(got["half", "strict"], got["float", "strict"])


def test_half_partials_apply_to_float16_operands_only():
    target = ip.Target.test(16, 6 * 1024)
    assert plan_matmul(target, (32, 64), (64, 32), "float32", partials="half").partials == "float32"
    assert plan_matmul(target, (32, 64), (64, 32), "float16", partials="half").partials == "float16"
    with pytest.raises(ValueError, match="partials type 'quarter' is not supported; use 'float'"):
        plan_matmul(target, (32, 64), (64, 32), "float16", partials="quarter")


def test_planner_working_set_is_the_measured_peak():
    for target, (m, k, n) in [(ip.Target.test(16, 6 * 1024), (32, 64, 32)), (ROOMY, (32, 64, 32)),
                              (ip.Target.test(16, 64 * 1024), (33, 70, 20))]:
        g, a, b, c, prog = build(target, (m, k), (k, n))
        report = ip.Engine(g, prog).memory[0]
        assert report.not_always_live_peak.max() == plan_matmul(target, (m, k), (k, n)).bytes_per_tile


def test_split_candidates_and_grid():
    assert split_candidates(10, 16).tolist() == [1, 2, 3, 4, 5, 10]
    assert split_candidates(1, 1472).tolist() == [1]
    grid = split_grid((4, 64, 64, 64), 16)
    assert (grid.prod(axis=1) <= 16).all() and len(np.unique(grid, axis=0)) == len(grid)
    assert [1, 4, 4, 1] in grid.tolist() and [1, 1, 1, 16] in grid.tolist()


# ---- exchanges -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_operands_on_one_tile_are_exchanged_to_the_vertices(mode):
    rng = np.random.default_rng(5)
    g, a, b, c, prog = build(ip.Target.test(16, 64 * 1024), (16, 24), (24, 16), map_a=0)
    A, B = operands(rng, (16, 24), (24, 16))
    got, cycles, e = run(g, prog, mode, {a: A, b: B}, c)
    assert_float32_close(got, A, B)
    used = {tile for cs in g.compute_sets for t in cs.tables for tile in t.tiles.tolist()}
    assert len(used) > 1  # the vertices are spread; a lives on tile 0 only
    cost = e.costs[0]
    assert cost.per_ipu[0].exchange > 0 and cost.exchange_bytes >= A.nbytes
    # tile 0 sends a's elements to every block that needs them: at least all of a leaves it
    assert cost.per_ipu[0].exchange >= math.ceil(A.nbytes * 15 / 16 / 4)


def test_strict_mode_computes_from_exchanged_data_only():
    rng = np.random.default_rng(6)
    g, a, b, c, prog = build(ip.Target.test(16, 64 * 1024), (16, 24), (24, 16))
    op = prog.programs[0]
    without_exchange = ip.Sequence(*[p for p in op.body.programs if not isinstance(p, ip.Copy)])
    A, B = operands(rng, (16, 24), (24, 16))
    e = ip.Engine(g, [prog, without_exchange], mode="strict").load()
    e.writeTensor(a, A)
    e.writeTensor(b, B)
    e.run(1)
    assert not np.allclose(e.readTensor(c), A @ B, atol=1e-3)  # vertices never read a or b directly
    e.run(0)
    assert_float32_close(e.readTensor(c), A, B)


# ---- cycle estimators ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,amp", [("float32", 8), ("float16", 16)])
def test_partial_product_estimator_formula(dtype, amp):
    """The AMP supervisor vertex: supervisor fixed cost, per group, per further input group, and
    per pass the weight loads and the slowest of the 6 workers sharing the rows."""
    t = ip.GC200
    row = 2 * amp * amp // t.flops_per_cycle(dtype)  # thread cycles per row and pass at the AMP peak
    loads = amp * amp * np.dtype(dtype).itemsize // 16
    for g, m, n, k in [(1, 1, 1, 1), (1, 4, 8, 16), (3, 7, 33, 65), (2, 100, 16, 256)]:
        in_groups, out_groups = math.ceil(k / amp), math.ceil(n / amp)
        worker = 19 + row * max(math.ceil(m / 6), 3)
        want = 50 + 6 * 7 + g * (24 + 15 * (in_groups - 1) + in_groups * out_groups * (25 + loads + 6 * worker))
        assert MATMUL_VERTEX.cycles({}, np.array([[g, m, n, k]], float), np.dtype(dtype), t).tolist() == [want]
    assert MATMUL_VERTEX.supervisor


def test_reduce_estimator_formula():
    t = ip.GC200
    for n, r in [(1, 2), (30, 4), (31, 16)]:
        want = t.thread_cycles(17 + math.ceil(n / 2) * (r + 3))
        assert REDUCE_VERTEX.cycles({"out": np.array([n])}, np.array([[r]], float), np.dtype("float32"), t).tolist() \
            == [want]


def test_compute_set_cycles_follow_the_estimator():
    """One tile: the block is one supervisor vertex, which shares its rows among the workers
    itself; the compute superstep is its estimate + vertex overhead + sync."""
    t = ip.Target.test(1, 64 * 1024)
    g, a, b, c, prog = build(t, (1, 40), (40, 24))
    (cs,) = g.compute_sets
    (table,) = cs.tables
    assert table.params.tolist() == [[1, 1, 24, 40]]
    e = ip.Engine(g, prog)
    execute = next(p for p in prog.programs[0].body.programs if isinstance(p, ip.Execute))
    expected = int(amp_partial_cycles(1, 1, 24, 40, "float32", t)) + t.vertex_overhead_cycles
    assert e.cost(execute).total == expected + t.sync_cycles


def test_supervisor_vertices_of_a_tile_run_one_after_another():
    """A batched matmul on one tile: one vertex loops over the batch entries (its groups); two such
    matmuls in one compute set would add up, not share the workers."""
    t = ip.Target.test(1, 256 * 1024)
    g, a, b, c, prog = build(t, (5, 12, 16), (5, 16, 8))
    (table,) = g.compute_sets[0].tables
    assert table.params.tolist() == [[5, 12, 8, 16]]
    one = int(amp_partial_cycles(5, 12, 8, 16, "float32", t)) + t.vertex_overhead_cycles
    assert g.compute_sets[0].tile_cycles(t).tolist() == [one]
    cs = g.addComputeSet("twice")
    cs.add(table)
    cs.add(table)
    assert cs.tile_cycles(t).tolist() == [2 * one]


def test_float16_runs_at_the_float16_amp_rate():
    g, m, n, k = 1, 96, 16, 512
    params = np.array([[g, m, n, k]], float)
    assert (MATMUL_VERTEX.cycles({}, params, np.dtype("float32"), ip.GC200)
            > 3 * MATMUL_VERTEX.cycles({}, params, np.dtype("float16"), ip.GC200)).all()


# ---- errors ----------------------------------------------------------------------------------
def test_bad_operands_are_clear_errors():
    g = ip.Graph(ip.Target.test(4))
    a = g.addVariable("float32", (4, 5), "a")
    b = g.addVariable("float32", (6, 3), "b")
    h = g.addVariable("float16", (5, 3), "h")
    i = g.addVariable("int32", (5, 3), "i")
    a3 = g.addVariable("float32", (2, 4, 5), "a3")
    b3 = g.addVariable("float32", (3, 5, 4), "b3")
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \[4, 5\] and b is \[6, 3\]"):
        matmul(g, a, b, ip.Sequence())
    with pytest.raises(TypeError, match="different dtypes"):
        matmul(g, a, h, ip.Sequence())
    with pytest.raises(TypeError, match="'i' is int32"):
        matmul(g, i.reshape(3, 5), i, ip.Sequence())
    with pytest.raises(ValueError, match="batch sizes differ"):
        matmul(g, a3, b3, ip.Sequence())
    with pytest.raises(ValueError, match=r"expected a\[M, K\] @ b\[K, N\]"):
        matmul(g, a3, h, ip.Sequence())
    with pytest.raises(ValueError, match="available_memory_proportion must be in"):
        matmul(g, a, g.addVariable("float32", (5, 3)), ip.Sequence(), available_memory_proportion=1.5)
