"""PopTorch names that applications (Graphcore's BERT application, optimum-graphcore) use beyond
the tutorials: the optimisers' base class and variable attributes, AdamW without bias
correction, the model unwrapping of poptorch._impl, hardware queries under an emulated
attachment, poptorch.Attribute."""
import copy

import pytest
import torch

import poptorch_lite as poptorch


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.linear(x)
        return out, torch.nn.functional.mse_loss(out, y)


def test_poptorch_optimisers_share_a_base_class():
    params = Regression().parameters
    for make in (lambda: poptorch.optim.SGD(params(), lr=0.1), lambda: poptorch.optim.Adam(params()),
                 lambda: poptorch.optim.AdamW(params()), lambda: poptorch.optim.RMSprop(params()),
                 lambda: poptorch.optim.LAMB(params())):
        assert isinstance(make(), poptorch.optim.Optimizer)
    assert not isinstance(torch.optim.SGD(params(), lr=0.1), poptorch.optim.Optimizer)


def test_variable_attributes_as_poptorch():
    opt = poptorch.optim.AdamW(Regression().parameters(), lr=0.01, weight_decay=0.1, loss_scaling=None)
    attrs = opt.variable_attrs
    assert not attrs.isConstant("lr") and not attrs.isConstant("weight_decay")
    assert attrs.isConstant("loss_scaling") and attrs.isConstant("eps")  # not given: constant, as in PopTorch
    attrs.markAsConstant("weight_decay")
    assert attrs.isConstant("weight_decay")
    attrs.markAsVariable("loss_scaling")
    assert not attrs.isConstant("loss_scaling")
    with pytest.raises(AssertionError, match="Unknown attribute no_such"):
        attrs.markAsConstant("no_such")


def adamw_reference(model, batches, lr, betas, eps, bias_correction):
    """PopTorch's AdamW by hand: decoupled weight decay 0, moments with or without bias correction."""
    m = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for t, (x, y) in enumerate(batches, 1):
        model.zero_grad()
        model(x, y)[1].backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                m[n] = betas[0] * m[n] + (1 - betas[0]) * p.grad
                v[n] = betas[1] * v[n] + (1 - betas[1]) * p.grad ** 2
                bc1, bc2 = (1 - betas[0] ** t, 1 - betas[1] ** t) if bias_correction else (1.0, 1.0)
                p -= lr / bc1 * m[n] / (v[n].sqrt() / bc2 ** 0.5 + eps)
    return model


@pytest.mark.parametrize("bias_correction", [True, False])
def test_adamw_with_and_without_bias_correction_matches_reference(bias_correction):
    torch.manual_seed(0)
    model = Regression()
    ref = copy.deepcopy(model)
    batches = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(4)]
    opt = poptorch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0,
                               bias_correction=bias_correction)
    training = poptorch.trainingModel(model, poptorch.Options(), opt)
    for x, y in batches:
        training(x, y)
    adamw_reference(ref, batches, 0.05, (0.8, 0.9), 1e-6, bias_correction)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_unwrap_and_rewrap_a_trained_model():
    """poptorch._impl: unwrapped, the model and its tensors have their own classes and the trained
    weights; rewrapped, reading weights after another call syncs them again."""
    from poptorch_lite import _impl
    torch.manual_seed(0)
    model = Regression()
    before = model.linear.weight.detach().clone()
    training = poptorch.trainingModel(model, poptorch.Options(), poptorch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    training(x, y)
    assert type(model) is not Regression
    _impl.unwrapModelIfNecessary(model)
    assert type(model) is Regression and type(model.linear.weight) is torch.nn.Parameter
    trained = model.linear.weight.detach().clone()
    assert not torch.equal(trained, before)
    copy.deepcopy(model)  # a plain module again
    _impl.rewrapModelIfNecessary(model)
    assert type(model) is not Regression and isinstance(model, Regression)
    training(x, y)
    assert not torch.equal(model.linear.weight.detach(), trained)  # synced from the device again
    _impl.unwrapModelIfNecessary(Regression())  # not wrapped: nothing to do


def test_attribute_scopes_nest_and_leave_values_alone():
    with poptorch.Attribute(__outline={"layer": "embedding"}):
        assert poptorch.Attribute.current() == {"__outline": {"layer": "embedding"}}
        with poptorch.Attribute(__outline={"layer": "encoder", "extra": 1}):
            assert poptorch.Attribute.current() == {"__outline": {"layer": "encoder", "extra": 1}}
        assert poptorch.Attribute.current() == {"__outline": {"layer": "embedding"}}
    assert poptorch.Attribute.current() == {}
    with pytest.raises(ValueError, match="__outline must be a dict"):
        poptorch.Attribute(__outline="layer")

    class Scoped(Regression):
        def forward(self, x, y):
            with poptorch.Attribute(__outline={"layer": "head"}):
                return super().forward(x, y)

    torch.manual_seed(0)
    model = Scoped()
    x = torch.randn(4, 6)
    plain = poptorch.inferenceModel(copy.deepcopy(model))(x, torch.zeros(4, 3))[0]
    torch.testing.assert_close(plain, model(x, torch.zeros(4, 3))[0], rtol=1e-6, atol=1e-6)


def test_rebatched_worker_size_outside_async_rebatched_is_ignored_with_a_warning():
    """PopTorch ignores rebatched_worker_size unless the mode is AsyncRebatched (optimum-graphcore's
    trainer always passes one); the emulator says it has no effect."""
    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    with pytest.warns(UserWarning, match="rebatched_worker_size=4 has no effect"):
        loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=4, rebatched_worker_size=4)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
