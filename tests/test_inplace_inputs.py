"""A model that changes its inputs in place: the device returns their new values and the call
copies them into the caller's tensors, as PopTorch does; the model's outputs are unchanged."""
import pytest
import torch

import poptorch_lite as poptorch


class AddInPlace(torch.nn.Module):
    def forward(self, x):
        x += 1


def test_an_input_changed_in_place_is_copied_back_to_the_callers_tensor():
    model = poptorch.inferenceModel(AddInPlace())
    t = torch.tensor([1.0, 5.0])
    assert model(t) is None
    assert t.tolist() == [2.0, 6.0]
    assert model(t) is None
    assert t.tolist() == [3.0, 7.0]
    other = torch.tensor([0.0, 0.0])
    model(other)
    assert other.tolist() == [1.0, 1.0] and t.tolist() == [3.0, 7.0]


def test_in_place_updates_in_containers_slices_and_with_outputs_match_torch():
    class Model(torch.nn.Module):
        def forward(self, pair, y):
            total = pair[1].sum()
            pair[1].zero_()
            pair[1].add_(total)
            y[1:3] *= 2
            y.masked_fill_(y > 10, -1.0)
            return y * 3, total

    torch.manual_seed(0)
    pair, y = (torch.rand(2, 3), torch.rand(2, 3)), torch.arange(8.0).reshape(4, 2)
    cpu_pair, cpu_y = tuple(t.clone() for t in pair), y.clone()
    expected = Model()(cpu_pair, cpu_y)
    got = poptorch.inferenceModel(Model())(pair, y)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(y, cpu_y)
    torch.testing.assert_close(pair, cpu_pair)


def test_an_input_changed_in_place_keeps_its_dtype():
    class Model(torch.nn.Module):
        def forward(self, x):
            x.copy_(torch.full((3,), 2.5))
            return x + 1

    t = torch.zeros(3, dtype=torch.int32)
    out = poptorch.inferenceModel(Model())(t)
    assert t.dtype == torch.int32 and t.tolist() == [2, 2, 2]
    assert out.tolist() == [3, 3, 3]


def test_inputs_changed_in_place_over_device_iterations_get_every_micro_batch():
    opts = poptorch.Options().deviceIterations(3)
    model = poptorch.inferenceModel(AddInPlace(), opts)
    t = torch.arange(6.0).reshape(6, 1)
    model(t)
    assert t.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_an_input_whose_new_value_comes_back_in_another_shape_is_an_error():
    opts = poptorch.Options().deviceIterations(3).outputMode(poptorch.OutputMode.Final)
    model = poptorch.inferenceModel(AddInPlace(), opts)
    with pytest.raises(poptorch.Error, match=r"changes its input x in place.*OutputMode.All"):
        model(torch.zeros(6, 1))


class Buffered(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x):
        if self.how == "remove":
            del self._buffers["count"]
        elif self.how == "reassign":
            self.count = x * 2
        else:
            self.count.copy_(self.count + x)
        return x + 1


def test_a_buffer_changed_in_place_is_kept_and_one_removed_or_reassigned_in_forward_is_an_error():
    model = Buffered("copy")
    poptorch.inferenceModel(model)(torch.ones(2))
    with pytest.raises(poptorch.Error, match=r"Buffer count is removed from the model"):
        poptorch.inferenceModel(Buffered("remove"))(torch.ones(2))
    with pytest.raises(poptorch.Error, match=r"Buffer count is reassigned .*self\.count\.copy_\(src\)"):
        poptorch.inferenceModel(Buffered("reassign"))(torch.ones(2))


def test_an_input_with_autograd_history_is_data_to_the_model():
    """y.copy_(x) on a tensor that requires grad leaves y with a grad_fn; passed to a model later,
    y is an input like any other (the compiler differentiates parameters only)."""
    class Copy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2, 3), 2.0))

        def forward(self, x, y):
            out = y.copy_(x * self.w)
            return out, poptorch.identity_loss((out ** 2).sum(), reduction="sum")

    x = torch.randn(2, 3)
    y = torch.empty(2, 3)
    y.copy_(x * torch.ones(2, 3, requires_grad=True))
    assert y.grad_fn is not None
    model = Copy()
    out, _ = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))(x, y)
    torch.testing.assert_close(out, x * 2)
