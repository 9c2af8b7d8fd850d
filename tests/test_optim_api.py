"""poptorch.optim as PopTorch has it: which attributes are variable, what the device is told of an
optimiser (the debug log of its hyperparameters), the warnings about attributes and subclasses."""
import copy
import logging

import numpy as np
import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.api.optim import describe


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.lin(x)
        return out, torch.nn.functional.mse_loss(out, y)


def batch():
    torch.manual_seed(0)
    return torch.randn(3, 4), torch.randn(3, 2)


@pytest.fixture
def debug_log(caplog):
    poptorch.setLogLevel("DEBUG")
    caplog.set_level(logging.DEBUG, logger="poptorch_lite")
    yield caplog
    poptorch.setLogLevel("WARN")


def test_only_given_hyperparameters_are_variable():
    params = Regression().parameters()
    opt = poptorch.optim.SGD(params, lr=0.1, momentum=0.0)
    assert not opt.variable_attrs.isConstant("momentum")   # given, even at its default value
    assert opt.variable_attrs.isConstant("weight_decay") and opt.variable_attrs.isConstant("dampening")
    adamw = poptorch.optim.AdamW(Regression().parameters())
    assert adamw.variable_attrs.isConstant("weight_decay") and adamw.variable_attrs.isConstant("betas")
    assert adamw.defaults["weight_decay"] == 1e-2 and adamw.defaults["betas"] == (0.9, 0.999)


def test_description_names_defaults_groups_constants_and_types():
    opt = poptorch.optim.Adam(Regression().parameters(), lr=0.01, eps=1e-6, accum_type=torch.float16)
    graph, groups = describe(opt)
    assert graph.startswith("ADAM, ")
    assert "defaultLearningRate=0.01," in graph and "defaultEps=1e-06," in graph
    assert "defaultWeightDecay=0 (const)" in graph and "lossScaling=1 (const)" in graph
    assert "accumType=float16" in graph and "firstOrderMomentumAccumType=float32" in graph
    assert len(groups) == 1 and "learningRate=0.01," in groups[0] and "defaultEps" not in groups[0]
    # torch's own optimiser: a value at its no-op default is constant
    graph, _ = describe(torch.optim.SGD(Regression().parameters(), lr=0.5, momentum=0.9))
    assert graph.startswith("SGD2, ") and "defaultMomentum=0.9," in graph and "defaultDampening=0 (const)" in graph
    # the separate SGD variant scales its velocity by the loss scaling
    graph, _ = describe(poptorch.optim.SGD(Regression().parameters(), lr=1.0, loss_scaling=2.0))
    assert "defaultVelocityScaling=2," in graph and "lossScaling=2," in graph


def test_the_device_receives_a_changed_optimiser_once(debug_log):
    model = Regression()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*batch())
    assert sum("Updating graph optimizer with SGD2" in r.message for r in debug_log.records) == 1
    debug_log.clear()
    training.setOptimizer(opt)   # unchanged: nothing sent
    assert not any("Updating" in r.message for r in debug_log.records)
    opt.param_groups[0]["lr"] = 0.05
    training.setOptimizer(opt)
    assert any("Updating group 0 optimizer with SGD2" in r.message and "learningRate=0.05," in r.message
               for r in debug_log.records)


def test_loss_scaling_is_an_optimiser_attribute_and_velocity_scaling_a_combined_sgd_group_value(caplog):
    """As in PopTorch: the loss scaling is one value for the optimiser (a group's copy would be
    ignored, and is reported); SGD's velocity scaling is a group value of the combined variant."""
    model = Regression()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=4.0)
    assert opt.loss_scaling == 4.0 and "loss_scaling" not in opt.defaults and "loss_scaling" not in opt.param_groups[0]
    assert "velocity_scaling" not in opt.defaults
    combined = poptorch.optim.SGD(model.parameters(), lr=0.1, velocity_scaling=2.0, use_combined_accum=True)
    assert combined.param_groups[0]["velocity_scaling"] == 2.0
    copied = copy.copy(opt)
    assert copied.loss_scaling == 4.0 and not copied.variable_attrs.isConstant("loss_scaling")
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*batch())
    opt.loss_scaling = 8.0
    opt.param_groups[0]["loss_scaling"] = 2.0
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        training.setOptimizer(opt)
    assert "Ignoring unexpected group 0 attribute in SGD2 optimizer: ['loss_scaling']" in caplog.text
    assert training._executable.updates.configs[0][1].loss_scaling == 8.0
    with pytest.raises(ValueError, match="loss_scaling must be > 0"):
        poptorch.optim.Adam(model.parameters(), loss_scaling=0.0)


def test_attributes_added_after_the_first_use_are_reported_once(caplog):
    model = Regression()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    opt.before = 1   # known from the start: no warning
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*batch())
    opt.step_count = 0
    opt.param_groups[0]["initial_lr"] = 0.1
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        training.setOptimizer(opt)
        training.setOptimizer(opt)
    messages = [r.message for r in caplog.records]
    assert messages.count("Ignoring unexpected optimizer attribute in SGD2 optimizer: ['step_count']") == 1
    assert messages.count("Ignoring unexpected group 0 attribute in SGD2 optimizer: ['initial_lr']") == 1
    assert not any("before" in m for m in messages)


def test_a_subclassed_optimiser_is_warned_about(caplog):
    class Mine(torch.optim.SGD):
        pass

    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        poptorch.trainingModel(Regression(), optimizer=torch.optim.AdamW(Regression().parameters()))
        assert not caplog.records
        model = Regression()
        poptorch.trainingModel(model, optimizer=Mine(model.parameters(), lr=0.1))
    assert "Poptorch does not run Python optimizer code directly" in caplog.records[0].message


def test_a_variable_momentum_can_start_at_zero():
    """Momentum given to the constructor is variable: its velocity exists at zero (holding the
    last gradient), so a later setOptimizer can turn it on without a new model and the velocity
    carries on: the steps equal torch's with that momentum from the start (its first velocity is
    the first gradient too)."""
    model = Regression()
    reference = Regression()
    reference.load_state_dict(model.state_dict())
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    training = poptorch.trainingModel(model, optimizer=opt)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    x, y = batch()
    for step in range(3):
        if step == 1:
            opt.param_groups[0]["momentum"] = 0.5
            training.setOptimizer(opt)
        training(x, y)
        cpu.zero_grad()
        reference(x, y)[1].backward()
        cpu.step()
    torch.testing.assert_close(model.lin.weight.detach(), reference.lin.weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum, centered", [(0.0, False), (0.9, False), (0.9, True)])
def test_rmsprop_tf_variant_matches_tensorflows_update(momentum, centered):
    """use_tf_variant: the squared-gradient average starts at one, eps goes inside the square root
    and the momentum buffer accumulates lr times the step (TensorFlow's RMSprop)."""
    model = Regression()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    lr, alpha, eps = 0.01, 0.9, 1e-3
    opt = poptorch.optim.RMSprop(model.parameters(), lr=lr, alpha=alpha, eps=eps, momentum=momentum,
                                 centered=centered, use_tf_variant=True)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, y = batch()
    reference = Regression()
    reference.load_state_dict(start)
    sq = {n: torch.ones_like(p) for n, p in reference.named_parameters()}
    avg = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    buf = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for _ in range(3):
        training(x, y)
        reference.zero_grad()
        reference(x, y)[1].backward()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                sq[n] = alpha * sq[n] + (1 - alpha) * p.grad ** 2
                s = sq[n]
                if centered:
                    avg[n] = alpha * avg[n] + (1 - alpha) * p.grad
                    s = s - avg[n] ** 2
                step = p.grad / torch.sqrt(s + eps)
                if momentum:
                    buf[n] = momentum * buf[n] + lr * step
                    p -= buf[n]
                else:
                    p -= lr * step
    torch.testing.assert_close(model.lin.weight.detach(), reference.lin.weight.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.lin.bias.detach(), reference.lin.bias.detach(), rtol=1e-4, atol=1e-5)


def test_lamb_steps_on_the_cpu_with_its_loss_scaling():
    """LAMB's own (CPU) step divides the gradients by the optimiser's loss scaling."""
    torch.manual_seed(0)
    models = [Regression(), Regression()]
    models[1].load_state_dict(models[0].state_dict())
    x, y = batch()
    for model, scale in zip(models, (1.0, 4.0)):
        opt = poptorch.optim.LAMB(model.parameters(), lr=0.01, loss_scaling=scale)
        (model(x, y)[1] * scale).backward()
        opt.step()
    torch.testing.assert_close(models[0].lin.weight, models[1].lin.weight)


# ---- the device state in optimizer.state_dict(): PopTorch's ipu_state and ipu_param -----------------
def test_state_dict_holds_the_device_state_and_variable_hyperparameters_by_popart_name():
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.025, loss_scaling=0.75)
    training = poptorch.trainingModel(model, optimizer=opt)
    assert opt.state_dict()["ipu_state"] is None and opt.state_dict()["ipu_param"] is None   # not compiled
    training(*batch())
    state = opt.state_dict()
    params = state["ipu_param"]
    assert params["learningRate___specific___lin.weight"].item() == pytest.approx(0.05)
    assert params["weightDecay___specific___lin.bias"].item() == pytest.approx(0.025)
    assert params["lossScaling_FLOAT"].item() == pytest.approx(0.75)
    assert not any(k.startswith(("adamBeta1", "adamEps")) for k in params)   # constants are no tensors
    # the moments after one step are torch's
    cpu = torch.optim.Adam(reference.parameters(), lr=0.05, weight_decay=0.025)
    reference(*batch())[1].backward()
    cpu.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state["ipu_state"][f"Accl1___{name}"], cpu.state[p]["exp_avg"])
        torch.testing.assert_close(state["ipu_state"][f"Accl2___{name}"], cpu.state[p]["exp_avg_sq"])
        assert state["ipu_state"][f"Step___{name}"].item() == 1


def test_sgd_hyperparameters_are_popart_compound_values():
    model = Regression()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.025, loss_scaling=0.75)
    training = poptorch.trainingModel(model, optimizer=opt)
    training.compile(*batch())
    params = opt.state_dict()["ipu_param"]
    assert params["scaledLearningRate0___specific___lin.weight"].item() == pytest.approx(0.05 / 0.75)
    assert params["weightDecayScaleFactor0___specific___lin.bias"].item() == pytest.approx(1 - 0.05 * 0.025)
    assert opt.state_dict()["ipu_state"] == {}   # SGD without momentum keeps no state


def test_a_loaded_state_is_what_the_next_step_starts_from():
    """Device: one step, the first moment replaced through load_state_dict, a second step; the
    CPU does the same with torch's Adam: the weights agree."""
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=opt)
    cpu = torch.optim.Adam(reference.parameters(), lr=0.01)
    x, y = batch()

    def cpu_step():
        cpu.zero_grad()
        reference(x, y)[1].backward()
        cpu.step()

    training(x, y)
    cpu_step()
    state = opt.state_dict()
    moments = {name: torch.randn_like(p) for name, p in reference.named_parameters()}
    for name, p in reference.named_parameters():
        state["ipu_state"][f"Accl1___{name}"] = moments[name].clone()
        cpu.state[p]["exp_avg"] = moments[name].clone()
    opt.load_state_dict(state)
    assert torch.equal(opt.state_dict()["ipu_state"]["Accl1___lin.bias"], moments["lin.bias"])  # not run yet
    training(x, y)
    cpu_step()
    torch.testing.assert_close(model.lin.weight.detach(), reference.lin.weight.detach())
    torch.testing.assert_close(model.lin.bias.detach(), reference.lin.bias.detach())


def test_state_dict_reads_the_device_once_per_run(debug_log):
    model = Regression()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*batch())
    opt.state_dict()
    assert sum("from IPU to host" in r.message for r in debug_log.records) == 1
    debug_log.clear()
    opt.state_dict()
    assert any("Using cached optimiser state dict" in r.message for r in debug_log.records)
    assert not any("from IPU to host" in r.message for r in debug_log.records)


def test_only_an_ipu_state_dict_loads():
    model = Regression()
    cpu = torch.optim.Adam(model.parameters())
    model(*batch())[1].backward()
    cpu.step()
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto the IPU"):
        poptorch.optim.Adam(model.parameters()).load_state_dict(cpu.state_dict())


def test_float16_accumulation_runs_the_running_mean_whatever_the_options_set():
    opts = poptorch.Options()
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(poptorch.MeanReductionStrategy.Post)
    model = Regression()
    half = poptorch.optim.Adam(model.parameters(), lr=0.01, accum_type=torch.float16)
    training = poptorch.trainingModel(model, opts, optimizer=half)
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Running
    training.compile(*batch())
    assert training._executable.lowering.accumulators["lin.weight"].dtype == "float16"

    model = Regression()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, opts, optimizer=opt)
    training.compile(*batch())
    opt.accum_type = torch.float16   # the strategy is compiled in: this optimiser cannot run
    with pytest.raises(ValueError, match="is already compiled"):
        training.setOptimizer(opt)


def test_adamw_without_bias_correction_steps_on_the_cpu_as_on_the_device():
    torch.manual_seed(0)
    models = [Regression() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    x, y = batch()
    device_opt = poptorch.optim.AdamW(models[0].parameters(), lr=0.01, bias_correction=False)
    training = poptorch.trainingModel(models[0], optimizer=device_opt)
    cpu = poptorch.optim.AdamW(models[1].parameters(), lr=0.01, bias_correction=False)
    corrected = poptorch.optim.AdamW(models[2].parameters(), lr=0.01)
    for _ in range(3):
        training(x, y)
        for model, opt in ((models[1], cpu), (models[2], corrected)):
            opt.zero_grad()
            model(x, y)[1].backward()
            opt.step()
    torch.testing.assert_close(models[0].lin.weight.detach(), models[1].lin.weight.detach())
    assert not torch.allclose(models[1].lin.weight, models[2].lin.weight, atol=1e-4)


@pytest.mark.parametrize("make, expected", [
    (lambda p: poptorch.optim.SGD(p, lr=0.1), {"SGD0VarUpdate": 2}),
    (lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9), {"SGD1VarUpdate": 2}),
    (lambda p: torch.optim.AdamW(p, lr=0.1), {"AdamUpdater": 2, "AdamVarUpdate": 2}),
    (lambda p: poptorch.optim.LAMB(p, lr=0.1), {"AdamUpdater": 2, "LambSquare": 4, "AdamVarUpdate": 2}),
    (lambda p: poptorch.optim.RMSprop(p, lr=0.1), {"RMSPropUpdater": 2, "ScaledVarUpdate": 2}),
])
def test_the_ir_lists_each_weight_s_update_ops(make, expected):
    import json
    model = Regression()
    training = poptorch.trainingModel(model, optimizer=make(model.parameters()))
    training.compile(*batch())
    ops = json.loads(training._debugGetPopartIR())["maingraph"]
    counted = {}
    for op in ops:
        if op["type"] in ("SGD0VarUpdate", "SGD1VarUpdate", "AdamUpdater", "AdamVarUpdate", "LambSquare",
                          "RMSPropUpdater", "ScaledVarUpdate"):
            counted[op["type"]] = counted.get(op["type"], 0) + 1
    assert counted == expected
    assert {op["inputs"][0]["name"] for op in ops if op["type"].endswith("VarUpdate")} == {"lin.weight", "lin.bias"}
    inference = poptorch.inferenceModel(Regression())
    inference.compile(*batch())
    assert not any(op["type"].endswith("VarUpdate") for op in json.loads(inference._debugGetPopartIR())["maingraph"])


@pytest.mark.parametrize("accumulation, scaling", [(1, 1.0), (2, 8.0)])
def test_max_grad_norm_clips_the_gradients_by_their_global_norm_as_torch_does(accumulation, scaling):
    """The bound holds for the gradient the update uses: accumulated (mean of the micro-batches)
    and without the loss scaling."""
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, max_grad_norm=0.01, loss_scaling=scaling)
    training = poptorch.trainingModel(model, opts, optimizer=opt)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(3 * accumulation, 4), torch.randn(3 * accumulation, 2)
    for _ in range(3):
        training(x, y)
        cpu.zero_grad()
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
            (reference(xs, ys)[1] / accumulation).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01) > 0.01   # the bound bites
        cpu.step()
    torch.testing.assert_close(model.lin.weight.detach(), reference.lin.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.lin.bias.detach(), reference.lin.bias.detach(), rtol=1e-5, atol=1e-6)
    opt.defaults["max_grad_norm"] = 0.5   # compiled in: a new bound needs a new model
    with pytest.raises(ValueError, match="max_grad_norm"):
        training.setOptimizer(opt)


def test_max_grad_norm_over_several_ipus_is_refused():
    class TwoStages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = poptorch.BeginBlock(torch.nn.Linear(4, 4), ipu_id=0)
            self.b = poptorch.BeginBlock(torch.nn.Linear(4, 2), ipu_id=1)

        def forward(self, x, y):
            out = self.b(self.a(x))
            return out, torch.nn.functional.mse_loss(out, y)

    net = TwoStages()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    training = poptorch.trainingModel(net, opts, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1,
                                                                              max_grad_norm=0.01))
    with pytest.raises(ValueError, match="max_grad_norm.*2 IPUs"):
        training(torch.randn(3, 4), torch.randn(3, 2))


def test_destroy_reads_the_optimiser_state_back_first():
    model = Regression()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*batch())
    training.destroy()
    state = opt.state_dict()   # no executable now: the copy read when destroyed
    assert state["ipu_state"]["Step___lin.weight"].item() == 1
    assert state["ipu_state"]["Accl1___lin.weight"].abs().sum() > 0


def test_a_loaded_state_reaches_every_replica():
    torch.manual_seed(0)
    model = Regression()
    opts = poptorch.Options().replicationFactor(2)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, opts, optimizer=opt)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    training(x, y)
    state = opt.state_dict()
    state["ipu_state"]["Accl1___lin.weight"] = torch.randn(2, 4)
    opt.load_state_dict(state)
    training(x, y)   # written first, then a step from it on each replica
    exe = training._executable
    (cfg0, w0), = exe.updates.states["lin.weight"]
    (cfg1, w1), = exe.updates.copies["lin.weight"]
    first = exe.engine.readTensor(cfg0.state_of(w0).tensors["exp_avg"])
    second = exe.engine.readTensor(cfg1.state_of(w1).tensors["exp_avg"])
    np.testing.assert_array_equal(first, second)   # (replica 1 left at its old state would differ)
