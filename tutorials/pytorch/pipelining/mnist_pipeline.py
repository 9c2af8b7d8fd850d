#!/usr/bin/env python3
"""Graphcore's PopTorch pipelining tutorial on emulated IPUs: a small CNN split into four
blocks, one per IPU, trained pipelined (or sharded) with gradient accumulation and device
iterations, then tested with an inference model that reuses the trained weights.

Same model, options, command line and output as the original; in addition `--dataset` and
`--data-dir` choose the data (MNIST when it can be had, see mnist_data.py), and every epoch
also reports the emulated IPU time next to the host's wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from tqdm import tqdm

import poptorch_lite as poptorch
from poptorch_lite.api.options import setLogLevel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_data import CHOICES, Datasets, announce, load_datasets  # noqa: E402

SEED = 0  # model initialisation and shuffling: runs are reproducible


def get_data(opts, datasets: Datasets, mode=poptorch.DataLoaderMode.Async):
    """The training and test loaders of the tutorial: each training item feeds one call of the
    training model (batch size x gradient accumulation x device iterations images), each test
    item one call of the inference model (test batch size x the same number of micro-batches)."""
    options = poptorch.Options()
    options.Training.gradientAccumulation(opts.gradient_accumulation)
    options.deviceIterations(opts.device_iterations)
    training_data = poptorch.DataLoader(
        options,
        datasets.train.subset(opts.train_samples) if opts.train_samples else datasets.train,
        batch_size=opts.batch_size,
        shuffle=True,
        mode=mode,
        num_workers=opts.num_workers,
        generator=torch.Generator().manual_seed(SEED))

    test_data = poptorch.DataLoader(
        poptorch.Options().deviceIterations(opts.gradient_accumulation * opts.device_iterations),
        datasets.test.subset(opts.test_samples) if opts.test_samples else datasets.test,
        batch_size=opts.test_batch_size,
        shuffle=True,
        drop_last=True,
        mode=mode,
        num_workers=opts.num_workers,
        generator=torch.Generator().manual_seed(SEED + 1))
    return training_data, test_data


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    """Four blocks, B1..B4: the units the execution strategy places on stages and IPUs."""

    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x


class TrainingModelWithLoss(nn.Module):
    """The network plus its loss, which joins the last block (B4)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def accuracy(predictions, labels) -> float:
    """Percentage of correct predictions. A training call returns the predictions of its last
    micro-batch only (OutputMode.Final), so they are compared with the last labels."""
    _, predicted = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    return torch.sum(torch.eq(predicted, labels)).item() / labels.size()[0] * 100.0


def four_stages():
    return (poptorch.Stage("B1").ipu(0), poptorch.Stage("B2").ipu(1),
            poptorch.Stage("B3").ipu(2), poptorch.Stage("B4").ipu(3))


def training_options(opts) -> poptorch.Options:
    """The training model's options: strategy, batching, tensor locations, profiling."""
    options = poptorch.Options()
    options._Popart.set("defaultPrefetchBufferingDepth", 3)
    options.deviceIterations(opts.device_iterations)
    if opts.strategy == "pipelined":
        options.setExecutionStrategy(poptorch.PipelinedExecution(*four_stages()))
        options.Training.gradientAccumulation(opts.gradient_accumulation)
    else:
        # Without gradient accumulation a sharded call takes the loader's items as
        # device_iterations micro-batches of batch_size * gradient_accumulation images.
        options.setExecutionStrategy(poptorch.ShardedExecution(*four_stages()))
    if opts.offload_optimiser:
        on_chip = poptorch.TensorLocationSettings().useOnChipStorage(True)
        options.TensorLocations.setActivationLocation(on_chip)
        options.TensorLocations.setWeightLocation(on_chip)
        options.TensorLocations.setAccumulatorLocation(on_chip)
        # The optimiser state (AdamW's two moments) lives in host memory between weight updates.
        options.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    if opts.profile:
        print(f"Profiling is enabled: reports go to {opts.profile_dir}")
        options.enableProfiling(opts.profile_dir)
    return options


def inference_options(model_opts: poptorch.Options, opts) -> poptorch.Options:
    """Same strategy as training, no gradient accumulation, and as many micro-batches per call."""
    options = model_opts.clone()
    options.Training.gradientAccumulation(1)
    options.deviceIterations(opts.device_iterations * opts.gradient_accumulation)
    return options


@dataclass
class EpochResult:
    epoch: int
    calls: int
    images: int
    wall_s: float            # host time of the epoch
    compile_s: float         # host time of the call that compiled the model (within wall_s), else 0
    simulated_s: float       # emulated IPU time of the epoch's calls
    loss: float              # of the epoch's last call
    accuracy: float          # of the epoch's last call (its last micro-batch)


def simulated_seconds(model) -> float:
    """Emulated IPU time of the model's last call."""
    return model.last_run.seconds


def train(training_model, training_data, opts) -> list[EpochResult]:
    nr_batches = len(training_data)
    results = []
    for epoch in range(1, opts.epochs + 1):
        print(f"Epoch {epoch}/{opts.epochs}")
        bar = tqdm(training_data, total=nr_batches)
        start, compile_s, simulated_s, images = time.perf_counter(), 0.0, 0.0, 0
        mean_loss = acc = float("nan")
        for data, labels in bar:
            compiling, call_start = not training_model.isCompiled(), time.perf_counter()
            preds, losses = training_model(data, labels)
            if compiling:
                compile_s = time.perf_counter() - call_start
            simulated_s += simulated_seconds(training_model)
            images += len(data)
            mean_loss = torch.mean(losses).item()
            acc = accuracy(preds, labels)
            bar.set_description(f"Loss:{mean_loss:0.4f} | Accuracy:{acc:0.2f}%")
        bar.close()
        wall_s = time.perf_counter() - start
        results.append(EpochResult(epoch, nr_batches, images, wall_s, compile_s, simulated_s, mean_loss, acc))
        rate = f" ({images / simulated_s:,.0f} images/s)" if simulated_s else ""
        print(f"Emulated IPU time {simulated_s:.3f} s for {images} images{rate}; host time {wall_s:.1f} s"
              + (f" ({compile_s:.1f} s of it compiling)" if compile_s else ""))
    return results


def test(inference_model, test_data) -> float:
    nr_batches = len(test_data)
    sum_acc = 0.0
    for data, labels in tqdm(test_data, total=nr_batches):
        output = inference_model(data)
        sum_acc += accuracy(output, labels)
    test_accuracy = sum_acc / len(test_data)
    print(f"Accuracy on test set: {test_accuracy:0.2f}%")
    return test_accuracy


@dataclass
class RunResult:
    dataset: str
    epochs: list[EpochResult] = field(default_factory=list)
    test_accuracy: float = float("nan")


def run(opts) -> RunResult:
    """The whole tutorial: data, training on the emulated IPUs, then testing."""
    if opts.debug:
        setLogLevel("DEBUG")
    datasets = load_datasets(opts.dataset, opts.data_dir,
                             synthetic_sizes=(opts.train_samples or 60000, opts.test_samples or 10000))
    announce(datasets)
    training_data, test_data = get_data(opts, datasets)
    torch.manual_seed(SEED)
    model = Network()
    model_with_loss = TrainingModelWithLoss(model)
    model_opts = training_options(opts)
    training_model = poptorch.trainingModel(
        model_with_loss, model_opts, optimizer=poptorch.optim.AdamW(model.parameters(), lr=opts.learning_rate))

    print("Training...")
    result = RunResult(datasets.name, train(training_model, training_data, opts))

    # The inference model reads the trained weights from `model` (copied back from the
    # training model's IPUs on first access).
    inference_model = poptorch.inferenceModel(model, inference_options(model_opts, opts))
    training_model.detachFromDevice()
    print("Testing...")
    result.test_accuracy = test(inference_model, test_data)
    inference_model.detachFromDevice()
    print(f"({datasets.name}: {'' if datasets.is_mnist else 'NOT '}MNIST)")
    return result


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="MNIST training on emulated IPUs (poptorch_lite)")
    parser.add_argument("--batch-size", type=positive_int, default=40, help="batch size for training (default: 40)")
    parser.add_argument("--device-iterations", type=positive_int, default=10,
                        help="device iterations for training (default: 10)")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=10,
                        help="gradient accumulation count (default: 10)")
    parser.add_argument("--test-batch-size", type=positive_int, default=8, help="batch size for testing (default: 8)")
    parser.add_argument("--epochs", type=positive_int, default=3, help="number of epochs to train (default: 3)")
    parser.add_argument("--learning-rate", type=float, default=0.001, help="learning rate (default: 0.001)")
    parser.add_argument("--profile", action="store_true", help="turn on profiling (default: off)")
    parser.add_argument("--profile-dir", type=str, default="./profile",
                        help="where to save the profile (default: ./profile)")
    parser.add_argument("--strategy", choices=["sharded", "pipelined"], default="pipelined",
                        help="execution strategy (default: pipelined)")
    parser.add_argument("--offload-optimiser", action="store_true", help="keep the optimiser state off chip")
    parser.add_argument("--debug", action="store_true", help="print the debug log while running")
    parser.add_argument("--dataset", choices=CHOICES, default="auto",
                        help="auto: MNIST when present or downloadable, else Fashion-MNIST when installed, "
                             "else procedural digits (default: auto)")
    parser.add_argument("--data-dir", default="~/.torch/datasets",
                        help="where torchvision keeps (or downloads) the datasets (default: ~/.torch/datasets)")
    parser.add_argument("--train-samples", type=positive_int, default=None,
                        help="train on the first N training images only (default: all)")
    parser.add_argument("--test-samples", type=positive_int, default=None,
                        help="test on the first N test images only (default: all)")
    parser.add_argument("--num-workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="data loading worker processes (default: the CPU count, at most 16)")
    return parser.parse_args(argv)


def main(argv=None) -> RunResult:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
