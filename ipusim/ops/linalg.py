"""Dense linear algebra on batches of small matrices: LU, Cholesky, Householder QR, triangular
solves, symmetric eigendecomposition, SVD and the matrix exponential.

A batch is a tensor [..., m, n]: every leading axis is a batch axis. Each matrix lives on one
tile: `rows.plan_rows` spreads the matrices (the rows of the [batch, m * n] view) over the tiles in
blocks, each block's operands come to its tile with one exchange, its results are mapped there,
and a block's matrices are split over the tile's workers, one vertex per piece, each running the
factorisation of its matrices one after the other. A matrix larger than a tile's memory is an
out-of-memory report of the compile, as for any op.

Every algorithm runs in float64 on the matrix loaded from its tile and rounds its results once to
the tensor's dtype; the fast mode runs the same routine on every matrix of the batch, so both
modes give identical values. Conventions follow LAPACK's, as PyTorch returns them:

- `lu_factor`: partial pivoting (the first largest magnitude of the column, as `idamax`), pivots
  1-based as `getrf`'s, `info` the first zero pivot (1-based, 0 when none); without pivoting the
  pivots are 1..k.
- `cholesky`: the lower factor; `info` the first order whose minor is not positive definite.
- `ldl_factor`: Bunch-Kaufman pivoting as LAPACK's sytf2 (lower): pivots 1-based, a 2 x 2 block's
  both entries the negated row it swapped; `ldl_solve` is sytrs on that form.
- `geqrf`: Householder reflectors as `dlarfg` makes them (beta = -sign(alpha) * norm, tau = 0
  for a column already zero below the diagonal), so R's diagonal has LAPACK's signs;
  `householder_product` is `orgqr`'s product H_1 ... H_k of the first n columns.
- `eigh`: ascending eigenvalues; `svd`: descending singular values. Their vectors come from
  Jacobi rotations (cyclic two-sided for eigh, one-sided Hestenes for SVD), each vector's sign
  chosen so that its component of largest magnitude is positive: LAPACK's signs (from its
  tridiagonal and bidiagonal QR iterations) are not reproduced, so the vectors match PyTorch's up
  to sign; everything invariant to the signs (eigenvalues, singular values, projectors, inverses)
  matches.
- `matrix_exp`: scaling and squaring with a Taylor series to float64 accuracy.

Cycles per vertex (one worker, one matrix after another): the flops of each algorithm at one
float32 multiply-add pair per instruction (FLOPS_PER_INSTRUCTION = 2), plus per column a pivot
search, a division and a square root (COLUMN_INSTRUCTIONS). Flop counts: LU m n k - (m + n) k^2 / 2
+ k^3 / 3 (2/3 n^3 square); Cholesky n^3 / 3; triangular solve n^2 r; Householder QR 2 m n^2 -
2 n^3 / 3 (4/3 n^3 square) and as much again to form Q; symmetric Jacobi SWEEPS sweeps of
n (n - 1) / 2 rotations, 8 n flops each (two-sided, with the vectors); one-sided Jacobi SVD SWEEPS
sweeps of n (n - 1) / 2 rotations, 10 m + 4 n flops each (three dot products, the rotation of U and
of V); the matrix exponential ceil(log2 |A|_1) + 2 squarings and TAYLOR_TERMS products, 2 n^3
flops each. SWEEPS = 8: cyclic Jacobi converges quadratically, and 6 to 10 sweeps are usual for
float64 accuracy at the sizes a tile holds.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from .rows import RowBlocks, plan_rows

FLOPS_PER_INSTRUCTION = 2
COLUMN_INSTRUCTIONS = 40
SWEEPS = 8
TAYLOR_TERMS = 18
MAX_SWEEPS = 60          # the Jacobi iterations stop here even if not converged (NaN input)


# =========================================================================================
# The algorithms (float64, one matrix)
# =========================================================================================
@njit(**JIT)
def lu_inplace(a, piv, pivot):
    """LU of the m x n matrix `a` in place (unit lower L below the diagonal, U on and above it),
    rows swapped as LAPACK's getf2 does; piv gets the 1-based pivot rows. Returns info."""
    m, n = a.shape
    info = 0
    for j in range(min(m, n)):
        p = j
        if pivot:
            best = -1.0
            for i in range(j, m):
                v = abs(a[i, j])
                if v > best:
                    best, p = v, i
        piv[j] = p + 1
        if a[p, j] != 0.0:
            if p != j:
                for c in range(n):
                    a[j, c], a[p, c] = a[p, c], a[j, c]
            d = a[j, j]
            for i in range(j + 1, m):
                a[i, j] /= d
        elif info == 0:
            info = j + 1
        for i in range(j + 1, m):
            f = a[i, j]
            if f != 0.0:
                for c in range(j + 1, n):
                    a[i, c] -= f * a[j, c]
    return info


@njit(**JIT)
def cholesky_inplace(a):
    """The lower Cholesky factor of the symmetric matrix whose lower triangle is `a`, in place
    (the strict upper triangle zeroed). Returns info: the first order (1-based) that is not
    positive definite, 0 when none; from there on the factor is left as it was reached."""
    n = a.shape[0]
    for i in range(n):
        for j in range(i + 1, n):
            a[i, j] = 0.0
    for j in range(n):
        d = a[j, j]
        for k in range(j):
            d -= a[j, k] * a[j, k]
        if not d > 0.0:
            a[j, j] = d
            return j + 1
        d = math.sqrt(d)
        a[j, j] = d
        for i in range(j + 1, n):
            s = a[i, j]
            for k in range(j):
                s -= a[i, k] * a[j, k]
            a[i, j] = s / d
    return 0


LDL_ALPHA = (1.0 + math.sqrt(17.0)) / 8.0


@njit(**JIT)
def _first_largest(values):
    best, at = -1.0, 0
    for i in range(values.shape[0]):
        if abs(values[i]) > best:
            best, at = abs(values[i]), i
    return at


@njit(**JIT)
def ldl_inplace(a, piv):
    """Bunch-Kaufman LDL^T of the symmetric matrix whose lower triangle is `a`, in place, as
    LAPACK's sytf2 with uplo 'L': L below the diagonal (unit diagonal implied), D's 1 x 1 and 2 x 2
    blocks on and below the diagonal; piv 1-based, a 2 x 2 block's two entries -(row swapped).
    Returns info (the first zero block, 1-based, 0 when none); the strict upper triangle zeroed."""
    n = a.shape[0]
    for i in range(n):
        for j in range(i + 1, n):
            a[i, j] = 0.0
    info = 0
    k = 0
    while k < n:
        step = 1
        absakk = abs(a[k, k])
        imax, colmax = k, 0.0
        if k < n - 1:
            imax = k + 1 + _first_largest(a[k + 1:, k])
            colmax = abs(a[imax, k])
        if max(absakk, colmax) == 0.0 or absakk != absakk:
            if info == 0:
                info = k + 1
            kp = k
        else:
            if absakk >= LDL_ALPHA * colmax:
                kp = k
            else:
                jmax = k + _first_largest(a[imax, k:imax])
                rowmax = abs(a[imax, jmax])
                if imax < n - 1:
                    jmax = imax + 1 + _first_largest(a[imax + 1:, imax])
                    rowmax = max(rowmax, abs(a[jmax, imax]))
                if absakk >= LDL_ALPHA * colmax * (colmax / rowmax):
                    kp = k
                elif abs(a[imax, imax]) >= LDL_ALPHA * rowmax:
                    kp = imax
                else:
                    kp = imax
                    step = 2
            kk = k + step - 1
            if kp != kk:
                for i in range(kp + 1, n):
                    a[i, kk], a[i, kp] = a[i, kp], a[i, kk]
                for j in range(kk + 1, kp):
                    a[j, kk], a[kp, j] = a[kp, j], a[j, kk]
                a[kk, kk], a[kp, kp] = a[kp, kp], a[kk, kk]
                if step == 2:
                    a[k + 1, k], a[kp, k] = a[kp, k], a[k + 1, k]
            if step == 1:
                if k < n - 1:
                    d11 = 1.0 / a[k, k]
                    for j in range(k + 1, n):
                        f = d11 * a[j, k]
                        for i in range(j, n):
                            a[i, j] -= f * a[i, k]
                    for i in range(k + 1, n):
                        a[i, k] *= d11
            elif k < n - 2:
                d21 = a[k + 1, k]
                d11 = a[k + 1, k + 1] / d21
                d22 = a[k, k] / d21
                t = 1.0 / (d11 * d22 - 1.0)
                d21 = t / d21
                for j in range(k + 2, n):
                    wk = d21 * (d11 * a[j, k] - a[j, k + 1])
                    wkp1 = d21 * (d22 * a[j, k + 1] - a[j, k])
                    for i in range(j, n):
                        a[i, j] -= a[i, k] * wk + a[i, k + 1] * wkp1
                    a[j, k] = wk
                    a[j, k + 1] = wkp1
        if step == 1:
            piv[k] = kp + 1
        else:
            piv[k] = -(kp + 1)
            piv[k + 1] = -(kp + 1)
        k += step
    return info


@njit(**JIT)
def ldl_solve_inplace(a, piv, b):
    """Solve A X = B in place of b from sytf2's lower factors `a` and pivots (LAPACK's sytrs)."""
    n, r = b.shape
    k = 0
    while k < n:
        if piv[k] > 0:
            kp = piv[k] - 1
            if kp != k:
                for c in range(r):
                    b[k, c], b[kp, c] = b[kp, c], b[k, c]
            for i in range(k + 1, n):
                for c in range(r):
                    b[i, c] -= a[i, k] * b[k, c]
            for c in range(r):
                b[k, c] /= a[k, k]
            k += 1
        else:
            kp = -piv[k] - 1
            if kp != k + 1:
                for c in range(r):
                    b[k + 1, c], b[kp, c] = b[kp, c], b[k + 1, c]
            for i in range(k + 2, n):
                for c in range(r):
                    b[i, c] -= a[i, k] * b[k, c] + a[i, k + 1] * b[k + 1, c]
            akm1k = a[k + 1, k]
            akm1 = a[k, k] / akm1k
            ak = a[k + 1, k + 1] / akm1k
            denom = akm1 * ak - 1.0
            for c in range(r):
                bkm1 = b[k, c] / akm1k
                bk = b[k + 1, c] / akm1k
                b[k, c] = (ak * bkm1 - bk) / denom
                b[k + 1, c] = (akm1 * bk - bkm1) / denom
            k += 2
    k = n - 1
    while k >= 0:
        if piv[k] > 0:
            for i in range(k + 1, n):
                for c in range(r):
                    b[k, c] -= a[i, k] * b[i, c]
            kp = piv[k] - 1
            if kp != k:
                for c in range(r):
                    b[k, c], b[kp, c] = b[kp, c], b[k, c]
            k -= 1
        else:
            for i in range(k + 1, n):
                for c in range(r):
                    b[k, c] -= a[i, k] * b[i, c]
                    b[k - 1, c] -= a[i, k - 1] * b[i, c]
            kp = -piv[k] - 1
            if kp != k:
                for c in range(r):
                    b[k, c], b[kp, c] = b[kp, c], b[k, c]
            k -= 2


@njit(**JIT)
def triangular_solve_inplace(a, b, upper, unit):
    """Solve a x = b for x in place of the n x r matrix b, `a` n x n upper or lower triangular
    (only that triangle read), with a unit diagonal when `unit`."""
    n, r = b.shape
    if upper:
        for i in range(n - 1, -1, -1):
            for c in range(r):
                s = b[i, c]
                for k in range(i + 1, n):
                    s -= a[i, k] * b[k, c]
                b[i, c] = s if unit else s / a[i, i]
    else:
        for i in range(n):
            for c in range(r):
                s = b[i, c]
                for k in range(i):
                    s -= a[i, k] * b[k, c]
                b[i, c] = s if unit else s / a[i, i]


@njit(**JIT)
def geqrf_inplace(a, tau):
    """Householder QR in place as LAPACK's geqr2: R on and above the diagonal, reflector j's
    vector (implicit 1 first) below it, its scale in tau[j]."""
    m, n = a.shape
    for j in range(min(m, n)):
        alpha = a[j, j]
        xnorm = 0.0
        for i in range(j + 1, m):
            xnorm = math.hypot(xnorm, a[i, j])
        if xnorm == 0.0:
            tau[j] = 0.0
            continue
        beta = -math.copysign(math.hypot(alpha, xnorm), alpha)
        tau[j] = (beta - alpha) / beta
        scale = 1.0 / (alpha - beta)
        for i in range(j + 1, m):
            a[i, j] *= scale
        a[j, j] = beta
        t = tau[j]
        for c in range(j + 1, n):       # apply H = I - tau v v^T, v = [1, a[j+1:, j]]
            w = a[j, c]
            for i in range(j + 1, m):
                w += a[i, j] * a[i, c]
            w *= t
            a[j, c] -= w
            for i in range(j + 1, m):
                a[i, c] -= w * a[i, j]


@njit(**JIT)
def householder_product(v, tau, q):
    """q (m x n) = the first n columns of H_0 ... H_{k-1}, H_j = I - tau[j] v_j v_j^T with v_j
    column j of `v` below the diagonal and 1 on it (LAPACK's org2r)."""
    m, n = q.shape
    k = tau.shape[0]
    q[:, :] = 0.0
    for i in range(n):
        q[i, i] = 1.0
    for j in range(k - 1, -1, -1):
        t = tau[j]
        for c in range(j, n):
            w = q[j, c]
            for i in range(j + 1, m):
                w += v[i, j] * q[i, c]
            w *= t
            q[j, c] -= w
            for i in range(j + 1, m):
                q[i, c] -= w * v[i, j]


@njit(**JIT)
def _largest_positive(vectors, j):
    """Flip column j of `vectors` so that its component of largest magnitude is positive."""
    best, at = -1.0, 0
    for i in range(vectors.shape[0]):
        if abs(vectors[i, j]) > best:
            best, at = abs(vectors[i, j]), i
    if vectors[at, j] < 0.0:
        for i in range(vectors.shape[0]):
            vectors[i, j] = -vectors[i, j]


@njit(**JIT)
def rotate_columns(x, p, q, c, s):
    """Columns p and q of x turned by the plane rotation (c, s): x_p <- c x_p - s x_q, x_q <- s x_p + c x_q."""
    for k in range(x.shape[0]):
        xp, xq = x[k, p], x[k, q]
        x[k, p] = c * xp - s * xq
        x[k, q] = s * xp + c * xq


@njit(**JIT)
def eigh_inplace(a, w, vectors):
    """Eigenvalues (ascending, into w) and eigenvectors (columns of `vectors`) of the symmetric
    matrix `a` (both triangles read: symmetrise first), by cyclic Jacobi rotations."""
    n = a.shape[0]
    vectors[:, :] = 0.0
    for i in range(n):
        vectors[i, i] = 1.0
    for _ in range(MAX_SWEEPS):
        off, diag = 0.0, 0.0
        for p in range(n):
            diag += a[p, p] * a[p, p]
            for q in range(p + 1, n):
                off += a[p, q] * a[p, q]
        if not off > 1e-32 * diag:
            break
        for p in range(n - 1):
            for q in range(p + 1, n):
                apq = a[p, q]
                if apq == 0.0:
                    continue
                theta = (a[q, q] - a[p, p]) / (2.0 * apq)
                t = math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1.0))
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                rotate_columns(a, p, q, c, s)
                rotate_columns(a.T, p, q, c, s)   # the same rotation of rows p and q
                rotate_columns(vectors, p, q, c, s)
    d = np.empty(n)
    for i in range(n):
        d[i] = a[i, i]
    order = np.argsort(d, kind="mergesort")
    out = vectors.copy()
    for j in range(n):
        w[j] = d[order[j]]
        for i in range(n):
            vectors[i, j] = out[i, order[j]]
        _largest_positive(vectors, j)


@njit(**JIT)
def _complete_basis(u, k):
    """Columns k.. of the m x c matrix u made orthonormal to the ones before (Gram-Schmidt,
    twice, on the unit vectors in order, skipping those already spanned)."""
    m, cols = u.shape
    e = 0
    for j in range(k, cols):
        while True:
            x = np.zeros(m)
            x[e % m] = 1.0
            e += 1
            for _ in range(2):
                for c in range(j):
                    d = 0.0
                    for i in range(m):
                        d += u[i, c] * x[i]
                    for i in range(m):
                        x[i] -= d * u[i, c]
            norm = math.sqrt(np.sum(x * x))
            if norm > 1e-6 or e >= 2 * m + cols:
                break
        for i in range(m):
            u[i, j] = x[i] / norm if norm > 0.0 else 0.0


@njit(**JIT)
def svd_tall(a, s, u, v):
    """SVD of the m x n matrix a, m >= n, by one-sided Jacobi: a = u diag(s) v^T with s
    descending, u m x c (c = n, or m for the full basis: columns past n completed), v n x n."""
    m, n = a.shape
    w = a.copy()
    vv = np.zeros((n, n))
    for i in range(n):
        vv[i, i] = 1.0
    for _ in range(MAX_SWEEPS):
        rotated = False
        for p in range(n - 1):
            for q in range(p + 1, n):
                alpha = beta = gamma = 0.0
                for i in range(m):
                    alpha += w[i, p] * w[i, p]
                    beta += w[i, q] * w[i, q]
                    gamma += w[i, p] * w[i, q]
                if not abs(gamma) > 1e-15 * math.sqrt(alpha * beta):
                    continue
                rotated = True
                zeta = (beta - alpha) / (2.0 * gamma)
                t = math.copysign(1.0, zeta) / (abs(zeta) + math.sqrt(1.0 + zeta * zeta))
                c = 1.0 / math.sqrt(1.0 + t * t)
                sn = c * t
                rotate_columns(w, p, q, c, sn)
                rotate_columns(vv, p, q, c, sn)
        if not rotated:
            break
    norms = np.empty(n)
    for j in range(n):
        norms[j] = math.sqrt(np.sum(w[:, j] * w[:, j]))
    order = np.argsort(-norms, kind="mergesort")
    u[:, :] = 0.0
    rank = 0
    top = norms[order[0]] if n else 0.0
    for j in range(n):
        src = order[j]
        s[j] = norms[src]
        for i in range(n):
            v[i, j] = vv[i, src]
        if norms[src] > top * 1e-15 and norms[src] > 0.0:
            for i in range(m):
                u[i, j] = w[i, src] / norms[src]
            rank = j + 1
    _complete_basis(u, rank)
    for j in range(n):
        best, at = -1.0, 0
        for i in range(n):
            if abs(v[i, j]) > best:
                best, at = abs(v[i, j]), i
        if v[at, j] < 0.0:
            for i in range(n):
                v[i, j] = -v[i, j]
            if j < u.shape[1]:
                for i in range(m):
                    u[i, j] = -u[i, j]


@njit(**JIT)
def svd_any(a, s, u, vh):
    """a = u diag(s) vh for any m x n: u m x c, vh c' x n (c, c' = k reduced, or m and n full)."""
    m, n = a.shape
    if m >= n:
        v = np.empty((n, n))
        svd_tall(a, s, u, v)
        for i in range(vh.shape[0]):
            for j in range(n):
                vh[i, j] = v[j, i]
    else:
        ut = np.empty((m, m))
        vt = np.empty((n, vh.shape[0]))
        svd_tall(a.T.copy(), s, vt, ut)
        for i in range(m):
            for j in range(u.shape[1]):
                u[i, j] = ut[i, j]
        for i in range(vh.shape[0]):
            for j in range(n):
                vh[i, j] = vt[j, i]


@njit(**JIT)
def expm(a):
    """exp(a): a scaled by 2^-s to a 1-norm at most 1/2, a Taylor series summed until its terms
    stop mattering in float64, squared s times."""
    n = a.shape[0]
    norm = 0.0
    for j in range(n):
        col = 0.0
        for i in range(n):
            col += abs(a[i, j])
        norm = max(norm, col)
    squarings = 0
    if norm > 0.5 and norm == norm and norm < np.inf:
        squarings = int(math.ceil(math.log2(norm / 0.5)))
    x = a * (0.5 ** squarings)
    result = np.eye(n)
    term = np.eye(n)
    for k in range(1, 40):
        term = (term @ x) / k
        result += term
        if not np.abs(term).max() > 1e-18 * np.abs(result).max():
            break
    for _ in range(squarings):
        result = result @ result
    if not (norm == norm and norm < np.inf):
        result[:, :] = np.nan
    return result


# =========================================================================================
# Codelets: each vertex loads its matrices one after another, runs the algorithm, stores
# =========================================================================================
@njit(**JIT)
def _load(arena, addr, base, rows, cols):
    out = np.empty((rows, cols))
    for i in range(rows):
        for j in range(cols):
            out[i, j] = ld(arena, addr[base + i * cols + j])
    return out


@njit(**JIT)
def _store(arena, addr, base, values):
    flat = values.reshape(-1)
    for i in range(flat.size):
        st(arena, addr[base + i], flat[i])


@njit(parallel=True, **JIT)
def lu_codelet(a, a_addr, a_start, lu, l_addr, l_start, piv, p_addr, p_start, info, i_addr, i_start, params):
    """params: m, n, pivot (1) or not (0)."""
    for v in prange(params.shape[0]):
        m, n, pivot = int(params[v, 0]), int(params[v, 1]), params[v, 2] != 0
        k = min(m, n)
        for b in range(i_start[v + 1] - i_start[v]):
            x = _load(a, a_addr, a_start[v] + b * m * n, m, n)
            p = np.empty(k, np.int64)
            st(info, i_addr[i_start[v] + b], lu_inplace(x, p, pivot))
            _store(lu, l_addr, l_start[v] + b * m * n, x)
            for j in range(k):
                st(piv, p_addr[p_start[v] + b * k + j], p[j])


@njit(**JIT)
def permutation(piv, perm):
    """perm (0-based, length m): the rows 0..m-1 after the swaps i <-> piv[i] - 1 in order, so
    that row i of the permuted matrix is row perm[i] of the original."""
    for i in range(perm.shape[0]):
        perm[i] = i
    for i in range(piv.shape[0]):
        p = piv[i] - 1
        if 0 <= p < perm.shape[0]:
            perm[i], perm[p] = perm[p], perm[i]


@njit(parallel=True, **JIT)
def permutation_codelet(piv, p_addr, p_start, perm, q_addr, q_start, params):
    """params: k (pivots), m (rows)."""
    for v in prange(params.shape[0]):
        k, m = int(params[v, 0]), int(params[v, 1])
        for b in range((q_start[v + 1] - q_start[v]) // max(m, 1)):
            pv = np.empty(k, np.int64)
            for j in range(k):
                pv[j] = ld(piv, p_addr[p_start[v] + b * k + j])
            out = np.empty(m, np.int64)
            permutation(pv, out)
            for j in range(m):
                st(perm, q_addr[q_start[v] + b * m + j], out[j])


@njit(parallel=True, **JIT)
def cholesky_codelet(a, a_addr, a_start, out, o_addr, o_start, info, i_addr, i_start, params):
    """params: n."""
    for v in prange(params.shape[0]):
        n = int(params[v, 0])
        for b in range(i_start[v + 1] - i_start[v]):
            x = _load(a, a_addr, a_start[v] + b * n * n, n, n)
            st(info, i_addr[i_start[v] + b], cholesky_inplace(x))
            _store(out, o_addr, o_start[v] + b * n * n, x)


@njit(parallel=True, **JIT)
def ldl_codelet(a, a_addr, a_start, ld, l_addr, l_start, piv, p_addr, p_start, info, i_addr, i_start, params):
    """params: n."""
    for v in prange(params.shape[0]):
        n = int(params[v, 0])
        for b in range(i_start[v + 1] - i_start[v]):
            x = _load(a, a_addr, a_start[v] + b * n * n, n, n)
            p = np.empty(n, np.int64)
            st(info, i_addr[i_start[v] + b], ldl_inplace(x, p))
            _store(ld, l_addr, l_start[v] + b * n * n, x)
            for j in range(n):
                st(piv, p_addr[p_start[v] + b * n + j], p[j])


@njit(parallel=True, **JIT)
def ldl_solve_codelet(a, a_addr, a_start, piv, p_addr, p_start, b, b_addr, b_start, x, x_addr, x_start, params):
    """params: n, r (right-hand sides)."""
    for v in prange(params.shape[0]):
        n, r = int(params[v, 0]), int(params[v, 1])
        for k in range((a_start[v + 1] - a_start[v]) // max(n * n, 1)):
            factors = _load(a, a_addr, a_start[v] + k * n * n, n, n)
            pv = np.empty(n, np.int64)
            for j in range(n):
                pv[j] = ld(piv, p_addr[p_start[v] + k * n + j])
            rhs = _load(b, b_addr, b_start[v] + k * n * r, n, r)
            ldl_solve_inplace(factors, pv, rhs)
            _store(x, x_addr, x_start[v] + k * n * r, rhs)


@njit(parallel=True, **JIT)
def triangular_solve_codelet(a, a_addr, a_start, b, b_addr, b_start, x, x_addr, x_start, params):
    """params: n, r (right-hand sides), upper, unit."""
    for v in prange(params.shape[0]):
        n, r, upper, unit = int(params[v, 0]), int(params[v, 1]), params[v, 2] != 0, params[v, 3] != 0
        for k in range((a_start[v + 1] - a_start[v]) // max(n * n, 1)):
            coef = _load(a, a_addr, a_start[v] + k * n * n, n, n)
            rhs = _load(b, b_addr, b_start[v] + k * n * r, n, r)
            triangular_solve_inplace(coef, rhs, upper, unit)
            _store(x, x_addr, x_start[v] + k * n * r, rhs)


@njit(parallel=True, **JIT)
def geqrf_codelet(a, a_addr, a_start, qr, q_addr, q_start, tau, t_addr, t_start, params):
    """params: m, n."""
    for v in prange(params.shape[0]):
        m, n = int(params[v, 0]), int(params[v, 1])
        k = min(m, n)
        for b in range((a_start[v + 1] - a_start[v]) // max(m * n, 1)):
            x = _load(a, a_addr, a_start[v] + b * m * n, m, n)
            t = np.empty(k)
            geqrf_inplace(x, t)
            _store(qr, q_addr, q_start[v] + b * m * n, x)
            for j in range(k):
                st(tau, t_addr[t_start[v] + b * k + j], t[j])


@njit(parallel=True, **JIT)
def householder_codelet(a, a_addr, a_start, tau, t_addr, t_start, q, q_addr, q_start, params):
    """params: m, n, k (reflectors)."""
    for v in prange(params.shape[0]):
        m, n, k = int(params[v, 0]), int(params[v, 1]), int(params[v, 2])
        for b in range((a_start[v + 1] - a_start[v]) // max(m * n, 1)):
            x = _load(a, a_addr, a_start[v] + b * m * n, m, n)
            t = _load(tau, t_addr, t_start[v] + b * k, 1, k)[0]
            out = np.empty((m, n))
            householder_product(x, t, out)
            _store(q, q_addr, q_start[v] + b * m * n, out)


@njit(parallel=True, **JIT)
def eigh_codelet(a, a_addr, a_start, w, w_addr, w_start, vec, v_addr, v_start, params):
    """params: n, lower (the triangle read: 1 lower, 0 upper)."""
    for v in prange(params.shape[0]):
        n, lower = int(params[v, 0]), params[v, 1] != 0
        for b in range((a_start[v + 1] - a_start[v]) // max(n * n, 1)):
            x = _symmetric(_load(a, a_addr, a_start[v] + b * n * n, n, n), lower)
            values, vectors = np.empty(n), np.empty((n, n))
            eigh_inplace(x, values, vectors)
            _store(w, w_addr, w_start[v] + b * n, values)
            _store(vec, v_addr, v_start[v] + b * n * n, vectors)


@njit(**JIT)
def _symmetric(x, lower):
    n = x.shape[0]
    for i in range(n):
        for j in range(i + 1, n):
            if lower:
                x[i, j] = x[j, i]
            else:
                x[j, i] = x[i, j]
    return x


@njit(parallel=True, **JIT)
def svd_codelet(a, a_addr, a_start, s, s_addr, s_start, u, u_addr, u_start, vh, v_addr, v_start, params):
    """params: m, n, columns of u, rows of vh."""
    for v in prange(params.shape[0]):
        m, n, uc, vr = int(params[v, 0]), int(params[v, 1]), int(params[v, 2]), int(params[v, 3])
        k = min(m, n)
        for b in range((a_start[v + 1] - a_start[v]) // max(m * n, 1)):
            x = _load(a, a_addr, a_start[v] + b * m * n, m, n)
            sv, um, vm = np.empty(k), np.empty((m, uc)), np.empty((vr, n))
            svd_any(x, sv, um, vm)
            _store(s, s_addr, s_start[v] + b * k, sv)
            _store(u, u_addr, u_start[v] + b * m * uc, um)
            _store(vh, v_addr, v_start[v] + b * vr * n, vm)


@njit(parallel=True, **JIT)
def expm_codelet(a, a_addr, a_start, out, o_addr, o_start, params):
    """params: n."""
    for v in prange(params.shape[0]):
        n = int(params[v, 0])
        for b in range((a_start[v + 1] - a_start[v]) // max(n * n, 1)):
            _store(out, o_addr, o_start[v] + b * n * n, expm(_load(a, a_addr, a_start[v] + b * n * n, n, n)))


# ---- the same routines over a whole batch (fast mode) ------------------------------------------
@njit(parallel=True, **JIT)
def lu_batch(a, pivot):
    B, m, n = a.shape
    k = min(m, n)
    piv = np.empty((B, k), np.int64)
    info = np.empty(B, np.int64)
    for b in prange(B):
        info[b] = lu_inplace(a[b], piv[b], pivot)
    return a, piv, info


@njit(parallel=True, **JIT)
def permutation_batch(piv, m):
    out = np.empty((piv.shape[0], m), np.int64)
    for b in prange(piv.shape[0]):
        permutation(piv[b], out[b])
    return out


@njit(parallel=True, **JIT)
def cholesky_batch(a):
    info = np.empty(a.shape[0], np.int64)
    for b in prange(a.shape[0]):
        info[b] = cholesky_inplace(a[b])
    return a, info


@njit(parallel=True, **JIT)
def ldl_batch(a):
    B, n, _ = a.shape
    piv = np.empty((B, n), np.int64)
    info = np.empty(B, np.int64)
    for b in prange(B):
        info[b] = ldl_inplace(a[b], piv[b])
    return a, piv, info


@njit(parallel=True, **JIT)
def ldl_solve_batch(a, piv, rhs):
    for b in prange(a.shape[0]):
        ldl_solve_inplace(a[b], piv[b], rhs[b])
    return rhs


@njit(parallel=True, **JIT)
def triangular_solve_batch(a, rhs, upper, unit):
    for b in prange(a.shape[0]):
        triangular_solve_inplace(a[b], rhs[b], upper, unit)
    return rhs


@njit(parallel=True, **JIT)
def geqrf_batch(a):
    B, m, n = a.shape
    tau = np.empty((B, min(m, n)))
    for b in prange(B):
        geqrf_inplace(a[b], tau[b])
    return a, tau


@njit(parallel=True, **JIT)
def householder_batch(a, tau):
    q = np.empty_like(a)
    for b in prange(a.shape[0]):
        householder_product(a[b], tau[b], q[b])
    return q


@njit(parallel=True, **JIT)
def eigh_batch(a, lower):
    B, n, _ = a.shape
    w, vec = np.empty((B, n)), np.empty((B, n, n))
    for b in prange(B):
        eigh_inplace(_symmetric(a[b], lower), w[b], vec[b])
    return w, vec


@njit(parallel=True, **JIT)
def svd_batch(a, uc, vr):
    B, m, n = a.shape
    s, u, vh = np.empty((B, min(m, n))), np.empty((B, m, uc)), np.empty((B, vr, n))
    for b in prange(B):
        svd_any(a[b], s[b], u[b], vh[b])
    return s, u, vh


@njit(parallel=True, **JIT)
def expm_batch(a):
    out = np.empty_like(a)
    for b in prange(a.shape[0]):
        out[b] = expm(a[b])
    return out


# =========================================================================================
# Cycle estimators
# =========================================================================================
def _cycles(flops, columns, target):
    return target.thread_cycles(12 + flops / FLOPS_PER_INSTRUCTION + columns * COLUMN_INSTRUCTIONS)


def lu_flops(m, n):
    k = np.minimum(m, n)
    return 2.0 * (m * n * k - (m + n) * k * k / 2.0 + k ** 3 / 3.0)


def qr_flops(m, n):
    k = np.minimum(m, n)
    return 2.0 * (2.0 * m * n * k - (m + n) * k * k + 2.0 * k ** 3 / 3.0)


def jacobi_flops(n):
    return SWEEPS * n * (n - 1) / 2.0 * 8.0 * n


def svd_flops(m, n):
    big, small = np.maximum(m, n), np.minimum(m, n)
    return SWEEPS * small * (small - 1) / 2.0 * (10.0 * big + 4.0 * small) + 2.0 * big * big * small


def expm_flops(n, norm_squarings=2):
    return (TAYLOR_TERMS + norm_squarings) * 2.0 * n ** 3


def _lu_cycles(sizes, params, dtype, target):
    m, n = params[:, 0], params[:, 1]
    count = sizes["info"]
    return _cycles(count * lu_flops(m, n), count * np.minimum(m, n), target)


def _permutation_cycles(sizes, params, dtype, target):
    k, m = params[:, 0], params[:, 1]
    count = sizes["perm"] // np.maximum(m, 1)
    return target.thread_cycles(12 + count * (2 * m + 6 * k))


def _cholesky_cycles(sizes, params, dtype, target):
    n = params[:, 0]
    count = sizes["info"]
    return _cycles(count * n ** 3 / 3.0, count * n, target)


def _ldl_cycles(sizes, params, dtype, target):
    n = params[:, 0]
    count = sizes["info"]
    return _cycles(count * n ** 3 / 3.0, count * n * 2, target)


def _ldl_solve_cycles(sizes, params, dtype, target):
    n, r = params[:, 0], params[:, 1]
    count = sizes["a"] // np.maximum(n * n, 1)
    return _cycles(count * 2.0 * n * n * r, count * n, target)


def _triangular_cycles(sizes, params, dtype, target):
    n, r = params[:, 0], params[:, 1]
    count = sizes["a"] // np.maximum(n * n, 1)
    return _cycles(count * n * n * r, count * n, target)


def _geqrf_cycles(sizes, params, dtype, target):
    m, n = params[:, 0], params[:, 1]
    count = sizes["a"] // np.maximum(m * n, 1)
    return _cycles(count * qr_flops(m, n), count * np.minimum(m, n), target)


def _householder_cycles(sizes, params, dtype, target):
    m, n = params[:, 0], params[:, 1]
    count = sizes["a"] // np.maximum(m * n, 1)
    return _cycles(count * qr_flops(m, n), count * n, target)


def _eigh_cycles(sizes, params, dtype, target):
    n = params[:, 0]
    count = sizes["a"] // np.maximum(n * n, 1)
    return _cycles(count * jacobi_flops(n), count * SWEEPS * n * (n - 1) / 2, target)


def _svd_cycles(sizes, params, dtype, target):
    m, n = params[:, 0], params[:, 1]
    count = sizes["a"] // np.maximum(m * n, 1)
    k = np.minimum(m, n)
    return _cycles(count * svd_flops(m, n), count * SWEEPS * k * (k - 1) / 2, target)


def _expm_cycles(sizes, params, dtype, target):
    n = params[:, 0]
    count = sizes["a"] // np.maximum(n * n, 1)
    return _cycles(count * expm_flops(n), count * n, target)


LU = VertexType("poplin::LUFactor", ("a",), ("lu", "pivots", "info"), lu_codelet, _lu_cycles, num_params=3)
PERMUTATION = VertexType("poplin::PivotPermutation", ("pivots",), ("perm",), permutation_codelet,
                         _permutation_cycles, num_params=2)
CHOLESKY = VertexType("poplin::Cholesky", ("a",), ("out", "info"), cholesky_codelet, _cholesky_cycles,
                      num_params=1)
LDL = VertexType("poplin::LDLFactor", ("a",), ("ld", "pivots", "info"), ldl_codelet, _ldl_cycles, num_params=1)
LDL_SOLVE = VertexType("poplin::LDLSolve", ("a", "pivots", "b"), ("x",), ldl_solve_codelet, _ldl_solve_cycles,
                       num_params=2)
TRIANGULAR_SOLVE = VertexType("poplin::TriangularSolve", ("a", "b"), ("x",), triangular_solve_codelet,
                              _triangular_cycles, num_params=4)
GEQRF = VertexType("poplin::HouseholderQR", ("a",), ("qr", "tau"), geqrf_codelet, _geqrf_cycles, num_params=2)
HOUSEHOLDER = VertexType("poplin::HouseholderProduct", ("a", "tau"), ("q",), householder_codelet,
                         _householder_cycles, num_params=3)
EIGH = VertexType("poplin::SymmetricEigen", ("a",), ("w", "vectors"), eigh_codelet, _eigh_cycles, num_params=2)
SVD = VertexType("poplin::SVD", ("a",), ("s", "u", "vh"), svd_codelet, _svd_cycles, num_params=4)
EXPM = VertexType("poplin::MatrixExp", ("a",), ("out",), expm_codelet, _expm_cycles, num_params=1)


# =========================================================================================
# The plan: matrices over tiles
# =========================================================================================
def _check(name: str, t: Tensor, what: str, square: bool = False) -> tuple:
    if t.dtype.kind != "f":
        raise TypeError(f"{name}: {what} {t.name!r} is {t.dtype.name}; linear algebra takes float32 or float16")
    if t.rank < 2:
        raise ValueError(f"{name}: {what} {t.name!r} of shape {t.shape} is not a matrix (it needs two "
                         "dimensions, after any batch dimensions)")
    if square and t.shape[-1] != t.shape[-2]:
        raise ValueError(f"{name}: {what} {t.name!r} of shape {t.shape} must be square (batches of n x n "
                         "matrices)")
    return t.shape[:-2]


def _whole_rows(blocks: RowBlocks, t: Tensor) -> RowBlocks:
    """The blocks of matrices as blocks of whole rows of the [B, elements] view `t`."""
    return replace(blocks, col=np.zeros_like(blocks.col), cols=np.full_like(blocks.cols, t.shape[1]))


def _batched(graph: Graph, prog: Sequence, name: str, vertex: VertexType, batch: tuple, inputs: list[Tensor],
             outputs: list[tuple], params: list, work: float, fast) -> list[Tensor]:
    """Run `vertex` on every matrix of the batch: inputs [*batch, ...], outputs (dtype, shape
    of one matrix's result) as new variables [*batch, *shape]; `work` the flops of one matrix
    (how the matrices are spread over tiles). `fast(*arrays of the inputs as [B, ...])` gives
    the outputs as [B, ...] arrays."""
    B = int(np.prod(batch, dtype=np.int64))
    outs = [graph.addVariable(dtype, tuple(batch) + tuple(shape), f"{name}/{vertex.fields[len(inputs) + i]}"
                              if i else name, category="activations", always_live=False)
            for i, (dtype, shape) in enumerate(outputs)]
    flat_in = [t.reshape(B, int(np.prod(t.shape[len(batch):], dtype=np.int64))) for t in inputs]
    flat_out = [t.reshape(B, int(np.prod(t.shape[len(batch):], dtype=np.int64))) for t in outs]
    body = Sequence(name=name)
    if B and all(t.shape[1] for t in flat_in + flat_out):
        blocks = plan_rows(graph, B, int(max(work, 1)), 1)
        for t in flat_out:
            _whole_rows(blocks, t).map_output(t)
        b, first, end = blocks.pieces(graph.target.workers_per_tile)
        fields = {}
        for field, t in zip(vertex.fields, flat_in):
            local, at = blocks.bring(graph, body, t, f"{name}/{field}", whole_rows=True)
            fields[field] = blocks.local_rows(local, at, b, first, end, t.shape[1])
        for field, t in zip(vertex.fields[len(inputs):], flat_out):
            fields[field] = _whole_rows(blocks, t).rows_of(t, b, first, end)
        cs = graph.addComputeSet(name)
        graph.addVertices(cs, vertex, blocks.tile[b], fields, np.array([params], np.float64).repeat(b.size, 0))
        body.add(Execute(cs))

    def run_fast(io):
        arrays = [io.read(t).reshape((B,) + t.shape[len(batch):]).astype(np.float64 if t.dtype.kind == "f" else
                                                                          np.int64) for t in inputs]
        results = fast(*arrays) if B else [np.zeros((0,) + tuple(s)) for _, s in outputs]
        results = (results,) if isinstance(results, np.ndarray) else results
        for t, r in zip(outs, results):
            io.write(t, np.asarray(r).reshape(t.shape).astype(t.dtype))

    prog.add(OpProgram(name, body, run_fast, tuple(inputs), tuple(outs)))
    return outs


# =========================================================================================
# The ops
# =========================================================================================
def lu_factor(graph: Graph, a: Tensor, prog: Sequence, name: str = "lu", pivot: bool = True
              ) -> tuple[Tensor, Tensor, Tensor]:
    """LU of every m x n matrix of `a` [..., m, n] with partial pivoting (LAPACK's getrf): the
    factors [..., m, n], the 1-based int32 pivots [..., min(m, n)] and int32 info [...]."""
    batch = _check(name, a, "input")
    m, n = a.shape[-2:]
    k = min(m, n)

    def fast(x):
        lu, piv, info = lu_batch(x, pivot)
        return lu, piv, info

    return tuple(_batched(graph, prog, name, LU, batch, [a], [(a.dtype, (m, n)), (np.int32, (k,)), (np.int32, ())],
                          [m, n, float(pivot)], float(lu_flops(m, n)), fast))


def pivot_permutation(graph: Graph, pivots: Tensor, m: int, prog: Sequence, name: str = "permutation") -> Tensor:
    """The row permutation [..., m] (int32, 0-based) of LAPACK's 1-based pivots [..., k]: row i
    of P^T A is row perm[i] of A (the swaps i <-> pivots[i] - 1 applied in order)."""
    if pivots.dtype != np.int32 or pivots.rank < 1:
        raise TypeError(f"{name}: pivots {pivots.name!r} must be int32 [..., k], got {pivots.dtype.name} "
                        f"{pivots.shape}")
    k = pivots.shape[-1]
    return _batched(graph, prog, name, PERMUTATION, pivots.shape[:-1], [pivots], [(np.int32, (m,))], [k, m],
                    float(2 * m + 6 * k), lambda p: permutation_batch(p, m))[0]


def cholesky(graph: Graph, a: Tensor, prog: Sequence, name: str = "cholesky") -> tuple[Tensor, Tensor]:
    """The lower Cholesky factor of every symmetric positive-definite n x n matrix of `a` (its
    lower triangle read) and int32 info (0, or the first order that is not positive definite)."""
    batch = _check(name, a, "input", square=True)
    n = a.shape[-1]
    return tuple(_batched(graph, prog, name, CHOLESKY, batch, [a], [(a.dtype, (n, n)), (np.int32, ())], [n],
                          n ** 3 / 3.0, lambda x: cholesky_batch(x)))


def ldl_factor(graph: Graph, a: Tensor, prog: Sequence, name: str = "ldl") -> tuple[Tensor, Tensor, Tensor]:
    """Bunch-Kaufman LDL^T of every symmetric n x n matrix of `a` (its lower triangle read), in
    LAPACK's sytrf form: the factors [..., n, n], int32 pivots [..., n], int32 info [...]."""
    batch = _check(name, a, "input", square=True)
    n = a.shape[-1]
    return tuple(_batched(graph, prog, name, LDL, batch, [a], [(a.dtype, (n, n)), (np.int32, (n,)), (np.int32, ())],
                          [n], n ** 3 / 3.0, lambda x: ldl_batch(x)))


def ldl_solve(graph: Graph, ld: Tensor, pivots: Tensor, b: Tensor, prog: Sequence, name: str = "ldl_solve"
              ) -> Tensor:
    """X with A X = b from `ldl_factor`'s factors and pivots of A [..., n, n] (LAPACK's sytrs),
    right-hand sides b [..., n, r] of the same batch."""
    batch = _check(name, ld, "factors", square=True)
    _check(name, b, "right-hand sides")
    n, r = ld.shape[-1], b.shape[-1]
    if b.shape[:-1] != ld.shape[:-1] or pivots.shape != ld.shape[:-1] or pivots.dtype != np.int32:
        raise ValueError(f"{name}: factors {ld.shape}, int32 pivots {pivots.dtype.name} {pivots.shape} and "
                         f"right-hand sides {b.shape} must be [..., n, n], [..., n] and [..., n, r] of one batch")
    return _batched(graph, prog, name, LDL_SOLVE, batch, [ld, pivots, b], [(b.dtype, (n, r))], [n, r],
                    2.0 * n * n * r, lambda x, p, y: ldl_solve_batch(x, p, y))[0]


def triangular_solve(graph: Graph, a: Tensor, b: Tensor, prog: Sequence, upper: bool, unit: bool = False,
                     name: str = "triangular_solve") -> Tensor:
    """X with a X = b for every triangular n x n matrix of `a` [..., n, n] (only its upper or
    lower triangle read; a unit diagonal when `unit`) and n x r right-hand sides `b` [..., n, r]
    of the same batch."""
    batch = _check(name, a, "coefficients", square=True)
    _check(name, b, "right-hand sides")
    n, r = a.shape[-1], b.shape[-1]
    if b.shape[:-1] != a.shape[:-1]:
        raise ValueError(f"{name}: right-hand sides {b.name!r} of shape {b.shape} do not fit coefficients "
                         f"{a.name!r} of shape {a.shape}: give them the shape [..., {n}, r] of the same batch")
    return _batched(graph, prog, name, TRIANGULAR_SOLVE, batch, [a, b], [(b.dtype, (n, r))],
                    [n, r, float(upper), float(unit)], float(n * n * r),
                    lambda x, y: triangular_solve_batch(x, y, upper, unit))[0]


def geqrf(graph: Graph, a: Tensor, prog: Sequence, name: str = "geqrf") -> tuple[Tensor, Tensor]:
    """Householder QR of every m x n matrix of `a` in LAPACK's geqrf form: R on and above the
    diagonal, the reflectors below it, and their scales tau [..., min(m, n)]."""
    batch = _check(name, a, "input")
    m, n = a.shape[-2:]
    return tuple(_batched(graph, prog, name, GEQRF, batch, [a], [(a.dtype, (m, n)), (a.dtype, (min(m, n),))],
                          [m, n], float(qr_flops(m, n)), lambda x: geqrf_batch(x)))


def householder(graph: Graph, a: Tensor, tau: Tensor, prog: Sequence, name: str = "householder_product") -> Tensor:
    """The first n columns of the product of the Householder reflectors of every m x n matrix of
    `a` (m >= n) with scales `tau` [..., k], k <= n (LAPACK's orgqr)."""
    batch = _check(name, a, "reflectors")
    m, n = a.shape[-2:]
    k = tau.shape[-1] if tau.rank else 0
    if m < n or k > n or tau.shape[:-1] != batch:
        raise ValueError(f"{name}: reflectors {a.name!r} of shape {a.shape} and scales {tau.name!r} of shape "
                         f"{tau.shape}: need m >= n >= k with scales [..., k] of the same batch")
    return _batched(graph, prog, name, HOUSEHOLDER, batch, [a, tau], [(a.dtype, (m, n))], [m, n, k],
                    float(qr_flops(m, n)), lambda x, t: householder_batch(x, t))[0]


def eigh(graph: Graph, a: Tensor, prog: Sequence, lower: bool = True, name: str = "eigh") -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) [..., n] and eigenvectors (columns) [..., n, n] of every symmetric
    n x n matrix of `a`, of which only the lower (or upper) triangle is read."""
    batch = _check(name, a, "input", square=True)
    n = a.shape[-1]
    return tuple(_batched(graph, prog, name, EIGH, batch, [a], [(a.dtype, (n,)), (a.dtype, (n, n))],
                          [n, float(lower)], float(jacobi_flops(n)), lambda x: eigh_batch(x, lower)))


def svd(graph: Graph, a: Tensor, prog: Sequence, full_matrices: bool = False, name: str = "svd"
        ) -> tuple[Tensor, Tensor, Tensor]:
    """a = U diag(S) Vh for every m x n matrix: S [..., k] descending (k = min(m, n)), U
    [..., m, k] and Vh [..., k, n], or [..., m, m] and [..., n, n] with `full_matrices`."""
    batch = _check(name, a, "input")
    m, n = a.shape[-2:]
    k = min(m, n)
    uc, vr = (m, n) if full_matrices else (k, k)
    s, u, vh = _batched(graph, prog, name, SVD, batch, [a], [(a.dtype, (k,)), (a.dtype, (m, uc)), (a.dtype, (vr, n))],
                        [m, n, uc, vr], float(svd_flops(m, n)), lambda x: svd_batch(x, uc, vr))
    return u, s, vh


def matrix_exp(graph: Graph, a: Tensor, prog: Sequence, name: str = "matrix_exp") -> Tensor:
    """exp of every n x n matrix of `a`."""
    batch = _check(name, a, "input", square=True)
    n = a.shape[-1]
    return _batched(graph, prog, name, EXPM, batch, [a], [(a.dtype, (n, n))], [n], float(expm_flops(n)),
                    expm_batch)[0]
