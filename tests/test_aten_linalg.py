"""ATen's dense linear algebra through the whole compiler (poptorch_lite.compiler.linalg onto
ipusim.ops.linalg) against eager PyTorch: values and the gradients of PyTorch's own autograd
formulas, and a model trained through slogdet, Cholesky solves and an inverse."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import poptorch_lite as poptorch
from poptorch_lite.compiler.aten import UnsupportedOpError

from test_compiled_ops import run_op


EYE = {n: torch.eye(n) for n in range(1, 8)}   # constants (torch.eye in a model traces to uint8 arithmetic)


def spd(p):
    """A symmetric positive-definite matrix (batch) made from a parameter."""
    n = p.shape[-1]
    return p @ p.mT + n * EYE[n]


def flat(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


CASES = {
    "det": (lambda a: torch.linalg.det(a), [(2, 4, 4)]),
    "slogdet": (lambda a: flat(*torch.linalg.slogdet(a)), [(3, 3, 3)]),
    "logdet": (lambda a: torch.logdet(spd(a)), [(4, 4)]),
    "inv": (lambda a: torch.linalg.inv(a), [(2, 4, 4)]),
    "solve": (lambda a, b: torch.linalg.solve(a, b), [(2, 4, 4), (2, 4, 3)]),
    "solve vector": (lambda a, b: torch.linalg.solve(a, b), [(4, 4), (4,)]),
    "solve right, broadcast": (lambda a, b: torch.linalg.solve(a, b, left=False), [(4, 4), (2, 3, 4)]),
    "cholesky": (lambda a: torch.linalg.cholesky(spd(a)), [(2, 4, 4)]),
    "cholesky upper": (lambda a: torch.linalg.cholesky(spd(a), upper=True), [(4, 4)]),
    "cholesky_solve": (lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(spd(a))), [(4, 4), (4, 2)]),
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(torch.linalg.cholesky(spd(a)), upper=False), [(3, 3)]),
    "lu_factor and lu_solve": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), [(4, 4), (4, 2)]),
    "lu_solve adjoint, right": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False,
                                                                   adjoint=True), [(4, 4), (2, 4)]),
    "lu": (lambda a: flat(*torch.linalg.lu(a)), [(3, 5)]),
    "lu tall": (lambda a: flat(*torch.linalg.lu(a)), [(5, 3)]),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a.triu() + 4 * EYE[4], b, upper=True),
                         [(4, 4), (4, 2)]),
    "solve_triangular right, unit": (lambda a, b: torch.linalg.solve_triangular(a.tril(), b, upper=False,
                                                                                left=False, unitriangular=True),
                                     [(4, 4), (3, 4)]),
    "triangular_solve transposed": (lambda b, a: torch.triangular_solve(b, a.triu() + 4 * EYE[4],
                                                                        transpose=True).solution, [(4, 2), (4, 4)]),
    "qr": (lambda a: flat(*torch.linalg.qr(a)), [(2, 5, 3)]),
    "qr complete": (lambda a: flat(*torch.linalg.qr(a, mode="complete")), [(3, 5)]),
    "qr wide": (lambda a: flat(*torch.linalg.qr(a)), [(3, 5)]),
    "householder_product": (lambda a, t: torch.linalg.householder_product(a, t), [(5, 3), (2,)]),
    "ormqr": (lambda a, t, c: torch.ormqr(a, t, c, transpose=True), [(4, 3), (3,), (4, 2)]),
    "svdvals": (lambda a: torch.linalg.svdvals(a), [(2, 5, 3)]),
    "nuclear norm": (lambda a: torch.linalg.matrix_norm(a, "nuc"), [(3, 4)]),
    "pinv": (lambda a: torch.linalg.pinv(a), [(5, 3)]),
    "pinv hermitian": (lambda a: torch.linalg.pinv(spd(a), hermitian=True), [(4, 4)]),
    "eigvalsh": (lambda a: torch.linalg.eigvalsh(a + a.mT), [(2, 4, 4)]),
    "eigh projector": (lambda a: (lambda wv: wv[1] @ torch.diag_embed(wv[0]) @ wv[1].mT)(torch.linalg.eigh(a + a.mT)),
                       [(4, 4)]),
    "svd projector": (lambda a: (lambda usv: usv[0] @ usv[0].mT)(torch.linalg.svd(a, full_matrices=False)),
                      [(5, 3)]),
    "lstsq tall": (lambda a, b: torch.linalg.lstsq(a, b, driver="gels").solution, [(5, 3), (5, 2)]),
    "lstsq wide": (lambda a, b: torch.linalg.lstsq(a, b).solution, [(2, 4), (2, 3)]),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a), [(2, 3, 3)]),
    "matrix_sqrth": (lambda a: torch.linalg.matrix_sqrth(spd(a)), [(3, 3)]),
    "polar": (lambda a: flat(*torch.linalg.polar(a)), [(3, 3)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_linalg_op_and_its_gradient_match_pytorch(case):
    fn, shapes = CASES[case]
    run_op(fn, *shapes, rtol=1e-4, atol=1e-4)


def test_sign_independent_results_of_eigh_and_svd_match_while_vectors_match_up_to_sign():
    class Decompose(nn.Module):
        def forward(self, a):
            w, v = torch.linalg.eigh(a + a.mT)
            u, s, vh = torch.linalg.svd(a)
            return w, v, u, s, vh

    a = torch.randn(2, 4, 4)
    got = poptorch.inferenceModel(Decompose())(a)
    want = Decompose()(a)
    for k in (0, 3):
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-4, atol=1e-5)
    for k, dim in ((1, -2), (2, -2), (4, -1)):
        dots = (got[k] * want[k]).sum(dim).abs()
        np.testing.assert_allclose(dots.numpy(), 1, atol=1e-4)


def test_complete_qr_of_a_tall_matrix_and_ormqr_from_the_left_and_right():
    class Full(nn.Module):
        def forward(self, a, c):
            q, r = torch.linalg.qr(a, mode="complete")
            qr, tau = torch.geqrf(a)
            return q, r, torch.ormqr(qr, tau, c), torch.ormqr(qr, tau, c.mT, left=False, transpose=True)

    a, c = torch.randn(2, 5, 3), torch.randn(2, 5, 2)
    for got, want in zip(poptorch.inferenceModel(Full())(a, c), Full()(a, c)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def test_ldl_factor_and_solve_are_lapacks():
    class LDL(nn.Module):
        def forward(self, a, b):
            ld, piv = torch.linalg.ldl_factor(a)
            return ld, piv, torch.linalg.ldl_solve(ld, piv, b)

    torch.manual_seed(2)
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 3)
    a = a + a.mT
    got, want = poptorch.inferenceModel(LDL())(a, b), LDL()(a, b)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[1].numpy(), want[1].numpy())
    np.testing.assert_allclose(got[2].numpy(), want[2].numpy(), rtol=1e-4, atol=1e-4)


def test_lstsq_outputs_have_pytorchs_shapes_and_a_tall_matrix_needs_gels():
    class Lstsq(nn.Module):
        def __init__(self, driver):
            super().__init__()
            self.driver = driver

        def forward(self, a, b):
            return tuple(torch.linalg.lstsq(a, b, driver=self.driver))

    torch.manual_seed(3)
    for shape, driver in (((2, 6, 3), "gels"), ((3, 5), "gelsd"), ((3, 5), "gelsy")):
        a, b = torch.randn(shape), torch.randn(shape[:-1] + (2,))
        got, want = poptorch.inferenceModel(Lstsq(driver))(a, b), Lstsq(driver)(a, b)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pass driver='gels'"):
        poptorch.inferenceModel(Lstsq("gelsy"))(torch.randn(5, 3), torch.randn(5, 2))


def test_determinant_of_a_singular_matrix_is_zero_and_info_names_it():
    class Factor(nn.Module):
        def forward(self, a):
            return torch.linalg.det(a), torch.linalg.lu_factor_ex(a).info, torch.linalg.slogdet(a)

    a = torch.tensor([[[1.0, 2.0], [2.0, 4.0]], [[2.0, 0.0], [0.0, 3.0]]])
    det, info, (sign, logabs) = poptorch.inferenceModel(Factor())(a)
    np.testing.assert_allclose(det.numpy(), [0, 6], atol=1e-6)
    np.testing.assert_array_equal(info.numpy(), [2, 0])
    np.testing.assert_array_equal(sign.numpy(), [0, 1])
    assert logabs[0] == -np.inf


class GaussianNLL(nn.Module):
    """The negative log-likelihood of x under N(mu, L L^T + I): slogdet, a Cholesky solve and an
    inverse in one loss."""

    def __init__(self, n):
        super().__init__()
        torch.manual_seed(1)
        self.mu = nn.Parameter(torch.randn(n))
        self.factor = nn.Parameter(torch.randn(n, n) * 0.5)

    def forward(self, x):
        cov = self.factor @ self.factor.mT + EYE[self.factor.shape[0]]
        d = (x - self.mu).unsqueeze(-1)
        chol = torch.linalg.cholesky(cov)
        quad = (d * torch.cholesky_solve(d, chol)).sum()
        _, logdet = torch.linalg.slogdet(cov)
        ridge = torch.linalg.inv(cov).diagonal().sum()
        loss = 0.5 * quad + 0.5 * x.shape[0] * logdet + 0.01 * ridge
        return poptorch.identity_loss(loss, reduction="sum")


def test_training_through_slogdet_cholesky_and_inverse_follows_pytorch():
    model = GaussianNLL(3)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 3) + 1.0
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(3):
        loss = training(x)
        opt.zero_grad()
        want = ref(x)
        want.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), float(want.detach()), rtol=1e-4)
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_complex_eigendecomposition_stays_refused_naming_the_op():
    class Eig(nn.Module):
        def forward(self, a):
            return torch.linalg.eigvals(a).real

    with pytest.raises(UnsupportedOpError, match="linalg_eig"):
        poptorch.inferenceModel(Eig())(torch.randn(3, 3))
