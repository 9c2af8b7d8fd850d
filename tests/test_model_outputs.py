"""What a model call returns when an output needs no computation: an input returned as it is, or
an op that reduces to the identity (dropout in inference)."""
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
