"""The tutorial network on emulated IPUs against plain PyTorch: forward outputs, training with
gradient accumulation and device iterations (pipelined and sharded), OutputMode shapes,
weight sync, optimiser changes, memory errors."""
import copy

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss

SHARDED = poptorch.ShardedExecution(poptorch.Stage("B1").ipu(0), poptorch.Stage("B2").ipu(1),
                                    poptorch.Stage("B3").ipu(2), poptorch.Stage("B4").ipu(3))
STRATEGIES = {"pipelined": TUTORIAL_STRATEGY, "sharded": SHARDED}


def tutorial_model(seed=0):
    torch.manual_seed(seed)
    net = Network()
    net.layer3_dropout.p = 0.0  # deterministic: the reference and the device see the same network
    return TrainingModelWithLoss(net)


def options(strategy, device_iterations=1, accumulation=1, output_mode=None):
    opts = poptorch.Options().deviceIterations(device_iterations)
    opts.Training.gradientAccumulation(accumulation)
    opts.setExecutionStrategy(STRATEGIES[strategy])
    if output_mode is not None:
        opts.outputMode(output_mode)
    return opts


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("strategy", ["pipelined", "sharded"])
def test_inference_matches_pytorch(strategy):
    model = tutorial_model()
    x = torch.randn(4 * 8, 1, 28, 28)
    expected = model.eval()(x)
    opts = poptorch.Options().deviceIterations(8).setExecutionStrategy(STRATEGIES[strategy])
    out = poptorch.inferenceModel(model, opts)(x)
    assert out.shape == (32, 10)
    assert max_relative_error(out, expected.detach()) < 1e-5


def reference_training(model, make_opt, batches, accumulation):
    """Plain PyTorch with the same gradient accumulation (gradients averaged, PopTorch's Mean)."""
    opt = make_opt(model.parameters())
    losses = []
    for xs, ys in batches:
        opt.zero_grad()
        for x, y in zip(xs, ys):
            _, loss = model(x, y)
            (loss / accumulation).backward()
            losses.append(loss.item())
        opt.step()
    return losses


OPTIMIZERS = {
    "sgd_momentum": lambda params: poptorch.optim.SGD(params, lr=0.02, momentum=0.9),
    "adamw": lambda params: poptorch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pipelined", "sharded"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_fifty_optimiser_steps_match_pytorch(strategy, optimizer):
    """Gradient accumulation 10, device iterations 10: 50 optimiser steps in 5 calls."""
    micro, accumulation, iterations, calls = 2, 10, 10, 5
    model = tutorial_model()
    ref = copy.deepcopy(model)
    opts = options(strategy, iterations, accumulation, poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, opts, OPTIMIZERS[optimizer](model.parameters()))
    gen = torch.Generator().manual_seed(1)
    per_call = micro * accumulation * iterations
    data = [(torch.randn(per_call, 1, 28, 28, generator=gen), torch.randint(0, 10, (per_call,), generator=gen))
            for _ in range(calls)]
    device_losses = [training(x, y)[1] for x, y in data]
    batches = [(x[i:i + micro * accumulation].split(micro), y[i:i + micro * accumulation].split(micro))
               for x, y in data for i in range(0, per_call, micro * accumulation)]
    ref_losses = reference_training(ref, OPTIMIZERS[optimizer], batches, accumulation)
    np.testing.assert_allclose(torch.cat(device_losses).numpy(), ref_losses, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        p, q = p.detach(), q.detach()
        # Relative error of each parameter tensor. Adam divides by sqrt(v): a weight whose gradient
        # is pure float32 rounding noise (a few of layer3's 81920) can step either way, so we
        # also bound how many elements may differ by more than 1e-4 of the tensor's largest value.
        assert float((p - q).norm() / q.norm()) < 1e-4, name
        assert int(((p - q).abs() > 1e-4 * q.abs().max()).sum()) <= max(1, q.numel() // 10000), name


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mode,period", [(poptorch.OutputMode.All, None), (poptorch.OutputMode.Final, None),
                                         (poptorch.OutputMode.EveryN, 2), (poptorch.OutputMode.Sum, None),
                                         (poptorch.OutputMode.Default, None)])
def test_output_mode_shapes(training, mode, period):
    model = tutorial_model()
    micro, iterations = 2, 4
    accumulation = 8 if training else 1
    opts = poptorch.Options().deviceIterations(iterations).setExecutionStrategy(TUTORIAL_STRATEGY)
    opts.Training.gradientAccumulation(accumulation)
    opts.outputMode(mode, period) if period else opts.outputMode(mode)
    n = micro * iterations * accumulation
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    if training:
        out, loss = poptorch.trainingModel(model, opts)(x, y)
    else:
        out = poptorch.inferenceModel(model, opts)(x)
    effective = mode if mode != poptorch.OutputMode.Default else (
        poptorch.OutputMode.Final if training else poptorch.OutputMode.All)
    multiplier = {poptorch.OutputMode.All: iterations * accumulation,
                  poptorch.OutputMode.EveryN: iterations * accumulation // 2,
                  poptorch.OutputMode.Final: 1, poptorch.OutputMode.Sum: 1}[effective]
    assert out.shape == ((micro * multiplier, 10) if multiplier > 1 else (micro, 10))
    if training:
        assert loss.shape == ((multiplier,) if multiplier > 1 else ())


def test_batch_not_a_multiple_names_all_factors():
    model = tutorial_model()
    opts = options("pipelined", 2, 8)
    with pytest.raises(ValueError, match=r"deviceIterations \(2\).*replicationFactor \(1\).*gradientAccumulation \(8"):
        poptorch.trainingModel(model, opts)(torch.randn(20, 1, 28, 28), torch.randint(0, 10, (20,)))


def test_pipeline_needs_enough_accumulation():
    model = tutorial_model()
    with pytest.raises(Exception, match=r"gradientAccumulation must be greater than or equal to the number of pipeline stages \(7\)"):
        poptorch.trainingModel(model, options("pipelined", 1, 4))(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))


def test_weights_sync_lazily_and_inference_sees_trained_weights():
    model = tutorial_model()
    before = copy.deepcopy(model.state_dict())
    training = poptorch.trainingModel(model, options("pipelined", 1, 8))
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    training(x, y)
    assert training._dirty_host_weights
    after = model.model.layer4.weight.detach().clone()  # reading a parameter copies the weights back
    assert not training._dirty_host_weights
    assert not torch.equal(after, before["model.layer4.weight"])
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(4)
                                        .setExecutionStrategy(TUTORIAL_STRATEGY))
    np.testing.assert_allclose(inference(x[:8]).numpy(), model.eval()(x[:8]).detach().numpy(), rtol=1e-5, atol=1e-6)
    training(x, y)                      # train more: the inference model picks the new weights up
    fresh = model.eval()(x[:8]).detach()
    np.testing.assert_allclose(inference(x[:8]).numpy(), fresh.numpy(), rtol=1e-5, atol=1e-6)


def test_set_optimizer_changes_the_learning_rate_without_recompiling():
    model = tutorial_model()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.05)
    training = poptorch.trainingModel(model, options("sharded", 1, 1), opt)
    x, y = torch.randn(2, 1, 28, 28), torch.randint(0, 10, (2,))
    training(x, y)
    executable = training._executable
    frozen = copy.deepcopy(model.state_dict())
    training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.0))
    training(x, y)
    assert training._executable is executable
    for k, v in model.state_dict().items():
        assert torch.equal(v, frozen[k]), k


def test_optimizer_state_dict_reads_the_device_state():
    model = tutorial_model()
    opt = poptorch.optim.Adam(model.parameters(), lr=1e-3)
    training = poptorch.trainingModel(model, options("sharded", 3, 1), opt)
    training(torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,)))
    state = opt.state_dict()["state"]
    assert len(state) == len(list(model.parameters()))
    first = next(iter(state.values()))
    assert int(first["step"]) == 3 and first["exp_avg"].abs().sum() > 0


def test_out_of_memory_names_the_ipu_and_suggests_a_split():
    model = tutorial_model()
    opts = options("pipelined", 1, 8)
    opts.Emulator.setTarget(ip.Target.test(num_tiles=8, bytes_per_tile=16 * 1024))
    training = poptorch.trainingModel(model, opts)
    with pytest.raises(ip.OutOfMemoryError, match=r"(?s)IPU 2 \(stage 2; blocks B3\).*Split the blocks"):
        training(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))


def test_strict_mode_gives_the_fast_mode_numbers():
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    losses = []
    for mode in ("fast", "strict"):
        model = tutorial_model()
        opts = options("pipelined", 1, 8, poptorch.OutputMode.All)
        opts.Emulator.setTarget(ip.Target.test(num_tiles=64, bytes_per_tile=256 * 1024)).setMode(mode)
        training = poptorch.trainingModel(model, opts)
        losses.append(training(x, y)[1])
        cycles = training.last_run.cycles
        losses.append(cycles)
    np.testing.assert_allclose(losses[0].numpy(), losses[2].numpy(), rtol=1e-6)
    assert losses[1] == losses[3]


def test_pipelined_steps_follow_the_schedule_and_cost_the_slowest_ipu():
    model = tutorial_model()
    training = poptorch.trainingModel(model, options("pipelined", 1, 8))
    training(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    record = training.last_run
    assert len(record.steps) == training._executable.schedule.num_steps
    for step in record.steps:
        assert step.cycles == max(c.total for c in step.busy.values())
    sharded = poptorch.trainingModel(tutorial_model(), options("sharded", 1, 8))
    sharded(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    assert record.cycles < sharded.last_run.cycles  # pipelining overlaps the stages
    # programs and cycles are fixed when compiled: later calls reuse the first call's record,
    # which a record built anew matches step by step, program by program
    training(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    assert training.last_run is record
    training._record = None
    training(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    fresh = training.last_run
    assert fresh is not record
    assert [(s.cycles, [(e.part, e.program, e.per_ipu) for e in s.events]) for s in fresh.steps] == \
        [(s.cycles, [(e.part, e.program, e.per_ipu) for e in s.events]) for s in record.steps]


# ---- mean reduction over accumulation and replicas ---------------------------------------------
class Scaled(torch.nn.Module):
    """loss = sum(w * x): the gradient of w is the sum of x's rows."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, x):
        return poptorch.identity_loss(self.w * x, reduction="sum")


def mean_reduction_options(strategy, accumulation=4, replicas=1):
    opts = poptorch.Options().replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    if strategy is not None:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    return opts


@pytest.mark.parametrize("replicas", [1, 2])
def test_running_and_post_mean_reduction_train_the_same_weights(replicas):
    x = torch.randn(8 * replicas, 3, generator=torch.Generator().manual_seed(0))
    trained = {}
    for strategy in (poptorch.MeanReductionStrategy.Post, poptorch.MeanReductionStrategy.Running):
        net = Scaled()
        model = poptorch.trainingModel(net, mean_reduction_options(strategy, replicas=replicas),
                                       optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
        for _ in range(2):
            model(x)
        trained[strategy] = net.w.detach().clone()
    mean_grad = x.reshape(4 * replicas, 2, 3).sum(1).mean(0)
    torch.testing.assert_close(trained[poptorch.MeanReductionStrategy.Post], 1 - 2 * 0.5 * mean_grad)
    torch.testing.assert_close(trained[poptorch.MeanReductionStrategy.Running],
                               trained[poptorch.MeanReductionStrategy.Post], rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Post's float16 sum, as asserted
def test_running_mean_keeps_float16_accumulators_finite_where_their_sum_overflows():
    x = torch.full((8, 3), 20000.0, dtype=torch.float16)  # a gradient of 40000 per micro-batch: 4 sum to inf
    results = {}
    # (float16 accumulation runs Running whatever the options say, as in PopTorch, but for SGD's
    # combined variant, which keeps the strategy set)
    for strategy in (poptorch.MeanReductionStrategy.Post, poptorch.MeanReductionStrategy.Running):
        net = Scaled(torch.float16)
        model = poptorch.trainingModel(net, mean_reduction_options(strategy),
                                       optimizer=poptorch.optim.SGD(
                                           net.parameters(), lr=1e-5, accum_type=torch.float16,
                                           use_combined_accum=strategy == poptorch.MeanReductionStrategy.Post))
        assert model.options.Training.meanAccumulationAndReplicationReductionStrategy == strategy
        model(x)
        results[strategy] = net.w.detach().float()
    assert not torch.isfinite(results[poptorch.MeanReductionStrategy.Post]).any()
    torch.testing.assert_close(results[poptorch.MeanReductionStrategy.Running], torch.full((3,), 1 - 0.4),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the float16 loss value itself
def test_float16_weights_accumulate_gradients_in_accum_type():
    """PopTorch's accum_type is the dtype of the gradient accumulators, float32 unless given (for
    float16 weights too): the float16 sum that overflows above is finite in float32."""
    x = torch.full((8, 3), 20000.0, dtype=torch.float16)
    net = Scaled(torch.float16)
    model = poptorch.trainingModel(net, mean_reduction_options(poptorch.MeanReductionStrategy.Post),
                                   optimizer=poptorch.optim.SGD(net.parameters(), lr=1e-5))
    model(x)
    torch.testing.assert_close(net.w.detach().float(), torch.full((3,), 1 - 0.4), rtol=1e-3, atol=1e-3)
    accumulators = [v for g in model._executable.engine.device.graphs for v in g.variables
                    if v.category == "accumulators" and v.name.endswith("/accumulator")]
    assert accumulators and all(v.dtype == np.float32 for v in accumulators)


def test_adam_moments_take_poptorch_s_first_and_second_order_types():
    """accum_type=float16 leaves the second moment in float32 (Graphcore's mixed-precision
    tutorial's AdamW: a float16 second moment would underflow and the update blow up), and the
    first moment takes its own type."""
    net = Scaled()
    optimizer = poptorch.optim.AdamW(net.parameters(), lr=1e-3, accum_type=torch.float16,
                                     first_order_momentum_accum_type=torch.float16)
    model = poptorch.trainingModel(net, mean_reduction_options(poptorch.MeanReductionStrategy.Post),
                                   optimizer=optimizer)
    model(torch.randn(8, 3))
    variables = [v for g in model._executable.engine.device.graphs for v in g.variables]
    moments = {v.name.rsplit("/", 1)[1]: v.dtype.name for v in variables
               if v.category == "optimiser_state" and v.name.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments == {"exp_avg": "float16", "exp_avg_sq": "float32"}
    assert {v.dtype.name for v in variables if v.name.endswith("/accumulator")} == {"float16"}



@pytest.mark.parametrize("training, accum_type, combined, expected", [
    (True, None, False, "Post"),
    (True, torch.float32, False, "Post"),
    (True, torch.float16, False, "Running"),   # float16 accumulators keep a running mean...
    (True, torch.float16, True, "Post"),       # ...unless SGD combines them with its velocity
    (False, None, False, "Post"),
])
def test_the_mean_reduction_strategy_follows_the_accumulation_type(training, accum_type, combined, expected):
    net = Scaled()
    opts = mean_reduction_options(None, accumulation=1)
    if training:
        optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1, accum_type=accum_type, use_combined_accum=combined)
        model = poptorch.trainingModel(net, opts, optimizer)
    else:
        model = poptorch.inferenceModel(net, opts)
    assert model.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy[expected]
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy is None  # the user's options: unchanged
    explicit = mean_reduction_options(poptorch.MeanReductionStrategy.Running, accumulation=1)
    assert poptorch.inferenceModel(net, explicit).options.Training.meanAccumulationAndReplicationReductionStrategy \
        == poptorch.MeanReductionStrategy.Running


def test_a_loss_of_constants_trains_with_zero_gradients():
    """A loss that no trainable parameter reaches (every layer frozen or constant) is still the
    model's loss, as in PopTorch: the weights keep their values."""
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x, target):
            return x * 2, torch.nn.functional.l1_loss(x * 2, target)

    model = Frozen()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, target = torch.randn(4, 3), torch.zeros(4, 3)
    out, loss = training(x, target)
    torch.testing.assert_close(out, x * 2)
    torch.testing.assert_close(loss, (x * 2).abs().mean())
    torch.testing.assert_close(model.w.detach(), torch.ones(3))
