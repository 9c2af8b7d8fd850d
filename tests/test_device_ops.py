"""PopTorch's ops that act on the device: ipu_print_tensor prints a tensor (and its gradient) as the
device computes it; set_available_memory gives an op's planner its temporary-memory budget."""
import logging

import pytest
import torch

import poptorch_lite as poptorch


class Printed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        h = poptorch.ipu_print_tensor(self.lin(x), "hidden", digits=3, separator=" ", open_bracket="[",
                                      close_bracket="]")
        return poptorch.identity_loss(h * h, reduction="sum")


def test_print_tensor_prints_each_micro_batch_and_its_gradient(capfd):
    torch.manual_seed(0)
    net = Printed()
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    with torch.no_grad():
        hidden = net.lin(x)
    model = poptorch.trainingModel(net, poptorch.Options().deviceIterations(2),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.0))
    model(x)
    err = capfd.readouterr().err

    def shown(title, row):  # a [1, 2] micro-batch, 3 significant digits, aligned
        cells = [f"{v:.2f}" for v in row.tolist()]
        width = max(map(len, cells))
        return f"{title}: [\n [{' '.join(c.rjust(width) for c in cells)}]\n]\n"

    expected = "".join(shown("hidden", row) + shown("hidden_gradient", 2 * row) for row in hidden)
    assert err.endswith(expected), err


def test_device_ops_are_ops_of_their_own_in_the_placement_table():
    rows = poptorch.op_placement(Printed(), None, torch.ones(2, 2))
    assert [(r.op, r.origin) for r in rows if r.op.startswith("poptorch_lite.")] == \
        [("poptorch_lite.print_tensor", "function ipu_print_tensor()")]


def test_print_tensor_is_an_identity_on_the_cpu_and_checks_its_format():
    x = torch.ones(2)
    assert poptorch.ipu_print_tensor(x) is x
    with pytest.raises(ValueError, match="float_format must be one of"):
        poptorch.ipu_print_tensor(x, float_format="engineering")
    with pytest.raises(poptorch.Error, match="prints a torch.Tensor"):
        poptorch.ipu_print_tensor([1.0])


def test_print_format_wraps_and_summarises():
    from poptorch_lite.api.printing import PrintFormat, format_tensor
    wide = torch.tensor([[1.25, -2.5, 3.0]]).numpy()
    assert format_tensor(wide, PrintFormat(digits=3, max_line_width=12, separator=",", float_format="fixed")) == \
        "(\n ( 1.25,\n   -2.50,\n    3.00)\n)"
    long = torch.arange(10, dtype=torch.int32).numpy()
    assert format_tensor(long, PrintFormat(summarise_threshold=5, edge_items=2, digits=0)) == "(0, 1, ..., 8, 9)"
    assert format_tensor(torch.tensor([1e-6, 2.0]).numpy(), PrintFormat(digits=2)) == "(1.0e-06, 2.0e+00)"


class Wide(torch.nn.Module):
    def __init__(self, proportion=None):
        super().__init__()
        self.lin = torch.nn.Linear(512, 512)
        self.proportion = proportion

    def forward(self, x):
        y = self.lin(x)
        return y if self.proportion is None else poptorch.set_available_memory(y, self.proportion)


def cycles(proportion):
    torch.manual_seed(0)
    net = Wide(proportion)
    model = poptorch.inferenceModel(net)
    x = torch.randn(512, 512)
    torch.testing.assert_close(model(x), net.lin(x), rtol=1e-4, atol=1e-4)
    return model.last_run.cycles


def test_available_memory_reaches_the_matmul_planner():
    default = cycles(None)
    assert cycles(0.6) == default  # PopLibs' default proportion
    assert cycles(0.01) > default  # a smaller budget forces a slower plan (another split)


class Conv(torch.nn.Module):
    def __init__(self, proportion=None):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.proportion = proportion

    def forward(self, x):
        y = self.conv(x).reshape(x.shape[0], -1)  # the hint reaches the convolution through its bias and a view
        return y if self.proportion is None else poptorch.set_available_memory(y, self.proportion)


def test_available_memory_reaches_the_convolution_planner():
    def conv_cycles(proportion):
        torch.manual_seed(0)
        net = Conv(proportion)
        model = poptorch.inferenceModel(net)
        x = torch.randn(8, 16, 32, 32)
        torch.testing.assert_close(model(x), net(x), rtol=1e-4, atol=1e-4)
        return model.last_run.cycles

    default = conv_cycles(None)
    assert conv_cycles(0.6) == default
    assert conv_cycles(0.01) > default


def test_available_memory_on_other_ops_has_no_effect(caplog):
    class Relu(torch.nn.Module):
        def forward(self, x):
            return poptorch.set_available_memory(torch.relu(x), 0.3)

    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        out = poptorch.inferenceModel(Relu())(torch.tensor([-1.0, 2.0]))
    assert torch.equal(out, torch.tensor([0.0, 2.0]))
    assert "set_available_memory at" in caplog.text and "has no effect" in caplog.text
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        poptorch.set_available_memory(torch.ones(1), 1.5)
