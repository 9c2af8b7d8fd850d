"""Options.Emulator.setPipelineSchedule: the tutorial network trained under GPipe, 1F1B and
interleaved 1F1B ends with the parameters PopTorch's schedule gives; the zero-bubble kinds and
placements a kind cannot run are refused with what to do."""
import pytest
import torch

import poptorch_lite as poptorch
from tutorial_model import Network, TrainingModelWithLoss

MICRO_BATCH, ACCUMULATION, CALLS = 4, 8, 2


def tutorial_model():
    torch.manual_seed(0)
    net = Network()
    net.layer3_dropout.p = 0.0
    return TrainingModelWithLoss(net)


def train(kind, ipus, strategy_cls=poptorch.PipelinedExecution):
    """Parameters after CALLS calls; blocks B1..B4 are stages 0..3, stage s on IPU ipus[s]."""
    model = tutorial_model()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.setExecutionStrategy(strategy_cls(*[poptorch.Stage(f"B{s + 1}").ipu(i) for s, i in enumerate(ipus)]))
    opts.Emulator.setPipelineSchedule(kind)
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05))
    torch.manual_seed(1)
    for _ in range(CALLS):
        x = torch.randn(MICRO_BATCH * ACCUMULATION, 1, 28, 28)
        y = torch.randint(0, 10, (MICRO_BATCH * ACCUMULATION,))
        training(x, y)
    strategy = training._executable.schedule.strategy
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    training.destroy()
    return strategy, params


@pytest.fixture(scope="module")
def poptorch_params():
    return train("PopTorch", [0, 1, 2, 3])[1]


def assert_same(params, reference):
    for name, ref in reference.items():
        rel = float((params[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert rel <= 1e-6, (name, rel)


@pytest.mark.parametrize("kind,ipus", [("GPipe", [0, 1, 2, 3]), ("1F1B", [0, 1, 2, 3]),
                                       ("Interleaved1F1B", [0, 1, 0, 1])])
def test_training_under_each_kind_matches_poptorchs_schedule(kind, ipus, poptorch_params):
    strategy, params = train(kind, ipus)
    assert strategy == kind
    assert_same(params, poptorch_params)


def test_option_validates_and_defaults_to_poptorch():
    opts = poptorch.Options()
    assert opts.Emulator.pipeline_schedule == "PopTorch"
    with pytest.raises(ValueError, match=r"unknown schedule '1f1b'; use one of 'PopTorch', 'GPipe', '1F1B'"):
        opts.Emulator.setPipelineSchedule("1f1b")


@pytest.mark.parametrize("kind,ipus,message", [
    ("ZB-H1", [0, 1, 2, 3], r"ZB-H1 runs the backward as separate input-gradient \(B\) and weight-gradient \(W\) "
                            r"programs, which the compiler does not build yet"),
    ("1F1B", [0, 1, 0, 1], r"runs stage s on IPU s; this model places its stages on IPUs \[0, 1, 0, 1\]"),
    # B2 and B3 on IPU 1 merge into one stage: 3 stages on 2 IPUs
    ("Interleaved1F1B", [0, 1, 1, 0], r"needs stage s on IPU s mod 2 \(3 stages on 2 IPUs, each IPU the same number "
                                      r"of stages\); this model places its stages on IPUs \[0, 1, 0\]"),
])
def test_kinds_the_runtime_cannot_run_are_refused(kind, ipus, message):
    with pytest.raises(ValueError, match=message):
        train(kind, ipus)
