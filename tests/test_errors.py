"""PopTorch's exception classes and hardware queries, as a PopTorch program sees them."""
import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.api.batching import BatchSizeError


def test_error_hierarchy_matches_poptorch():
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
    assert not issubclass(poptorch.Error, (RuntimeError, ValueError))
    error = poptorch.RecoverableError("the run failed")
    assert error.message == "the run failed"
    assert error.type and error.recovery_action == "" and error.location == ""


@pytest.mark.parametrize("cls, python_class", [
    (poptorch.BlockError, RuntimeError), (poptorch.StrategyError, ValueError),
    (BatchSizeError, ValueError), (poptorch.CompileError, RuntimeError),
    (poptorch.UnsupportedOpError, NotImplementedError)])
def test_project_errors_are_poptorch_errors(cls, python_class):
    assert issubclass(cls, poptorch.Error) and issubclass(cls, python_class)


def test_a_wrong_batch_is_caught_as_poptorch_error():
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2), poptorch.Options().deviceIterations(3))
    with pytest.raises(poptorch.Error, match="Invalid batch dimension 4"):
        model(torch.ones(4, 2))


def test_no_ipu_hardware():
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(16) is False
    with pytest.raises(ValueError, match="num_ipus"):
        poptorch.ipuHardwareIsAvailable(0)
    with pytest.raises(AssertionError, match="No IPU hardware"):
        poptorch.ipuHardwareVersion()


class TwoStages(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(1, 1)
        self.second = torch.nn.Linear(1, 1)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            x = self.first(x)
        with poptorch.Block("B", ipu_id=1):
            return poptorch.identity_loss(self.second(x), reduction="mean")


def test_inference_with_gradient_accumulation_is_refused_when_the_model_is_created():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match=r"gradientAccumulation to 1.*deviceIterations.*gradientAccumulation\(2\)"):
        poptorch.inferenceModel(TwoStages(), opts)


def test_pipeline_depth_errors_are_poptorch_errors():
    with pytest.raises(poptorch.Error, match=r"number of pipeline stages \(3\).*model with 2 pipeline stages.*"
                                             r"additional 1 stages"):
        poptorch.trainingModel(TwoStages())(torch.ones(1, 1))
    with pytest.raises(poptorch.Error, match=r"deviceIterations must be greater than or equal to the number of "
                                             r"pipeline stages \(2\)"):
        poptorch.inferenceModel(TwoStages())(torch.ones(1, 1))


def test_an_argument_error_in_forward_names_the_users_tensor_class():
    """torch's argument parser lists the classes it got; the capture's fake tensors are Tensors to
    the user, as in eager PyTorch."""
    class Scatter(torch.nn.Module):
        def forward(self, x, i):
            return x.scatter(0, i, x, None)

    x, i = torch.randn(3, 3), torch.zeros(3, 3, dtype=torch.long)
    with pytest.raises(TypeError) as eager:
        Scatter()(x, i)
    with pytest.raises(TypeError) as compiled:
        poptorch.inferenceModel(Scatter())(x, i)
    assert str(compiled.value) == str(eager.value)
