"""Lowerings of ATen's dense linear algebra onto ipusim.ops.linalg (one matrix per tile).

The factorisations are one IR op each, ``linalg`` with its ``fn``: ``lu_factor``,
``pivot_permutation``, ``cholesky``, ``triangular_solve``, ``geqrf``, ``householder``, ``eigh``,
``svd``, ``matrix_exp``, ``ldl_factor``, ``ldl_solve``. Everything else is composed from them and
the IR's other ops, exactly as LAPACK and PyTorch compose it: a solve is an LU then the pivots'
rows gathered and two triangular solves; an inverse solves the identity; a determinant is the product of U's diagonal times the
pivots' sign; QR forms Q from geqrf's reflectors; the pseudo-inverse, matrix square root and polar
factors are products of SVD or eigh factors. PyTorch's autograd formulas are captured as ATen ops
and lowered the same way.

The device raises no error: a singular or not positive-definite matrix gives what the arithmetic
gives (inf or NaN; the ``info`` outputs say which matrix), and ``_linalg_check_errors`` (the
check ``torch.linalg.inv`` and friends make on ``info``) runs nothing.

Eigenvectors and singular vectors are unique up to sign only: ipusim's Jacobi methods choose the
sign that makes each vector's largest component positive, LAPACK's tridiagonal and bidiagonal QR
iterations another, so U, V and eigenvectors may differ from PyTorch's by a sign per vector;
everything that does not depend on it (values, projectors, pseudo-inverses, square roots) matches.
"""
from __future__ import annotations

import numpy as np
import torch

from .aten import _diagonal, _gather_along, _scatter_along, _select, _slice, lowers
from .ir import Value

aten = torch.ops.aten

F32_EPS = float(np.finfo(np.float32).eps)


# ---- helpers ---------------------------------------------------------------------------------------
def _meta_shape(c, i: int) -> tuple:
    return tuple(int(s) for s in c.out_meta(i).shape)


def _empty(c, i: int, dtype=np.float32) -> Value:
    """Output i when PyTorch returns an empty tensor there (not asked for)."""
    return c.const(np.zeros(_meta_shape(c, i)), dtype)


def _mT(c, x: Value) -> Value:
    r = len(x.shape)
    return c.transpose(x, tuple(range(r - 2)) + (r - 1, r - 2))


def _batch(*shapes) -> tuple:
    return tuple(np.broadcast_shapes(*(s[:-2] for s in shapes)))


def _to_batch(c, x: Value, batch: tuple) -> Value:
    return c.expand(x, batch + x.shape[-2:])


def _mm(c, a: Value, b: Value) -> Value:
    """a @ b for batches of matrices [..., m, k] @ [..., k, n], batch dimensions broadcast."""
    batch = _batch(a.shape, b.shape)
    a, b = _to_batch(c, a, batch), _to_batch(c, b, batch)
    B = int(np.prod(batch, dtype=np.int64))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out = c.one("matmul", [c.reshape(a, (B, m, k)), c.reshape(b, (B, k, n))], (B, m, n), a.dtype)
    return c.reshape(out, batch + (m, n))


def _eye(c, m: int, n: int, dtype) -> Value:
    return c.const(np.eye(m, n), dtype)


def _mask(c, x: Value, keep: np.ndarray) -> Value:
    """x where `keep` (a constant of x's last two dimensions), exactly 0 elsewhere."""
    m = c.const(keep.astype(np.float32), x.dtype)
    return c.binary("relu_grad", c.expand(m, x.shape), x, x.dtype)


def _tril(c, x: Value, k: int = 0) -> Value:
    return _mask(c, x, np.tri(x.shape[-2], x.shape[-1], k, dtype=bool))


def _triu(c, x: Value, k: int = 0) -> Value:
    return _mask(c, x, ~np.tri(x.shape[-2], x.shape[-1], k - 1, dtype=bool))


def _linalg(c, fn: str, inputs: list, outs: list, **attrs) -> list[Value]:
    return c.emit("linalg", inputs, outs, fn=fn, **attrs)


def _float(c, x: Value) -> Value:
    if x.dtype.kind != "f":
        raise c.error(f"linear algebra takes floating tensors; got {x.dtype.name} {list(x.shape)}")
    return x


def _lu(c, a: Value, pivot: bool = True) -> tuple[Value, Value, Value]:
    a = _float(c, a)
    m, n = a.shape[-2:]
    batch = a.shape[:-2]
    return tuple(_linalg(c, "lu_factor", [a], [(a.shape, a.dtype), (batch + (min(m, n),), np.int32),
                                               (batch, np.int32)], pivot=bool(pivot)))


def _permutation(c, pivots: Value, m: int) -> Value:
    """perm [..., m]: row i of P^T A is row perm[i] of A."""
    return _linalg(c, "pivot_permutation", [c.cast(pivots, np.int32)], [(pivots.shape[:-1] + (m,), np.int32)],
                   m=int(m))[0]


def _solve_tri(c, a: Value, b: Value, upper: bool, unit: bool = False) -> Value:
    """X with a X = b (a triangular [..., n, n], b [..., n, r]; batches broadcast)."""
    batch = _batch(a.shape, b.shape)
    a, b = _to_batch(c, a, batch), _to_batch(c, c.cast(b, a.dtype), batch)
    return _linalg(c, "triangular_solve", [a, b], [(b.shape, a.dtype)], upper=bool(upper), unit=bool(unit))[0]


def _rows(c, x: Value, perm: Value) -> Value:
    """x[..., perm, :] (perm [..., m] broadcast over x's batch)."""
    batch = _batch(x.shape, perm.shape + (1,))
    x = _to_batch(c, x, batch)
    idx = c.expand(c.reshape(perm, perm.shape + (1,)), batch + x.shape[-2:])
    return _gather_along(c, x, idx, len(x.shape) - 2)


def _unrows(c, z: Value, perm: Value) -> Value:
    """x with x[..., perm, :] = z."""
    batch = _batch(z.shape, perm.shape + (1,))
    z = _to_batch(c, z, batch)
    idx = c.expand(c.reshape(perm, perm.shape + (1,)), batch + z.shape[-2:])
    return _scatter_along(c, c.const(np.zeros(z.shape), z.dtype), idx, z, len(z.shape) - 2, False)


def _lu_solve(c, lu: Value, pivots: Value, b: Value, left: bool = True, adjoint: bool = False) -> Value:
    """X with A X = B (A^T X = B when `adjoint`; X A = B, X A^T = B when not `left`), A = P L U."""
    if not left:
        return _mT(c, _lu_solve(c, lu, pivots, _mT(c, b), True, not adjoint))
    perm = _permutation(c, pivots, lu.shape[-2])
    if not adjoint:
        y = _solve_tri(c, lu, _rows(c, b, perm), upper=False, unit=True)
        return _solve_tri(c, lu, y, upper=True)
    y = _solve_tri(c, _mT(c, lu), b, upper=False)
    z = _solve_tri(c, _mT(c, lu), y, upper=True, unit=True)
    return _unrows(c, z, perm)


def _diag_product(c, lu: Value, pivots: Value) -> tuple[Value, Value]:
    """(U's diagonal, the sign of the permutation as +-1 per pivot) of an LU."""
    d = _diagonal(c, lu, 0, -2, -1)
    n = d.shape[-1]
    swapped = c.binary("ne", pivots, c.const(np.arange(1, n + 1), np.int32), dtype=np.int32)
    flips = c.unary("scale", c.cast(swapped, lu.dtype), scale=-2.0, bias=1.0)
    return d, flips


def _product(c, x: Value) -> Value:
    """The product along the last axis (a running product's last element)."""
    p = c.one("scan", [x], x.shape, x.dtype, fn="prod", axis=len(x.shape) - 1)
    return _select(c, p, len(x.shape) - 1, -1)


def _sign(c, x: Value) -> Value:
    pos = c.cast(c.binary("gt", x, 0.0, dtype=x.dtype), x.dtype)
    neg = c.cast(c.binary("lt", x, 0.0, dtype=x.dtype), x.dtype)
    return c.binary("sub", pos, neg, x.dtype)


def _contiguous(c, i: int = 0) -> bool:
    arg = c.node.args[i]
    val = arg.meta.get("val") if hasattr(arg, "meta") else None
    return bool(val is not None and val.is_contiguous())


# ---- LU, determinants, solves, inverses ------------------------------------------------------------
@lowers(aten.linalg_lu_factor_ex, doc="linalg lu_factor (LU with partial pivoting, one matrix per tile)")
def _lu_factor_ex(c, a, pivot=True, check_errors=False):
    return _lu(c, a, pivot)


@lowers(aten._linalg_check_errors, doc="nothing: the device raises no error (info says which matrix failed)")
def _check_errors(c, info, api_name, is_matrix=True):
    return None


def _unpack(c, lu: Value, pivots: Value, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    k = min(m, n)
    if unpack_pivots:
        perm = _permutation(c, pivots, m)
        onehot = c.cast(c.binary("eq", c.reshape(perm, perm.shape + (1,)), c.const(np.arange(m), np.int32),
                                 dtype=np.int32), lu.dtype)
        p = _mT(c, onehot)
    else:
        p = _empty(c, 0, lu.dtype)
    if unpack_data:
        lower = _slice(c, lu, len(lu.shape) - 1, 0, k, 1)
        L = c.binary("add", _tril(c, lower, -1), _eye(c, m, k, lu.dtype), lu.dtype)
        U = _triu(c, _slice(c, lu, len(lu.shape) - 2, 0, k, 1))
    else:
        L, U = _empty(c, 1, lu.dtype), _empty(c, 2, lu.dtype)
    return p, L, U


@lowers(aten.lu_unpack, doc="linalg pivot_permutation, eq (P as one-hot rows), masks (L and U)")
def _lu_unpack(c, lu, pivots, unpack_data=True, unpack_pivots=True):
    return _unpack(c, lu, pivots, unpack_data, unpack_pivots)


@lowers(aten.linalg_lu, doc="linalg lu_factor, then as lu_unpack")
def _linalg_lu(c, a, pivot=True):
    lu, pivots, _ = _lu(c, a, pivot)
    p, L, U = _unpack(c, lu, pivots, True, bool(pivot))
    return p, L, U


@lowers(aten.linalg_lu_solve, doc="linalg pivot_permutation, gather (rows), two linalg triangular_solve")
def _linalg_lu_solve(c, lu, pivots, b, left=True, adjoint=False):
    return _lu_solve(c, lu, pivots, b, left, adjoint)


@lowers(aten.linalg_solve_triangular, doc="linalg triangular_solve (right-hand solves transposed)")
def _linalg_solve_triangular(c, a, b, upper, left=True, unitriangular=False):
    if left:
        return _solve_tri(c, a, b, upper, unitriangular)
    return _mT(c, _solve_tri(c, _mT(c, a), _mT(c, b), not upper, unitriangular))


@lowers(aten.triangular_solve, doc="linalg triangular_solve")
def _triangular_solve(c, b, a, upper=True, transpose=False, unitriangular=False):
    x = _solve_tri(c, _mT(c, a) if transpose else a, b, upper != bool(transpose), unitriangular)
    return x, c.one("copy", [c.expand(a, _meta_shape(c, 1))], _meta_shape(c, 1), a.dtype)


@lowers(aten._linalg_det, doc="linalg lu_factor, the product of U's diagonal and the pivots' signs")
def _linalg_det(c, a):
    src = _mT(c, a) if _contiguous(c) else a       # as PyTorch: the LU of A^T when A is contiguous
    lu, pivots, _ = _lu(c, src)
    d, flips = _diag_product(c, lu, pivots)
    return _product(c, c.binary("mul", d, flips, lu.dtype)), lu, pivots


@lowers(aten._linalg_slogdet, doc="linalg lu_factor; sign: the product of signs; the log of abs(det): a sum of logs of abs(U_ii)")
def _linalg_slogdet(c, a):
    src = _mT(c, a) if _contiguous(c) else a
    lu, pivots, _ = _lu(c, src)
    d, flips = _diag_product(c, lu, pivots)
    sign = _product(c, c.binary("mul", _sign(c, d), flips, lu.dtype))
    logabs = c.reduce("sum", c.unary("log", c.unary("abs", d)), (len(d.shape) - 1,), False)
    return sign, logabs, lu, pivots


@lowers(aten.linalg_inv_ex, doc="linalg lu_factor, then as linalg_lu_solve of the identity")
def _linalg_inv_ex(c, a, check_errors=False):
    lu, pivots, info = _lu(c, a)
    n = a.shape[-1]
    eye = c.expand(_eye(c, n, n, a.dtype), a.shape)
    return _lu_solve(c, lu, pivots, eye), info


@lowers(aten._linalg_solve_ex, doc="linalg lu_factor, then as linalg_lu_solve")
def _linalg_solve_ex(c, a, b, left=True, check_errors=False):
    vector = len(b.shape) == 1 or (len(b.shape) == len(a.shape) - 1 and b.shape == a.shape[:-1])
    bm = c.reshape(b, b.shape + (1,)) if vector else b
    if not left and vector:
        bm = c.reshape(b, b.shape[:-1] + (1, b.shape[-1]))
    lu, pivots, info = _lu(c, a)
    x = _lu_solve(c, lu, pivots, bm, left)
    return c.reshape(x, _meta_shape(c, 0)), lu, pivots, info


# ---- Cholesky ----------------------------------------------------------------------------------------
def _cholesky(c, a: Value) -> tuple[Value, Value]:
    a = _float(c, a)
    return tuple(_linalg(c, "cholesky", [a], [(a.shape, a.dtype), (a.shape[:-2], np.int32)]))


@lowers(aten.linalg_cholesky_ex, doc="linalg cholesky (the upper factor: of the transpose, transposed)")
def _linalg_cholesky_ex(c, a, upper=False, check_errors=False):
    if upper:
        L, info = _cholesky(c, _mT(c, a))
        return _mT(c, L), info
    return _cholesky(c, a)


def _chol_solve(c, factor: Value, b: Value, upper: bool) -> Value:
    """X with A X = B, A = L L^T (U^T U when `upper`)."""
    if upper:
        y = _solve_tri(c, _mT(c, factor), b, upper=False)
        return _solve_tri(c, factor, y, upper=True)
    y = _solve_tri(c, factor, b, upper=False)
    return _solve_tri(c, _mT(c, factor), y, upper=True)


@lowers(aten.cholesky_solve, doc="two linalg triangular_solve")
def _cholesky_solve(c, b, factor, upper=False):
    return _chol_solve(c, factor, b, upper)


@lowers(aten.cholesky_inverse, doc="two linalg triangular_solve of the identity")
def _cholesky_inverse(c, factor, upper=False):
    n = factor.shape[-1]
    return _chol_solve(c, factor, c.expand(_eye(c, n, n, factor.dtype), factor.shape), upper)


# ---- QR -------------------------------------------------------------------------------------------
def _geqrf(c, a: Value) -> tuple[Value, Value]:
    a = _float(c, a)
    m, n = a.shape[-2:]
    return tuple(_linalg(c, "geqrf", [a], [(a.shape, a.dtype), (a.shape[:-2] + (min(m, n),), a.dtype)]))


def _householder(c, v: Value, tau: Value) -> Value:
    return _linalg(c, "householder", [v, tau], [(v.shape, v.dtype)])[0]


def _full_q(c, v: Value, tau: Value) -> Value:
    """The m x m product of the reflectors of v [..., m, >= r] with scales tau [..., r]: v's first
    r columns, zero columns and zero scales after them (reflectors that are the identity)."""
    m, r = v.shape[-2], tau.shape[-1]
    v = _slice(c, v, len(v.shape) - 1, 0, r, 1)
    if r < m:
        batch = v.shape[:-2]
        v = c.one("cat", [v, c.const(np.zeros(batch + (m, m - r)), v.dtype)], batch + (m, m), v.dtype,
                  **_cat_attrs(v.shape, m, r))
        tau = c.one("cat", [tau, c.const(np.zeros(tau.shape[:-1] + (m - r,)), tau.dtype)],
                    tau.shape[:-1] + (m,), tau.dtype, **_cat_attrs(tau.shape, m, r))
    return _householder(c, v, tau)


def _cat_attrs(shape, m, r):
    rank = len(shape)
    first = tuple(slice(None) for _ in range(rank - 1)) + (slice(0, r),)
    second = tuple(slice(None) for _ in range(rank - 1)) + (slice(r, m),)
    return {"keys": (first, second)}


@lowers(aten.geqrf, doc="linalg geqrf (Householder QR, LAPACK's reflectors)")
def _geqrf_op(c, a):
    return _geqrf(c, a)


@lowers(aten.linalg_householder_product, doc="linalg householder (LAPACK's orgqr)")
def _householder_product(c, v, tau):
    return _householder(c, v, c.cast(tau, v.dtype))


@lowers(aten.linalg_qr, doc="linalg geqrf, linalg householder (Q), mask (R)")
def _linalg_qr(c, a, mode="reduced"):
    m, n = a.shape[-2:]
    k = min(m, n)
    qr, tau = _geqrf(c, a)
    if mode == "complete":
        q = _full_q(c, qr, tau) if m > n else _householder(c, _slice(c, qr, len(a.shape) - 1, 0, m, 1), tau)
        return q, _triu(c, qr)
    R = _triu(c, _slice(c, qr, len(a.shape) - 2, 0, k, 1))
    if mode == "r":
        return _empty(c, 0, a.dtype), R
    if mode != "reduced":
        raise c.error(f"linalg.qr mode {mode!r}: the modes are 'reduced', 'complete' and 'r'")
    return _householder(c, _slice(c, qr, len(a.shape) - 1, 0, k, 1), tau), R


@lowers(aten.ormqr, doc="linalg householder (the full Q), matmul")
def _ormqr(c, v, tau, other, left=True, transpose=False):
    q = _full_q(c, v, c.cast(tau, v.dtype))
    q = _mT(c, q) if transpose else q
    return _mm(c, q, other) if left else _mm(c, other, q)


# ---- eigh, SVD and what is made of them ---------------------------------------------------------------
def _eigh(c, a: Value, lower: bool = True) -> tuple[Value, Value]:
    a = _float(c, a)
    return tuple(_linalg(c, "eigh", [a], [(a.shape[:-1], a.dtype), (a.shape, a.dtype)], lower=bool(lower)))


def _svd(c, a: Value, full_matrices: bool = False) -> tuple[Value, Value, Value]:
    a = _float(c, a)
    m, n = a.shape[-2:]
    k = min(m, n)
    batch = a.shape[:-2]
    uc, vr = (m, n) if full_matrices else (k, k)
    u, s, vh = _linalg(c, "svd", [a], [(batch + (m, uc), a.dtype), (batch + (k,), a.dtype),
                                       (batch + (vr, n), a.dtype)], full_matrices=bool(full_matrices))
    return u, s, vh


@lowers(aten._linalg_eigh, doc="linalg eigh (Jacobi; eigenvectors up to sign, see docs)")
def _linalg_eigh(c, a, UPLO="L", compute_v=True):
    w, v = _eigh(c, a, UPLO.upper() == "L")
    return w, (v if compute_v else _empty(c, 1, a.dtype))


@lowers(aten._linalg_svd, doc="linalg svd (one-sided Jacobi; singular vectors up to sign, see docs)")
def _linalg_svd(c, a, full_matrices=False, compute_uv=True, driver=None):
    u, s, vh = _svd(c, a, full_matrices and compute_uv)
    if not compute_uv:
        return _empty(c, 0, a.dtype), s, _empty(c, 2, a.dtype)
    return u, s, vh


def _scale_columns(c, x: Value, s: Value) -> Value:
    """x [..., m, k] times s [..., k] column by column."""
    return c.binary("mul", x, c.reshape(s, s.shape[:-1] + (1, s.shape[-1])), x.dtype)


@lowers(aten.linalg_pinv, doc="linalg svd (or eigh when hermitian): V diag(1/s where s > tol) U^T")
def _linalg_pinv(c, a, *args, **kwargs):
    a = _float(c, a)
    target = c.node.target
    hermitian = kwargs.get("hermitian", False)
    atol = rtol = None
    if target == aten.linalg_pinv.default or target == aten.linalg_pinv.rcond_tensor:
        rtol = args[0] if args else kwargs.get("rcond")
        hermitian = args[1] if len(args) > 1 else hermitian
        atol = 0.0
    else:
        atol, rtol = kwargs.get("atol"), kwargs.get("rtol")
    m, n = a.shape[-2:]
    if hermitian:
        w, v = _eigh(c, a, True)
        s, u, right = c.unary("abs", w), v, v
        values = w
    else:
        u, s, vh = _svd(c, a)
        right, values = _mT(c, vh), s
    biggest = c.reduce("max", s, (len(s.shape) - 1,), True) if s.shape[-1] else c.const(np.zeros(s.shape), s.dtype)
    default_rtol = F32_EPS * max(m, n)
    if rtol is None:
        rtol = default_rtol if atol is None else _default_rtol(c, atol, default_rtol, s.dtype)
    atol = 0.0 if atol is None else atol
    tol = c.binary("max", c.binary("mul", biggest, _operand(c, rtol, s.dtype), s.dtype),
                   _operand(c, atol, s.dtype), s.dtype)
    keep = c.cast(c.binary("gt", s, tol, dtype=s.dtype), s.dtype)
    safe = c.binary("add", values, c.unary("scale", keep, scale=-1.0, bias=1.0), s.dtype)   # 1 where dropped
    inv = c.binary("relu_grad", keep, c.unary("reciprocal", safe), s.dtype)
    return _mm(c, _scale_columns(c, right, inv), _mT(c, u))


def _operand(c, x, dtype) -> Value:
    if isinstance(x, Value):
        x = c.cast(x, dtype)
        return c.reshape(x, x.shape + (1,)) if x.shape else x
    return c.const(float(x), dtype)


def _default_rtol(c, atol, default_rtol, dtype):
    """PyTorch's rule: rtol is 0 when atol is given and positive, else eps * max(m, n)."""
    if not isinstance(atol, Value):
        return 0.0 if atol > 0 else default_rtol
    positive = c.cast(c.binary("gt", atol, 0.0, dtype=dtype), dtype)
    return c.unary("scale", positive, scale=-default_rtol, bias=default_rtol)


@lowers(aten.linalg_matrix_exp, doc="linalg matrix_exp (scaling and squaring)")
def _matrix_exp(c, a):
    a = _float(c, a)
    return _linalg(c, "matrix_exp", [a], [(a.shape, a.dtype)])[0]


@lowers(aten.linalg_matrix_sqrth, doc="linalg eigh (lower triangle): V diag(sqrt(w)) V^T")
def _matrix_sqrth(c, a):
    w, v = _eigh(c, a, True)
    return _mm(c, _scale_columns(c, v, c.unary("sqrt", w)), _mT(c, v))


@lowers(aten.linalg_polar, doc="linalg svd: U = W Vh, H = Vh^T diag(s) Vh")
def _linalg_polar(c, a):
    w, s, vh = _svd(c, a)
    return _mm(c, w, vh), _mm(c, _scale_columns(c, _mT(c, vh), s), vh)


# ---- LDL ------------------------------------------------------------------------------------------
@lowers(aten.linalg_ldl_factor_ex, doc="linalg ldl_factor (Bunch-Kaufman, LAPACK's sytrf form)")
def _ldl_factor_ex(c, a, hermitian=False, check_errors=False):
    a = _float(c, a)
    return tuple(_linalg(c, "ldl_factor", [a], [(a.shape, a.dtype), (a.shape[:-1], np.int32),
                                                (a.shape[:-2], np.int32)]))


@lowers(aten.linalg_ldl_solve, doc="linalg ldl_solve (LAPACK's sytrs)")
def _ldl_solve(c, ld, pivots, b, hermitian=False):
    ld = _float(c, ld)
    batch = _batch(ld.shape, b.shape)
    ld, b = _to_batch(c, ld, batch), _to_batch(c, c.cast(b, ld.dtype), batch)
    pivots = c.expand(c.cast(pivots, np.int32), batch + pivots.shape[-1:])
    return _linalg(c, "ldl_solve", [ld, pivots, b], [(b.shape, ld.dtype)])[0]


# ---- decompositions for the capture ----------------------------------------------------------------
LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def _lstsq(a, b, rcond=None, *, driver=None):
    """torch.linalg.lstsq with the shapes its outputs take, known before the data: the solution
    from the pseudo-inverse (the least-squares solution of least norm, LAPACK's for a full-rank
    matrix and, with rcond as the pseudo-inverse's rtol, gelsy's, gelsd's and gelss's for any);
    the squared residuals of a tall matrix for 'gels' (which assumes full rank); the rank for
    'gelsy', 'gelsd' and 'gelss', the singular values for 'gelsd' and 'gelss'. PyTorch's fake
    tensors refuse the op: its residuals' shape depends on the rank for the other drivers, so a
    tall matrix with those is refused here with how to change it."""
    driver = driver or "gelsy"
    if driver not in LSTSQ_DRIVERS:
        raise ValueError(f"torch.linalg.lstsq: driver {driver!r} is not one of {LSTSQ_DRIVERS}")
    m, n = a.shape[-2:]
    if m > n and driver != "gels":
        raise ValueError(f"torch.linalg.lstsq of a tall {m} x {n} matrix with driver {driver!r}: its residuals "
                         "are returned only for full-rank matrices, a shape that depends on the data, which the "
                         "IPU's static graph cannot have; pass driver='gels' (full rank assumed) or compute "
                         "torch.linalg.pinv(A) @ B")
    vector = b.dim() == 1
    bm = b.unsqueeze(-1) if vector else b
    eps = torch.finfo(a.dtype).eps
    rtol = rcond if rcond is not None and rcond > 0 else eps * max(m, n)
    x = torch.linalg.pinv(a, rtol=rtol if driver != "gels" else None) @ bm
    empty = a.new_empty((0,))
    residuals = ((a @ x - bm) ** 2).sum(-2) if m > n else empty
    if driver == "gels":
        rank = empty.long()
    else:
        s = torch.linalg.svdvals(a)
        rank = (s > rtol * s[..., :1]).sum(-1)
    singular = torch.linalg.svdvals(a) if driver in ("gelsd", "gelss") else empty
    return (x.squeeze(-1) if vector else x), residuals, rank, singular


DECOMPOSITIONS = {aten.linalg_lstsq.default: _lstsq}
