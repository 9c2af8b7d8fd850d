"""Automatic loss scaling: float16 gradient statistics on the device and PopART's rule moving the
loss scale held in a device tensor; PopTorch's optimisers' loss_scaling as the starting point."""
import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops.loss_scaling import bin_edge, gradient_statistics, loss_scale_update

EDGE = 0.125 * 65504      # PopART's default bin edge for float16 gradients


class Scaled(torch.nn.Module):
    """loss = sum(w * x): the weight's gradient is the loss scale times x, exactly."""

    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n, dtype=torch.float16))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum(), "sum")


def als_options(**settings):
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    for k, v in settings.items():
        opts._Popart.set(f"automaticLossScalingSettings.{k}", v)
    opts.anchorTensor("scale", "finalLossScale", poptorch.OutputMode.Final)
    return opts


def scales(x, steps, initial=1.0, **settings):
    model = Scaled(x.numel())
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=initial, use_combined_accum=False)
    training = poptorch.trainingModel(model, als_options(**settings), optimizer)
    out = []
    for _ in range(steps):
        training(x)
        out.append(float(training.getAnchoredTensor("scale")))
    return out, training, optimizer


def popart_rule(x, steps, initial=1.0, threshold=1e-7, period=1):
    """The loss scales PopART's rule gives when the only tracked gradient is scale * x (and the
    seed, the scale itself)."""
    scale, out = initial, []
    for u in range(steps):
        out.append(scale)
        if u % period:
            continue
        grads = np.append(np.abs(x.numpy().astype(np.float64) * scale), scale)
        upper = np.count_nonzero(grads >= EDGE)
        scale *= 0.5 if upper / grads.size > threshold else 2.0
    return out


@pytest.mark.parametrize("peak", [3000.0, 20000.0, 0.5])
def test_the_scale_moves_as_poptorchs_rule_says(peak):
    x = torch.linspace(-peak, peak, 16, dtype=torch.float16)
    got, _, _ = scales(x, 8)
    assert got == popart_rule(x, 8)


def test_threshold_and_update_period_are_poptorchs_options():
    x = torch.tensor([3000.0] * 3 + [1.0] * 7, dtype=torch.float16)   # 3 of 11 tracked elements can be large
    got, _, _ = scales(x, 6, thresholdUpperCountProportion=0.5)
    assert got == popart_rule(x, 6, threshold=0.5) == [1, 2, 4, 8, 16, 32]   # 27% upper never exceeds 50%
    got, _, _ = scales(x, 6, updatePeriod=2)
    assert got == popart_rule(x, 6, period=2) == [1, 2, 2, 4, 4, 2]


def test_factor_and_final_scale_as_poptorch_reports_them():
    """PopTorch's own check: the final loss scale is the optimiser's loss_scaling times the update
    factor read from optimizer.state_dict()["ipu_state"] before the run."""
    x = torch.full((5,), 1.0, dtype=torch.float16)
    model = Scaled(5)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.0, loss_scaling=2.0)
    training = poptorch.trainingModel(model, als_options(), optimizer)
    training.compile(x)
    for _ in range(4):
        factor = float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"])
        training(x)
        assert float(training.getAnchoredTensor("scale")) == 2.0 * factor
    assert factor == 8.0


def test_the_update_divides_by_the_scale_the_gradients_had():
    """Whatever the scale, the weights move as unscaled float32 SGD says."""
    x = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float16)
    model = Scaled(4)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.125, loss_scaling=4.0, use_combined_accum=False)
    training = poptorch.trainingModel(model, als_options(), optimizer)
    for step in range(1, 4):
        training(x)
        torch.testing.assert_close(model.w.detach(), (1 - 0.125 * step * x.float()).half())


@pytest.mark.parametrize("optimizer_class", [poptorch.optim.SGD, poptorch.optim.Adam])
def test_a_new_optimizers_loss_scaling_applies_from_the_next_call(optimizer_class):
    """loss_scaling is a variable hyperparameter, as in PopTorch: the gradient seed reads it from
    the device, so setOptimizer changes it without compiling again and the weights move as the
    unscaled optimiser says whatever the scale."""
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer_class(model.parameters(), lr=0.01))
    eager = optimizer_class(reference.parameters(), lr=0.01)
    executables = set()
    for scale in (1.0, 128.0, 0.25):
        training.setOptimizer(optimizer_class(model.parameters(), lr=0.01, loss_scaling=scale))
        training(x, y)
        executables.add(id(training._executable))
        eager.zero_grad()
        reference(x, y)[1].backward()
        eager.step()
    training.copyWeightsToHost()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(executables) == 1   # compiled once


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def train_half(loss_scaling, automatic, steps=24, replicas=1, pipelined=False):
    torch.manual_seed(0)
    model = Net().half()
    if pipelined:
        model.fc2 = poptorch.BeginBlock(model.fc2, ipu_id=1)
    opts = als_options() if automatic else poptorch.Options()
    opts.replicationFactor(replicas)
    if pipelined:
        opts.Training.gradientAccumulation(4)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, loss_scaling=loss_scaling, use_combined_accum=False)
    training = poptorch.trainingModel(model, opts, optimizer)
    gen = torch.Generator().manual_seed(1)
    batch = 8 * replicas * (4 if pipelined else 1)
    x = torch.randn(batch, 16, generator=gen).half()
    y = (100 * torch.randn(batch, 4, generator=gen)).half()
    for _ in range(steps):
        training(x, y)
    return model, training


def test_float16_training_stays_finite_where_a_large_fixed_scale_overflows():
    fixed, _ = train_half(2.0 ** 12, automatic=False, steps=3)
    assert not all(torch.isfinite(p).all() for p in fixed.parameters())     # gradients overflowed
    auto, training = train_half(1.0, automatic=True)
    assert all(torch.isfinite(p).all() for p in auto.parameters())
    scale = float(training.getAnchoredTensor("scale"))
    assert 8.0 <= scale < 2.0 ** 12      # it grew, and settled below what overflows


@pytest.mark.parametrize("replicas, pipelined", [(2, False), (1, True)])
def test_statistics_of_every_replica_and_ipu_decide_together(replicas, pipelined):
    model, training = train_half(1.0, automatic=True, steps=8, replicas=replicas, pipelined=pipelined)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    exe = training._executable
    scaling = exe.updates.loss_scaling
    assert len({t.ipu for t in scaling.stats.values()}) == (2 if pipelined or replicas == 2 else 1)
    values = {float(exe.engine.readTensor(t)[0]) for t in scaling.scales}
    assert len(values) == 1 and len(scaling.scales) == replicas   # every replica uses the same scale


def test_statistics_cost_cycles():
    x = torch.randn(8, 16).half(), torch.randn(8, 4).half()
    runs = []
    for automatic in (False, True):
        torch.manual_seed(0)
        model = Net().half()
        opts = als_options() if automatic else poptorch.Options()
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0))
        training(*x)
        runs.append(training.last_run)
    compute = [sum(c.compute for s in r.steps for c in s.busy.values()) for r in runs]
    assert compute[1] > compute[0]      # the histograms and the update
    assert training._executable.updates.loss_scaling.program in [e.program for s in runs[1].steps for e in s.events]


def test_float32_gradients_are_not_tracked():
    model = Net()
    training = poptorch.trainingModel(model, als_options())
    with pytest.raises(poptorch.Error, match="No tracked gradient tensors of type fp16 were found"):
        training(torch.randn(2, 16), torch.randn(2, 4))


def test_settings_are_checked():
    model = Scaled(2)
    training = poptorch.trainingModel(model, als_options(binEdgeLocation=1.5))
    with pytest.raises(poptorch.Error, match="Out of range value for 'binEdgeLocation'"):
        training(torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_device_statistics_and_update_on_constructed_gradients(mode):
    g = ip.Graph(ip.Target.test(8))
    grad = g.addVariable("float16", (64,), "grad")
    g.map_linearly(grad)
    stats, counter, factor = (g.addVariable("float32", shape, name) for shape, name in
                              (((1, 2), "stats"), ((1,), "counter"), ((1,), "factor")))
    for t in (stats, counter, factor):
        g.setTileMapping(t, 5)
    prog = ip.Sequence()
    gradient_statistics(g, grad, stats, bin_edge("float16", 0.125), prog)
    change = loss_scale_update(g, stats, counter, factor, prog, threshold=0.1)
    engine = ip.Engine(g, prog, mode=mode).load()
    engine.writeTensor(factor, [1.0])
    values = np.ones(64, np.float16)
    # upper-bin proportions 6/64 (9%, not above 10%: double), 7/64 (11%, with an inf: halve), 0 (double)
    for upper, big, expected in ((6, 9000.0, 2.0), (7, np.inf, 0.5), (0, 0.0, 2.0)):
        values[:] = -1.0
        values[:upper] = big
        engine.writeTensor(stats, [[0.0, 0.0]])
        engine.writeTensor(grad, values)
        engine.run()
        assert engine.readTensor(stats).tolist() == [[64.0 - upper, float(upper)]]
        assert float(engine.readTensor(change)[0]) == expected
    assert float(engine.readTensor(factor)[0]) == 2.0 * 0.5 * 2.0


def test_automatic_loss_scaling_settings_are_not_listed_as_without_effect(caplog):
    import logging
    from poptorch_lite.api import poptorch_core
    opts = als_options(updatePeriod=2, binEdgeLocation=0.25, thresholdUpperCountProportion=1e-6,
                       gradientTensorTrackingMethod=0)
    opts._Popart.set("enableOutlining", False)
    poptorch_core._LISTED.clear()
    model = Scaled(4)
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=1.0))
    listed = [r.getMessage() for r in caplog.records if "no effect on the emulator" in r.getMessage()]
    assert listed == ["PopART options accepted with no effect on the emulator: enableOutlining"]
