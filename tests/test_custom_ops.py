"""Custom ops: poptorch.custom_op runs the kernel registered for its name and domain on the tiles,
with its gradient kernel in training, its cycle estimate and its partition over tiles."""
import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops.custom import CustomKernelError, custom


def cube(x, bias):
    return x * x * x + bias, x * x * x


def cube_grad(grads, inputs, outputs):
    (g0, g1), (x, _) = grads, inputs
    return (g0 + g1) * 3 * x * x, g0


@pytest.fixture
def registered():
    made = []

    def register(name, **kwargs):
        made.append(poptorch.register_custom_op(name, "com.test", 1, **kwargs))
        return made[-1]

    yield register
    for name in {d.name for d in made}:
        poptorch.unregister_custom_op(name, "com.test", 1)


class CubeNet(torch.nn.Module):
    def __init__(self, name="Cube"):
        super().__init__()
        self.name = name

    def forward(self, x, bias):
        return tuple(poptorch.custom_op([x, bias], self.name, "com.test", 1, example_outputs=[x, x]))


def options(mode):
    opts = poptorch.Options()
    opts.Emulator.setMode(mode)
    return opts


@pytest.mark.parametrize("mode", ["fast", "strict"])
@pytest.mark.parametrize("partition", ["none", "rows", "elements"])
def test_inference_values_come_from_the_registered_kernel(registered, mode, partition):
    registered("Cube", forward=cube, partition=partition)
    x, bias = torch.randn(6, 5), torch.randn(6, 5)
    y, z = poptorch.inferenceModel(CubeNet(), options(mode))(x, bias)
    torch.testing.assert_close(y, x ** 3 + bias)
    torch.testing.assert_close(z, x ** 3)


def test_outside_a_model_it_gives_zeros_as_poptorch_does(registered):
    registered("Cube", forward=cube)
    x = torch.ones(2, 3)
    outs = poptorch.custom_op([x, x], "Cube", "com.test", 1, example_outputs=[x, x.half()])
    assert [o.dtype for o in outs] == [torch.float32, torch.float16]
    assert all(not o.any() for o in outs)


def test_attributes_reach_the_kernel_as_keywords(registered):
    seen = []

    def scaled(x, alpha, names, sizes):
        seen.append((alpha, names, sizes))
        return x * alpha

    registered("Scale", forward=scaled)

    class Net(torch.nn.Module):
        def forward(self, x):
            return poptorch.custom_op([x], "Scale", "com.test", 1, example_outputs=[x],
                                      attributes={"alpha": 0.5, "names": ["a", "b"], "sizes": (1, 2)})[0]

    x = torch.randn(3, 4)
    torch.testing.assert_close(poptorch.inferenceModel(Net())(x), x * 0.5)
    assert seen[-1] == (0.5, ["a", "b"], [1, 2])


class Trained(torch.nn.Module):
    def __init__(self, name="Cube"):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.name = name

    def forward(self, x, bias, target):
        y, z = poptorch.custom_op([self.lin(x), bias], self.name, "com.test", 1, example_outputs=[x, x])
        return y, torch.nn.functional.mse_loss(y + z, target)


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_training_uses_the_registered_gradient_kernel(registered, mode):
    registered("Cube", forward=cube, backward=cube_grad, partition="rows")
    torch.manual_seed(0)
    net, ref = Trained(), Trained()
    ref.load_state_dict(net.state_dict())
    x, bias, target = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    model = poptorch.trainingModel(net, options(mode), optimizer=torch.optim.SGD(net.parameters(), lr=0.01))
    _, loss = model(x, bias, target)
    h = ref.lin(x)
    expected = torch.nn.functional.mse_loss(2 * h ** 3 + bias, target)
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.01 * p.grad
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(net.lin.weight.detach(), ref.lin.weight.detach())


def test_a_different_gradient_kernel_gives_a_different_update(registered):
    """The update follows the registered gradient, not PyTorch's derivative of the forward."""
    registered("Cube", forward=cube, backward=lambda grads, inputs, outputs: (2 * (grads[0] + grads[1]) * 3 *
                                                                               inputs[0] ** 2, grads[0]))
    torch.manual_seed(0)
    net, ref = Trained(), Trained()
    ref.load_state_dict(net.state_dict())
    x, bias, target = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01))(x, bias, target)
    h = ref.lin(x)
    torch.nn.functional.mse_loss(2 * h ** 3 + bias, target).backward()
    torch.testing.assert_close(ref.lin.weight.detach() - net.lin.weight.detach(), 2 * 0.01 * ref.lin.weight.grad)


def test_the_cycle_estimate_is_the_registered_one(registered):
    x, bias = torch.randn(8, 4), torch.randn(8, 4)
    registered("Cube", forward=cube)
    plain = poptorch.inferenceModel(CubeNet())
    plain(x, bias)
    registered("Cube", forward=cube, cycles=lambda xs, bs: 10_000 * xs[0])
    costly = poptorch.inferenceModel(CubeNet())
    costly(x, bias)
    overhead = ip.GC200.vertex_overhead_cycles
    default = ip.GC200.thread_cycles(4 * 32)   # one instruction per element read or written
    assert costly.last_run.cycles - plain.last_run.cycles == 80_000 + overhead - (default + overhead)


def test_rows_spread_the_vertices_over_tiles(registered):
    target = ip.Target.test(8)
    for partition, tiles in (("none", 1), ("rows", 8)):
        g = ip.Graph(target)
        x = g.addVariable("float32", (16, 3), "x")
        g.map_linearly(x)
        prog = ip.Sequence()
        custom(g, [x], [((16, 3), "float32")], lambda a: a + 1, prog, partition=partition, name="op")
        (cs,) = g.compute_sets
        assert len(np.unique(cs.tables[0].tiles)) == tiles


def test_an_unregistered_op_is_a_compile_error_saying_how_to_register():
    with pytest.raises(poptorch.Error, match=r"com.test::Missing .*register_custom_op\('Missing', 'com.test', 1"):
        poptorch.inferenceModel(CubeNet("Missing"))(torch.ones(2), torch.ones(2))


def test_training_through_an_op_without_gradient_kernel_is_an_error(registered):
    registered("Cube", forward=cube)
    model = poptorch.trainingModel(Trained())
    with pytest.raises(poptorch.Error, match="has no gradient kernel"):
        model(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4))


def test_results_of_the_wrong_shape_are_an_error(registered):
    registered("Cube", forward=lambda x, b: (x, x[:1]))
    with pytest.raises(CustomKernelError, match="output 1 of the kernel has shape"):
        poptorch.inferenceModel(CubeNet())(torch.ones(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("attributes, message", [
    ({1: 2.0}, "All attribute keys must be strings"),
    ({"a": None}, "Attribute values must be"),
    ({"a": [1, 2.0]}, "must all be the same"),
    ({"a": "caf\u00e9"}, "non-ASCII"),
    ({"a": ["x", "\u00e9"]}, "non-ASCII"),
])
def test_attributes_are_checked_as_poptorch_checks_them(attributes, message):
    x = torch.ones(2)
    with pytest.raises(ValueError, match=message):
        poptorch.custom_op([x], "Op", "com.test", 1, example_outputs=[x], attributes=attributes)


def test_registration_is_checked():
    with pytest.raises(ValueError, match="partition must be one of"):
        poptorch.register_custom_op("Op", "com.test", 1, forward=cube, partition="columns")
    with pytest.raises(TypeError, match="backward must be callable"):
        poptorch.register_custom_op("Op", "com.test", 1, forward=cube, backward=3)
