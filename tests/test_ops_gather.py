"""ipusim.ops.gather: embedding lookup (multiSlice) and its gradient (multiUpdateAdd)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import gather as G
from ipusim.device.program import Copy, Execute, walk

MODES = ["strict", "fast"]
TARGET = ip.Target.test(16, 64 * 1024)


def reference_lookup(x, w):
    valid = (x >= 0) & (x < w.shape[0])
    return np.where(valid[..., None], w[np.clip(x, 0, w.shape[0] - 1)], 0).astype(w.dtype)


def reference_grad(x, g, V, padding_idx=-1):
    out = np.zeros((V, g.shape[-1]))
    for i, r in enumerate(x.reshape(-1)):
        if 0 <= r < V and r != padding_idx:
            out[r] += g.reshape(-1, g.shape[-1])[i]
    return out


def build(V, D, idx_shape, dtype="float32", plan=None, padding_idx=-1, target=TARGET, table_tile=None):
    """Forward and backward on one graph; the table is mapped linearly (or on one tile)."""
    g = ip.Graph(target)
    idx = g.addVariable("int32", idx_shape, "idx")
    g.map_linearly(idx)
    w = g.addVariable(dtype, (V, D), "w")
    if table_tile is None:
        g.map_linearly(w)
    else:
        g.setTileMapping(w, table_tile)
    go = g.addVariable(dtype, (*idx_shape, D), "grad_out")
    g.map_linearly(go)
    prog = ip.Sequence()
    out = G.embedding(g, idx, w, prog, plan=plan, padding_idx=padding_idx)
    gw = G.embedding_backward(g, idx, go, V, prog, plan=plan, padding_idx=padding_idx)
    return g, prog, (idx, w, go), (out, gw)


def run(mode, V, D, x, w_val, g_val, **kw):
    g, prog, (idx, w, go), (out, gw) = build(V, D, x.shape, w_val.dtype.name, **kw)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(idx, x)
    e.writeTensor(w, w_val)
    e.writeTensor(go, g_val)
    cycles = e.run()
    return e.readTensor(out), e.readTensor(gw), cycles, e


def data(rng, V, D, shape, dtype="float32", low=-2, high=None):
    x = rng.integers(low, V + 2 if high is None else high, shape).astype(np.int32)
    return x, rng.standard_normal((V, D)).astype(dtype), rng.standard_normal((*shape, D)).astype(dtype)


# ---- numbers in both modes -------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_lookup_and_gradient_match_numpy(mode):
    rng = np.random.default_rng(0)
    x, w, g = data(rng, 10, 6, (3, 5))
    x[0, :3] = [-1, 10, 12]  # out of range on both sides
    out, gw, _, _ = run(mode, 10, 6, x, w, g)
    assert out.shape == (3, 5, 6)
    np.testing.assert_array_equal(out, reference_lookup(x, w))
    assert not out[0, :3].any()  # out-of-range indices give zero rows
    np.testing.assert_allclose(gw, reference_grad(x, g, 10), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("splits", [(1, 1, 1), (3, 2, 1), (2, 1, 3), (4, 2, 2), (13, 1, 1), (1, 5, 3)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_split_gives_the_same_bits_in_both_modes(splits, dtype):
    V, D, n = 13, 5, 11
    rng = np.random.default_rng(1)
    x, w, g = data(rng, V, D, (n,), dtype)
    x[:5] = 4  # a row hit from several lookup groups
    x[5] = 7   # the padding row
    plan = G.EmbeddingPlan.of(V, D, n, *splits)
    res = {m: run(m, V, D, x, w, g, plan=plan, padding_idx=7) for m in MODES}
    (so, sg, sc, _), (fo, fg, fc, _) = res["strict"], res["fast"]
    np.testing.assert_array_equal(so, reference_lookup(x, w))
    np.testing.assert_array_equal(so, fo)
    np.testing.assert_array_equal(sg, fg)  # same summation order in both modes
    assert sc == fc
    assert not sg[7].any()
    tol = 1e-6 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(sg.astype(np.float64), reference_grad(x, g.astype(np.float64), V, 7),
                               rtol=tol, atol=tol)


def test_gradient_sums_in_float64_and_rounds_once():
    """Many float16 gradient rows into one table row: one rounding of the exact sum."""
    V, D, n = 4, 4, 64
    x = np.full(n, 2, np.int32)
    g = np.full((n, D), 0.0999755859375, np.float16)  # 0.1 in float16; a float16 running sum drifts
    plan = G.EmbeddingPlan.of(V, D, n)
    for mode in MODES:
        _, gw, _, _ = run(mode, V, D, x, np.zeros((V, D), np.float16), g, plan=plan)
        exact = np.float16(np.float32(n * 0.0999755859375))
        assert (gw[2] == exact).all()
        assert not gw[[0, 1, 3]].any()


@settings(max_examples=20, deadline=None)
@given(V=st.integers(1, 17), D=st.integers(1, 9), shape=st.lists(st.integers(0, 6), min_size=1, max_size=2),
       splits=st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4)) | st.none(),
       tiles=st.sampled_from([4, 16]), pad=st.integers(-1, 3), seed=st.integers(0, 2**16))
def test_property_shapes_and_plans(V, D, shape, splits, tiles, pad, seed):
    pad = pad if pad < V else -1
    shape = tuple(shape)
    n = int(np.prod(shape))
    target = ip.Target.test(tiles, 64 * 1024)
    plan = G.EmbeddingPlan.of(V, D, n, *splits) if splits else G.plan_embedding(target, V, D, n, "float32")
    if plan.num_tiles > tiles:
        plan = G.EmbeddingPlan.of(V, D, n)
    rng = np.random.default_rng(seed)
    x, w, g = data(rng, V, D, shape)
    res = {m: run(m, V, D, x, w, g, plan=plan, padding_idx=pad, target=target) for m in MODES}
    for out, gw, _, _ in res.values():
        assert out.shape == (*shape, D) and gw.shape == (V, D)
        np.testing.assert_array_equal(out, reference_lookup(x, w))
        np.testing.assert_allclose(gw, reference_grad(x, g, V, pad), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res["strict"][1], res["fast"][1])
    assert res["strict"][2] == res["fast"][2]


# ---- mapping and exchange ----------------------------------------------------------------------
def exchange_of(e):
    return e.last_run.per_ipu[0].exchange


def test_strict_mode_moves_the_table_by_exchange():
    """A table on one tile, far from the vertices: right numbers, and the exchange is paid."""
    V, D, n = 12, 4, 8
    rng = np.random.default_rng(2)
    x, w, g = data(rng, V, D, (n,), low=0, high=V)
    plan = G.EmbeddingPlan.of(V, D, n, 4, 1, 1)
    out, gw, cycles, e = run("strict", V, D, x, w, g, plan=plan, table_tile=15)
    np.testing.assert_array_equal(out, reference_lookup(x, w))
    np.testing.assert_allclose(gw, reference_grad(x, g, V), rtol=1e-6)
    assert exchange_of(e) >= math.ceil(V * D * 4 / TARGET.exchange_bytes_per_cycle)


def test_embedding_table_is_laid_out_for_the_plan():
    V, D, n = 12, 4, 8
    plan = G.EmbeddingPlan.of(V, D, n, 4, 2, 1)
    g = ip.Graph(TARGET)
    w = G.embedding_table(g, V, D, "float32", n, plan=plan)
    for v in range(4):
        for d in range(2):
            (ra, rb), (ca, cb) = plan.rows(v), plan.cols(d)
            assert (w[ra:rb, ca:cb].tiles() == plan.tile(v, d, 0)).all()
    idx = g.addVariable("int32", (n,), "idx")
    g.map_linearly(idx)
    prog = ip.Sequence()
    out = G.embedding(g, idx, w, prog, plan=plan)
    copies = [p for p in walk(prog) if isinstance(p, Copy)]
    assert all(c.src.var is not w.var for c in copies)  # the table is already where the vertices are
    e = ip.Engine(g, prog, mode="strict").load()
    x = np.arange(n, dtype=np.int32) + 2
    wv = np.arange(V * D, dtype=np.float32).reshape(V, D)
    e.writeTensor(idx, x)
    e.writeTensor(w, wv)
    e.run()
    np.testing.assert_array_equal(e.readTensor(out), wv[x])


def test_planner_spreads_work_and_respects_memory():
    p = G.plan_embedding(ip.GC200, 30522, 768, 512, "float16")
    assert 1000 < p.num_tiles <= ip.GC200.num_tiles
    cycles, nbytes = p.estimate(ip.GC200, "float16")
    assert nbytes <= G.MEMORY_PROPORTION * ip.GC200.bytes_per_tile
    one_tile = G.EmbeddingPlan.of(30522, 768, 512)
    assert cycles < one_tile.estimate(ip.GC200, "float16")[0]
    small = ip.Target.test(16, 16 * 1024)
    p2 = G.plan_embedding(small, 1000, 16, 32, "float32")  # 64 KB table: must be cut to fit 16 KB tiles
    assert p2.estimate(small, "float32")[1] <= G.MEMORY_PROPORTION * small.bytes_per_tile
    assert p2.row_split * p2.col_split >= 8


# ---- cycle estimators --------------------------------------------------------------------------
def compute_sets(prog):
    return {p.compute_set.name: p for p in walk(prog) if isinstance(p, Execute)}


def test_estimators_follow_the_popops_formulas():
    assert G.multislice_instructions(10, 8, 5, 10) == 13 + 5 * (19 + 8) + 5 * 8
    assert G.multislice_instructions(3, 3, 7, 7) == 13 + 3 * (19 + 4)
    assert G.multiupdateadd_instructions(10, 8, 5, 10, True) == 3 + 24 + 5 * (11 + 3 * 7) + 5 * 5 + 20
    assert G.multiupdateadd_instructions(10, 8, 5, 10, False) == 3 + 25 + 5 * (12 + 3 * 3) + 5 * 5 + 10
    assert G.multiupdateadd_instructions(0, 8, 5, 10, True) == 3 + 20
    assert G.reduce_instructions(9, 3) == 8 + 5 * 4


def test_compute_set_cycles_are_the_estimates():
    t = TARGET
    V, D, n = 12, 6, 12
    plan = G.EmbeddingPlan.of(V, D, n, 2, 1, 2)  # 2 row groups x 2 lookup groups
    g, prog, _, _ = build(V, D, (n,), plan=plan)
    e = ip.Engine(g, prog)
    cs = compute_sets(prog)
    over, sync = t.vertex_overhead_cycles, t.sync_cycles
    # stage 1: 6 indices per tile, one per worker, table rows 6 of 12
    slice_ = t.thread_cycles(G.multislice_instructions(1, D, 6, V)) + over
    assert e.cost(cs["embedding/slice"]).total == slice_ + sync
    # stage 2: 3 output rows per tile, one per worker, every index in range
    select = t.thread_cycles(G.multislice_instructions(1, D, 1, 1)) + over
    assert e.cost(cs["embedding/select"]).total == select + sync
    # update: 6 rows per tile, one per worker; each scans the tile's 6 indices; float32 data
    update = t.thread_cycles(G.multiupdateadd_instructions(6, D, 1, V, True)) + over
    assert e.cost(cs["embedding_grad/update"]).total == update + sync
    # reduction of 2 partials: 36 elements per tile over 6 workers
    reduce = t.thread_cycles(G.reduce_instructions(6, 2)) + over
    assert e.cost(cs["embedding_grad/reduce"]).total == reduce + sync


# ---- errors ------------------------------------------------------------------------------------
def test_bad_inputs_are_named():
    g = ip.Graph(TARGET)
    idx = g.addVariable("int32", (4,), "idx")
    fidx = g.addVariable("float32", (4,), "fidx")
    w = g.addVariable("float32", (5, 3), "w")
    w3 = g.addVariable("float32", (5, 3, 1), "w3")
    wi = g.addVariable("int32", (5, 3), "wi")
    go = g.addVariable("float32", (4, 3), "go")
    bad_go = g.addVariable("float32", (3, 3), "bad_go")
    prog = ip.Sequence()
    with pytest.raises(TypeError, match="'fidx' are float32; they must be int32"):
        G.embedding(g, fidx, w, prog)
    with pytest.raises(ValueError, match="'w3' must be 2-D"):
        G.embedding(g, idx, w3, prog)
    with pytest.raises(TypeError, match="'wi' is int32"):
        G.embedding(g, idx, wi, prog)
    with pytest.raises(ValueError, match="padding_idx must be -1 .* pass 5 \\+ padding_idx"):
        G.embedding(g, idx, w, prog, padding_idx=-2)
    with pytest.raises(ValueError, match="'bad_go' has shape"):
        G.embedding_backward(g, idx, bad_go, 5, prog)
    with pytest.raises(ValueError, match="padding_idx must be -1"):
        G.embedding_backward(g, idx, go, 5, prog, padding_idx=5)
    with pytest.raises(ValueError, match="the plan is for"):
        G.embedding(g, idx, w, prog, plan=G.EmbeddingPlan.of(6, 3, 4))
    with pytest.raises(ValueError, match="uses 20 tiles"):
        G.embedding(g, idx, w, prog, plan=G.EmbeddingPlan.of(5, 3, 4, 5, 1, 4))
    with pytest.raises(ValueError, match="at least one row"):
        G.EmbeddingPlan.of(0, 3, 4)
