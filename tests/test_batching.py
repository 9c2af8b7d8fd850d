"""Batching rules: combined batch size, call batch checks, output modes."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poptorch_lite.api import strategies
from poptorch_lite.api.batching import (BatchSizeError, check_inference_options,
                                    combined_batch_size, device_layout,
                                    output_multiplier, output_plan,
                                    resolve_output_mode, split_call_batch)
from poptorch_lite.api.enums import OutputMode
from poptorch_lite.api.options import Options


def make_options(device_iterations=1, replicas=1, accumulation=1, mode=None,
                 period=None):
    options = Options().deviceIterations(device_iterations)
    options.replicationFactor(replicas)
    options.Training.gradientAccumulation(accumulation)
    if mode is not None:
        options.outputMode(mode, period)
    return options


def test_combined_batch_size_training_and_inference():
    options = make_options(device_iterations=3, replicas=2, accumulation=5)
    assert combined_batch_size(4, options, training=True) == 4 * 3 * 2 * 5
    assert combined_batch_size(4, options, training=False) == 4 * 3 * 2


@settings(max_examples=60, deadline=None)
@given(micro=st.integers(1, 6), device_iterations=st.integers(1, 5),
       replicas=st.integers(1, 4), accumulation=st.integers(1, 5),
       training=st.booleans(), offset=st.integers(1, 200))
def test_split_call_batch_accepts_exactly_the_multiples(
        micro, device_iterations, replicas, accumulation, training, offset):
    options = make_options(device_iterations, replicas, accumulation)
    per_micro_sample = device_iterations * replicas * (accumulation
                                                        if training else 1)
    plan = split_call_batch(micro * per_micro_sample, options, training)
    assert plan.micro_batch_size == micro
    assert plan.combined_batch_size == micro * per_micro_sample
    assert plan.micro_batches == per_micro_sample
    assert plan.gradient_accumulation == (accumulation if training else 1)
    wrong = micro * per_micro_sample + offset
    if wrong % per_micro_sample:
        with pytest.raises(BatchSizeError):
            split_call_batch(wrong, options, training)
    with pytest.raises(BatchSizeError):
        split_call_batch(wrong, options, training, micro_batch_size=micro)


def test_batch_error_names_all_four_factors():
    options = make_options(device_iterations=2, replicas=3, accumulation=4)
    with pytest.raises(BatchSizeError) as info:
        split_call_batch(torch.zeros(10, 7), options, True, input_name="x")
    message = str(info.value)
    for part in ("micro_batch_size", "deviceIterations (2)",
                 "replicationFactor (3)", "gradientAccumulation (4",
                 "multiple of 24", "batch dimension 10", "x (shape [10, 7])"):
        assert part in message
    with pytest.raises(BatchSizeError) as info:
        split_call_batch(48, options, True, micro_batch_size=5)
    message = str(info.value)
    for part in ("micro_batch_size (5)", "deviceIterations (2)",
                 "replicationFactor (3)", "gradientAccumulation (4)",
                 "= 120 samples", "batch dimension 48"):
        assert part in message


def test_inference_batch_error_says_accumulation_is_one():
    options = make_options(device_iterations=2, accumulation=4)
    with pytest.raises(BatchSizeError,
                       match=r"gradientAccumulation \(1, always 1 for "
                       r"inference\)"):
        split_call_batch(3, options, False)


def test_scalar_input_counts_as_batch_of_one():
    assert split_call_batch(torch.tensor(2.0), Options(),
                            False).micro_batch_size == 1
    with pytest.raises(BatchSizeError):
        split_call_batch(torch.tensor(2.0), make_options(2), False)


@pytest.mark.parametrize("as_numpy", [False, True])
def test_device_layout_follows_popart_order(as_numpy):
    options = make_options(device_iterations=3, replicas=2, accumulation=4)
    plan = split_call_batch(3 * 2 * 4 * 5, options, True)
    samples = torch.arange(plan.combined_batch_size * 2).reshape(-1, 2)
    if as_numpy:
        samples = samples.numpy()
    layout = device_layout(samples, plan)
    assert tuple(layout.shape) == (3, 4, 2, 5, 2)
    m, r, g = 5, 2, 4
    for i in range(plan.combined_batch_size):
        position = (i // (g * r * m), (i // (r * m)) % g, (i // m) % r, i % m)
        assert np.array_equal(np.asarray(layout[position]),
                              np.asarray(samples[i]))
    with pytest.raises(BatchSizeError, match="leading dimension of 120"):
        device_layout(samples[:7], plan)


def test_inference_models_refuse_gradient_accumulation():
    check_inference_options(Options())
    options = make_options(accumulation=2)
    with pytest.raises(ValueError,
                       match=r"gradientAccumulation to 1.*inferenceModel\(\)\. Use "
                       r"poptorch.Options\(\).deviceIterations .* instead.*gradientAccumulation\(2\)"):
        check_inference_options(options)
    options = make_options(accumulation=2)
    options.setExecutionStrategy(strategies.PipelinedExecution("a", "b"))
    with pytest.raises(ValueError, match="deviceIterations"):
        check_inference_options(options)
    options = make_options(accumulation=3)
    options.setExecutionStrategy(strategies.ShardedExecution())
    with pytest.raises(ValueError, match=r"gradientAccumulation\(3\)") as info:
        check_inference_options(options)
    assert "deviceIterations" not in str(info.value)


def test_default_output_mode_depends_on_training():
    assert resolve_output_mode(Options(), True) == OutputMode.Final
    assert resolve_output_mode(Options(), False) == OutputMode.All
    options = make_options(mode=OutputMode.Sum)
    assert resolve_output_mode(options, True) == OutputMode.Sum
    assert resolve_output_mode(options, False) == OutputMode.Sum


# D=4 device iterations, R=2 replicas, G=3 accumulation steps, N=2.
@pytest.mark.parametrize("mode, training, expected", [
    (OutputMode.All, True, 2 * 4 * 3),
    (OutputMode.EveryN, True, 2 * 4 * 3 // 2),
    (OutputMode.Final, True, 2),
    (OutputMode.Sum, True, 2),
    (OutputMode.Default, True, 2),
    (OutputMode.All, False, 2 * 4),
    (OutputMode.EveryN, False, 2 * 4 // 2),
    (OutputMode.Final, False, 2),
    (OutputMode.Sum, False, 2),
    (OutputMode.Default, False, 2 * 4),
])
def test_output_multiplier(mode, training, expected):
    period = 2 if mode == OutputMode.EveryN else None
    options = make_options(4, 2, 3 if training else 1, mode, period)
    assert output_multiplier(options, training) == expected


@pytest.mark.parametrize("period", [3, 8])
def test_every_n_period_must_divide_device_iterations(period):
    options = make_options(device_iterations=4, mode=OutputMode.EveryN,
                           period=period)
    with pytest.raises(ValueError,
                       match=rf"N \({period}\) must divide "
                       r"Options.deviceIterations \(4\)"):
        output_multiplier(options, False)


def test_multiplier_of_one_keeps_the_micro_batch_shape():
    plan = output_plan(Options(), training=True)
    assert plan.multiplier == 1
    assert plan.output_shape(()) == ()
    assert plan.output_shape((5, 3)) == (5, 3)
    loss = torch.tensor(1.5)
    assert plan.gather({(0, 0, 0): loss}).shape == ()
    plan = output_plan(make_options(3), training=False)
    assert plan.output_shape(()) == (3, )
    assert plan.output_shape((5, 3)) == (15, 3)


def _results(device_iterations, accumulation, replicas, shape=()):
    """Results whose value encodes (iteration, step, replica)."""
    return {(i, s, r): torch.full(shape, 100 * i + 10 * s + r, dtype=float)
            for i in range(device_iterations) for s in range(accumulation)
            for r in range(replicas)}


@pytest.mark.parametrize("mode, period, expected", [
    (OutputMode.All, None, [100 * i + 10 * s + r for i in range(4)
                            for s in range(3) for r in range(2)]),
    (OutputMode.EveryN, 2, [100 * i + 10 * s + r for i in (1, 3)
                            for s in range(3) for r in range(2)]),
    (OutputMode.Final, None, [320, 321]),
    (OutputMode.Sum, None, [
        sum(100 * i + 10 * s for i in range(4) for s in range(3)) + 12 * r
        for r in range(2)
    ]),
])
def test_gather_selects_and_orders_results(mode, period, expected):
    plan = output_plan(make_options(4, 2, 3, mode, period), training=True)
    gathered = plan.gather(_results(4, 3, 2))
    assert gathered.tolist() == expected
    assert gathered.shape == plan.output_shape(())
    batched = plan.gather(_results(4, 3, 2, shape=(2, 5)))
    assert batched.shape == plan.output_shape((2, 5))
    assert batched[::2, 0].tolist() == expected
