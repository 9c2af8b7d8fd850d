"""Random numbers: Philox bits, determinism across modes and mappings, statistics, dropout."""
import math

import numpy as np
import pytest

import ipusim as ip
from ipusim.ops import random as RR

TARGET = ip.Target.test(16, 64 * 1024)
M32 = 0xFFFFFFFF


def philox_reference(ctr, key):
    """Philox4x32-10 in NumPy (vectorised over counters), independent of the Numba kernel."""
    c = [np.asarray(v, dtype=np.uint64) for v in ctr]
    k0, k1 = (np.uint64(v) for v in key)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & np.uint64(M32), p1 & np.uint64(M32),
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & np.uint64(M32), p0 & np.uint64(M32)]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & np.uint64(M32), (k1 + np.uint64(0xBB67AE85)) & np.uint64(M32)
    return c


def words(seed, modifier, kind, n):
    i = np.arange(n, dtype=np.uint64)
    w = philox_reference((i & np.uint64(M32), i >> np.uint64(32), np.full(n, modifier), np.full(n, kind)),
                         (seed & M32, seed >> 32))
    return w[0], w[1]


def variable(g, dtype, shape, name, mapping="linear"):
    t = g.addVariable(dtype, shape, name)
    if mapping == "linear":
        g.map_linearly(t, grain=4, min_elements_per_tile=8)
    elif mapping == "reversed":
        g.map_linearly(t, grain=4, min_elements_per_tile=8, tiles=range(g.target.num_tiles - 1, -1, -1))
    else:
        g.setTileMapping(t, mapping)
    return t


def run_both(g, prog, inputs, outputs, runs=1):
    results = {}
    for mode in ("strict", "fast"):
        e = ip.Engine(g, prog, mode=mode).load()
        for t, v in inputs.items():
            e.writeTensor(t, v)
        results[mode] = []
        for _ in range(runs):
            e.run()
            results[mode].append([e.readTensor(o) for o in outputs])
    for a, b in zip(results["strict"], results["fast"]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    return results["strict"] if runs > 1 else results["strict"][0]


def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32-10
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
               ((M32,) * 4, (M32, M32), (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
               ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
                (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for ctr, key, expected in vectors:
        got = RR.philox4x32(*(np.uint64(v) for v in ctr), *(np.uint64(v) for v in key))
        assert tuple(int(v) for v in got) == expected
        assert tuple(int(v[()]) for v in philox_reference(ctr, key)) == expected


def test_values_are_the_documented_functions_of_the_bits():
    seed = 2 ** 40 + 12345
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    n = 300
    u = RR.uniform(g, (n,), seed, prog, -1.0, 3.0, seed_modifier=7)
    z = RR.normal(g, (n,), seed, prog, 0.5, 2.0, seed_modifier=7)
    b = RR.bernoulli(g, (n,), 0.3, seed, prog, dtype=np.int32, seed_modifier=7)
    got = run_both(g, prog, {}, [u, z, b])
    w0, _ = words(seed, 7, RR.UNIFORM, n)
    np.testing.assert_array_equal(got[0], (-1.0 + 4.0 * (w0 >> np.uint64(8)) * 2.0 ** -24).astype(np.float32))
    w0, w1 = words(seed, 7, RR.NORMAL, n)
    u1 = ((w0 >> np.uint64(8)) + 1.0) * 2.0 ** -24
    u2 = (w1 >> np.uint64(8)) * 2.0 ** -24
    np.testing.assert_allclose(got[1], 0.5 + 2.0 * np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2), rtol=1e-6)
    w0, _ = words(seed, 7, RR.BERNOULLI, n)
    np.testing.assert_array_equal(got[2], (w0 < math.floor(0.3 * 2 ** 32)).astype(np.int32))


def test_same_seed_same_bits_whatever_the_mapping_and_mode():
    outs = []
    for mapping in ("linear", "reversed", 5):
        g = ip.Graph(TARGET)
        x = variable(g, "float32", (24, 10), "x", mapping)
        prog = ip.Sequence()
        y, mask = RR.dropout(g, x, 0.5, 99, prog)
        outs.append(run_both(g, prog, {x: np.ones((24, 10), np.float32)}, [y, mask]))
    for y, mask in outs[1:]:
        np.testing.assert_array_equal(y, outs[0][0])
        np.testing.assert_array_equal(mask, outs[0][1])


def test_seeds_modifiers_and_distributions_give_independent_streams():
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    shape = (4000,)
    streams = [RR.uniform(g, shape, 1, prog), RR.uniform(g, shape, 2, prog),
               RR.uniform(g, shape, 1, prog, seed_modifier=1), RR.uniform(g, shape, 2 ** 32 + 1, prog)]
    got = run_both(g, prog, {}, streams)
    for i in range(len(got)):
        for j in range(i + 1, len(got)):
            assert abs(np.corrcoef(got[i], got[j])[0, 1]) < 0.06  # ~4 sigma for 4000 samples
    a = got[0]
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.06  # neighbouring elements (also across tiles)


def test_statistics_of_the_distributions():
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    n = 20000
    u = RR.uniform(g, (n,), 3, prog, 2.0, 5.0)
    z = RR.normal(g, (n,), 3, prog, -1.0, 3.0, dtype=np.float16)
    b = RR.bernoulli(g, (n,), 0.2, 3, prog, dtype=np.bool_)
    uv, zv, bv = run_both(g, prog, {}, [u, z, b])
    assert uv.min() >= 2.0 and uv.max() < 5.0
    assert abs(uv.mean() - 3.5) < 4 * math.sqrt(0.75 / n)
    assert abs(uv.var() - 0.75) < 0.03
    # uniform: every tenth of the range holds about a tenth of the samples (chi-square, 9 dof)
    counts = np.histogram(uv, bins=10, range=(2, 5))[0]
    assert ((counts - n / 10) ** 2 / (n / 10)).sum() < 30
    zf = zv.astype(np.float64)
    assert zv.dtype == np.float16
    assert abs(zf.mean() + 1.0) < 4 * 3 / math.sqrt(n) and abs(zf.std() - 3.0) < 0.1
    assert abs(np.mean(np.abs(zf + 1) < 3.0) - 0.6827) < 0.015  # one sigma
    assert bv.dtype == np.bool_ and abs(bv.mean() - 0.2) < 4 * math.sqrt(0.16 / n)


def ks_statistic(samples, cdf) -> float:
    """Kolmogorov-Smirnov: the largest distance between the samples' distribution function and `cdf`."""
    x = np.sort(np.asarray(samples, dtype=np.float64))
    f = cdf(x)
    n = x.size
    return float(max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max()))


KS_LIMIT = 1.95   # / sqrt(n): the KS test's critical value at a 0.1% level


def test_samplers_are_the_documented_functions_of_the_bits():
    seed = 2 ** 33 + 7
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    n = 300
    outs = [RR.exponential(g, (n,), seed, prog, 0.5, seed_modifier=3),
            RR.cauchy(g, (n,), seed, prog, 1.0, 2.0, seed_modifier=3),
            RR.geometric(g, (n,), 0.2, seed, prog, dtype=np.int32, seed_modifier=3),
            RR.log_normal(g, (n,), seed, prog, 0.5, 0.25, seed_modifier=3),
            RR.integers(g, (n,), -3, 7, seed, prog, seed_modifier=3)]
    got = run_both(g, prog, {}, outs)

    def unit(kind):
        w0, w1 = words(seed, 3, kind, n)
        return (((w0 >> np.uint64(6)) * 2.0 ** 26 + (w1 >> np.uint64(6))) + 0.5) * 2.0 ** -52

    np.testing.assert_allclose(got[0], -np.log(unit(RR.EXPONENTIAL)) / 0.5, rtol=1e-6)
    np.testing.assert_allclose(got[1], 1.0 + 2.0 * np.tan(np.pi * (unit(RR.CAUCHY) - 0.5)), rtol=1e-6)
    np.testing.assert_array_equal(got[2], np.maximum(1, np.ceil(np.log(unit(RR.GEOMETRIC)) / np.log1p(-0.2))))
    w0, w1 = words(seed, 3, RR.LOG_NORMAL, n)
    z = np.sqrt(-2 * np.log(((w0 >> np.uint64(8)) + 1.0) * 2.0 ** -24)) * np.cos(2 * np.pi * (w1 >> np.uint64(8)) * 2.0 ** -24)
    np.testing.assert_allclose(got[3], np.exp(0.5 + 0.25 * z), rtol=1e-6)
    w0, _ = words(seed, 3, RR.INTEGERS, n)
    np.testing.assert_array_equal(got[4], -3 + ((w0 * np.uint64(10)) >> np.uint64(32)).astype(np.int64))
    assert got[2].dtype == np.int32 and got[4].dtype == np.int32


def test_samplers_follow_their_distributions():
    """Each sampler against its distribution function (KS) or its probabilities (chi-square)."""
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    n = 20000
    e = RR.exponential(g, (n,), 5, prog, 2.5)
    c = RR.cauchy(g, (n,), 5, prog, -1.0, 0.5)
    ln = RR.log_normal(g, (n,), 5, prog, 0.3, 0.6)
    geo = RR.geometric(g, (n,), 0.3, 5, prog)
    ints = RR.integers(g, (n,), 10, 17, 5, prog, dtype=np.float32)
    ev, cv, lv, gv, iv = run_both(g, prog, {}, [e, c, ln, geo, ints])
    limit = KS_LIMIT / math.sqrt(n)
    assert ev.min() > 0 and np.isfinite(ev).all()
    assert ks_statistic(ev, lambda x: 1 - np.exp(-2.5 * x)) < limit
    assert abs(ev.mean() - 0.4) < 4 * 0.4 / math.sqrt(n)
    assert np.isfinite(cv).all()
    assert ks_statistic(cv, lambda x: 0.5 + np.arctan((x + 1.0) / 0.5) / np.pi) < limit
    assert abs(np.median(cv) + 1.0) < 0.03
    erf = np.vectorize(math.erf)
    assert lv.min() > 0
    assert ks_statistic(lv, lambda x: 0.5 * (1 + erf((np.log(x) - 0.3) / (0.6 * math.sqrt(2))))) < limit
    assert abs(np.log(lv).mean() - 0.3) < 4 * 0.6 / math.sqrt(n)
    # geometric: integers >= 1 with P(k) = 0.7**(k-1) * 0.3 (chi-square over k = 1..12 and the tail)
    assert gv.dtype == np.float32 and gv.min() >= 1 and (gv == np.round(gv)).all()
    k = np.arange(1, 13)
    expected = np.append(0.7 ** (k - 1) * 0.3, 0.7 ** 12) * n
    counts = np.append([(gv == v).sum() for v in k], (gv > 12).sum())
    assert ((counts - expected) ** 2 / expected).sum() < 35    # 12 dof, 0.05% level
    assert abs(gv.mean() - 1 / 0.3) < 4 * math.sqrt(0.7) / 0.3 / math.sqrt(n)
    # integers in [10, 17): each value a seventh of the samples
    assert set(np.unique(iv).tolist()) == set(range(10, 17))
    counts = np.array([(iv == v).sum() for v in range(10, 17)])
    assert ((counts - n / 7) ** 2 / (n / 7)).sum() < 25        # 6 dof, 0.05% level


def test_sampler_arguments_are_checked():
    g = ip.Graph(TARGET)
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="rate must be positive"):
        RR.exponential(g, (3,), 0, prog, 0.0)
    with pytest.raises(ValueError, match="sigma must be positive"):
        RR.cauchy(g, (3,), 0, prog, 0.0, -1.0)
    with pytest.raises(ValueError, match=r"p must be in the open interval \(0, 1\), got 1.0"):
        RR.geometric(g, (3,), 1.0, 0, prog)
    with pytest.raises(ValueError, match="std must be positive"):
        RR.log_normal(g, (3,), 0, prog, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"need low < high"):
        RR.integers(g, (3,), 5, 5, 0, prog)
    with pytest.raises(ValueError, match="does not fit in int32"):
        RR.integers(g, (3,), 2 ** 31, 2 ** 31 + 2, 0, prog)
    with pytest.raises(TypeError, match="output dtype must be float32 or float16"):
        RR.exponential(g, (3,), 0, prog, dtype=np.int32)


def test_dropout_scales_like_torch_and_its_backward_uses_the_mask():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (100, 50), "x")
    dy = variable(g, "float32", (100, 50), "dy", 3)
    prog = ip.Sequence()
    p = 0.3
    y, mask = RR.dropout(g, x, p, 11, prog)
    dx = RR.dropout_backward(g, dy, mask, p, prog)
    rng = np.random.default_rng(0)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    dyv = rng.standard_normal(x.shape).astype(np.float32)
    yv, mv, dxv = run_both(g, prog, {x: xv, dy: dyv}, [y, mask, dx])
    assert mv.dtype == np.bool_ and abs(mv.mean() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / mv.size)
    np.testing.assert_array_equal(yv, (xv.astype(np.float64) * mv / (1 - p)).astype(np.float32))
    np.testing.assert_array_equal(dxv, (dyv.astype(np.float64) * mv / (1 - p)).astype(np.float32))
    assert (y.tiles() == x.tiles()).all() and (mask.tiles() == x.tiles()).all() and (dx.tiles() == dy.tiles()).all()


def test_dropout_edge_probabilities():
    g = ip.Graph(TARGET)
    x = variable(g, "float16", (8, 8), "x")
    prog = ip.Sequence()
    y0, m0 = RR.dropout(g, x, 0.0, 1, prog)
    y1, m1 = RR.dropout(g, x, 1.0, 1, prog)
    xv = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float16)
    a, ma, b, mb = run_both(g, prog, {x: xv}, [y0, m0, y1, m1])
    np.testing.assert_array_equal(a, xv)
    assert ma.all() and not mb.any() and not b.any()


def test_device_seed_advances_between_runs():
    g = ip.Graph(TARGET)
    seed = RR.seed_tensor(g, tile=2)
    seed_i32 = g.addVariable("int32", (2,), "seed_i32")
    g.setTileMapping(seed_i32, 7)
    prog = ip.Sequence()
    u = RR.uniform(g, (64,), seed, prog)
    v = RR.uniform(g, (64,), seed_i32, prog)
    RR.advance_seed(g, seed, prog)
    RR.advance_seed(g, seed_i32, prog, step=2 ** 32 - 1)
    start = 2 ** 32 - 1  # the low word carries into the high word
    runs = run_both(g, prog, {seed: RR.seed_words(start), seed_i32: RR.seed_words(5).view(np.int32)},
                    [u, v, seed, seed_i32], runs=2)
    (u1, v1, s1, t1), (u2, v2, _, _) = runs
    assert s1.tolist() == [0, 1] and t1.view(np.uint32).tolist() == [4, 1]
    assert not np.array_equal(u1, u2)
    # the second run draws exactly what a fresh seed of start + 1 draws
    g2 = ip.Graph(TARGET)
    prog2 = ip.Sequence()
    fresh = RR.uniform(g2, (64,), start + 1, prog2)
    np.testing.assert_array_equal(run_both(g2, prog2, {}, [fresh])[0], u2)
    w0, _ = words(5, 0, RR.UNIFORM, 64)  # an int32 seed reads as the same 32-bit words
    np.testing.assert_array_equal(v1, ((w0 >> np.uint64(8)) * 2.0 ** -24).astype(np.float32))


def test_bad_arguments_are_named():
    g = ip.Graph(TARGET)
    x = variable(g, "float32", (4,), "x")
    i = variable(g, "int32", (4,), "i")
    bad_seed = variable(g, "float32", (2,), "s")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match=r"dropout probability p must be in \[0, 1\], got 1.5"):
        RR.dropout(g, x, 1.5, 0, prog)
    with pytest.raises(TypeError, match="dropout needs a float tensor"):
        RR.dropout(g, i, 0.5, 0, prog)
    with pytest.raises(TypeError, match="seed tensor 's' is float32"):
        RR.uniform(g, (3,), bad_seed, prog)
    with pytest.raises(ValueError, match="a seed is an integer"):
        RR.seed_words(-1)
    with pytest.raises(TypeError, match="only a seed tensor"):
        RR.advance_seed(g, 5, prog)
    split = g.addVariable("uint32", (2,), "split")
    g.setTileMappingIntervals(split, [(0, 0, 1), (1, 1, 2)])
    with pytest.raises(ValueError, match="split over tiles"):
        RR.advance_seed(g, split, prog)
    with pytest.raises(ValueError, match="must be a bool tensor"):
        RR.dropout_backward(g, x, x, 0.5, prog)


def test_estimators_follow_the_poprand_shape():
    t = ip.GC200
    assert RR.rng_instructions(10, 2, RR.UNIFORM) == 19 + 5 * 3
    assert RR.rng_instructions(10, 4, RR.NORMAL) == 19 + 3 * 2
    assert RR.rng_instructions(10, 2, RR.CAUCHY) == 19 + 5 * 29
    sizes = {"seed": np.array([2]), "out": np.array([10])}
    assert RR.RANDOM_VERTEX.cycles(sizes, np.array([[RR.BERNOULLI, 0, 0, 0, 0]]), np.dtype("float32"), t).tolist() \
        == [t.thread_cycles(19 + 5)]
    sizes = {"x": np.array([8]), "seed": np.array([2]), "out": np.array([8]), "mask": np.array([8])}
    assert RR.DROPOUT_VERTEX.cycles(sizes, np.array([[0, 0, 1, 0]]), np.dtype("float16"), t).tolist() \
        == [t.thread_cycles(19 + 2 * 3)]


def test_work_runs_are_contiguous_and_balanced():
    tiles = np.array([0] * 24 + [1] * 3 + [0] * 2)
    work = list(zip(*(a.tolist() for a in RR.contiguous_work(tiles, 6))))
    assert [w for w in work if w[0] == 0] == [(0, 0, 8), (0, 8, 16), (0, 16, 24), (0, 27, 29)]
    assert [w for w in work if w[0] == 1] == [(1, 24, 27)]
