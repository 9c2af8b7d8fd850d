#!/usr/bin/env python3
"""Data-parallel training over several PopRun instances on emulated IPUs.

    poprun --num-instances 2 --num-replicas 4 python3 train.py

poprun starts two instances of this script; each runs 4 / 2 = 2 replicas of the model and reads
its own share of the training set. Gradients are summed over every replica of every instance
before each weight update, so all replicas keep the same weights. Instance 0 alone writes the
checkpoints; the loss and accuracy printed are averaged over all instances.

Without poprun the same script trains on one instance with one replica.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

import popdist
import popdist.poptorch
import poptorch_lite as poptorch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelining"))
from mnist_data import CHOICES, announce, load_datasets  # noqa: E402

SEED = 0  # the same in every instance: they must agree on the shuffling of the dataset


class Classifier(nn.Module):
    """A small CNN in two blocks, "features" and "classifier". With 2 IPUs per replica the
    blocks are two pipeline stages on IPUs 0 and 1; with 1 IPU both run on IPU 0."""

    def __init__(self, ipus_per_replica: int):
        super().__init__()
        if ipus_per_replica not in (1, 2):
            raise SystemExit(f"this model runs on 1 or 2 IPUs per replica, not {ipus_per_replica}: "
                             "give poprun --ipus-per-replica 1 or 2")
        self.classifier_ipu = ipus_per_replica - 1
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=5), nn.MaxPool2d(2), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(),
                                        nn.Linear(64, 10))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images, labels=None):
        with poptorch.Block("features", ipu_id=0):
            x = self.features(images)
        with poptorch.Block("classifier", ipu_id=self.classifier_ipu):
            logits = self.classifier(x)
            if labels is None:
                return logits
            return logits, self.loss(logits, labels)


@dataclass
class Metrics:
    """Sums over the samples seen: summed loss, correct predictions, samples."""
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor | None = None):
        self.correct += int((logits.argmax(dim=1) == labels).sum())
        self.samples += len(labels)
        if losses is not None:  # one mean loss per micro-batch, all micro-batches the same size
            self.loss_sum += float(losses.sum()) * len(labels) / losses.numel()

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.samples, 1)

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / max(self.samples, 1)

    def across_instances(self) -> "Metrics":
        """Every instance's sums added together (an all-reduce over the instances)."""
        if popdist.getNumInstances() == 1:
            return self
        sums = torch.tensor([self.loss_sum, self.correct, self.samples], dtype=torch.float64)
        torch.distributed.all_reduce(sums)
        return Metrics(float(sums[0]), int(sums[1]), int(sums[2]))


def instance_prefix() -> str:
    return f"instance {popdist.getInstanceIndex()}/{popdist.getNumInstances()}"


def load_data(args):
    """The datasets; instance 0 loads (and if needed downloads) them first, then the others
    read what it left on disk."""
    def load():
        return load_datasets(args.dataset, args.data_dir,
                             synthetic_sizes=(args.train_samples or 60000, args.test_samples or 10000))

    datasets = None
    if args.dataset != "synthetic":  # generated in memory, so there is nothing to share
        datasets = popdist.execute_on_instances({0}, load)
    if datasets is None:
        datasets = load()
    if popdist.getInstanceIndex() == 0:
        announce(datasets)
    train, test = datasets.train, datasets.test
    if args.train_samples:
        train = torch.utils.data.Subset(train, range(min(args.train_samples, len(train))))
    if args.test_samples:
        test = torch.utils.data.Subset(test, range(min(args.test_samples, len(test))))
    return datasets, train, test


def training_options(args) -> popdist.poptorch.Options:
    opts = popdist.poptorch.Options()  # local replicas, process id and count from poprun
    opts.deviceIterations(args.device_iterations)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss and logits, for the metrics
    opts.randomSeed(SEED)
    return opts


def save_checkpoint(path: Path, model, optimizer, epoch: int, metrics: Metrics) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": epoch, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(), "loss": metrics.loss,
                "train_accuracy": metrics.accuracy, "saved_by_instance": popdist.getInstanceIndex()},
               path)
    print(f"{instance_prefix()}: saved checkpoint {path}", flush=True)


def train(args, model: Classifier, train_set) -> Metrics:
    opts = training_options(args)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    loader = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    first = popdist.getInstanceIndex() == 0
    for epoch in range(1, args.epochs + 1):
        local = Metrics()
        bar = tqdm(loader, desc=f"Epoch {epoch}", disable=not first)
        for images, labels in bar:
            logits, losses = training_model(images, labels)
            local.add(logits, labels, losses)
            bar.set_postfix(loss=f"{local.loss:.4f}")
        bar.close()
        total = local.across_instances()
        print(f"{instance_prefix()}: epoch {epoch} on its {local.samples} images: loss "
              f"{local.loss:.4f}, accuracy {local.accuracy:.2f}%", flush=True)
        if first:
            print(f"epoch {epoch}, all {popdist.getNumInstances()} instances "
                  f"({total.samples} images): loss {total.loss:.4f}, "
                  f"accuracy {total.accuracy:.2f}%", flush=True)
        popdist.execute_on_instances({0}, save_checkpoint, Path(args.checkpoint_dir) /
                                     f"epoch{epoch}.pt", model, optimizer, epoch, total)
    training_model.detachFromDevice()
    return total


def test(args, model: Classifier, test_set) -> Metrics:
    """Each instance evaluates its share of the test set with an inference model of the trained
    weights; the accuracy is over all shares."""
    opts = popdist.poptorch.Options().deviceIterations(args.device_iterations)
    loader = poptorch.DataLoader(opts, test_set, batch_size=args.batch_size)
    inference_model = poptorch.inferenceModel(model, opts)
    local = Metrics()
    for images, labels in loader:
        local.add(inference_model(images), labels)
    inference_model.detachFromDevice()
    total = local.across_instances()
    if popdist.getInstanceIndex() == 0:
        print(f"test accuracy over {total.samples} images (all instances): "
              f"{total.accuracy:.2f}%", flush=True)
    return total


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Data-parallel training over PopRun instances on emulated IPUs")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="micro-batch size of each replica (default: 16)")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=4,
                        help="micro-batches accumulated per weight update (default: 4)")
    parser.add_argument("--device-iterations", type=positive_int, default=4,
                        help="weight updates per model call (default: 4)")
    parser.add_argument("--epochs", type=positive_int, default=1, help="epochs (default: 1)")
    parser.add_argument("--learning-rate", type=float, default=0.05,
                        help="SGD learning rate, momentum 0.9 (default: 0.05)")
    parser.add_argument("--checkpoint-dir", default="checkpoints",
                        help="where instance 0 saves epochN.pt (default: checkpoints)")
    parser.add_argument("--dataset", choices=CHOICES, default="auto",
                        help="auto: MNIST when present or downloadable, else Fashion-MNIST when "
                             "installed, else procedural digits (default: auto)")
    parser.add_argument("--data-dir", default="~/.torch/datasets",
                        help="where torchvision keeps (or downloads) the datasets")
    parser.add_argument("--train-samples", type=positive_int, default=None,
                        help="train on the first N training images only (default: all)")
    parser.add_argument("--test-samples", type=positive_int, default=None,
                        help="test on the first N test images only (default: all)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    popdist.init()  # the instances' process group, for the metrics and the checkpoint barrier
    if popdist.getInstanceIndex() == 0:
        print(f"{popdist.getNumInstances()} instance(s) x {popdist.getNumLocalReplicas()} "
              f"replica(s) x {popdist.getNumIpusPerReplica()} IPU(s) per replica", flush=True)
    _, train_set, test_set = load_data(args)
    torch.manual_seed(SEED)
    model = Classifier(popdist.getNumIpusPerReplica())
    train(args, model, train_set)
    test(args, model, test_set)


if __name__ == "__main__":
    sys.exit(main())
