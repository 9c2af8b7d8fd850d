"""Serialised matmuls (poptorch.serializedMatMul, ipusim.ops.matmul.serialized_matmul): the
product runs as `factor` smaller products along the mode's dimension; the peak of temporary
memory falls, cycles follow the pieces, values are the plain product's (bit-identical for row
and column pieces, within float32 rounding of a sum of `factor` partial products for the
reducing dimension)."""
import re

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops import matmul as mm

T = ip.Target.test(64, 256 * 1024)
M, K, N = 96, 128, 80
MODES = ["input_channels", "reducing_dim", "output_channels"]


def run(mode, factor, emulator, dtype="float32", keep_precision=False):
    """(result, A, B, cycles, peak temporary bytes) of one product on the test target."""
    g, prog = ip.Graph(T), ip.Sequence()
    a, b = g.addVariable(dtype, (M, K), "a"), g.addVariable(dtype, (K, N), "b")
    g.map_linearly(a)
    g.map_linearly(b)
    c = mm.matmul(g, a, b, prog, "mm") if mode is None else \
        mm.serialized_matmul(g, a, b, prog, mode, factor, "mm", keep_precision=keep_precision)
    engine = ip.Engine(g, [prog], mode=emulator).load()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((M, K)).astype(dtype), rng.standard_normal((K, N)).astype(dtype)
    engine.writeTensor(a, x)
    engine.writeTensor(b, y)
    engine.execute(0)
    report = engine.memory[0]
    return engine.readTensor(c), x, y, engine.costs[0].total, report.live_peak_by_category.get("temporaries", 0)


@pytest.mark.parametrize("emulator", ["fast", "strict"])
@pytest.mark.parametrize("mode", MODES)
def test_pieces_need_less_temporary_memory_and_give_the_product(mode, emulator):
    plain, x, y, cycles, peak = run(None, 1, emulator)
    for factor in (2, 4, 8):
        got, _, _, c, p = run(mode, factor, emulator)
        assert p < peak, (factor, p, peak)
        assert c > cycles
        if mode == "reducing_dim":   # another summation order
            np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
        else:   # the same sums, in the same parts of K
            assert np.array_equal(got, plain)
        np.testing.assert_allclose(got, x.astype(np.float64) @ y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_fast_and_strict_modes_agree_and_cycles_do_not_depend_on_the_mode(mode):
    fast, strict = run(mode, 4, "fast"), run(mode, 4, "strict")
    np.testing.assert_allclose(fast[0], strict[0], rtol=1e-5, atol=1e-5)
    assert fast[3:] == strict[3:]


def test_float16_reducing_pieces_sum_in_float32_with_keep_precision():
    exact = None
    errors = {}
    for keep in (False, True):
        got, x, y, _, _ = run("reducing_dim", 8, "fast", "float16", keep)
        exact = x.astype(np.float64) @ y.astype(np.float64)
        assert got.dtype == np.float16
        errors[keep] = np.abs(got - exact).max()
    assert errors[True] <= errors[False]
    assert errors[True] < 0.05


def test_a_factor_must_divide_the_dimension():
    g, prog = ip.Graph(T), ip.Sequence()
    a, b = g.addVariable("float32", (M, K), "a"), g.addVariable("float32", (K, N), "b")
    with pytest.raises(ValueError, match=r"positive divisor of M \(the rows of the result\) = 96"):
        mm.serialized_matmul(g, a, b, prog, "input_channels", 7)
    with pytest.raises(ValueError, match="unknown serialisation mode"):
        mm.serialized_matmul(g, a, b, prog, "rows", 2)


# ---- poptorch.serializedMatMul ---------------------------------------------------------------------
class Product(torch.nn.Module):
    """x @ w1 @ w2, both products serialised."""

    def __init__(self, mode, factor, keep_precision=False):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(200, 40) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(40, 40) * 0.1)
        self.mode, self.factor, self.keep = mode, factor, keep_precision

    def forward(self, x, y=None):
        h = poptorch.serializedMatMul(x, self.w1, self.mode, self.factor, self.keep)
        out = poptorch.serializedMatMul(h, self.w2, self.mode, self.factor, self.keep)
        if y is None:
            return out
        return out, torch.nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("mode", list(poptorch.MatMulSerializationMode))
def test_inference_gives_torch_values(mode):
    torch.manual_seed(0)
    model = Product(mode, 5 if mode is not poptorch.MatMulSerializationMode.Disabled else 0)
    x = torch.rand(2, 10, 200)
    got = poptorch.inferenceModel(model)(x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", list(poptorch.MatMulSerializationMode))
def test_training_serialises_the_gradients_and_learns_as_the_plain_product(mode):
    runs = []
    for m in (mode, poptorch.MatMulSerializationMode.Disabled):
        torch.manual_seed(0)
        model = Product(m, 4 if m is not poptorch.MatMulSerializationMode.Disabled else 0)
        training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.rand(8, 200), torch.rand(8, 40)
        training(x, y)
        runs.append(([p.detach().clone() for p in (model.w1, model.w2)], training._executable))
    (serial, exe), (plain, _) = runs
    for s, p in zip(serial, plain):
        torch.testing.assert_close(s, p, rtol=1e-5, atol=1e-6)
    names = [p.name for p in exe.engine.programs]
    pieces = sum(1 for node in exe.engine.programs for n in ip.device.program.walk(node)
                 if isinstance(n, ip.device.program.OpProgram) and re.search(r"/piece\d+$", n.name))
    if mode is poptorch.MatMulSerializationMode.Disabled:
        assert pieces == 0
    else:
        # two forward products, both weights' gradients and h's gradient (none for the data), 4 pieces each
        assert pieces == 5 * 4, names


@pytest.mark.parametrize("mode, factor, message", [
    (poptorch.MatMulSerializationMode.InputChannels, 3,
     "Invalid serialisation factor 3 for input channels dimension 10"),
    (poptorch.MatMulSerializationMode.ReducingDim, 7, "Invalid serialisation factor 7 for reducing dimension 200"),
    (poptorch.MatMulSerializationMode.OutputChannels, 0, "Invalid serialisation factor 0"),
    ("input_channels", 2, "mode must be a poptorch.MatMulSerializationMode"),
])
def test_poptorch_errors(mode, factor, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.serializedMatMul(torch.rand(2, 10, 200), torch.rand(200, 40), mode, factor)


def test_keep_precision_for_half_inputs():
    torch.manual_seed(0)
    x, w = torch.rand(1, 10, 200).half(), torch.rand(200, 45).half()

    class Half(torch.nn.Module):
        def forward(self, x, w):
            return poptorch.serializedMatMul(x, w, poptorch.MatMulSerializationMode.ReducingDim, 10, True)

    got = poptorch.inferenceModel(Half())(x, w)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ w.float(), rtol=0.01, atol=0.05)


def test_half_partials_from_precision_options_shrink_the_k_split_and_keep_torch_values():
    """Precision.setPartialsType(torch.half): a float16 product's K-split writes float16 partials
    (PopLibs' partialsType "half"): fewer cycles and bytes than float partials, values within
    float16 rounding of each K slice."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 4096).half(), torch.randn(4096, 64).half()

    class Half(torch.nn.Module):
        def forward(self, x, w):
            return x @ w

    runs = {}
    for partials in (torch.float, torch.half):
        opts = poptorch.Options().logCycleCount(True)
        opts.Precision.setPartialsType(partials)
        model = poptorch.inferenceModel(Half(), opts)
        got = model(x, w)
        part = [v for v in model._executable.engine.device.graphs[0].variables if v.name.endswith("/partials")]
        runs[partials] = part, model.cycleCount()
        assert part and {v.dtype for v in part} == {np.dtype("float16" if partials == torch.half else "float32")}
        torch.testing.assert_close(got.float(), x.float() @ w.float(), rtol=0.01, atol=0.5)
    assert sum(v.nbytes for v in runs[torch.half][0]) * 2 == sum(v.nbytes for v in runs[torch.float][0])
    assert runs[torch.half][1] < runs[torch.float][1]


def test_a_partials_type_popart_does_not_know_is_an_error():
    opts = poptorch.Options()
    opts._Popart.set("partialsTypeMatMuls", "quarter")
    with pytest.raises(poptorch.Error, match="partialsTypeMatMuls must be 'float' or 'half', got 'quarter'"):
        poptorch.inferenceModel(torch.nn.Linear(4, 4), opts)(torch.rand(2, 4))
