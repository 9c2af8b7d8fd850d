"""Device control flow: poptorch.for_loop (one Repeat over one body), poptorch.cond (an If on device
data), poptorch.nop, poptorch.dynamic_slice and dynamic_update, with PopTorch's semantics and errors
(its loop_test.py and if_test.py behaviours), on the device and on the CPU."""
import time

import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device.program import walk


def infer(model, *args, mode="fast", options=None):
    opts = options or poptorch.Options()
    opts.Emulator.setMode(mode)
    pm = poptorch.inferenceModel(model, opts)
    return pm(*args), pm


def repeats(pm) -> list:
    return [p for prog in pm._executable.engine.programs for p in walk(prog) if isinstance(p, ip.Repeat)]


# ---- for_loop ---------------------------------------------------------------------------------------
class Recurrence(torch.nn.Module):
    def __init__(self, count):
        super().__init__()
        self.count = count
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return poptorch.for_loop(self.count, lambda h: torch.tanh(self.lin(h)) * 0.5 + h, [x])[0]

    def unrolled(self, x):
        with torch.no_grad():
            for _ in range(self.count):
                x = torch.tanh(self.lin(x)) * 0.5 + x
        return x


def test_a_loop_is_one_repeat_over_one_body_and_costs_its_iterations():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    bodies, costs = {}, {}
    for count in (10, 20):
        m = Recurrence(count)
        out, pm = infer(m, x)
        torch.testing.assert_close(out, m.unrolled(x), rtol=1e-5, atol=1e-5)
        (rep,) = repeats(pm)
        assert rep.count == count
        bodies[count] = sum(1 for p in walk(rep.body) if isinstance(p, ip.Execute))
        engine = pm._executable.engine
        costs[count] = engine.cost(rep).total
        assert costs[count] == count * engine.cost(rep.body).total
    assert bodies[10] == bodies[20] > 0


def test_a_thousand_iterations_compile_in_about_the_time_of_one():
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def compile_seconds(count):
        m = Recurrence(count)
        pm = poptorch.inferenceModel(m)
        start = time.perf_counter()
        pm.compile(x)
        return time.perf_counter() - start, m, pm

    compile_seconds(1)   # warm: kernels, decompositions
    one, _, pm1 = compile_seconds(1)
    thousand, m, pm = compile_seconds(1000)
    assert thousand < 3 * one + 1.0, (one, thousand)
    body = lambda p: sum(1 for n in walk(repeats(p)[0].body) if isinstance(n, ip.Execute))  # noqa: E731
    assert body(pm) == body(pm1)
    torch.testing.assert_close(pm(x), m.unrolled(x), rtol=1e-4, atol=1e-4)


def test_loop_strict_and_fast_modes_agree():
    torch.manual_seed(1)
    m, x = Recurrence(5), torch.randn(3, 8)
    fast, _ = infer(m, x, mode="fast")
    strict, _ = infer(m, x, mode="strict")
    torch.testing.assert_close(fast, strict, rtol=1e-6, atol=0)


def test_loop_constant_and_closure():
    class Constant(torch.nn.Module):
        def forward(self, x):
            return poptorch.for_loop(10, lambda x: x * 2, [x])[0]

    class Closure(torch.nn.Module):
        def forward(self, x, y):
            return poptorch.for_loop(10, lambda x: x * y, [x])[0]

    assert infer(Constant(), torch.tensor([1.]))[0] == 2 ** 10
    assert infer(Closure(), torch.tensor([1.]), torch.tensor([2.]))[0] == 2 ** 10


def test_loop_multiple_inputs_match_the_host_loop():
    class Model(torch.nn.Module):
        def forward(self, x, y, z, w):
            return poptorch.for_loop(10, lambda x, y, z, w: (x * y, y + z, x * w, w + 1), [x, y, z, w])

    args = [torch.tensor([v]) for v in (0.1, 0.2, 0.3, 0.4)]
    out, _ = infer(Model(), *args)
    x, y, z, w = (a.clone() for a in args)
    for _ in range(10):
        x, y, z, w = x * y, y + z, x * w, w + 1
    for host, ipu in zip((x, y, z, w), out):
        assert host == ipu


def test_loop_swapping_carried_values_reads_them_all_before_writing():
    class Swap(torch.nn.Module):
        def forward(self, a, b):
            return poptorch.for_loop(3, lambda a, b: (b, a + 1), [a, b])

    a, b = torch.tensor([1.]), torch.tensor([10.])
    out, _ = infer(Swap(), a, b)
    assert [float(t) for t in out] == [11., 3.]   # (1, 10) -> (10, 2) -> (2, 11) -> (11, 3)
    assert [float(t) for t in poptorch.for_loop(3, lambda a, b: (b, a + 1), [a, b])] == [11., 3.]


def test_a_new_value_made_before_the_old_one_is_last_read_does_not_overwrite_it():
    class Late(torch.nn.Module):
        def forward(self, x, w):
            def body(x, w):
                y = x + 1                               # x's new value ...
                z = x.reshape(2, 2).t().reshape(4) * 2  # ... before a view of x is read
                return y, z + w
            return poptorch.for_loop(3, body, [x, w])

    x, w = torch.arange(4.), torch.ones(4)
    out, _ = infer(Late(), x, w)
    expected = Late()(x, w)
    for got, want in zip(out, expected):
        assert torch.equal(got, want)


def test_loop_argument_errors():
    class NonTensor(torch.nn.Module):
        def forward(self, x):
            return poptorch.for_loop(10, lambda x, y: (x * y, y + 1), [x, 5])

    class NonList(torch.nn.Module):
        def forward(self, x):
            return poptorch.for_loop(10, lambda x: x, x)

    class WrongReturn(torch.nn.Module):
        def forward(self, x):
            return poptorch.for_loop(2, lambda x: (x, x), [x])

    class Reshaping(torch.nn.Module):
        def forward(self, x):
            return poptorch.for_loop(2, lambda x: x.reshape(-1), [x])

    x = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"\(Object contained in list at index 1 is not torch.tensor\)"):
        infer(NonTensor(), x)
    with pytest.raises(ValueError, match=r"\(Object is not list\)"):
        infer(NonList(), x)
    with pytest.raises(poptorch.Error, match="returned 2 tensors for 1 inputs"):
        infer(WrongReturn(), x)
    with pytest.raises(poptorch.Error, match="keep their shapes and types"):
        infer(Reshaping(), x)


def test_loop_bodies_with_weights():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(1, 256)
            self.layer2 = torch.nn.Conv2d(4, 1, [8, 8])

        def forward(self, x):
            def body(x):
                act = self.layer1(x).reshape([1, 4, 8, 8])
                return self.layer2(act).flatten()
            return poptorch.for_loop(2, body, [x])[0]

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(4, 4)

        def forward(self, x):
            return poptorch.for_loop(2, lambda x: self.layer1(self.layer1(x)), [x])

    torch.manual_seed(0)
    m = Model()
    x = torch.tensor([1.])
    with torch.no_grad():
        ref = m.layer2(m.layer1(m.layer2(m.layer1(x).reshape(1, 4, 8, 8)).flatten()).reshape(1, 4, 8, 8)).flatten()
    torch.testing.assert_close(infer(m, x)[0], ref, rtol=1e-5, atol=1e-5)
    t = Twice()
    x = torch.ones(1, 4)
    with torch.no_grad():
        ref = t.layer1(t.layer1(t.layer1(t.layer1(x))))
    torch.testing.assert_close(infer(t, x)[0][0], ref, rtol=1e-5, atol=1e-5)


def test_loop_output_feeds_a_loss_in_inference_but_training_is_refused():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = poptorch.for_loop(2, lambda x: self.layer1(x), [x])[0]
            return out, poptorch.identity_loss(out, reduction="sum")

    x = torch.ones(1, 4)
    out, loss = infer(Model(), x)[0]
    torch.testing.assert_close(loss, out.sum())
    with pytest.raises(poptorch.Error, match=r"poptorch.for_loop\(\) is only supported in inference"):
        poptorch.trainingModel(Model())(x)


def test_loop_inputs_are_passed_by_value():
    class Model(torch.nn.Module):
        def forward(self, x):
            def body(y):
                y += 1
                y += 1
                return y
            return poptorch.for_loop(3, body, [x])[0]

    x = torch.ones(1, 5, dtype=torch.int32)
    out, _ = infer(Model(), x)
    assert torch.equal(x, torch.ones(1, 5, dtype=torch.int32))
    assert torch.equal(out, torch.full((1, 5), 7, dtype=torch.int32))


def test_loop_with_constant_inputs_only():
    class Model(torch.nn.Module):
        def forward(self):
            t0 = torch.tensor([0., 0.]) + 8
            t1, t2 = poptorch.for_loop(5, lambda x, y: (x * 2, y * (x * 2)), [torch.tensor([1., 2.]),
                                                                           torch.tensor([3., 4.])])
            return t1, t0

    out, _ = infer(Model())
    assert torch.equal(out[0], torch.tensor([32., 64.])) and torch.equal(out[1], torch.tensor([8., 8.]))


def test_loops_on_two_ipus():
    class Model(torch.nn.Module):
        def forward(self, x, y):
            with poptorch.Block("0", ipu_id=0):
                x, y = poptorch.for_loop(5, lambda x, y: (x + y, y), [x, y])
            with poptorch.Block("1", ipu_id=1):
                x, y = poptorch.for_loop(5, lambda x, y: (x + y, y), [x, y])
            return x, y

    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution(poptorch.Stage("0"),
                                                                             poptorch.Stage("1")))
    x, y = torch.tensor([1., 2.]), torch.tensor([1., 2.])
    out, pm = infer(Model(), x, y, options=opts)
    torch.testing.assert_close(out[0], x + 10 * y)
    assert sorted(r.body.ipus().pop() for r in repeats(pm)) == [0, 1]


def test_a_value_made_in_a_body_is_not_visible_outside_it():
    class Leaky(torch.nn.Module):
        def forward(self, x):
            seen = []

            def body(h):
                seen.append(h * 3)
                return h + 1
            out = poptorch.for_loop(4, body, [x])[0]
            return out + seen[0]

    with pytest.raises(poptorch.Error, match="made inside the body of poptorch.for_loop"):
        infer(Leaky(), torch.ones(2))


def test_loop_on_the_cpu_runs_the_body_count_times():
    out = poptorch.for_loop(4, lambda a, b: (a * 2, b + a), [torch.tensor([1.]), torch.tensor([0.])])
    assert [float(t) for t in out] == [16., 15.]
    x = torch.ones(2)
    assert torch.equal(poptorch.for_loop(0, lambda a: a * 5, [x])[0], x)
    with pytest.raises(ValueError, match="non-negative integer count"):
        poptorch.for_loop(-1, lambda a: a, [x])


def test_nested_loops_and_a_branch_inside_a_loop():
    class Nested(torch.nn.Module):
        def forward(self, x, flag):
            def outer(h):
                h = poptorch.for_loop(3, lambda g: g * 2, [h])[0]
                return poptorch.cond(flag, lambda: h + 1, [], lambda: h - 1, [])[0]
            return poptorch.for_loop(2, outer, [x])[0]

    x = torch.tensor([1.])
    assert float(infer(Nested(), x, torch.tensor([True]))[0]) == 73.    # ((1*8)+1)*8+1
    assert float(infer(Nested(), x, torch.tensor([False]))[0]) == 55.   # ((1*8)-1)*8-1
    assert float(Nested()(x, torch.tensor([True]))) == 73.


# ---- cond -------------------------------------------------------------------------------------------
def branches(model, expected_then, expected_else, *args):
    pm = poptorch.inferenceModel(model)
    for flag, expected in ((True, expected_then), (False, expected_else)):
        condition = torch.tensor([flag])
        torch.testing.assert_close(pm(condition, *args), expected)
        torch.testing.assert_close(model(condition, *args), expected)
    return pm


def test_cond_runs_one_branch_on_device_data():
    class Model(torch.nn.Module):
        def forward(self, condition, x, y):
            return poptorch.cond(condition, lambda a: (a + a) + (a + a), [x], lambda b: b, [y])[0]

    x, y = torch.rand(1), torch.rand(1)
    pm = branches(Model(), x * 4, y, x, y)
    (branch,) = [p for prog in pm._executable.engine.programs for p in walk(prog) if isinstance(p, ip.If)]
    assert branch.predicate.dtype.name == "bool"
    # the then branch costs more, and each call is charged for the branch that ran
    pm(torch.tensor([True]), x, y)
    then_cycles = pm.last_run.cycles
    pm(torch.tensor([False]), x, y)
    assert then_cycles > pm.last_run.cycles > 0


def test_cond_outputs_arguments_and_outer_values():
    class MultiOut(torch.nn.Module):
        def forward(self, condition, x, y):
            return poptorch.cond(condition, lambda a: (a, x + y, y), [x], lambda b: (b * y, y, x - y), [y])

    class DiffArgs(torch.nn.Module):
        def forward(self, condition, x, y):
            return poptorch.cond(condition, lambda x, y: x + y, [x, y], lambda x: x, [x])[0]

    class Outer(torch.nn.Module):
        def forward(self, condition, x, y):
            def outer_body():
                return x + y
            return poptorch.cond(condition, lambda: outer_body(), [], lambda: x, [])[0]

    class SingleBody(torch.nn.Module):
        def forward(self, condition, x, y):
            def body(a, b):
                return a + b
            return poptorch.cond(condition, body, [x, y], body, [x, x])[0]

    class Internal(torch.nn.Module):
        def forward(self, condition, x):
            inner = torch.tensor([10., -10.])
            return poptorch.cond(condition, lambda a, b: x + a + b, [inner, torch.tensor([0., -2.])],
                                 lambda a: a + x, [inner])[0]

    x, y = torch.rand(1), torch.rand(1)
    branches(SingleBody(), x + y, x + x, x, y)
    z = torch.tensor([5., -1.])
    branches(Internal(), z + torch.tensor([10., -12.]), z + torch.tensor([10., -10.]), z)
    branches(MultiOut(), [x, x + y, y], [y * y, y, x - y], x, y)
    branches(DiffArgs(), x + y, x, x, y)
    branches(Outer(), x + y, x, x, y)


def test_cond_with_constants_and_an_op_needing_a_constant_size():
    constant = [1.1, 2.3]

    class Model(torch.nn.Module):
        def forward(self, condition, z):
            x = torch.tensor(constant)
            return poptorch.cond(condition, lambda a, b: a * torch.topk(b, 2)[0], [x, z],
                                 lambda a, b: b[:2] + (a - 2), [x, z])[0]

    arg = torch.rand(4)
    branches(Model(), torch.topk(arg, 2)[0] * torch.tensor(constant), torch.tensor(constant) - 2 + arg[:2], arg)


def test_nested_cond():
    class Model(torch.nn.Module):
        def forward(self, condition, cond_nested, x, y):
            def body_then():
                return poptorch.cond(cond_nested, lambda x, y: x + y, [x, y], lambda: x - y, [])[0]

            def body_else(c):
                return poptorch.cond(torch.logical_not(c), lambda y: x * y, [y], lambda: x * 2, [])[0]

            a = poptorch.cond(condition, body_then, [], body_else, [cond_nested])[0]
            b = poptorch.cond(condition, body_then, [], body_else, [cond_nested])[0]
            return a + b

    x, y = torch.rand(1), torch.rand(1)
    model = Model()
    branches(model, 2 * (x + y), 2 * x * 2, torch.tensor([True]), x, y)
    branches(model, 2 * (x - y), 2 * (x * y), torch.tensor([False]), x, y)


@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution, poptorch.SerialPhasedExecution,
                                      poptorch.ParallelPhasedExecution])
def test_cond_on_two_ipus(strategy):
    class Model(torch.nn.Module):
        def forward(self, condition, x, y):
            with poptorch.Block("0", ipu_id=0):
                x, y = poptorch.cond(condition, lambda x, y: (x + y, y), [x, y], lambda x, y: (x, x * y), [x, y])
            with poptorch.Block("1", ipu_id=1):
                x, y = poptorch.cond(torch.logical_not(condition), lambda x, y: (x + y, y), [x, y],
                                     lambda x, y: (x, x * y), [x, y])
            return x, y

    opts = poptorch.Options().autoRoundNumIPUs(True)
    opts.setExecutionStrategy(strategy(poptorch.Stage("0"), poptorch.Stage("1")))
    x, y = torch.tensor([1., 2.]), torch.tensor([3., 4.])
    out, _ = infer(Model(), torch.tensor([True]), x, y, options=opts)
    torch.testing.assert_close(out, (x + y, (x + y) * y))


def test_cond_errors():
    class Training(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(4, 4)

        def forward(self, condition, x):
            out = poptorch.cond(condition, self.layer1, [x], self.layer1, [x])[0]
            return out, poptorch.identity_loss(out, reduction="sum")

    class Mismatch(torch.nn.Module):
        def forward(self, condition, x):
            return poptorch.cond(condition, lambda x: (x, x), [x], lambda x: x, [x])

    class Shapes(torch.nn.Module):
        def forward(self, condition, x):
            return poptorch.cond(condition, lambda x: x, [x], lambda x: x[:1], [x])

    x = torch.ones(2, 4)
    with pytest.raises(poptorch.Error, match=r"poptorch.cond\(\) is only supported in inference"):
        poptorch.trainingModel(Training())(torch.tensor([True]), x)
    with pytest.raises(poptorch.Error, match="same number of tensors"):
        infer(Mismatch(), torch.tensor([True]), x)
    with pytest.raises(poptorch.Error, match="keep their shapes and types"):
        infer(Shapes(), torch.tensor([True]), x)
    with pytest.raises(ValueError, match=r"\(Object is not list\)"):
        poptorch.cond(torch.tensor([True]), lambda x: x, x, lambda x: x, [x])


# ---- nop and dynamic slices ---------------------------------------------------------------------------
def test_nop_is_a_kept_copy_with_a_pass_through_gradient():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = poptorch.nop(self.lin(x)) * 2
            return y, poptorch.identity_loss(y.sum(), reduction="sum")

    torch.manual_seed(0)
    m, x = Model(), torch.randn(2, 3)
    out, pm = infer(m, x)
    torch.testing.assert_close(out[0], m.lin(x).detach() * 2)
    assert any(n.op == "copy" for n in pm._executable.ir.nodes)
    assert poptorch.nop(x) is x
    with pytest.raises(poptorch.Error, match="nop must take a torch.tensor argument"):
        poptorch.nop(3)
    reference = Model()
    reference.load_state_dict(m.state_dict())
    trained = poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    trained(x)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x)[1].backward()
    opt.step()
    torch.testing.assert_close(m.lin.weight.detach(), reference.lin.weight.detach())


class Slicer(torch.nn.Module):
    def __init__(self, size, step, offset):
        super().__init__()
        self.size, self.step, self.offset = size, step, offset

    def forward(self, t, e):
        return poptorch.dynamic_slice(t, 0, e + self.offset, self.size, self.step)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, -4])
def test_dynamic_slice_reads_its_start_on_the_device(step, offset):
    t = torch.tensor([2.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    e = torch.tensor([1 - offset])
    model = Slicer(4, step, offset)
    pm = poptorch.inferenceModel(model)
    pm.compile(torch.randn_like(t), e + 20)   # compiled with other values: nothing is folded
    torch.testing.assert_close(pm(t, e), model(t, e))
    torch.testing.assert_close(pm(t, e + 2), t[3:7:step])


def test_dynamic_slice_errors_are_poptorchs():
    t, e = torch.arange(8.), torch.tensor([1])
    for size, step, message in ((0, 1, "The start and end of a slice must be different."),
                                (-2, 2, "Taking a slice of a tensor with the end less than the start"),
                                (7, 1, r"The size of the slice \(7\) must be a factor of the slicing dimension "
                                       r"\(8\)\.")):
        with pytest.raises(poptorch.Error, match=message):
            poptorch.inferenceModel(Slicer(size, step, 0))(t, e)
    with pytest.raises(poptorch.Error, match="Dimension must be an integer."):
        poptorch.dynamic_slice(t, 0.5, e, 1, 1)
    with pytest.raises(poptorch.Error, match="Slice start argument to dynamic_slice must be a torch.tensor"):
        poptorch.dynamic_slice(t, 0, 1, 1, 1)


class Updater(torch.nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self.dim, self.size = dim, size

    def forward(self, t, s, e):
        return poptorch.dynamic_update(t, s, self.dim, e.to(torch.int32), self.size)


@pytest.mark.parametrize("dim,shape,src", [(0, (8,), (4,)), (0, (2, 8), (1, 8)), (1, (2, 8), (2, 1))])
def test_dynamic_update_writes_at_its_device_start(dim, shape, src):
    torch.manual_seed(0)
    t, s = torch.randn(shape), -torch.ones(src)
    model = Updater(dim, src[dim])
    pm = poptorch.inferenceModel(model)
    pm.compile(torch.randn_like(t), torch.randn_like(s), torch.tensor([20]))
    for start in (0, 1):
        e = torch.tensor([start])
        torch.testing.assert_close(pm(t, s, e), model(t, s, e))


def test_dynamic_update_errors_are_poptorchs():
    t = torch.arange(16.).reshape(2, 8)
    with pytest.raises(poptorch.Error, match=r"input and src tensors must have same dimensionality. \(2\) vs \(1\)"):
        poptorch.dynamic_update(t, torch.ones(8), 0, torch.tensor([0]), 1)
    with pytest.raises(poptorch.Error, match="must have same dtype"):
        poptorch.dynamic_update(t, torch.ones(1, 8, dtype=torch.int32), 0, torch.tensor([0]), 1)
    with pytest.raises(poptorch.Error, match="The start and end of a slice must be different."):
        poptorch.inferenceModel(Updater(0, 0))(t, torch.ones(1, 8), torch.tensor([0]))

    class Mixed(torch.nn.Module):
        def forward(self, t, s):
            return poptorch.dynamic_update(t, s, 0, torch.tensor([1]), 1)

    # in a model the message names the types the IPU holds (no int64), as PopTorch's does
    with pytest.raises(poptorch.Error, match=r"same dtype. \(torch.float32 vs torch.int32\)"):
        poptorch.inferenceModel(Mixed())(torch.ones(8), torch.tensor([-1]))


def test_dynamic_slices_train():
    """Beyond PopTorch (PopART has no gradient for them): the gradient of a dynamic slice is an
    update of zeros, of an update a slice."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, 8))

        def forward(self, s, e):
            y = poptorch.dynamic_slice(self.w * 3, 0, e, 4, 2)
            z = poptorch.dynamic_update(self.w, s, 0, e, 2)
            return poptorch.identity_loss((y * y).sum() + (z * z * z).sum(), reduction="sum")

    m, reference = Model(), Model()
    s, e = torch.tensor([0.5, -0.25]), torch.tensor([3])
    trained = poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    trained(s, e)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(s, e).backward()
    opt.step()
    torch.testing.assert_close(m.w.detach(), reference.w.detach())


def test_each_iteration_draws_new_random_numbers():
    class Noisy(torch.nn.Module):
        def __init__(self, count):
            super().__init__()
            self.count = count

        def forward(self, x):
            return poptorch.for_loop(self.count, lambda h: h + torch.rand(h.shape), [x])[0]

    x = torch.zeros(64)
    once, _ = infer(Noisy(1), x, options=poptorch.Options().randomSeed(7))
    twice, _ = infer(Noisy(2), x, options=poptorch.Options().randomSeed(7))
    first, second = once, twice - once
    assert float(first.min()) >= 0 and float(first.max()) < 1 and float(second.min()) >= -1e-6
    assert not torch.allclose(first, second)
