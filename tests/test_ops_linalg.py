"""ipusim.ops.linalg: batched factorisations and solves, one matrix per tile, against torch's
LAPACK, strict and fast modes alike."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import linalg as L

TARGET = ip.Target.test(16, 256 * 1024)


def build(fn, arrays, target=TARGET):
    g = ip.Graph(target)
    prog = ip.Sequence()
    ts = []
    for i, x in enumerate(arrays):
        t = g.addVariable(x.dtype, x.shape, f"x{i}")
        g.map_linearly(t)
        ts.append(t)
    outs = fn(g, *ts, prog)
    return g, prog, ts, (outs if isinstance(outs, tuple) else (outs,))


def run(fn, arrays, mode, target=TARGET):
    g, prog, ts, outs = build(fn, arrays, target)
    e = ip.Engine(g, prog, mode=mode).load()
    for t, x in zip(ts, arrays):
        e.writeTensor(t, x)
    cycles = e.run()
    return [e.readTensor(o) for o in outs], cycles


def both(fn, arrays):
    """The outputs, strict and fast equal to the bit, and the cycles."""
    strict, cycles = run(fn, arrays, "strict")
    fast, _ = run(fn, arrays, "fast")
    for a, b in zip(strict, fast):
        np.testing.assert_array_equal(a, b)
    return strict, cycles


def spd(rng, shape):
    a = rng.standard_normal(shape)
    return (a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])).astype(np.float32)


@given(m=st.integers(1, 7), n=st.integers(1, 7), batch=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_lu_factor_is_lapacks_getrf(m, n, batch, seed):
    a = np.random.default_rng(seed).standard_normal(tuple(batch) + (m, n)).astype(np.float32)
    (lu, piv, info), _ = both(lambda g, x, p: L.lu_factor(g, x, p), [a])
    want_lu, want_piv, want_info = torch.linalg.lu_factor_ex(torch.from_numpy(a))
    np.testing.assert_allclose(lu, want_lu.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(piv, want_piv.numpy())
    np.testing.assert_array_equal(info, want_info.numpy())
    perm, _ = both(lambda g, x, p: L.pivot_permutation(g, x, m, p), [piv])
    P, _, _ = torch.lu_unpack(want_lu, want_piv)
    np.testing.assert_array_equal(np.swapaxes(P.numpy(), -1, -2).argmax(-1), perm[0])


def test_a_singular_matrix_reports_its_first_zero_pivot():
    a = np.array([[[1, 2, 3], [2, 4, 6], [1, 1, 1]], [[0, 0, 0], [0, 0, 0], [0, 0, 0]]], np.float32)
    (_, _, info), _ = both(lambda g, x, p: L.lu_factor(g, x, p), [a])
    np.testing.assert_array_equal(info, torch.linalg.lu_factor_ex(torch.from_numpy(a)).info.numpy())


def test_lu_without_pivoting_keeps_the_rows():
    a = spd(np.random.default_rng(1), (2, 4, 4))
    (lu, piv, _), _ = both(lambda g, x, p: L.lu_factor(g, x, p, pivot=False), [a])
    np.testing.assert_array_equal(piv, np.tile(np.arange(1, 5), (2, 1)))
    lower = np.tril(lu, -1) + np.eye(4)
    np.testing.assert_allclose(lower @ np.triu(lu), a, rtol=1e-4, atol=1e-4)


def test_cholesky_and_triangular_solves_match_torch():
    rng = np.random.default_rng(2)
    a = spd(rng, (3, 5, 5))
    (factor, info), _ = both(lambda g, x, p: L.cholesky(g, x, p), [a])
    np.testing.assert_allclose(factor, torch.linalg.cholesky(torch.from_numpy(a)).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(info, 0)
    b = rng.standard_normal((3, 5, 2)).astype(np.float32)
    for upper in (False, True):
        for unit in (False, True):
            tri = np.swapaxes(factor, -1, -2).copy() if upper else factor
            (x,), _ = both(lambda g, t, r, p: L.triangular_solve(g, t, r, p, upper, unit), [tri, b])
            want = torch.linalg.solve_triangular(torch.from_numpy(tri), torch.from_numpy(b), upper=upper,
                                                 unitriangular=unit)
            np.testing.assert_allclose(x, want.numpy(), rtol=1e-4, atol=1e-4)


def test_cholesky_of_a_matrix_that_is_not_positive_definite_names_the_order():
    a = np.array([[[4, 2], [2, -3]]], np.float32)
    (_, info), _ = both(lambda g, x, p: L.cholesky(g, x, p), [a])
    np.testing.assert_array_equal(info, torch.linalg.cholesky_ex(torch.from_numpy(a)).info.numpy())


@pytest.mark.parametrize("seed", range(4))
def test_ldl_is_lapacks_bunch_kaufman_and_solves(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((3, 6, 6)).astype(np.float32)
    a[0] = a[0] + a[0].T
    a[1, 0, 0] = 0.0            # a 2 x 2 pivot first
    (ld, piv, info), _ = both(lambda g, x, p: L.ldl_factor(g, x, p), [a])
    want_ld, want_piv, want_info = torch.linalg.ldl_factor_ex(torch.from_numpy(a))
    np.testing.assert_array_equal(piv, want_piv.numpy())
    np.testing.assert_allclose(ld, want_ld.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(info, want_info.numpy())
    b = rng.standard_normal((3, 6, 2)).astype(np.float32)
    (x,), _ = both(lambda g, f, p_, r, p: L.ldl_solve(g, f, p_, r, p), [ld, piv, b])
    want = torch.linalg.ldl_solve(want_ld, want_piv, torch.from_numpy(b))
    np.testing.assert_allclose(x, want.numpy(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("m,n", [(5, 5), (6, 3), (3, 6)])
def test_householder_qr_has_lapacks_reflectors(m, n):
    a = np.random.default_rng(3).standard_normal((2, m, n)).astype(np.float32)
    (qr, tau), _ = both(lambda g, x, p: L.geqrf(g, x, p), [a])
    want_qr, want_tau = torch.geqrf(torch.from_numpy(a))
    np.testing.assert_allclose(qr, want_qr.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tau, want_tau.numpy(), rtol=1e-4, atol=1e-5)
    k = min(m, n)
    v = qr[..., :k].copy()
    (q,), _ = both(lambda g, x, t, p: L.householder(g, x, t, p), [v, tau])
    want_q = torch.linalg.householder_product(torch.from_numpy(v), torch.from_numpy(tau))
    np.testing.assert_allclose(q, want_q.numpy(), rtol=1e-4, atol=1e-5)


def test_eigh_values_and_vectors():
    a = np.random.default_rng(4).standard_normal((3, 6, 6)).astype(np.float32)
    sym = a + np.swapaxes(a, -1, -2)
    for lower in (True, False):
        (w, v), _ = both(lambda g, x, p: L.eigh(g, x, p, lower=lower), [a])   # one triangle read
        want_w, want_v = torch.linalg.eigh(torch.from_numpy(a), UPLO="L" if lower else "U")
        np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-4, atol=1e-5)
        # the same vectors up to sign; the largest component positive
        np.testing.assert_allclose(np.abs(np.sum(v * want_v.numpy(), axis=-2)), 1, atol=1e-4)
        biggest = np.take_along_axis(v, np.abs(v).argmax(-2)[..., None, :], -2)
        assert (biggest > 0).all()
    (w, v), _ = both(lambda g, x, p: L.eigh(g, x, p), [sym])
    np.testing.assert_allclose(v @ (w[..., None] * np.swapaxes(v, -1, -2)), sym, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,full", [(5, 3, False), (3, 5, False), (5, 3, True), (3, 5, True), (4, 4, True)])
def test_svd_values_and_orthonormal_vectors(m, n, full):
    a = np.random.default_rng(5).standard_normal((2, m, n)).astype(np.float32)
    (u, s, vh), _ = both(lambda g, x, p: L.svd(g, x, p, full_matrices=full), [a])
    want = torch.linalg.svd(torch.from_numpy(a), full_matrices=full)
    assert u.shape == tuple(want.U.shape) and vh.shape == tuple(want.Vh.shape)
    np.testing.assert_allclose(s, want.S.numpy(), rtol=1e-5, atol=1e-5)
    k = min(m, n)
    np.testing.assert_allclose((u[..., :k] * s[..., None, :]) @ vh[..., :k, :], a, rtol=1e-4, atol=1e-4)
    for q in (u, np.swapaxes(vh, -1, -2)):
        np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(q.shape[-1]), q.shape[:-2] +
                                   (q.shape[-1],) * 2), atol=1e-5)


def test_svd_of_a_rank_deficient_matrix_completes_the_basis():
    a = np.outer([1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 2.0]).astype(np.float32)[None]
    (u, s, vh), _ = both(lambda g, x, p: L.svd(g, x, p, full_matrices=True), [a])
    np.testing.assert_allclose(s, torch.linalg.svdvals(torch.from_numpy(a)).numpy(), atol=1e-5)
    np.testing.assert_allclose(u[0].T @ u[0], np.eye(4), atol=1e-5)


def test_matrix_exp_matches_torch_for_small_and_large_norms():
    a = np.random.default_rng(6).standard_normal((3, 4, 4)).astype(np.float32)
    a[1] *= 0.01
    a[2] *= 3
    (e,), _ = both(lambda g, x, p: L.matrix_exp(g, x, p), [a])
    np.testing.assert_allclose(e, torch.linalg.matrix_exp(torch.from_numpy(a)).numpy(), rtol=1e-4, atol=1e-5)


def test_float16_matrices_round_once():
    a = spd(np.random.default_rng(7), (2, 3, 3)).astype(np.float16)
    (factor, _), _ = both(lambda g, x, p: L.cholesky(g, x, p), [a])
    assert factor.dtype == np.float16
    want = np.linalg.cholesky(a.astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(factor, want)


def test_cycles_grow_with_the_matrix_order():
    rng = np.random.default_rng(8)
    small = run(lambda g, x, p: L.lu_factor(g, x, p), [rng.standard_normal((1, 4, 4)).astype(np.float32)], "fast")[1]
    big = run(lambda g, x, p: L.lu_factor(g, x, p), [rng.standard_normal((1, 16, 16)).astype(np.float32)], "fast")[1]
    assert big > 8 * small / 4     # the flops grow as n^3; fixed costs (exchange, sync) dilute it
    for fn in (L.eigh, L.matrix_exp, L.cholesky):
        cs = [run(lambda g, x, p: fn(g, x, p), [spd(rng, (1, n, n))], "fast")[1] for n in (4, 16)]
        assert cs[1] > 2 * cs[0], fn.__name__


def test_a_batch_spreads_over_the_tiles_one_matrix_each():
    a = np.random.default_rng(9).standard_normal((16, 8, 8)).astype(np.float32)
    g, *_ = build(lambda g, x, p: L.lu_factor(g, x, p), [a])
    cs = next(c for c in g.compute_sets if c.name.startswith("lu"))
    tiles = np.concatenate([t.tiles for t in cs.tables])
    assert len(np.unique(tiles)) == 16
    one, _ = run(lambda g, x, p: L.lu_factor(g, x, p), [a[:1]], "fast")
    many, _ = run(lambda g, x, p: L.lu_factor(g, x, p), [a], "fast")
    np.testing.assert_array_equal(many[0][:1], one[0])


def test_a_matrix_larger_than_a_tile_is_out_of_memory():
    tiny = ip.Target.test(4, 16 * 1024)
    g, prog, *_ = build(lambda g, x, p: L.lu_factor(g, x, p), [np.zeros((1, 80, 80), np.float32)], tiny)
    with pytest.raises(ip.OutOfMemoryError):
        ip.Engine(g, prog)


def test_bad_operands_are_named():
    g = ip.Graph(TARGET)
    x = g.addVariable("float32", (3, 4), "x")
    with pytest.raises(ValueError, match="must be square"):
        L.cholesky(g, x, ip.Sequence())
    v = g.addVariable("float32", (4,), "v")
    with pytest.raises(ValueError, match="not a matrix"):
        L.lu_factor(g, v, ip.Sequence())
    i = g.addVariable("int32", (4, 4), "i")
    with pytest.raises(TypeError, match="float32 or float16"):
        L.lu_factor(g, i, ip.Sequence())
    b = g.addVariable("float32", (3, 2), "b")
    s = g.addVariable("float32", (4, 4), "s")
    with pytest.raises(ValueError, match="do not fit"):
        L.triangular_solve(g, s, b, ip.Sequence(), upper=True)
