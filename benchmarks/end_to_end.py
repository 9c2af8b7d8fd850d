"""The MNIST pipelining tutorial end to end against a plain PyTorch CPU script doing the same work.

Both are whole processes, timed from start to exit, in one run and alternating:
- the tutorial: `tutorials/pytorch/pipelining/mnist_pipeline.py --epochs 1 --num-workers W`
  (four emulated IPUs, pipelined; then the test pass on an inference model);
- PyTorch: the same network, data, loaders (W workers), optimiser (AdamW, lr 0.001), micro-batch
  (40), gradient accumulation (10 micro-batches per optimiser step) and test pass, on the CPU with
  PyTorch's default threads.

    python benchmarks/end_to_end.py [--workers 16] [--repeats 1] [--dataset fashion-mnist]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIAL = os.path.join(HERE, "..", "tutorials", "pytorch", "pipelining")
# Both scripts import this checkout's packages.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.path.dirname(HERE), os.environ.get("PYTHONPATH"))))}

TORCH_SCRIPT = """
import sys, time
sys.path.insert(0, {tutorial!r})
import torch
from mnist_data import load_datasets
from mnist_pipeline import SEED, Network, accuracy, parse_args

def main():
    opts = parse_args(sys.argv[1:])
    data = load_datasets(opts.dataset, opts.data_dir)
    micro, acc = opts.batch_size, opts.gradient_accumulation
    train = torch.utils.data.DataLoader(data.train, batch_size=micro * acc * opts.device_iterations, shuffle=True,
                                        drop_last=True, num_workers=opts.num_workers,
                                        generator=torch.Generator().manual_seed(SEED))
    test = torch.utils.data.DataLoader(data.test, batch_size=opts.test_batch_size * acc * opts.device_iterations,
                                       shuffle=True, drop_last=True, num_workers=opts.num_workers,
                                       generator=torch.Generator().manual_seed(SEED + 1))
    torch.manual_seed(SEED)
    model = Network()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.learning_rate)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(opts.epochs):
        for images, labels in train:
            for start in range(0, len(images), micro * acc):
                optimizer.zero_grad()
                for i in range(start, start + micro * acc, micro):
                    (loss_fn(model(images[i:i + micro]), labels[i:i + micro]) / acc).backward()
                optimizer.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for images, labels in test:
            total += accuracy(model(images), labels)
    print(f"Accuracy on test set: {{total / len(test):0.2f}}%")

if __name__ == "__main__":
    main()
"""


def timed(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=ENV)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    if "leaked" in done.stderr:
        raise RuntimeError(f"{' '.join(command)} leaked resources:\n{done.stderr[-2000:]}")
    found = [line for line in done.stdout.splitlines() if "Accuracy on test set" in line]
    return seconds, found[-1].split(":")[-1].strip() if found else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dataset", default="fashion-mnist")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    common = ["--epochs", "1", "--num-workers", str(args.workers), "--dataset", args.dataset]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "torch_mnist.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(TORCH_SCRIPT.format(tutorial=os.path.abspath(TUTORIAL)))
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(timed([sys.executable, os.path.join(TUTORIAL, "mnist_pipeline.py"), *common]))
            theirs.append(timed([sys.executable, script, *common]))
    o, t = statistics.median(s for s, _ in ours), statistics.median(s for s, _ in theirs)
    print(f"one epoch and the test pass, {args.workers} loader workers, {args.dataset}, median of {args.repeats}, "
          f"{os.cpu_count()} cores, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end:")
    print(f"  tutorial on emulated IPUs: {o:.1f} s (test accuracy {ours[-1][1]})")
    print(f"  plain PyTorch on the CPU:  {t:.1f} s (test accuracy {theirs[-1][1]})")
    print(f"  ratio {o / t:.2f}")
    print(f"  each run, ours: {' '.join(f'{s:.1f}' for s, _ in ours)}; PyTorch: {' '.join(f'{s:.1f}' for s, _ in theirs)}")


if __name__ == "__main__":
    main()
