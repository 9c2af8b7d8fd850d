"""ipusim.ops.elementwise: the unary and binary maths (log1p, atan, erf, erfinv, rounding, ...)
against PyTorch's float32 results, strict and fast modes bit for bit."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
from ipusim.ops import elementwise as ew

TARGET = ip.Target.test(8, 64 * 1024)

UNARY = {
    "log1p": (torch.log1p, (-0.99, 5)), "expm1": (torch.expm1, (-5, 5)), "sin": (torch.sin, (-10, 10)),
    "cos": (torch.cos, (-10, 10)), "tan": (torch.tan, (-1.4, 1.4)), "asin": (torch.asin, (-1, 1)),
    "acos": (torch.acos, (-1, 1)), "atan": (torch.atan, (-20, 20)), "sinh": (torch.sinh, (-5, 5)),
    "cosh": (torch.cosh, (-5, 5)), "asinh": (torch.asinh, (-20, 20)), "acosh": (torch.acosh, (1, 20)),
    "atanh": (torch.atanh, (-0.99, 0.99)), "erf": (torch.erf, (-4, 4)), "erfinv": (torch.erfinv, (-0.999, 0.999)),
    "log2": (torch.log2, (0.01, 50)), "log10": (torch.log10, (0.01, 50)), "exp2": (torch.exp2, (-20, 20)),
    "floor": (torch.floor, (-5, 5)), "ceil": (torch.ceil, (-5, 5)), "round": (torch.round, (-5, 5)),
    "trunc": (torch.trunc, (-5, 5)), "lgamma": (torch.lgamma, (0.05, 20)), "isnan": (torch.isnan, (-1, 1)),
    "digamma": (torch.digamma, (-4.9, 20)),
}
BINARY = {"atan2": torch.atan2, "fmod": torch.fmod, "remainder": torch.remainder, "hypot": torch.hypot}


def run_unary(op, x, mode, dtype="float32", **kw):
    g = ip.Graph(TARGET)
    t = g.addVariable(dtype, x.shape, "x")
    g.map_linearly(t)
    prog = ip.Sequence()
    out = ew.unary(g, op, t, prog, **kw)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(t, x)
    e.run()
    return e.readTensor(out)


def run_binary(op, a, b, mode):
    g = ip.Graph(TARGET)
    ta, tb = (g.addVariable(v.dtype, v.shape, n) for v, n in ((a, "a"), (b, "b")))
    g.map_linearly(ta)
    g.map_linearly(tb)
    prog = ip.Sequence()
    out = ew.binary(g, op, ta, tb, prog)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(ta, a)
    e.writeTensor(tb, b)
    e.run()
    return e.readTensor(out)


@pytest.mark.parametrize("op", sorted(UNARY))
@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
@settings(max_examples=4, deadline=None)
def test_unary_maths_match_pytorch_in_both_modes(op, n, seed):
    fn, (lo, hi) = UNARY[op]
    x = np.random.default_rng(seed).uniform(lo, hi, n).astype(np.float32)
    if op == "round":
        x[: n // 2] = np.round(x[: n // 2] * 2) / 2   # halves round to even
    if op == "isnan":
        x[::3] = np.nan
    strict, fast = run_unary(op, x, "strict"), run_unary(op, x, "fast")
    np.testing.assert_array_equal(strict, fast)
    expected = fn(torch.from_numpy(x)).numpy()
    assert strict.dtype == expected.dtype
    np.testing.assert_allclose(strict, expected, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("op", sorted(BINARY))
@given(n=st.integers(1, 200), seed=st.integers(0, 2**16))
@settings(max_examples=4, deadline=None)
def test_binary_maths_match_pytorch_in_both_modes(op, n, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(-5, 5, (2, n)).astype(np.float32)
    b[np.abs(b) < 0.1] = 0.5
    strict, fast = run_binary(op, a, b, "strict"), run_binary(op, a, b, "fast")
    np.testing.assert_array_equal(strict, fast)
    np.testing.assert_allclose(strict, BINARY[op](torch.from_numpy(a), torch.from_numpy(b)).numpy(),
                               rtol=3e-6, atol=2e-6)


S = torch.special
EDGES = [0.0, -0.0, np.inf, -np.inf, np.nan]
SPECIAL_UNARY = {  # op: (torch function, domain to sample), checked against torch in float64 rounded once
    "isinf": (torch.isinf, (-3, 3)), "signbit": (torch.signbit, (-3, 3)), "erfc": (torch.erfc, (-6, 10)),
    "erfcx": (S.erfcx, (-5, 40)), "ndtri": (S.ndtri, (0, 1)), "i0": (S.i0, (-30, 30)), "i0e": (S.i0e, (-60, 60)),
    "i1": (S.i1, (-30, 30)), "i1e": (S.i1e, (-60, 60)), "k0": (S.modified_bessel_k0, (0, 40)),
    "k0e": (S.scaled_modified_bessel_k0, (0, 60)), "k1": (S.modified_bessel_k1, (0, 40)),
    "k1e": (S.scaled_modified_bessel_k1, (0, 60)), "j0": (lambda t: mpmath_reference(t, "besselj", 0), (-40, 40)), "j1": (S.bessel_j1, (-40, 40)),
    "y0": (S.bessel_y0, (0, 40)), "y1": (lambda t: mpmath_reference(t, "bessely", 1), (0, 40)), "spherical_j0": (S.spherical_bessel_j0, (-20, 20)),
    "airy_ai": (lambda t: mpmath_reference(t, "airyai"), (-20, 8)), "polygamma": (lambda t: S.polygamma(3, t), (-4.9, 20)),
    "angle": (torch.angle, (-2, 2)), "frexp_mantissa": (lambda t: torch.frexp(t)[0], (-1e6, 1e6)),
}
SPECIAL_BINARY = {  # op: (torch function, domain of a, domain of b)
    "copysign": (torch.copysign, (-5, 5), (-5, 5)), "fmax": (torch.fmax, (-5, 5), (-5, 5)),
    "fmin": (torch.fmin, (-5, 5), (-5, 5)), "logical_xor": (torch.logical_xor, (-1, 1), (-1, 1)),
    "zeta": (S.zeta, (1, 8), (-6, 10)), "igamma": (S.gammainc, (0, 30), (0, 40)),
    "igammac": (S.gammaincc, (0, 30), (0, 40)),
    **{f"{family}_{letter}": (getattr(S, f"{family}_polynomial_{letter}"), (-1.5, 1.5), (-2, 12))
       for family, letter in (op.rsplit("_", 1) for op in ew.POLYNOMIALS)},
}


def mpmath_reference(t, fn, *order):
    """mpmath's function where torch's float64 one is off by more than float32 rounding: Ai by up
    to 4e-5 relative on (-2.6, -2.09), J0 and Y1 by up to 5e-6 near their zeros around 5 (checked
    against mpmath); torch's values (nan) at the infinities."""
    import mpmath
    f = getattr(mpmath, fn)
    finite = [float(f(*order, float(v))) if math.isfinite(v) else None for v in t.tolist()]
    edges = {"airyai": S.airy_ai, "besselj": S.bessel_j0, "bessely": S.bessel_y1}[fn](t)
    return torch.tensor([e if v is None else v for v, e in zip(finite, edges.tolist())], dtype=torch.float64)


def grid(lo, hi, n=301):
    """n float32 points across [lo, hi] and the edges of every float (0, -0, +-inf, nan)."""
    return np.concatenate([np.linspace(lo, hi, n), EDGES]).astype(np.float32)


@pytest.mark.parametrize("op", sorted(SPECIAL_UNARY))
def test_special_functions_match_pytorch_in_both_modes(op):
    fn, (lo, hi) = SPECIAL_UNARY[op]
    x = grid(lo, hi)
    kw = {"scale": 3.0} if op == "polygamma" else {}
    strict, fast = run_unary(op, x, "strict", **kw), run_unary(op, x, "fast", **kw)
    np.testing.assert_array_equal(strict, fast)
    expected = fn(torch.from_numpy(x).double())
    expected = expected.numpy() if expected.dtype == torch.bool else expected.float().numpy()
    assert strict.dtype == expected.dtype
    np.testing.assert_allclose(strict, expected, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("op", sorted(SPECIAL_BINARY))
def test_special_binary_functions_match_pytorch_in_both_modes(op):
    fn, (alo, ahi), (blo, bhi) = SPECIAL_BINARY[op]
    a, b = (v.ravel() for v in np.meshgrid(grid(alo, ahi, 17), grid(blo, bhi, 19)))
    if op.endswith(tuple("tuvwhel")) and op in ew.POLYNOMIALS:
        b = np.where(np.isfinite(b), np.trunc(b), b).astype(np.float32)   # the degree
    strict, fast = run_binary(op, a, b, "strict"), run_binary(op, a, b, "fast")
    np.testing.assert_array_equal(strict, fast)
    expected = fn(torch.from_numpy(a).double(), torch.from_numpy(b).double())
    expected = expected.numpy() if expected.dtype == torch.bool else expected.float().numpy()
    # (at the polynomials' zeros torch's recurrence leaves a rounding error of 1e-15 where ours is 0)
    np.testing.assert_allclose(strict, expected, rtol=2e-6, atol=1e-12)


def test_frexp_exponents_are_integers():
    x = grid(-1e6, 1e6, 101)
    exponent = run_unary("frexp_exponent", x, "strict", out_dtype="int32")
    assert exponent.dtype == np.int32
    want = torch.frexp(torch.from_numpy(x))[1].numpy()
    finite = np.isfinite(x)
    np.testing.assert_array_equal(exponent[finite], want[finite])


def test_integer_remainder_and_fmod_follow_pytorch():
    a = np.array([-7, -3, -1, 0, 2, 5, 7], np.int32)
    for mode in ("strict", "fast"):
        for op in ("remainder", "fmod"):
            got = run_binary(op, a, np.full_like(a, 3), mode)
            np.testing.assert_array_equal(got, BINARY[op](torch.from_numpy(a), 3).numpy(), err_msg=f"{op} {mode}")


def test_edges_of_the_domains_follow_pytorch():
    x = np.array([-1.0, 1.0, 2.0, -2.0, 0.0, np.inf, -np.inf, np.nan], np.float32)
    for op in ("digamma", "log1p", "atanh", "erfinv", "asin", "acosh", "floor", "lgamma", "expm1", "erf", "atan"):
        got = run_unary(op, x, "strict")
        np.testing.assert_allclose(got, UNARY[op][0](torch.from_numpy(x)).numpy(), rtol=1e-6, err_msg=op)
    half = run_unary("erfinv", np.linspace(-0.9, 0.9, 7).astype(np.float16), "fast", "float16")
    np.testing.assert_allclose(half, torch.erfinv(torch.linspace(-0.9, 0.9, 7).half().float()).numpy(),
                               rtol=1e-3)


def test_normal_cdf_and_pdf_keep_relative_accuracy_in_both_tails():
    """gelu's Phi and phi (one branch-free polynomial form, for SIMD loops) against float64 erfc and
    exp, including the far left tail where 0.5 * (1 + erf) would cancel to nothing."""
    x = np.concatenate([np.linspace(-38, 38, 20001), [-8.3872, -5.5, 0.0, -0.0]])
    got = np.array([ew.normal_cdf_pdf.py_func(v) for v in x])
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    for values, ref in ((got[:, 0], cdf), (got[:, 1], pdf)):
        normal = ref > 1e-300
        np.testing.assert_allclose(values[normal], ref[normal], rtol=2e-10)
        assert np.all(values[~normal] < 1e-290)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gelu_and_its_gradient_match_pytorch_in_both_modes(dtype):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0, 3, 500), np.linspace(-12, 12, 97), [0.0, 40.0, -40.0, np.inf, -np.inf, np.nan]])
    x, dy = x.astype(dtype), rng.normal(0, 1, x.size).astype(dtype)
    dy[-6:] = 1
    strict, fast = run_unary("gelu", x, "strict", dtype), run_unary("gelu", x, "fast", dtype)
    np.testing.assert_array_equal(strict, fast)
    grad = [run_binary("gelu_grad", x, dy, mode) for mode in ("strict", "fast")]
    np.testing.assert_array_equal(*grad)
    # gelu(inf) is inf (torch's CPU kernel gives nan there); -inf and nan give nan
    np.testing.assert_array_equal(strict[-6:], np.array([0, 40, -0.0, np.inf, np.nan, np.nan], dtype))
    np.testing.assert_array_equal(grad[0][-6:], np.array([0.5, 1, 0, np.nan, np.nan, np.nan], dtype))
    tx = torch.from_numpy(x[:-3].astype(np.float32)).requires_grad_()
    y = torch.nn.functional.gelu(tx)
    y.backward(torch.from_numpy(dy[:-3].astype(np.float32)))
    tol = dict(rtol=3e-6, atol=1e-6) if dtype == "float32" else dict(rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(strict[:-3].astype(np.float32), y.detach().numpy().astype(dtype), **tol)
    np.testing.assert_allclose(grad[0][:-3].astype(np.float32), tx.grad.numpy().astype(dtype), **tol)


@pytest.mark.parametrize("op", ["relu_grad", "eq", "gt", "lt", "ge", "le", "ne", "logical_and", "logical_or"])
def test_selections_and_comparisons_agree_bit_for_bit_at_the_edges(op):
    edges = np.array([np.nan, -np.inf, -1.5, -0.0, 0.0, 2.0, np.inf], np.float32)
    a, b = np.repeat(edges, edges.size), np.tile(edges, edges.size)
    strict, fast = run_binary(op, a, b, "strict"), run_binary(op, a, b, "fast")
    assert strict.dtype == fast.dtype
    np.testing.assert_array_equal(strict.view(np.uint8), fast.view(np.uint8))  # signs of zeros and NaNs too


@pytest.mark.parametrize("op", ["bitwise_and", "bitwise_or", "bitwise_xor"])
@pytest.mark.parametrize("dtype", ["int32", "uint32"])
def test_bitwise_ops_on_integers_match_numpy_in_both_modes(op, dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    a = np.concatenate([rng.integers(info.min, info.max, 200, dtype, endpoint=True), [info.min, info.max, 0, -1 % 256]])
    b = np.concatenate([rng.integers(info.min, info.max, 200, dtype, endpoint=True), [info.max, info.min, 5, 3]])
    a, b = a.astype(dtype), b.astype(dtype)
    want = getattr(np, op)(a, b)
    for mode in ("strict", "fast"):
        got = run_binary(op, a, b, mode)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_nextafter_steps_to_the_neighbouring_float32_in_both_modes():
    tiny = np.float32(1.4e-45)
    a = np.array([1.0, 1.0, 0.0, 0.0, -0.0, tiny, -tiny, 2.0, 2.0, np.inf, -np.inf, np.finfo(np.float32).max,
                  np.nan, 3.0, 1e-38, 5.5], np.float32)
    b = np.array([2.0, 0.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, np.inf, 1.0, np.nan, 0.0, 5.5], np.float32)
    want = torch.nextafter(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    for mode in ("strict", "fast"):
        np.testing.assert_array_equal(run_binary("nextafter", a, b, mode).view(np.uint32), want.view(np.uint32))
    g = ip.Graph(TARGET)
    h = g.addVariable("float16", (2,), "h")
    with pytest.raises(TypeError, match="nextafter steps between float32 values; 'h' is float16"):
        ew.binary(g, "nextafter", h, h, ip.Sequence())


def test_transcendental_maths_cost_more_than_rounding():
    def cycles(op):
        g = ip.Graph(TARGET)
        t = g.addVariable("float32", (4096,), "x")
        g.map_linearly(t)
        prog = ip.Sequence()
        ew.unary(g, op, t, prog)
        return ip.Engine(g, prog, mode="fast").load().run()
    assert cycles("floor") < cycles("log1p") < cycles("erfinv")


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), keep=st.data(), seed=st.integers(0, 2**16),
       op=st.sampled_from(["add", "sub", "mul", "div"]), part_first=st.booleans(),
       dtype=st.sampled_from(["float32", "float16"]))
@settings(max_examples=25, deadline=None)
def test_an_operand_broadcast_along_the_other_agrees_with_numpy_in_both_modes(shape, keep, seed, op, part_first,
                                                                              dtype):
    """A bias-like operand (its dimensions a block of the other's, or any broadcast shape) gives
    NumPy's result bit for bit in both modes, whichever side it is on."""
    mask = keep.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    part_shape = tuple(n if k else 1 for n, k in zip(shape, mask))[keep.draw(st.integers(0, len(shape) - 1)):]
    rng = np.random.default_rng(seed)
    full = rng.standard_normal(shape).astype(dtype)
    part = rng.standard_normal(part_shape).astype(dtype)
    part[part == 0] = 1  # division by zero has its own test
    a, b = (part, full) if part_first else (full, part)
    want = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op](a, b)
    for mode in ("strict", "fast"):
        np.testing.assert_array_equal(run_binary(op, a, b, mode), want)


def test_broadcast_rows_finds_a_block_of_dimensions_or_nothing():
    assert ew.broadcast_rows((1, 10, 1, 1), (40, 10, 24, 24)) == (10, 576)
    assert ew.broadcast_rows((10, 1, 1), (40, 10, 24, 24)) == (10, 576)
    assert ew.broadcast_rows((24,), (40, 10, 24)) == (24, 1)
    assert ew.broadcast_rows((1, 1), (3, 4)) == (1, 12)
    assert ew.broadcast_rows((3, 1, 5), (3, 4, 5)) is None


@pytest.mark.parametrize("dtype,width,per_vector", [("float16", 4, 10), ("float32", 2, 20)])
def test_gelu_and_its_gradient_cost_what_poplibs_estimates(dtype, width, per_vector):
    """PopLibs' NonLinearity estimator: GELU is two ops per 64-bit vector at 5 (half) or 10
    (float) cycles an op, vectorised like the other elementwise ops (4 halves or 2 floats a
    vector); the gradient is charged the forward's per vector. Not the scalar 40 and 50
    instructions per element they were, which made GELU 18% of a BERT layer's forward."""
    n = np.array([1, 4, 5, 356, 2850])
    params = np.zeros((len(n), 3))
    for table, vertex in ((ew.UNARY, ew.UNARY_VERTEX), (ew.BINARY, ew.BINARY_VERTEX)):
        params[:, 0] = table["gelu" if table is ew.UNARY else "gelu_grad"][0]
        got = vertex.cycles({"out": n}, params, np.dtype(dtype), TARGET)
        np.testing.assert_array_equal(got, TARGET.thread_cycles(np.ceil(n / width) * per_vector + 6))
    # the same vertex for a cheap op costs less per vector, a transcendental one not vectorised more
    params[:, 0] = ew.UNARY["neg"][0]
    assert (ew.UNARY_VERTEX.cycles({"out": n}, params, np.dtype(dtype), TARGET)[1:] <
            TARGET.thread_cycles(np.ceil(n / width) * per_vector + 6)[1:]).all()
