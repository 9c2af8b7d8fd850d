"""Options.anchorTensor / getAnchoredTensor: a weight update's gradient and updated parameter,
returned from each call under the anchor's output mode."""
import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.api.enums import OutputMode


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        error = self.lin(x) - y
        return poptorch.identity_loss(error * error, reduction="sum")


def reference_steps(net, batches, lr):
    """(gradient of lin.bias, lin.weight after the step) of plain SGD steps on the CPU."""
    steps = []
    for x, y in batches:
        net.zero_grad()
        net(x, y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
        steps.append((net.lin.bias.grad.clone(), net.lin.weight.detach().clone()))
    return steps


@pytest.mark.parametrize("mode, picked", [(None, [1]), (OutputMode.All, [0, 1]), (OutputMode.Final, [1]),
                                          (OutputMode.EveryN, [1]), (OutputMode.Sum, "sum")])
def test_gradients_and_updated_weights_of_each_update(mode, picked):
    torch.manual_seed(0)
    net, reference = Regression(), Regression()
    reference.load_state_dict(net.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("grad_bias", "Gradient___lin.bias", mode, 2)
    opts.anchorTensor("weight", "UpdatedVar___lin.weight", mode, 2)
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.05))
    model(x, y)
    steps = reference_steps(reference, [(x[:2], y[:2]), (x[2:], y[2:])], 0.05)
    for short, k in (("grad_bias", 0), ("weight", 1)):
        got = model.getAnchoredTensor(short)
        if picked == "sum":
            expected = steps[0][k] + steps[1][k]
        elif len(picked) == 1:
            expected = steps[picked[0]][k]
        else:
            expected = torch.stack([steps[i][k] for i in picked])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_unknown_anchors_are_errors_naming_them():
    opts = poptorch.Options()
    opts.anchorTensor("scale", "finalLossScale")
    model = poptorch.trainingModel(Regression(), opts)
    with pytest.raises(poptorch.Error, match="no tensor 'finalLossScale'.*Gradient___lin.bias"):
        model(torch.ones(1, 3), torch.ones(1, 1))
    inference = poptorch.inferenceModel(Regression(), poptorch.Options().anchorTensor("g", "Gradient___lin.bias"))
    with pytest.raises(poptorch.Error, match="an inference model has no weight updates"):
        inference(torch.ones(1, 3), torch.ones(1, 1))
    model = poptorch.trainingModel(Regression())
    with pytest.raises(poptorch.Error, match="no tensor anchored as 'g'.*run the model first"):
        model.getAnchoredTensor("g")


@pytest.mark.parametrize("iterations, period", [(1, 4), (3, 2)])
def test_every_n_period_must_divide_the_updates_of_a_call(iterations, period):
    opts = poptorch.Options().deviceIterations(iterations)
    opts.anchorTensor("g", "Gradient___lin.bias", OutputMode.EveryN, period)
    model = poptorch.trainingModel(Regression(), opts)
    with pytest.raises(poptorch.Error, match=rf"makes {iterations} weight update.*period must divide {iterations}"):
        model(torch.ones(iterations, 3), torch.ones(iterations, 1))


def test_anchors_are_options():
    opts = poptorch.Options().anchorTensor("t1", "Gradient___w", OutputMode.EveryN, 2)
    copied = opts.clone().anchorTensor("t2", "UpdatedVar___w", OutputMode.Final)
    assert opts.anchored_tensors == {"t1": ("Gradient___w", OutputMode.EveryN, 2)}
    assert set(copied.anchored_tensors) == {"t1", "t2"}
    with pytest.raises(TypeError, match="long_name must be a non-empty str"):
        opts.anchorTensor("t3", "")
