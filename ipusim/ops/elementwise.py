"""Elementwise ops: unary maps, binary maps with NumPy broadcasting, and their gradients.

Mapping: the output takes the mapping of a full-shape operand (no exchange for it), else it is
spread linearly over the tiles in vector-sized grains; other operands are brought to the
output's tiles by exchange (broadcast operands are replicated where needed);
each tile's elements are split over its workers, one vertex per worker.
Kernel: one scalar function `apply` shared by the codelet (strict) and the whole-tensor kernel
(fast), computed in float64 and rounded once to the storage dtype, so both modes agree bit for bit.
Correctly rounded float ops (+, -, *, /, negation, abs, relu, squares, casts) run as NumPy ufuncs in
the fast mode: a float64 result rounded once equals the float32 (or float16) IEEE result, so the
bits are the same and the host work is a single vectorised pass; so do comparisons, which compute
nothing. The other ops run the codelet's scalar function in a Numba kernel compiled for each op
(`unary_kernel`, `binary_kernel`).
Cycles (per vertex, thread instructions): ceil(n / vector width) * cost of the op + 6, vector
width 2 for float32 and 4 for float16 (64-bit loads/stores), 1 for int32 and bool; transcendental
and division ops are not vectorised and cost more per element (table below).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from . import special as sp
from .common import lookup, new_output, placed, region_work

# op name -> (code, thread instructions per vector, vectorised); a cost (half, float) differs by dtype.
# GELU follows PopLibs' NonLinearity estimator (popnn PerformanceEstimation.hpp and
# popnnCycleEstimators.cpp): two ops per vector of 4 halves or 2 floats at 5 (half) or 10 (float)
# cycles an op; its gradient is charged the forward's per vector (it evaluates the same tanh).
UNARY = {"neg": (0, 1, True), "abs": (1, 1, True), "relu": (2, 1, True), "gelu": (3, (10, 20), True),
         "tanh": (4, 20, False), "sigmoid": (5, 20, False), "exp": (6, 15, False), "log": (7, 15, False),
         "sqrt": (8, 10, False), "rsqrt": (9, 10, False), "square": (10, 1, True),
         "reciprocal": (11, 10, False), "cast": (12, 1, True), "scale": (13, 2, True),
         "logical_not": (14, 1, True), "fill": (15, 1, True),
         "log1p": (16, 20, False), "expm1": (17, 20, False), "sin": (18, 20, False), "cos": (19, 20, False),
         "tan": (20, 25, False), "asin": (21, 25, False), "acos": (22, 25, False), "atan": (23, 25, False),
         "sinh": (24, 25, False), "cosh": (25, 25, False), "asinh": (26, 30, False), "acosh": (27, 30, False),
         "atanh": (28, 30, False), "erf": (29, 25, False), "erfinv": (30, 60, False), "log2": (31, 15, False),
         "log10": (32, 15, False), "exp2": (33, 15, False), "floor": (34, 2, True), "ceil": (35, 2, True),
         "round": (36, 3, True), "trunc": (37, 2, True), "lgamma": (38, 60, False), "isnan": (39, 1, True),
         "digamma": (40, 60, False), "isinf": (41, 1, True), "signbit": (42, 1, True), "erfc": (43, 25, False),
         "erfcx": (44, 60, False), "ndtri": (45, 120, False), "i0": (46, 80, False), "i0e": (47, 80, False),
         "i1": (48, 80, False), "i1e": (49, 80, False), "k0": (50, 120, False), "k0e": (51, 120, False),
         "k1": (52, 120, False), "k1e": (53, 120, False), "j0": (54, 100, False), "j1": (55, 100, False),
         "y0": (56, 120, False), "y1": (57, 120, False), "spherical_j0": (58, 25, False),
         "airy_ai": (59, 150, False), "polygamma": (60, 150, False),   # scale = the order n
         "angle": (61, 2, True), "frexp_mantissa": (62, 4, True), "frexp_exponent": (63, 4, True)}
BOOL_UNARY = {"logical_not", "isnan", "isinf", "signbit"}
BINARY = {"add": (0, 1, True), "sub": (1, 1, True), "mul": (2, 1, True), "div": (3, 10, False),
          "max": (4, 1, True), "min": (5, 1, True), "pow": (6, 30, False),
          "relu_grad": (7, 2, True),       # (x, dy) -> dy where x > 0
          "tanh_grad": (8, 3, True),       # (y, dy) -> dy * (1 - y^2)
          "sigmoid_grad": (9, 3, True),    # (y, dy) -> dy * y * (1 - y)
          "gelu_grad": (10, (10, 20), True),  # (x, dy) -> dy * gelu'(x)
          "eq": (11, 1, True), "gt": (12, 1, True), "lt": (13, 1, True), "ge": (14, 1, True),
          "le": (15, 1, True), "ne": (16, 1, True), "logical_and": (17, 1, True),
          "logical_or": (18, 1, True),
          "abs_grad": (19, 2, True),       # (x, dy) -> dy * sign(x)
          "atan2": (20, 30, False), "fmod": (21, 15, False),
          "remainder": (22, 15, False),    # x - floor(x / y) * y (Python's %, torch.remainder)
          "hypot": (23, 15, False), "copysign": (24, 1, True), "fmax": (25, 2, True), "fmin": (26, 2, True),
          "logical_xor": (27, 1, True), "zeta": (28, 150, False), "igamma": (29, 200, False),
          "igammac": (30, 200, False)}
# torch.special's orthogonal polynomials p(x, n), one binary op each (codes from POLYNOMIAL_CODE)
POLYNOMIALS = ("chebyshev_t", "chebyshev_u", "chebyshev_v", "chebyshev_w", "shifted_chebyshev_t",
               "shifted_chebyshev_u", "shifted_chebyshev_v", "shifted_chebyshev_w", "hermite_h", "hermite_he",
               "laguerre_l", "legendre_p")
POLYNOMIAL_CODE = 31
BINARY.update({name: (POLYNOMIAL_CODE + k, 40, False) for k, name in enumerate(POLYNOMIALS)})
BINARY.update({"bitwise_and": (43, 1, True), "bitwise_or": (44, 1, True), "bitwise_xor": (45, 1, True)})  # integers
BINARY["nextafter"] = (46, 4, True)   # float32 only: the next float32 after x towards y (bit steps, 4 instructions)
# Fast-mode NumPy equivalents of the correctly rounded ops (same bits as `apply_*`).
# Each computes into `out` (the output's dtype).
NUMPY_UNARY = {"neg": lambda x, p0, p1, out: np.negative(x, out=out), "abs": lambda x, p0, p1, out: np.abs(x, out=out),
               "relu": lambda x, p0, p1, out: np.maximum(x, x.dtype.type(0), out=out),
               "square": lambda x, p0, p1, out: np.square(x, out=out),
               "cast": lambda x, p0, p1, out: np.copyto(out, x, casting="unsafe"),
               "fill": lambda x, p0, p1, out: out.fill(p0)}
COMPARISONS = {"eq", "gt", "lt", "ge", "le", "ne", "logical_and", "logical_or", "logical_xor"}


# (comparisons, of any dtype, are exact too)
ARITHMETIC = ("add", "sub", "mul", "div")
NUMPY_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                "eq": np.equal, "gt": np.greater, "lt": np.less, "ge": np.greater_equal, "le": np.less_equal,
                "ne": np.not_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
                "logical_xor": np.logical_xor}
GELU, GELU_GRAD = UNARY["gelu"][0], BINARY["gelu_grad"][0]
SQRT1_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
TWO_OVER_SQRT_PI = 1.1283791670955126


@njit(**JIT)
def erfinv(x):
    """The inverse error function: Giles' single-precision polynomial ("Approximating the erfinv
    function", GPU Computing Gems, 2011) as a first guess, then two Newton steps on erf in float64."""
    if x != x or x < -1.0 or x > 1.0:
        return np.nan
    if x == 1.0 or x == -1.0:
        return math.copysign(np.inf, x)
    w = -math.log((1.0 - x) * (1.0 + x))
    if w < 5.0:
        w -= 2.5
        p = 2.81022636e-08
        for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                  -0.00417768164, 0.246640727, 1.50140941):
            p = c + p * w
    else:
        w = math.sqrt(w) - 3.0
        p = -0.000200214257
        for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                  0.00943887047, 1.00167406, 2.83297682):
            p = c + p * w
    y = p * x
    for _ in range(2):
        y -= (math.erf(y) - x) / (TWO_OVER_SQRT_PI * math.exp(-y * y))
    return y


# erfc(z) = exp(-z^2) R(t) with t = 2 / (2 + z) for z >= 0: R is smooth on (0, 1], and its
# degree-20 Chebyshev series in u = A t - B (t from ERFC_T0, z = 26.5, where exp(-z^2) underflows,
# to 1) stays within 2e-13 of erfc(z) exp(z^2) everywhere (a least-squares fit at 4,000 Chebyshev
# nodes against float64 erfc; tests check the bound). With exp(-z^2) from a Taylor polynomial,
# the pair below has no branches or library calls, so loops over it run in SIMD lanes.
ERFC_T0 = 2.0 / (2.0 + 26.5)
ERFC_A, ERFC_B = 2.0 / (1.0 - ERFC_T0), (1.0 + ERFC_T0) / (1.0 - ERFC_T0)
ERFC_CHEBYSHEV = np.array([
    0.39854710612753563, 0.4750088244297425, 0.1120312537518751, 0.014607531827835113, 6.71815011591576e-05,
    -0.0002605126708134194, -8.044716670241088e-06, 6.849866946940942e-06, 1.0990000127060305e-08,
    -2.235099578759836e-07, 1.708496283159017e-08, 6.818596729329176e-09, -1.4739300300227653e-09,
    -9.761879040087085e-11, 8.027040618701172e-11, -8.255743098082016e-12, -2.4855192316625756e-12,
    8.759473699515814e-13, -4.1755010962188855e-14, -3.833626660127871e-14, 1.0206776380102214e-14])
INV_FACTORIALS = np.array([1.0 / math.factorial(k) for k in range(14)])


@njit(inline="always", **JIT)
def exp_neg_square(z):
    """exp(-z^2): exp(-z^2 / 1024) by its Taylor series to degree 13, squared ten times (which
    multiplies its error by 1024): within 1e-10 relative while the result is a normal float64,
    within 1e-12 for z < 20; 0 from z^2 = 800 on."""
    u = -min(z * z, 800.0) * (1.0 / 1024.0)
    p = INV_FACTORIALS[13]
    for k in range(12, -1, -1):
        p = p * u + INV_FACTORIALS[k]
    for _ in range(10):
        p = p * p
    return p


@njit(inline="always", **JIT)
def normal_cdf_pdf(x):
    """(Phi(x), phi(x)) of the standard normal, Phi from erfc so both tails keep their relative
    accuracy (0.5 * (1 + erf(x / sqrt(2))) loses it below x = -5 by cancellation)."""
    z = abs(x) * SQRT1_2
    e = exp_neg_square(z)
    u = ERFC_A * (2.0 / (2.0 + z)) - ERFC_B
    b1 = 0.0
    b2 = 0.0
    for k in range(ERFC_CHEBYSHEV.size - 1, 0, -1):  # Clenshaw
        b1, b2 = 2.0 * u * b1 - b2 + ERFC_CHEBYSHEV[k], b1
    half_erfc = 0.5 * e * (u * b1 - b2 + ERFC_CHEBYSHEV[0])
    return (half_erfc if x < 0 else 1.0 - half_erfc), e * INV_SQRT_2PI


@njit(**JIT)
def round_half_even(x):
    r = math.floor(x)
    d = x - r
    if d > 0.5 or (d == 0.5 and r % 2.0 != 0.0):
        r += 1.0
    return r


@njit(**JIT)
def apply_unary(op, x, p0, p1):
    if op == 0:
        return -x
    if op == 1:
        return abs(x)
    if op == 2:
        return x if (x > 0 or x != x) else 0.0
    if op == 3:
        return x * normal_cdf_pdf(x)[0]
    if op == 4:
        return math.tanh(x)
    if op == 5:
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    if op == 6:
        return math.exp(x)
    if op == 7:
        return math.log(x) if x > 0 else (-np.inf if x == 0 else np.nan)
    if op == 8:
        return math.sqrt(x) if x >= 0 else np.nan
    if op == 9:
        return 1.0 / math.sqrt(x) if x > 0 else (np.inf if x == 0 else np.nan)
    if op == 10:
        return x * x
    if op == 11:
        return 1.0 / x if x != 0 else math.copysign(np.inf, x)
    if op == 12:
        return x
    if op == 13:
        return x * p0 + p1
    if op == 14:
        return 1.0 if x == 0 else 0.0
    if op == 15:
        return p0
    return apply_math(op, x, p0)


@njit(**JIT)
def apply_math(op, x, p0):
    """The unary maths of codes 16 and up, in float64 (the domain's edges as in C's libm: nan
    outside it, +-inf at its poles; the special functions' as torch's, see special.py)."""
    if op >= 41:
        return apply_special(op, x, p0)
    if x != x:
        return 1.0 if op == 39 else x
    if op == 16:
        return math.log1p(x) if x > -1.0 else (-np.inf if x == -1.0 else np.nan)
    if op == 17:
        return math.expm1(x)
    if op == 18:
        return math.sin(x) if abs(x) != np.inf else np.nan
    if op == 19:
        return math.cos(x) if abs(x) != np.inf else np.nan
    if op == 20:
        return math.tan(x) if abs(x) != np.inf else np.nan
    if op == 21:
        return math.asin(x) if abs(x) <= 1.0 else np.nan
    if op == 22:
        return math.acos(x) if abs(x) <= 1.0 else np.nan
    if op == 23:
        return math.atan(x)
    if op == 24:
        return math.sinh(x) if abs(x) < 710.0 else math.copysign(np.inf, x)
    if op == 25:
        return math.cosh(x) if abs(x) < 710.0 else np.inf
    if op == 26:
        return math.asinh(x)
    if op == 27:
        return math.acosh(x) if x >= 1.0 else np.nan
    if op == 28:
        return math.atanh(x) if abs(x) < 1.0 else (math.copysign(np.inf, x) if abs(x) == 1.0 else np.nan)
    if op == 29:
        return math.erf(x)
    if op == 30:
        return erfinv(x)
    if op == 31:
        return math.log2(x) if x > 0 else (-np.inf if x == 0 else np.nan)
    if op == 32:
        return math.log10(x) if x > 0 else (-np.inf if x == 0 else np.nan)
    if op == 33:
        return 2.0 ** x if x < 1024.0 else np.inf
    if op == 40:
        return sp.digamma(x) if x != -np.inf else np.nan
    if abs(x) == np.inf:
        return np.inf if op == 38 else (0.0 if op == 39 else x)
    if op == 34:
        return math.floor(x)
    if op == 35:
        return math.ceil(x)
    if op == 36:
        return round_half_even(x)
    if op == 37:
        return math.trunc(x)
    if op == 38:
        return math.lgamma(x) if not (x <= 0 and x == math.floor(x)) else np.inf
    return 0.0


@njit(**JIT)
def apply_special(op, x, p0):
    """Unary codes 41 and up: tests of a float's class and bits, and special functions."""
    if op == 41:
        return 1.0 if abs(x) == np.inf else 0.0
    if op == 42:
        return 1.0 if math.copysign(1.0, x) < 0 and x == x else 0.0
    if op == 61:
        return x if x != x else (math.pi if x < 0 else 0.0)
    if op == 62 or op == 63:
        if x != x or abs(x) == np.inf or x == 0:
            return (x if op == 62 else 0.0)
        mantissa, exponent = math.frexp(x)
        return mantissa if op == 62 else float(exponent)
    if op == 43:
        return math.erfc(x)
    if op == 44:
        return sp.erfcx(x)
    if op == 45:
        return sp.ndtri(x)
    if op <= 49:
        return sp.bessel_i(0 if op <= 47 else 1, x, op % 2 == 1)
    if op <= 53:
        return sp.bessel_k(0 if op <= 51 else 1, x, op % 2 == 1)
    if op <= 55:
        return sp.bessel_j(op - 54, x)
    if op <= 57:
        return sp.bessel_y(op - 56, x)
    if op == 58:
        return sp.spherical_bessel_j0(x)
    if op == 59:
        return sp.airy_ai(x)
    return sp.polygamma(int(p0), x)


@njit(**JIT)
def apply_binary(op, x, y):
    if op == 0:
        return x + y
    if op == 1:
        return x - y
    if op == 2:
        return x * y
    if op == 3:
        if y == 0:
            return np.nan if x == 0 or x != x else math.copysign(np.inf, x) * math.copysign(1.0, y)
        return x / y
    if op == 4:
        return x if x >= y or x != x else y
    if op == 5:
        return x if x <= y or x != x else y
    if op == 6:
        return x ** y
    if op == 7:
        return y if x > 0 else 0.0
    if op == 8:
        return y * (1.0 - x * x)
    if op == 9:
        return y * x * (1.0 - x)
    if op == 10:
        cdf, pdf = normal_cdf_pdf(x)
        return y * (cdf + x * pdf)
    if op == 11:
        return 1.0 if x == y else 0.0
    if op == 12:
        return 1.0 if x > y else 0.0
    if op == 13:
        return 1.0 if x < y else 0.0
    if op == 14:
        return 1.0 if x >= y else 0.0
    if op == 15:
        return 1.0 if x <= y else 0.0
    if op == 16:
        return 1.0 if x != y else 0.0
    if op == 17:
        return 1.0 if (x != 0 and y != 0) else 0.0
    if op == 18:
        return 1.0 if (x != 0 or y != 0) else 0.0
    if op == 19:
        return y if x > 0 else (-y if x < 0 else 0.0 * y)
    if op == 20:
        return math.atan2(x, y)
    if op == 21:
        return np.fmod(np.float64(x), np.float64(y)) if y != 0 and abs(x) != np.inf else np.nan
    if op == 22:
        if y == 0 or abs(x) == np.inf or x != x or y != y:
            return np.nan
        r = np.fmod(np.float64(x), np.float64(y))
        return r + y if r != 0 and (r < 0) != (y < 0) else (math.copysign(0.0, y) if r == 0 else r)
    if op == 23:
        return math.hypot(x, y)
    if op == 24:
        return math.copysign(x, y)
    if op == 25:
        return y if x != x else (x if y != y or x >= y else y)
    if op == 26:
        return y if x != x else (x if y != y or x <= y else y)
    if op == 27:
        return 1.0 if (x != 0) != (y != 0) else 0.0
    if op == 28:
        return sp.zeta(x, y)
    if op == 29 or op == 30:
        return sp.igamma(x, y, op == 30)
    if op == 43:
        return int(x) & int(y)
    if op == 44:
        return int(x) | int(y)
    if op == 45:
        return int(x) ^ int(y)
    if op == 46:
        return np.float64(np.nextafter(np.float32(x), np.float32(y)))
    return sp.polynomial(op - POLYNOMIAL_CODE, x, y)


@njit(parallel=True, **JIT)
def unary_codelet(x, x_addr, x_start, out, o_addr, o_start, params):
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        bx, bo = x_start[v], o_start[v]
        for i in range(o_start[v + 1] - bo):
            st(out, o_addr[bo + i], apply_unary(op, ld(x, x_addr[bx + i]), params[v, 1], params[v, 2]))


@njit(parallel=True, **JIT)
def binary_codelet(a, a_addr, a_start, b, b_addr, b_start, out, o_addr, o_start, params):
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        ba, bb, bo = a_start[v], b_start[v], o_start[v]
        for i in range(o_start[v + 1] - bo):
            st(out, o_addr[bo + i], apply_binary(op, ld(a, a_addr[ba + i]), ld(b, b_addr[bb + i])))


# Codes from which the ops share one fast kernel, the op an argument: the special functions and
# the float tests (their loops do not vectorise, and each would compile all of special.py again).
SHARED_UNARY, SHARED_BINARY = 41, 24


@njit(**JIT)
def shared_unary_kernel(op, x, out, p0, p1):
    for i in range(out.size):
        st(out, i, apply_unary(op, ld(x, i), p0, p1))


@njit(**JIT)
def shared_binary_kernel(op, a, b, out):
    for i in range(out.size):
        st(out, i, apply_binary(op, ld(a, i), ld(b, i)))


@lru_cache(maxsize=None)
def unary_kernel(op: int):
    """The fast mode's kernel of one unary op over whole flat arrays: out[i] = apply_unary(op,
    x[i], p0, p1). Compiled on first use for that op alone, so `apply_unary` folds to the op's
    formula and the loop runs in SIMD lanes (one kernel for every op would dispatch on the op for
    each element). A serial loop, as fast-mode kernels run on one thread by default
    (docs/performance.md, Threads), and a parallel one compiles 8x slower; gelu's is a parallel
    loop, which vectorises its normal CDF where the serial loop does not (5x faster, one thread).
    Codes from SHARED_UNARY on run `shared_unary_kernel`."""
    if op >= SHARED_UNARY:
        return lambda x, out, p0, p1: shared_unary_kernel(op, x, out, p0, p1)

    @njit(parallel=op == GELU, **JIT)
    def kernel(x, out, p0, p1):
        if op == GELU:  # the normal CDF called from the loop itself
            for i in prange(out.size):
                v = ld(x, i)
                st(out, i, v * normal_cdf_pdf(v)[0])
            return
        for i in range(out.size):
            st(out, i, apply_unary(op, ld(x, i), p0, p1))
    return kernel


@lru_cache(maxsize=None)
def binary_kernel(op: int):
    """The fast mode's kernel of one binary op over whole flat arrays: out[i] = apply_binary(op,
    a[i], b[i]), compiled for that op alone as `unary_kernel` is (gelu's gradient as gelu; codes
    from SHARED_BINARY on run `shared_binary_kernel`)."""
    if op >= SHARED_BINARY:
        return lambda a, b, out: shared_binary_kernel(op, a, b, out)

    @njit(parallel=op == GELU_GRAD, **JIT)
    def kernel(a, b, out):
        if op == GELU_GRAD:
            for i in prange(out.size):
                v = ld(a, i)
                cdf, pdf = normal_cdf_pdf(v)
                st(out, i, ld(b, i) * (cdf + v * pdf))
            return
        for i in range(out.size):
            st(out, i, apply_binary(op, ld(a, i), ld(b, i)))
    return kernel


@lru_cache(maxsize=None)
def broadcast_kernel(op: int):
    """The fast mode's kernel of one binary op between a whole flat array and an operand that
    repeats along it (`broadcast_rows`): element i of `full` meets part[(i // cols) % period],
    on the left when `part_first`. The loops run over contiguous memory and vectorise (NumPy's
    broadcasting loop over a [40, 10, 24, 24] + [1, 10, 1, 1] float32 add: 142 us; this: a copy's
    time)."""
    @njit(**JIT)
    def kernel(full, part, period, cols, part_first, out):
        if cols == 1:  # the operand varies along the innermost dimension: rows of `period`
            for r in range(out.size // period):
                base = r * period
                for j in range(period):
                    x, y = ld(full, base + j), ld(part, j)
                    st(out, base + j, apply_binary(op, y, x) if part_first else apply_binary(op, x, y))
            return
        for r in range(out.size // cols):
            y = ld(part, r % period)
            base = r * cols
            if part_first:
                for j in range(cols):
                    st(out, base + j, apply_binary(op, y, ld(full, base + j)))
            else:
                for j in range(cols):
                    st(out, base + j, apply_binary(op, ld(full, base + j), y))
    return kernel


def broadcast_rows(part_shape: tuple, shape: tuple) -> tuple[int, int] | None:
    """(period, cols) when an operand of `part_shape` broadcast to `shape` repeats as
    `broadcast_kernel` reads it: its dimensions that are not 1 are one contiguous block of
    `shape`'s (size `period`), with only broadcast dimensions after it (`cols` elements); None
    otherwise (it varies along dimensions apart from one another)."""
    part_shape = (1,) * (len(shape) - len(part_shape)) + tuple(part_shape)
    kept = [d for d, (p, n) in enumerate(zip(part_shape, shape)) if p == n and n != 1]
    if kept and any(part_shape[d] == 1 and shape[d] != 1 for d in range(kept[0], kept[-1] + 1)):
        return None
    last = kept[-1] + 1 if kept else 0
    return math.prod(shape[d] for d in kept), math.prod(shape[last:])


def _cycles(table):
    half = {code: cost[0] if isinstance(cost, tuple) else cost for code, cost, _ in table.values()}
    other = {code: cost[1] if isinstance(cost, tuple) else cost for code, cost, _ in table.values()}
    vectorised = {code: vec for code, _, vec in table.values()}

    def estimate(sizes, params, dtype, target):
        codes = params[:, 0].astype(np.int64)
        full = 4 if dtype == np.float16 else 2 if dtype == np.float32 else 1
        width = np.where(lookup(vectorised, codes), full, 1)
        costs = lookup(half if dtype == np.float16 else other, codes)
        return target.thread_cycles(np.ceil(sizes["out"] / width) * costs + 6)
    return estimate


UNARY_VERTEX = VertexType("popops::UnaryOp", ("x",), ("out",), unary_codelet, _cycles(UNARY), num_params=3)
BINARY_VERTEX = VertexType("popops::BinaryOp", ("a", "b"), ("out",), binary_codelet, _cycles(BINARY), num_params=1)


def _kernel_output(target: np.ndarray | None, out: Tensor, *inputs: Tensor) -> np.ndarray:
    """Where a whole-tensor kernel writes `out`: its storage when that is contiguous and apart
    from the inputs' (the kernels read element i after writing element j < i; in the fast layout
    distinct variables never share storage, and a read that is not a view is a copy), else a new
    array."""
    if target is not None and target.flags.c_contiguous and all(t.var is not out.var for t in inputs):
        return target
    return np.empty(out.shape, out.dtype)


def _flat_operand(values: np.ndarray, shape: tuple) -> np.ndarray:
    """An operand's values as the contiguous flat array of `shape` a whole-tensor kernel reads
    (broadcast in full when its shape differs)."""
    if values.shape != shape:
        values = np.broadcast_to(values, shape)
    return np.ascontiguousarray(values).reshape(-1)


def _vertices(graph: Graph, cs, vertex_type, out: Tensor, operands: dict[str, Tensor], params: tuple) -> None:
    """One vertex per worker on every tile holding output elements."""
    work = region_work(out.tile_map(), graph.target.workers_per_tile, grain=4)
    fields = {k: work.field(t) for k, t in {**operands, "out": out}.items()}
    graph.addVertices(cs, vertex_type, work.tiles, fields, np.asarray(params, np.float64))


def unary(graph: Graph, op: str, x: Tensor, prog: Sequence, name: str | None = None, *,
          out_dtype=None, scale: float = 1.0, bias: float = 0.0, out: Tensor | None = None) -> Tensor:
    """out = op(x). `cast` converts to `out_dtype`; `scale` computes x * scale + bias; `fill`
    sets every element to `scale` (clearing an accumulator, whatever it held)."""
    if op not in UNARY:
        raise ValueError(f"unknown unary op {op!r}; known: {sorted(UNARY)}")
    name = name or op
    dtype = np.dtype(out_dtype) if out_dtype is not None else (np.dtype(np.bool_) if op in BOOL_UNARY else x.dtype)
    if out is None:
        out = new_output(graph, dtype, x.shape, name, like=x)
    elif out.shape != x.shape or out.dtype != dtype:
        raise ValueError(f"{name}: output {out.name!r} is {out.dtype.name}{out.shape}, expected {dtype.name}{x.shape}")
    code = UNARY[op][0]
    body = Sequence(name=name)
    xl = placed(graph, body, x, out.tile_map(), f"{name}/x")
    cs = graph.addComputeSet(name)
    _vertices(graph, cs, UNARY_VERTEX, out, {"x": xl}, (code, scale, bias))
    body.add(Execute(cs))

    exact = NUMPY_UNARY.get(op) if x.dtype.kind == "f" and out.dtype.kind == "f" else None
    kernel = unary_kernel(code) if exact is None else None

    def fast(io):
        target = io.output(out)
        if exact is not None:
            res = target if target is not None else np.empty(out.shape, dtype=out.dtype)
            exact(io.read(x), scale, bias, res)
        else:
            values = np.ascontiguousarray(io.read(x)).reshape(-1)
            res = _kernel_output(target, out, x)
            kernel(kernel_view(values), kernel_view(res.reshape(-1)), float(scale), float(bias))
        if res is not target:
            io.write(out, res)

    prog.add(OpProgram(name, body, fast, (x,), (out,)))
    return out


def binary(graph: Graph, op: str, a: Tensor, b: Tensor, prog: Sequence, name: str | None = None, *,
           out: Tensor | None = None) -> Tensor:
    """out = a op b with NumPy broadcasting (comparisons give bool)."""
    if op not in BINARY:
        raise ValueError(f"unknown binary op {op!r}; known: {sorted(BINARY)}")
    name = name or op
    if op == "nextafter" and a.dtype != np.float32:
        raise TypeError(f"{name}: nextafter steps between float32 values; {a.name!r} is {a.dtype.name}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: operands {a.name!r} ({a.dtype.name}) and {b.name!r} ({b.dtype.name}) "
                        "have different dtypes; cast one first")
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"{name}: shapes {a.shape} and {b.shape} do not broadcast") from None
    dtype = np.dtype(np.bool_) if op in COMPARISONS else a.dtype
    if out is None:
        out = new_output(graph, dtype, shape, name, like=a if a.shape == shape else b)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"{name}: output {out.name!r} is {out.dtype.name}{out.shape}, expected {dtype.name}{shape}")
    code = BINARY[op][0]
    body = Sequence(name=name)
    tiles = out.tile_map()
    al = placed(graph, body, a.broadcast(shape), tiles, f"{name}/a")
    bl = placed(graph, body, b.broadcast(shape), tiles, f"{name}/b")
    cs = graph.addComputeSet(name)
    _vertices(graph, cs, BINARY_VERTEX, out, {"a": al, "b": bl}, (code,))
    body.add(Execute(cs))

    exact = NUMPY_BINARY.get(op) if a.dtype.kind == "f" or op in COMPARISONS else None
    kernel = binary_kernel(code) if exact is None else None
    # a float operand that repeats along the other (a bias): NumPy's broadcasting loop is slow
    part_first = b.shape == shape and a.shape != shape
    rows = (broadcast_rows((a if part_first else b).shape, shape)
            if dtype.kind == "f" and op in ARITHMETIC and (a.shape == shape) != (b.shape == shape)
            and math.prod(shape) else None)
    repeat = broadcast_kernel(code) if rows is not None else None

    def fast(io):
        target = io.output(out)
        if repeat is not None:
            full, part = (io.read(b), io.read(a)) if part_first else (io.read(a), io.read(b))
            res = _kernel_output(target, out, a, b)
            repeat(kernel_view(np.ascontiguousarray(full).reshape(-1)),
                   kernel_view(np.ascontiguousarray(part).reshape(-1)), *rows, part_first,
                   kernel_view(res.reshape(-1)))
        elif exact is not None:
            res = exact(io.read(a), io.read(b), out=target)
        else:
            x, y = _flat_operand(io.read(a), shape), _flat_operand(io.read(b), shape)
            res = _kernel_output(target, out, a, b)
            kernel(kernel_view(x), kernel_view(y), kernel_view(res.reshape(-1)))
        if res is not target:
            io.write(out, res)

    prog.add(OpProgram(name, body, fast, (a, b), (out,)))
    return out


def add(graph, a, b, prog, name="add"):
    return binary(graph, "add", a, b, prog, name)


def sub(graph, a, b, prog, name="sub"):
    return binary(graph, "sub", a, b, prog, name)


def mul(graph, a, b, prog, name="mul"):
    return binary(graph, "mul", a, b, prog, name)


def div(graph, a, b, prog, name="div"):
    return binary(graph, "div", a, b, prog, name)


def cast(graph, x, dtype, prog, name="cast"):
    return unary(graph, "cast", x, prog, name, out_dtype=dtype)


def scale(graph, x, factor, prog, name="scale", bias=0.0):
    return unary(graph, "scale", x, prog, name, scale=factor, bias=bias)
