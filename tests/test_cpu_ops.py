"""poptorch.CPU: a Python function called on the host from inside a model, its inputs and results
crossing the host link by streams (priced as host I/O)."""
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch


class Doubled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.cpu = poptorch.CPU(self.on_host, "Double")

    def on_host(self, x):
        self.calls.append(x.clone())
        return x * 2.0, x.sum()

    def forward(self, x):
        y, s = self.cpu(x + 1)
        return y - 1, s


def host_cycles(record) -> int:
    return sum(c.host for step in record.steps for c in step.busy.values())


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_the_host_runs_the_function_on_the_device_values(mode):
    net = Doubled()
    opts = poptorch.Options().deviceIterations(2)
    opts.Emulator.setMode(mode)
    model = poptorch.inferenceModel(net, opts)
    x = torch.randn(4, 3)
    y, s = model(x)
    torch.testing.assert_close(y, (x + 1) * 2 - 1)
    torch.testing.assert_close(s, (x + 1).reshape(2, 6).sum(1))
    # one call per micro-batch at run time (the compiler's call on zeros came first)
    torch.testing.assert_close(torch.cat(net.calls[-2:]), x + 1)


def test_the_call_is_priced_as_host_io_both_ways():
    x = torch.randn(8, 16)
    on_host = poptorch.inferenceModel(Doubled())
    on_host(x)

    class Same(torch.nn.Module):
        def forward(self, x):
            h = x + 1
            return h * 2.0 - 1, h.sum()

    on_device = poptorch.inferenceModel(Same())
    on_device(x)
    target = ip.GC200
    # the input [8, 16] float32 goes to the host, [8, 16] and a scalar come back
    streams = target.host_cycles(8 * 16 * 4) * 2 + target.host_cycles(4)
    assert host_cycles(on_host.last_run) - host_cycles(on_device.last_run) == streams


def test_several_calls_and_several_ops():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.twice = poptorch.CPU(lambda x: x * 2.0, "Twice")
            self.add = poptorch.CPU(lambda x, y: x + y, "Add")

        def forward(self, x, y):
            for _ in range(3):
                x = self.add(self.twice(x), y)
            return x

    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(poptorch.inferenceModel(Net())(x, y), Net()(x, y))


def test_a_module_runs_on_the_host_with_its_weights_frozen():
    lin = torch.nn.Linear(3, 2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorch.CPU(lin, "Linear")

        def forward(self, x):
            return self.cpu(x)

    net = Net()
    assert not any(p.requires_grad for p in lin.parameters())
    x = torch.randn(4, 3)
    torch.testing.assert_close(poptorch.inferenceModel(net)(x), lin(x))


def test_outside_a_model_it_calls_the_function():
    cpu = poptorch.CPU(lambda x: x + 1, "Inc")
    torch.testing.assert_close(cpu(torch.zeros(2)), torch.ones(2))


def test_a_cpu_op_on_the_gradient_path_is_an_error():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.cpu = poptorch.CPU(lambda x: x * 2.0, "Twice")

        def forward(self, x):
            return poptorch.identity_loss(self.cpu(self.lin(x)).sum(), "sum")

    with pytest.raises(poptorch.Error, match="CPU ops are only supported in inference models"):
        poptorch.trainingModel(Net())(torch.randn(2, 3))


def test_results_must_keep_their_shapes():
    state = {"n": 0}

    def varying(x):
        state["n"] += 1
        return x if state["n"] == 1 else x[:1]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorch.CPU(varying, "Varying")

        def forward(self, x):
            return self.cpu(x)

    with pytest.raises(poptorch.Error, match="must keep their shapes"):
        poptorch.inferenceModel(Net())(torch.ones(3))
