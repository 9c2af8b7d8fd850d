"""Capture -> IR: op conversion, placement on stages, loss detection, unsupported ops, autodiff shapes."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import poptorch_lite.api.blocks as blocks
from poptorch_lite.compiler.autodiff import differentiate
from poptorch_lite.compiler.capture import capture, place_graph
from poptorch_lite.compiler.frontend import UnsupportedOpError, to_ir
from poptorch_lite.api.ops import identity_loss
from poptorch_lite.api.strategies import PipelinedExecution, Stage


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = torch.nn.Dropout(0.5)
        self.layer4 = nn.Linear(256, 10)
        self.softmax = nn.LogSoftmax(1)

    def forward(self, x):
        with blocks.Block("B1"):
            x = self.layer1(x)
        with blocks.Block("B2"):
            x = self.layer2(x)
        with blocks.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
            x = self.layer3_dropout(x)
        with blocks.Block("B4"):
            x = self.layer4(x)
            x = self.softmax(x)
        return x


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.NLLLoss()

    def forward(self, args, loss_inputs=None):
        output = self.model(args)
        if loss_inputs is None:
            return output
        with blocks.Block("B4"):
            loss = self.loss(output, loss_inputs)
        return output, loss


TUTORIAL_STRATEGY = PipelinedExecution(Stage("B1").ipu(0), Stage("B2").ipu(1), Stage("B3").ipu(2), Stage("B4").ipu(3))


def tutorial_ir(training=True, batch=4):
    model = TrainingModelWithLoss(Network())
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    model.train(training)
    gm = capture(model, x, y) if training else capture(model, x)
    return to_ir(gm, place_graph(gm, TUTORIAL_STRATEGY), training)


def test_tutorial_model_lands_on_four_stages():
    ir = tutorial_ir()
    ops_by_stage = {}
    for n in ir.nodes:
        ops_by_stage.setdefault(n.stage, []).append(n.op)
        assert n.ipu == n.stage
    assert ops_by_stage[0] == ["conv2d", "reshape", "binary", "max_pool2d", "unary"]
    assert ops_by_stage[1] == ["conv2d", "reshape", "binary", "max_pool2d", "unary"]
    assert ops_by_stage[2] == ["reshape", "transpose", "matmul", "binary", "unary", "dropout"]
    assert ops_by_stage[3] == ["transpose", "matmul", "binary", "log_softmax", "nll_loss"]
    assert ir.loss is ir.nodes[-1].outputs[0] and ir.loss.shape == ()
    assert sorted(ir.params) == sorted(n for n, _ in TrainingModelWithLoss(Network()).named_parameters())
    assert [v.shape for v in ir.inputs] == [(4, 1, 28, 28), (4,)]
    assert ir.inputs[1].dtype == np.int32  # int64 labels become int32 on the device


def test_inference_drops_dropout_and_loss():
    ir = tutorial_ir(training=False)
    assert "dropout" not in [n.op for n in ir.nodes] and ir.loss is None
    assert ir.outputs.shape == (4, 10)


def test_autodiff_gives_every_parameter_a_gradient_on_its_stage():
    ir = tutorial_ir()
    grads = differentiate(ir, ir.loss)
    assert sorted(grads) == sorted(ir.params)
    for name, g in grads.items():
        assert g.shape == ir.params[name].shape
        assert g.producer.pass_ == "bwd"
    assert grads["model.layer1.conv.weight"].producer.stage == 0
    assert grads["model.layer4.weight"].producer.stage == 3
    assert {n.op for n in ir.nodes if n.pass_ == "bwd"} >= {
        "conv2d_backward_weights", "max_pool2d_backward", "log_softmax_backward", "nll_loss_backward",
        "dropout_backward", "matmul"}


def test_autodiff_builds_only_the_gradients_it_needs():
    """The data's gradient (layer1's input) and a frozen weight's are never computed, and every
    backward node contributes to a requested gradient."""
    ir = tutorial_ir()
    forward_nodes = len(ir.nodes)
    frozen = {"model.layer4.weight", "model.layer4.bias"}
    grads = differentiate(ir, ir.loss, wrt=set(ir.params) - frozen)
    assert sorted(grads) == sorted(set(ir.params) - frozen)
    backward = ir.nodes[forward_nodes:]
    assert [n.stage for n in backward if n.op == "conv2d_backward_input"] == [1]
    # layer4 (stage 3) only passes the gradient on to layer3: one matmul, no weight gradient
    assert [n.outputs[0].shape for n in backward if n.op == "matmul" and n.stage == 3] == [(4, 256)]
    needed = {g.id for g in grads.values()}
    for n in reversed(backward):
        assert any(v.id in needed for v in n.outputs), f"{n.op} feeds no gradient"
        needed.update(v.id for v in n.inputs)


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumsum(self.fc(x), 0)


def test_unsupported_op_names_the_op_and_the_source_line():
    gm = capture(Unsupported(), torch.randn(2, 4))
    with pytest.raises(UnsupportedOpError, match=r"cumsum.*test_frontend\.py:\d+.*not supported"):
        to_ir(gm, place_graph(gm, PipelinedExecution()), False)


class TwoLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return nn.functional.mse_loss(out, y), nn.functional.l1_loss(out, y)


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum()


class SummedLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return identity_loss(nn.functional.mse_loss(out, y) + nn.functional.l1_loss(out, y), reduction="none")


def _ir(model, *args):
    gm = capture(model, *args)
    return to_ir(gm, place_graph(gm, PipelinedExecution()), True)


def test_loss_rules_follow_poptorch():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="Multiple independent losses"):
        _ir(TwoLosses(), x, y)
    with pytest.raises(RuntimeError, match="Couldn't find a loss"):
        _ir(NoLoss(), x)
    ir = _ir(SummedLosses(), x, y)
    assert ir.loss.producer.op == "identity_loss"
