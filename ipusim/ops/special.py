"""Special functions of the elementwise ops, as scalar float64 Numba functions (codelet and
whole-tensor kernel call the same ones, so both modes give the same bits).

Each follows torch's conventions at the edges of its domain (nan outside it, +-inf at its poles)
and is accurate to about 1e-12 relative where its result is a normal float64 (the tests compare
with torch in float64). The methods: power series where they converge without cancellation,
asymptotic expansions (stopped at their smallest term) for large arguments, Euler-Maclaurin
summation for the Hurwitz zeta function (and so the polygamma functions), the series and Lentz's
continued fraction for the regularised incomplete gamma functions, the three-term recurrences
for the orthogonal polynomials (with the closed trigonometric forms torch uses for high degrees
inside [-1, 1]).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..device.kernels import JIT

EULER = 0.5772156649015329
SQRT_PI = 1.7724538509055159
SQRT2 = 1.4142135623730951
# B_2k / (2k)! for k = 1..12: the Euler-Maclaurin corrections of the zeta function
BERNOULLI_OVER_FACTORIAL = np.array([
    1.0 / 12, -1.0 / 720, 1.0 / 30240, -1.0 / 1209600, 1.0 / 47900160, -691.0 / 1307674368000,
    1.0 / 74724249600, -3617.0 / 10670622842880000, 43867.0 / 5109094217170944000,
    -174611.0 / 802857662698291200000, 77683.0 / 14101100039391805440000,
    -236364091.0 / 1693824136731743669452800000])


# ---- the error function --------------------------------------------------------------------------
@njit(**JIT)
def erfcx(x):
    """exp(x^2) erfc(x): the continued fraction (Lentz) for x > 2, where erfc underflows long
    before the product does; the direct product below."""
    if x != x:
        return x
    if x < 2.0:
        if x < -26.7:
            return np.inf
        return math.exp(x * x) * math.erfc(x)
    if x > 1e8:
        return 1.0 / (SQRT_PI * x)
    # erfc(x) exp(x^2) = (1 / sqrt(pi)) / (x + (1/2) / (x + 1 / (x + (3/2) / (x + 2 / (x + ...)))))
    tiny = 1e-300
    f = x
    c = x
    d = 0.0
    for k in range(1, 200):
        a = 0.5 * k
        d = x + a * d
        d = tiny if d == 0.0 else d
        c = x + a / c
        c = tiny if c == 0.0 else c
        d = 1.0 / d
        delta = c * d
        f *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return 1.0 / (SQRT_PI * f)


@njit(**JIT)
def ndtri(p):
    """The inverse of the standard normal CDF: sqrt(2) erfinv(2p - 1) refined by Newton steps on
    Phi (from erfc, accurate in both tails)."""
    if p != p or p < 0.0 or p > 1.0:
        return np.nan
    if p == 0.0:
        return -np.inf
    if p == 1.0:
        return np.inf
    if p == 0.5:
        return 0.0
    # a first guess from the tail form or the central form, then Newton on Phi(y) = p
    q = min(p, 1.0 - p)
    t = math.sqrt(-2.0 * math.log(q))
    y = t - (2.515517 + 0.802853 * t + 0.010328 * t * t) / (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t ** 3)
    y = -y if p < 0.5 else y
    for _ in range(6):
        cdf = 0.5 * math.erfc(-y / SQRT2)
        pdf = math.exp(-0.5 * y * y) / (SQRT2 * SQRT_PI)
        if pdf == 0.0:
            break
        # relative to the smaller tail, so tiny p keeps its precision
        if y < 0:
            step = (cdf - p) / pdf
        else:
            step = ((1.0 - p) - 0.5 * math.erfc(y / SQRT2)) / pdf
        y -= step
        if abs(step) < 1e-15 * max(1.0, abs(y)):
            break
    return y


# ---- Bessel functions ----------------------------------------------------------------------------
@njit(**JIT)
def _bessel_i_series(nu, x):
    """I_nu(x) for nu = 0 or 1 by its power series (positive terms)."""
    q = 0.25 * x * x
    term = 1.0 if nu == 0 else 0.5 * x
    total = term
    k = 0
    while True:
        k += 1
        term *= q / (k * (k + nu))
        total += term
        if term <= 1e-17 * total:
            return total


@njit(**JIT)
def _bessel_i_scaled_asymptotic(nu, x):
    """exp(-x) I_nu(x) for large x: 1 / sqrt(2 pi x) * sum_k (-1)^k a_k(nu) / x^k."""
    mu = 4.0 * nu * nu
    term = 1.0
    total = 1.0
    for k in range(1, 60):
        new = -term * (mu - (2 * k - 1) ** 2) / (k * 8.0 * x)
        if abs(new) > abs(term):
            break
        term = new
        total += term
        if abs(term) < 1e-17 * abs(total):
            break
    return total / math.sqrt(2.0 * math.pi * x)


@njit(**JIT)
def bessel_i(nu, x, scaled):
    """I_nu(x) (nu = 0 or 1), times exp(-|x|) when `scaled`."""
    if x != x:
        return x
    ax = abs(x)
    sign = -1.0 if (nu == 1 and x < 0) else 1.0
    if ax == np.inf:
        return sign * 0.0 if scaled else np.nan   # torch's: exp(inf) times its series' 0
    if ax > 30.0:
        if not scaled and ax > 713.0:
            return sign * np.inf
        s = _bessel_i_scaled_asymptotic(nu, ax)
        return sign * (s if scaled else s * math.exp(ax))
    v = _bessel_i_series(nu, ax)
    return sign * (v * math.exp(-ax) if scaled else v)


@njit(**JIT)
def _psi_pair_series(q):
    """sum over k >= 0 of (psi(k + 1) + psi(k + 2)) q^k / (k! (k + 1)!): the series of the
    order-1 Bessel functions of the second kind (K1 with q = x^2/4, Y1 with q = -x^2/4)."""
    term = 1.0
    psi1 = -EULER
    psi2 = 1.0 - EULER
    series = psi1 + psi2
    for k in range(1, 200):
        term *= q / (k * (k + 1))
        psi1 += 1.0 / k
        psi2 += 1.0 / (k + 1)
        series += term * (psi1 + psi2)
        if abs(term) * (psi1 + psi2) < 1e-17 * max(abs(series), 1e-300) and k > 2:
            break
    return series


@njit(**JIT)
def bessel_k(nu, x, scaled):
    """K_nu(x) (nu = 0 or 1), times exp(x) when `scaled`: the series below 2 (where the
    logarithmic term cancels little), the asymptotic expansion above 12, and between them the
    recurrence-free integral representation K_nu(x) = int_0^inf exp(-x cosh t) cosh(nu t) dt."""
    if x != x:
        return x
    if x < 0.0:
        return np.nan
    if x == 0.0:
        return np.inf
    if x > 12.0:
        mu = 4.0 * nu * nu
        term = 1.0
        total = 1.0
        for k in range(1, 60):
            new = term * (mu - (2 * k - 1) ** 2) / (k * 8.0 * x)
            if abs(new) > abs(term):
                break
            term = new
            total += term
            if abs(term) < 1e-17 * abs(total):
                break
        s = total * math.sqrt(math.pi / (2.0 * x))
        return s if scaled else s * math.exp(-x)
    if x <= 2.0:
        q = 0.25 * x * x
        log_half = math.log(0.5 * x)
        if nu == 0:   # K0 = -(log(x/2) + gamma) I0 + sum q^k / (k!)^2 H_k
            term = 1.0
            harmonic = 0.0
            total = -(log_half + EULER)
            for k in range(1, 60):
                term *= q / (k * k)
                harmonic += 1.0 / k
                total += term * (harmonic - log_half - EULER)
                if term * (harmonic + abs(log_half) + 1.0) < 1e-17 * abs(total):
                    break
        else:         # K1 = 1/x + log(x/2) I1 - (x/4) sum (psi(k+1) + psi(k+2)) q^k / (k! (k+1)!)
            total = 1.0 / x + log_half * _bessel_i_series(1, x) - 0.25 * x * _psi_pair_series(q)
        return total * math.exp(x) if scaled else total
    # 2 < x <= 12: the integral by the trapezoidal rule (exponentially convergent for this integrand)
    h = 0.05
    total = 0.5 * math.exp(-x + x if scaled else -x)
    t = h
    while True:
        e = math.exp(-x * math.cosh(t) + (x if scaled else 0.0))
        f = e * (math.cosh(nu * t) if nu else 1.0)
        total += f
        if f <= 1e-18 * total:
            break
        t += h
    return total * h


@njit(**JIT)
def _bessel_jy_asymptotic(nu, x):
    """(J_nu(x), Y_nu(x)) for large x by Hankel's expansion."""
    mu = 4.0 * nu * nu
    p = 1.0
    q = 0.0
    term = 1.0
    for k in range(1, 60):
        new = term * (mu - (2 * k - 1) ** 2) / (k * 8.0 * x)
        if abs(new) > abs(term) and k > 2:
            break
        term = new
        if k % 2 == 1:
            q += term if (k // 2) % 2 == 0 else -term
        else:
            p += -term if (k // 2) % 2 == 1 else term
        if abs(term) < 1e-17:
            break
    chi = x - (0.5 * nu + 0.25) * math.pi
    scale = math.sqrt(2.0 / (math.pi * x))
    return scale * (p * math.cos(chi) - q * math.sin(chi)), scale * (p * math.sin(chi) + q * math.cos(chi))


JY_ASYMPTOTIC = 12.0   # where the power series' cancellation (~1e-13 there) meets Hankel's error (~1e-11)


@njit(**JIT)
def bessel_j(nu, x):
    """J_nu(x) (nu = 0 or 1): the power series up to 12, Hankel's expansion beyond."""
    if x != x:
        return x
    ax = abs(x)
    sign = -1.0 if (nu == 1 and x < 0) else 1.0
    if ax == np.inf:
        return np.nan   # as torch
    if ax > JY_ASYMPTOTIC:
        return sign * _bessel_jy_asymptotic(nu, ax)[0]
    q = -0.25 * ax * ax
    term = 1.0 if nu == 0 else 0.5 * ax
    total = term
    for k in range(1, 200):
        term *= q / (k * (k + nu))
        total += term
        if abs(term) < 1e-17 * max(abs(total), 1e-300) and k > 2:
            break
    return sign * total


@njit(**JIT)
def bessel_y(nu, x):
    """Y_nu(x) (nu = 0 or 1) for x > 0: the series with its logarithmic term up to 12, Hankel's
    expansion beyond; -inf at 0, nan below."""
    if x != x:
        return x
    if x < 0.0:
        return np.nan
    if x == 0.0:
        return -np.inf
    if x == np.inf:
        return np.nan   # as torch
    if x > JY_ASYMPTOTIC:
        return _bessel_jy_asymptotic(nu, x)[1]
    q = -0.25 * x * x
    log_half = math.log(0.5 * x)
    if nu == 0:   # Y0 = (2/pi) [(log(x/2) + gamma) J0 - sum (-q)^k... H_k]
        term = 1.0
        harmonic = 0.0
        total = 0.0
        for k in range(1, 200):
            term *= q / (k * k)
            harmonic += 1.0 / k
            total -= term * harmonic
            if abs(term) * harmonic < 1e-17 * max(abs(total), 1e-300) and k > 2:
                break
        return (2.0 / math.pi) * ((log_half + EULER) * bessel_j(0, x) + total)
    # Y1 = -2/(pi x) + (2/pi) log(x/2) J1 - (x/(2 pi)) sum (psi(k+1) + psi(k+2)) (-q)^k... / (k!(k+1)!)
    return (-2.0 / (math.pi * x) + (2.0 / math.pi) * log_half * bessel_j(1, x)
            - x / (2.0 * math.pi) * _psi_pair_series(q))


@njit(**JIT)
def spherical_bessel_j0(x):
    if x != x:
        return x
    if abs(x) == np.inf:
        return 0.0
    if abs(x) < 0.5:
        x2 = x * x
        return 1.0 - x2 / 6.0 * (1.0 - x2 / 20.0 * (1.0 - x2 / 42.0 * (1.0 - x2 / 72.0 * (1.0 - x2 / 110.0))))
    return math.sin(x) / x


AIRY_C1 = 0.3550280538878172    # Ai(0)
AIRY_C2 = 0.2588194037928068    # -Ai'(0)


@njit(**JIT)
def airy_ai(x):
    """Ai(x): the Maclaurin series f and g (Ai = c1 f - c2 g) for -10 <= x <= 5, the asymptotic
    expansions beyond (exponentially small for x > 5, oscillating for x < -10)."""
    if x != x or abs(x) == np.inf:
        return np.nan   # as torch
    if x > 5.0 or x < -10.0:
        ax = abs(x)
        zeta = 2.0 / 3.0 * ax ** 1.5
        # u_k = (6k-5)(6k-3)(6k-1) / (216 k (2k-1)) u_{k-1}
        u = 1.0
        even = 1.0
        odd = 0.0
        alt = 1.0
        for k in range(1, 40):
            new = u * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / (216.0 * k * (2 * k - 1) * zeta)
            if abs(new) > abs(u):
                break
            u = new
            if x > 0:
                alt = -alt
                even += alt * u
            elif k % 2 == 0:
                even += u if (k // 2) % 2 == 0 else -u
            else:
                odd += u if (k // 2) % 2 == 0 else -u
            if abs(u) < 1e-17:
                break
        if x > 0:
            return math.exp(-zeta) / (2.0 * SQRT_PI * ax ** 0.25) * even
        theta = zeta + 0.25 * math.pi
        return (math.sin(theta) * even - math.cos(theta) * odd) / (SQRT_PI * ax ** 0.25)
    x3 = x * x * x
    f = 1.0
    g = x
    tf = 1.0
    tg = x
    for k in range(1, 200):
        tf *= x3 / ((3 * k - 1) * (3 * k))
        tg *= x3 / ((3 * k) * (3 * k + 1))
        f += tf
        g += tg
        if abs(tf) < 1e-18 * abs(f) and abs(tg) < 1e-18 * max(abs(g), 1e-300):
            break
    return AIRY_C1 * f - AIRY_C2 * g


@njit(**JIT)
def digamma(x):
    """psi(x): reflection below 1/2, the recurrence up to 6, then the asymptotic series; -inf at 0
    and nan at the negative integers, as torch."""
    if x == 0.0:
        return math.copysign(np.inf, -x)
    reflect = 0.0
    if x < 0.5:
        if x == math.floor(x):
            return np.nan
        reflect = -math.pi / math.tan(math.pi * x)
        x = 1.0 - x
    acc = 0.0
    while x < 6.0:
        acc -= 1.0 / x
        x += 1.0
    f = 1.0 / (x * x)
    series = f * (-1.0 / 12 + f * (1.0 / 120 + f * (-1.0 / 252 + f * (1.0 / 240 + f * (-1.0 / 132)))))
    return reflect + acc + math.log(x) - 0.5 / x + series


# ---- zeta, polygamma, incomplete gamma --------------------------------------------------------------
@njit(**JIT)
def zeta(s, q):
    """The Hurwitz zeta function sum_k (q + k)^-s (s > 1): direct terms until q + k >= 10 (and at
    least 10 of them), then Euler-Maclaurin's tail; inf at s = 1 and at non-positive integer q,
    nan for s < 1 and for negative q with a non-integer s."""
    if s == 1.0:   # the tests in Cephes' order, as torch, so nan and inf arguments give torch's results
        return np.inf
    if s < 1.0:
        return np.nan
    if q <= 0.0:
        if q == math.floor(q):
            return np.inf
        if s != math.floor(s):
            return np.nan
    if s != s or q != q or q == np.inf:
        return np.nan
    if s == np.inf:   # only the terms (q + k)^-s with q + k <= 1 survive
        return np.inf if q < 1.0 else (1.0 if q == 1.0 else np.nan)
    total = 0.0
    a = q
    n = 0
    while n < 10 or a < 10.0:
        total += a ** -s
        a += 1.0
        n += 1
    # tail: a^(1-s)/(s-1) + a^-s/2 + sum_j B_2j/(2j)! s(s+1)..(s+2j-2) a^(-s-2j+1)
    tail = a ** (1.0 - s) / (s - 1.0) + 0.5 * a ** -s
    rising = s
    power = a ** (-s - 1.0)
    for j in range(BERNOULLI_OVER_FACTORIAL.size):
        term = BERNOULLI_OVER_FACTORIAL[j] * rising * power
        tail += term
        if abs(term) < 1e-17 * abs(total + tail):
            break
        rising *= (s + 2 * j + 1) * (s + 2 * j + 2)
        power /= a * a
    return total + tail


@njit(**JIT)
def polygamma(n, x):
    """The n-th derivative of digamma: digamma itself for n = 0, else
    (-1)^(n+1) n! zeta(n + 1, x)."""
    if n == 0:
        return digamma(x)
    if x != x:
        return x
    if n == 1 and abs(x) == np.inf:   # torch's trigamma: 0 at inf, nan at -inf
        return 0.0 if x > 0 else np.nan
    sign = 1.0 if n % 2 == 1 else -1.0
    return sign * math.exp(math.lgamma(n + 1.0)) * zeta(n + 1.0, x)


@njit(**JIT)
def _gamma_series(a, x):
    """The regularised lower incomplete gamma P(a, x) by its series (x < a + 1)."""
    term = 1.0 / a
    total = term
    ap = a
    for _ in range(1000):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < 1e-17 * abs(total):
            break
    return total * math.exp(a * math.log(x) - x - math.lgamma(a))


@njit(**JIT)
def _gamma_fraction(a, x):
    """The regularised upper incomplete gamma Q(a, x) by Lentz's continued fraction (x >= a + 1)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(a * math.log(x) - x - math.lgamma(a)) * h


@njit(**JIT)
def igamma(a, x, upper):
    """torch.igamma (P, the regularised lower incomplete gamma) or torch.igammac (Q = 1 - P)
    when `upper`, with torch's edge cases."""
    if x < 0.0 or a < 0.0:   # the tests in torch's order (a nan argument falls through to nan)
        return np.nan
    if a == 0.0:
        return (0.0 if upper else 1.0) if x > 0.0 else np.nan
    if x == 0.0:
        return 1.0 if upper else 0.0
    if a == np.inf:
        if x == np.inf:
            return np.nan
        return 1.0 if upper else 0.0
    if x == np.inf:
        return 0.0 if upper else 1.0
    if a != a or x != x:
        return np.nan
    if x < a + 1.0:
        p = _gamma_series(a, x)
        return 1.0 - p if upper else p
    q = _gamma_fraction(a, x)
    return q if upper else 1.0 - q


# ---- orthogonal polynomials (torch.special.*_polynomial_*(x, n)) --------------------------------------
@njit(**JIT)
def _recurrence(x, n, p, q, a, b):
    """Terms of p_{k+1} = a(x) p_k - b p_{k-1} from p_0 = p, p_1 = q, up to p_n."""
    for _ in range(2, n + 1):
        p, q = q, a * q - b * p
    return q


@njit(**JIT)
def polynomial(kind, x, nf):
    """The orthogonal polynomial `kind` of degree n = trunc(nf) at x (0 for n < 0), as torch:
    0 Chebyshev T, 1 U, 2 V, 3 W, 4-7 the shifted Chebyshev T, U, V, W (at 2x - 1), 8 Hermite H
    (physicists'), 9 Hermite He (probabilists'), 10 Laguerre L, 11 Legendre P."""
    if not -1.0 < nf < 9.2e18:   # negative, nan and beyond int64 (torch's conversion of these is negative): 0
        return 0.0
    n = np.int64(nf)
    if n == 0:   # even at nan, as torch
        return 1.0
    if x != x:
        return np.nan
    if kind >= 4 and kind <= 7:
        kind -= 4
        x = x + x - 1.0
    if kind <= 3:
        if abs(x) == 1.0:
            if kind == 0:
                return 1.0 if (x > 0 or n % 2 == 0) else -1.0
            if kind == 1:
                return n + 1.0 if (x > 0 or n % 2 == 0) else -(n + 1.0)
            if kind == 2:
                return 1.0 if x > 0 else (n + n + 1.0 if n % 2 == 0 else -(n + n + 1.0))
            return n + n + 1.0 if x > 0 else (1.0 if n % 2 == 0 else -1.0)
        if abs(x) < 1.0 and n > (6 if kind == 0 else 8):
            t = math.acos(x)
            if kind == 0:
                return math.cos(n * t)
            if kind == 1:
                s = math.sin(t)
                return math.sin((n + 1) * t) / s if s != 0.0 else (n + 1) * math.cos((n + 1) * t) / x
            if kind == 2:
                return math.cos((n + 0.5) * t) / math.cos(0.5 * t)
            return math.sin((n + 0.5) * t) / math.sin(0.5 * t)
        if n == 0:
            return 1.0
        first = (x, x + x, x + x - 1.0, x + x + 1.0)[kind]
        return first if n == 1 else _recurrence(x, n, 1.0, first, x + x, 1.0)
    if n == 0:
        return 1.0
    if kind == 8:     # H_{k+1} = 2x H_k - 2k H_{k-1}
        p, q = 1.0, x + x
        for k in range(1, n):
            p, q = q, (x + x) * q - 2.0 * k * p
        return q
    if kind == 9:     # He_{k+1} = x He_k - k He_{k-1}
        p, q = 1.0, x
        for k in range(1, n):
            p, q = q, x * q - k * p
        return q
    if kind == 10:    # (k+1) L_{k+1} = (2k + 1 - x) L_k - k L_{k-1}
        if x == 0.0:
            return 1.0
        p, q = 1.0, 1.0 - x
        for k in range(1, n):
            p, q = q, ((2 * k + 1 - x) * q - k * p) / (k + 1)
        return q
    # (k+1) P_{k+1} = (2k + 1) x P_k - k P_{k-1}
    if abs(x) == 1.0:
        return 1.0 if (x > 0 or n % 2 == 0) else -1.0
    p, q = 1.0, x
    for k in range(1, n):
        p, q = q, ((2 * k + 1) * x * q - k * p) / (k + 1)
    return q
