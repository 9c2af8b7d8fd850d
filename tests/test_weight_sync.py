"""PopTorch's implicit weight sync seen from the host: training calls copy nothing back; reading
or saving the model copies the trained weights back once; a saved model loads as the user's class."""
import io

import pytest
import torch

import poptorch_lite as poptorch


class WithBatchNorm(torch.nn.Module):  # the (unused) BatchNorm layer has a host-side counter each call advances
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.lin(x)
        return poptorch.identity_loss(y * y, reduction="sum")


def counting_copies(model):
    calls = []
    real = model.copyWeightsToHost

    def copy():
        calls.append(1)
        real()
    model.copyWeightsToHost = copy
    return calls


def test_training_calls_copy_no_weights_back_and_reading_copies_once():
    torch.manual_seed(0)
    net = WithBatchNorm()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01))
    copies = counting_copies(training)
    for _ in range(3):
        training(torch.randn(2, 4))
    assert copies == []
    net.lin.weight.detach()
    net.lin.bias.detach()
    assert copies == [1]


def test_a_trained_model_saves_as_the_users_class_with_trained_weights():
    torch.manual_seed(0)
    net = WithBatchNorm()
    before = net.lin.weight.detach().clone()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    copies = counting_copies(training)
    training(torch.randn(2, 4))
    saved = io.BytesIO()
    torch.save(net, saved)
    assert copies == [1]
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded) is WithBatchNorm
    assert type(loaded.lin.weight) is torch.nn.Parameter and type(loaded.bn.running_mean) is torch.Tensor
    assert torch.equal(loaded.lin.weight, net.lin.weight) and not torch.equal(loaded.lin.weight, before)


def test_a_wrapped_model_loads_through_restore_wrapper_and_its_state_dict_without(monkeypatch):
    """PopTorch's `_impl._restoreWrapperIfNecessary` rebuilds a saved wrapped model; a state dict
    of a wrapped model holds no wrapper, so loading it never calls it."""
    from poptorch_lite import _impl
    net = WithBatchNorm()
    poptorch.trainingModel(net)
    poptorch.inferenceModel(net)
    files = []
    for obj in (net.state_dict(), net):
        files.append(io.BytesIO())
        torch.save(obj, files[-1])
        files[-1].seek(0)
    calls = []
    real = _impl._restoreWrapperIfNecessary
    monkeypatch.setattr(_impl, "_restoreWrapperIfNecessary", lambda *a: calls.append(a) or real(*a))
    torch.load(files[0], weights_only=False)
    assert calls == []
    loaded = torch.load(files[1], weights_only=False)
    assert len(calls) == 1 and type(loaded) is WithBatchNorm


def test_a_model_is_wrapped_by_one_training_model_until_destroyed():
    torch.manual_seed(0)
    net = WithBatchNorm()
    first = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    first(torch.ones(2, 4))
    with pytest.raises(RuntimeError, match=r"already been wrapped in 'poptorch.trainingModel'. Call "
                                           r"model.destroy\(\)"):
        poptorch.trainingModel(net)
    trained = net.lin.weight.detach().clone()
    net.destroy()  # the user's model releases its training model, trained weights copied back
    assert not first.isCompiled()
    assert type(net) is WithBatchNorm and type(net.lin.weight) is torch.nn.Parameter
    assert type(net.bn.running_mean) is torch.Tensor
    assert torch.equal(net.lin.weight, trained)
    # wrapped again, from the model or from a destroyed executor: training goes on from the trained weights
    second = poptorch.trainingModel(first, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert second.model is net
    second(torch.ones(2, 4))
    assert not torch.equal(net.lin.weight, trained)
    # a destroyed training model used again wraps the model again, unless another wraps it now
    with pytest.raises(RuntimeError, match="already been wrapped"):
        first(torch.ones(2, 4))
    second.destroy()
    first(torch.ones(2, 4))
    assert type(net).__name__ == "PoptorchWithBatchNorm"
