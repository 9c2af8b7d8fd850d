"""Speed and memory of the MNIST pipelining tutorial on emulated IPUs, next to plain PyTorch.

Each measurement runs in a fresh process so that its peak RSS and CPU time are its own:
- training epochs through poptorch_lite (the tutorial's loaders, model, options and train());
  the first epoch compiles, the later ones are the steady state;
- the same epochs in plain PyTorch on the same batches with the same micro-batching;
- cold and warm start: the whole tutorial script on one training call and one test call, first
  with an empty Numba cache (NUMBA_CACHE_DIR pointing to a new directory), then again with it;
- the emulated IPU time per epoch, next to the real tutorial's published speed (about 15
  iterations/s of 4,000 images on 4 IPUs: one 60,000-image epoch in about 1 s).

    python benchmarks/mnist_tutorial.py --dataset fashion-mnist --epochs 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TUTORIAL_DIR = os.path.join(REPO, "tutorials", "pytorch", "pipelining")
REAL_IPU_ITERATIONS_PER_S = 15.0   # the tutorial's published training output: ~15 it/s on 4 IPUs


def train_emulator(args) -> dict:
    """Train with poptorch_lite as the tutorial does (Async loader) for args.epochs epochs."""
    sys.path.insert(0, TUTORIAL_DIR)
    import torch
    import mnist_pipeline as tutorial
    import poptorch_lite as poptorch
    from mnist_data import load_datasets

    opts = tutorial.parse_args(["--strategy", args.strategy, "--epochs", str(args.epochs), *args.extra])
    datasets = load_datasets(args.dataset, opts.data_dir)
    training_data, _ = tutorial.get_data(opts, datasets)
    torch.manual_seed(tutorial.SEED)
    model = tutorial.Network()
    training_model = poptorch.trainingModel(tutorial.TrainingModelWithLoss(model), tutorial.training_options(opts),
                                            optimizer=poptorch.optim.AdamW(model.parameters(), lr=opts.learning_rate))
    epochs = tutorial.train(training_model, training_data, opts)
    training_data.terminate()  # its worker process is reaped, so its peak RSS is counted
    return {"dataset": datasets.name, "epochs": [e.__dict__ for e in epochs], **peak_rss_mb()}


def train_torch(args) -> dict:
    """The same epochs in plain PyTorch: same batches, micro-batching, optimiser and seed."""
    sys.path.insert(0, TUTORIAL_DIR)
    sys.path.insert(0, HERE)
    import torch
    import mnist_pipeline as tutorial
    from accuracy_vs_torch import torch_epochs
    from mnist_data import load_datasets

    torch.set_num_threads(args.torch_threads)
    opts = tutorial.parse_args(["--strategy", args.strategy, "--epochs", str(args.epochs), *args.extra])
    datasets = load_datasets(args.dataset, opts.data_dir)
    training_data, _ = tutorial.get_data(opts, datasets)
    torch.manual_seed(tutorial.SEED)
    model = tutorial.TrainingModelWithLoss(tutorial.Network())
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=opts.learning_rate)
    epochs = [{"wall_s": seconds} for seconds in torch_epochs(model, optimizer, training_data, opts)]
    training_data.terminate()
    return {"dataset": datasets.name, "epochs": epochs, **peak_rss_mb()}


def measured(command: list[str], env: dict | None = None) -> dict:
    """Run `command`: its wall time, CPU time (with its children's), and the JSON its last
    stdout line holds, if any."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-4000:]}")
    lines = out.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    return {**result, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def peak_rss_mb() -> dict:
    """Peak resident memory of this process and of its largest child (data loader workers)."""
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "child_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def steady(epochs: list[dict], key: str = "wall_s") -> float:
    """Median over the epochs after the first (which compiles), or the only epoch."""
    values = [e[key] for e in (epochs[1:] or epochs)]
    return statistics.median(values)


def benchmark(args) -> dict:
    me = [sys.executable, os.path.abspath(__file__), "--dataset", args.dataset, "--strategy", args.strategy,
          "--epochs", str(args.epochs), "--torch-threads", str(args.torch_threads)]
    emulator = measured([*me, "--part", "emulator", *args.extra])
    plain = measured([*me, "--part", "torch", *args.extra])
    cache = tempfile.mkdtemp(prefix="numba_cache_")
    script = [sys.executable, os.path.join(TUTORIAL_DIR, "mnist_pipeline.py"), "--dataset", args.dataset,
              "--strategy", args.strategy, "--epochs", "1", "--train-samples", "4000", "--test-samples", "800"]
    cold = measured(script, {"NUMBA_CACHE_DIR": cache})
    warm = measured(script, {"NUMBA_CACHE_DIR": cache})
    emulated_epoch = steady(emulator["epochs"], "simulated_s")
    calls = emulator["epochs"][-1]["calls"]
    return {
        "dataset": emulator["dataset"], "strategy": args.strategy, "epochs": args.epochs,
        "torch_threads": args.torch_threads,
        "emulator_epoch_s": steady(emulator["epochs"]), "torch_epoch_s": steady(plain["epochs"]),
        "first_epoch_s": emulator["epochs"][0]["wall_s"], "compile_s": emulator["epochs"][0]["compile_s"],
        "emulator_process_cpu_s": emulator["cpu_s"], "torch_process_cpu_s": plain["cpu_s"],
        "emulator_peak_rss_mb": emulator["peak_rss_mb"], "torch_peak_rss_mb": plain["peak_rss_mb"],
        "loader_worker_peak_rss_mb": emulator["child_peak_rss_mb"],
        "cold_start_s": cold["wall_s"], "cold_start_cpu_s": cold["cpu_s"],
        "warm_start_s": warm["wall_s"], "warm_start_cpu_s": warm["cpu_s"],
        "emulated_epoch_s": emulated_epoch, "calls_per_epoch": calls,
        "emulated_iterations_per_s": calls / emulated_epoch,
        "real_ipu_epoch_s": calls / REAL_IPU_ITERATIONS_PER_S,
    }


def report(r: dict) -> str:
    ratio = r["emulator_epoch_s"] / r["torch_epoch_s"]
    return "\n".join([
        f"MNIST pipelining tutorial, {r['strategy']}, on {r['dataset']} ({r['calls_per_epoch']} calls per epoch)",
        f"| measure | value |", "|---|---|",
        f"| wall time per epoch, poptorch_lite (steady state, median) | {r['emulator_epoch_s']:.1f} s |",
        f"| wall time per epoch, plain PyTorch (same batches, median, {r['torch_threads']} thread(s)) | "
        f"{r['torch_epoch_s']:.1f} s |",
        f"| ratio poptorch_lite / PyTorch | {ratio:.1f}x |",
        f"| first epoch (compiles the model) | {r['first_epoch_s']:.1f} s, of which the compiling call "
        f"{r['compile_s']:.1f} s |",
        f"| peak RSS, poptorch_lite training process | {r['emulator_peak_rss_mb']:.0f} MB |",
        f"| peak RSS, PyTorch training process | {r['torch_peak_rss_mb']:.0f} MB |",
        f"| peak RSS, largest data loader process (both) | {r['loader_worker_peak_rss_mb']:.0f} MB |",
        f"| cold start: script, 1 training + 1 test call, empty Numba cache | {r['cold_start_s']:.1f} s "
        f"({r['cold_start_cpu_s']:.1f} s CPU) |",
        f"| warm start: the same again, Numba cache filled | {r['warm_start_s']:.1f} s "
        f"({r['warm_start_cpu_s']:.1f} s CPU) |",
        f"| emulated IPU time per epoch | {r['emulated_epoch_s']:.3f} s ({r['emulated_iterations_per_s']:.0f} "
        f"iterations/s) |",
        f"| real tutorial on 4 IPUs (published ~15 it/s) | {r['real_ipu_epoch_s']:.1f} s per epoch |",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="auto", choices=["auto", "mnist", "fashion-mnist", "synthetic"])
    parser.add_argument("--strategy", default="pipelined", choices=["pipelined", "sharded"])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (the first one compiles)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the PyTorch reference (default 1: the emulator computes on one "
                             "thread, and on a busy machine PyTorch's spinning threads cost more than they give)")
    parser.add_argument("--part", choices=["emulator", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args, args.extra = parser.parse_known_args(argv)
    if args.part:
        result = train_emulator(args) if args.part == "emulator" else train_torch(args)
        print(json.dumps(result))
        return
    result = benchmark(args)
    print(report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
