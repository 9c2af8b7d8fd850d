"""Test accuracy of the MNIST pipelining tutorial on emulated IPUs against the same training in
plain PyTorch: same data order, initial weights, hyperparameters and seed.

For each configuration (pipelined / sharded, with and without --offload-optimiser) the
tutorial's own functions build the loaders, model, options and training/inference models; the
reference trains a copy of the same initial network with torch.optim.AdamW on the same batches,
split the same way (device iterations x gradient accumulation x micro-batches, gradients
averaged over the accumulated micro-batches, one optimiser step per device iteration), and is
tested on the same test batches with the tutorial's accuracy().

    python benchmarks/accuracy_vs_torch.py --dataset fashion-mnist --epochs 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tutorials", "pytorch", "pipelining"))
import mnist_pipeline as tutorial  # noqa: E402
from mnist_data import announce, load_datasets  # noqa: E402

import poptorch_lite as poptorch  # noqa: E402

CONFIGS = {"pipelined": [], "sharded": ["--strategy", "sharded"],
           "pipelined+offload": ["--offload-optimiser"],
           "sharded+offload": ["--strategy", "sharded", "--offload-optimiser"]}
TOLERANCE = 1.5  # percentage points


@dataclass
class Comparison:
    config: str
    dataset: str
    epochs: int
    emulator_accuracy: float
    torch_accuracy: float
    emulator_train_s: float
    torch_train_s: float

    @property
    def difference(self) -> float:
        return self.emulator_accuracy - self.torch_accuracy

    @property
    def within_tolerance(self) -> bool:
        return abs(self.difference) <= TOLERANCE


def micro_batches(opts) -> tuple[int, int]:
    """(micro-batch size, micro-batches accumulated per optimiser step) of a configuration:
    the sharded tutorial sets no gradient accumulation, so its micro-batch holds the whole step."""
    if opts.strategy == "pipelined":
        return opts.batch_size, opts.gradient_accumulation
    return opts.batch_size * opts.gradient_accumulation, 1


def torch_epochs(model, optimizer, training_data, opts) -> list[float]:
    """Train `model` (the tutorial's model with its loss) for opts.epochs epochs in plain PyTorch
    on the loader's items, split into the configuration's micro-batches and optimiser steps, the
    loss of each micro-batch divided by the accumulation; returns each epoch's wall seconds."""
    size, accumulation = micro_batches(opts)
    seconds = []
    for _ in range(opts.epochs):
        start = time.perf_counter()
        for data, labels in training_data:
            for step_data, step_labels in zip(data.split(size * accumulation), labels.split(size * accumulation)):
                optimizer.zero_grad()
                for x, y in zip(step_data.split(size), step_labels.split(size)):
                    _, loss = model(x, y)
                    (loss / accumulation).backward()
                optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def torch_reference(opts, datasets) -> tuple[float, float]:
    """Plain PyTorch training and testing on the tutorial's batches: (test accuracy, train seconds)."""
    training_data, test_data = tutorial.get_data(opts, datasets, mode=poptorch.DataLoaderMode.Sync)
    torch.manual_seed(tutorial.SEED)
    model = tutorial.TrainingModelWithLoss(tutorial.Network())  # Blocks do nothing outside the emulator
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=opts.learning_rate)
    model.train()
    train_s = sum(torch_epochs(model, optimizer, training_data, opts))
    model.eval()
    with torch.no_grad():
        accuracies = [tutorial.accuracy(model(data), labels) for data, labels in test_data]
    return sum(accuracies) / len(accuracies), train_s


def emulator_run(opts, datasets) -> tuple[float, float]:
    """The tutorial's training and test on emulated IPUs: (test accuracy, train seconds)."""
    training_data, test_data = tutorial.get_data(opts, datasets, mode=poptorch.DataLoaderMode.Sync)
    torch.manual_seed(tutorial.SEED)
    model = tutorial.Network()
    model_opts = tutorial.training_options(opts)
    training_model = poptorch.trainingModel(tutorial.TrainingModelWithLoss(model), model_opts,
                                            optimizer=poptorch.optim.AdamW(model.parameters(), lr=opts.learning_rate))
    epochs = tutorial.train(training_model, training_data, opts)
    inference_model = poptorch.inferenceModel(model, tutorial.inference_options(model_opts, opts))
    training_model.detachFromDevice()
    accuracy = tutorial.test(inference_model, test_data)
    inference_model.destroy()
    training_model.destroy()
    return accuracy, sum(e.wall_s for e in epochs)


def earlier_references(path: str, configs, epochs: int) -> dict:
    """The PyTorch results of an earlier run of this script (its --json file) for the micro-batching
    of `configs`: the reference training does not depend on the emulator options (offload)."""
    with open(path, encoding="utf-8") as f:
        earlier = {r["config"].split("+")[0]: r for r in json.load(f) if r["epochs"] == epochs}
    references = {}
    for name in configs:
        base = name.split("+")[0]
        if base in earlier:
            opts = tutorial.parse_args(CONFIGS[base])
            references[micro_batches(opts)] = (earlier[base]["torch_accuracy"], earlier[base]["torch_train_s"])
    return references


def compare(configs, dataset: str, data_dir: str, epochs: int, extra: list[str],
            references: dict | None = None) -> list[Comparison]:
    datasets = load_datasets(dataset, data_dir)
    announce(datasets)
    results, references = [], dict(references or {})
    for name in configs:
        opts = tutorial.parse_args([*CONFIGS[name], "--epochs", str(epochs), "--num-workers", "0", *extra])
        key = micro_batches(opts)
        if key not in references:
            print(f"== plain PyTorch, micro-batch {key[0]} x {key[1]} accumulated", flush=True)
            references[key] = torch_reference(opts, datasets)
            print(f"   accuracy on test set: {references[key][0]:.2f}%", flush=True)
        print(f"== poptorch_lite, {name}", flush=True)
        accuracy, train_s = emulator_run(opts, datasets)
        results.append(Comparison(name, datasets.name, epochs, accuracy, references[key][0], train_s,
                                  references[key][1]))
    return results


def table(results: list[Comparison]) -> str:
    rows = ["| configuration | dataset | epochs | poptorch_lite | PyTorch | difference | within 1.5 points |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {r.config} | {r.dataset} | {r.epochs} | {r.emulator_accuracy:.2f}% | {r.torch_accuracy:.2f}% | "
             f"{r.difference:+.2f} | {'yes' if r.within_tolerance else 'NO'} |" for r in results]
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion-mnist", choices=["auto", "mnist", "fashion-mnist", "synthetic"])
    parser.add_argument("--data-dir", default="~/.torch/datasets")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--reference", help="take the PyTorch results from this earlier --json file (same dataset, "
                                             "epochs and hyperparameters) instead of training again")
    args, extra = parser.parse_known_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}: choose from {', '.join(CONFIGS)}")
    references = earlier_references(args.reference, configs, args.epochs) if args.reference else None
    results = compare(configs, args.dataset, args.data_dir, args.epochs, extra, references)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{**asdict(r), "difference": r.difference} for r in results], f, indent=1)
    return 0 if all(r.within_tolerance for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
