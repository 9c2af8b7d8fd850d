"""What a model call returns when an output needs no computation: an input returned as it is, an
op that reduces to the identity (dropout in inference), or a parameter returned unchanged."""
import pytest
import torch

import poptorch_lite as poptorch


class PassThrough(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, y):
        return self.drop(x), self.lin(y), y


def test_inference_returns_inputs_and_identity_ops_for_every_micro_batch():
    torch.manual_seed(0)
    net = PassThrough().eval()
    model = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    a, b, c = model(x, y)
    assert torch.equal(a, x) and torch.equal(c, y)
    torch.testing.assert_close(b, net.lin(y), rtol=1e-6, atol=1e-6)


class LossAndLabels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        return labels, self.loss(self.lin(x), labels)


@pytest.mark.parametrize("mode, expected", [(poptorch.OutputMode.All, slice(None)),
                                             (poptorch.OutputMode.Final, slice(-2, None))])
def test_training_returns_an_input_shaped_by_the_output_mode(mode, expected):
    torch.manual_seed(0)
    opts = poptorch.Options().deviceIterations(2).outputMode(mode)
    opts.Training.gradientAccumulation(2)
    net = LossAndLabels()
    model = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.1))
    x, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))
    got, _ = model(x, labels)
    assert torch.equal(got, labels[expected].to(got.dtype))


class ReturnsItsBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()
        poptorch.BeginBlock(self.second, "second", ipu_id=1)

    def forward(self, x, labels):
        out = self.second(self.first(x))
        return self.second.bias, self.loss(out, labels)


def test_a_returned_parameter_is_its_value_as_each_micro_batch_saw_it():
    torch.manual_seed(0)
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(3)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    net = ReturnsItsBias()
    before = net.second.bias.detach().clone()
    model = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.5))
    bias, _ = model(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    model.copyWeightsToHost()
    # 2 device iterations of 3 micro-batches; the second iteration runs after the first's step
    assert bias.shape == (2 * 3 * 3,)
    bias = bias.reshape(2, 3, 3)
    assert all(torch.equal(b, before) for b in bias[0])
    stepped = bias[1, 0]
    assert not torch.equal(stepped, before) and all(torch.equal(b, stepped) for b in bias[1])
    assert not torch.equal(net.second.bias.detach(), stepped)


def test_inference_returns_a_parameter_for_every_micro_batch():
    net = ReturnsItsBias().eval()
    model = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(3))
    bias, _ = model(torch.randn(3, 4), torch.randint(0, 3, (3,)))
    assert torch.equal(bias.reshape(3, 3), net.second.bias.detach().expand(3, 3))
