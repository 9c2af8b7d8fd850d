"""Asynchronous loading against PyTorch's own DataLoader: time to the first batch and per epoch.

For each worker count W, in one run and alternating, each side in a fresh process of its own:
- ours: `poptorch_lite.DataLoader(opts, dataset, batch_size=40, num_workers=W, shuffle=True,
  mode=DataLoaderMode.Async)` with the tutorial's batching (gradient accumulation 10, device
  iterations 10: an item is 4000 images);
- PyTorch: `torch.utils.data.DataLoader(dataset, batch_size=4000, num_workers=W, shuffle=True)`,
  the same images per item.
A third column runs ours with `SharingStrategy.Fork` (the accessor process forked from the
host instead of spawned: no fresh interpreter to import torch and torchvision into).
The dataset is torchvision's FashionMNIST (PIL images, ToTensor and Normalize per sample, as
Graphcore's tutorials load MNIST) read from Debian's dataset-fashion-mnist package; without it,
the same pipeline over generated 28x28 images (said in the output). "First batch" is from
building the loader to holding its first item; an epoch is a full pass after that. Each row
ends with the share of the machine's CPU time other jobs took while it was measured.

    python benchmarks/loader_startup.py [--workers 1,4,16] [--repeats 3] [--samples 60000]

Goal: first batch within 1.5x PyTorch's + 1 s, epoch within 1.1x.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DEBIAN = "/usr/share/datasets/fashion-mnist"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each side runs in a process of its own that imports this checkout's packages.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))}
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class GeneratedImages:
    """28x28 grey images made from their index, as PIL images through the same transforms."""

    def __init__(self, count: int, transform):
        self.count, self.transform = count, transform

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        import numpy as np
        from PIL import Image
        pixels = ((np.arange(784, dtype=np.int64) * (index + 7)) % 251).astype(np.uint8).reshape(28, 28)
        return self.transform(Image.fromarray(pixels, mode="L")), index % 10


def dataset(root: str | None, samples: int):
    import torch
    import torchvision
    from torchvision import transforms
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    if root is None:
        return GeneratedImages(samples, transform)
    data = torchvision.datasets.FashionMNIST(root, train=True, download=False, transform=transform)
    return torch.utils.data.Subset(data, range(min(samples, len(data))))


def prepare(directory: str) -> str | None:
    """FashionMNIST where torchvision looks for it (`directory/FashionMNIST/raw`), from the
    Debian package; None when the package is not installed."""
    if not all(os.path.exists(os.path.join(DEBIAN, f + ".gz")) for f in FILES):
        return None
    raw = os.path.join(directory, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name in FILES:
        with gzip.open(os.path.join(DEBIAN, name + ".gz")) as src, open(os.path.join(raw, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return directory


def one(side: str, workers: int, root: str | None, samples: int) -> dict:
    start = time.perf_counter()
    import torch
    data = dataset(root, samples)
    if side != "torch":
        import poptorch_lite as poptorch
        opts = poptorch.Options().deviceIterations(10)
        opts.Training.gradientAccumulation(10)
        strategy = poptorch.SharingStrategy.Fork if side == "fork" else poptorch.SharingStrategy.FileSystem
        loader = poptorch.DataLoader(opts, data, batch_size=40, num_workers=workers, shuffle=True,
                                     mode=poptorch.DataLoaderMode.Async,
                                     async_options={"sharing_strategy": strategy})
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=4000, num_workers=workers, shuffle=True,
                                             drop_last=True)
    items = iter(loader)
    next(items)
    first = time.perf_counter() - start
    for _ in items:
        pass
    t0 = time.perf_counter()
    count = sum(1 for _ in loader)
    epoch = time.perf_counter() - t0
    if side != "torch":
        loader.terminate()
    return {"first": first, "epoch": epoch, "items": count}


class OtherJobs:
    """The share of the machine's CPU time that processes other than this benchmark's used between
    `start` and `share` (Linux: /proc/stat against this process's reaped children). The load
    average would count the benchmark's own DataLoader workers."""

    def start(self) -> None:
        self.busy, self.own, self.wall = self._busy(), self._own(), time.monotonic()

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
        except (OSError, ValueError):
            return None
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def share(self) -> str:
        busy = self._busy()
        if busy is None or self.busy is None:
            return "?"
        others = busy - self.busy - (self._own() - self.own)
        return f"{max(0.0, others) / ((time.monotonic() - self.wall) * os.cpu_count()):.0%}"


def measure(side: str, workers: int, root: str | None, samples: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", side, "--workers", str(workers), "--root",
                           root or "-", "--samples", str(samples)], capture_output=True, text=True, check=False,
                          env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"{side} with {workers} workers failed:\n{done.stderr[-2000:]}")
    if "leaked" in done.stderr:
        raise RuntimeError(f"{side} with {workers} workers leaked resources:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=60000)
    ap.add_argument("--one", choices=("ours", "fork", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, int(args.workers), None if args.root == "-" else args.root, args.samples)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = prepare(tmp)
        print(f"data: {'Fashion-MNIST from ' + DEBIAN if root else 'generated images (dataset-fashion-mnist is not installed)'}, "
              f"{args.samples} samples, items of 4000 images, median of {args.repeats} runs, {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f} at the start")
        print(f"{'W':>3} {'first batch s (ours / torch)':>30} {'goal':>6} {'epoch s (ours / torch)':>24} {'ratio':>6}"
              f" {'Fork: first, epoch s':>22} {'others':>6}")
        others = OtherJobs()
        for w in (int(x) for x in args.workers.split(",")):
            others.start()
            runs = {"ours": [], "fork": [], "torch": []}
            for _ in range(args.repeats):
                for side in runs:
                    runs[side].append(measure(side, w, root, args.samples))
            med = {s: {k: statistics.median(r[k] for r in rs) for k in ("first", "epoch")} for s, rs in runs.items()}
            o, t, f = med["ours"], med["torch"], med["fork"]
            goal = "met" if o["first"] <= 1.5 * t["first"] + 1 else "missed"
            print(f"{w:>3} {o['first']:>14.2f} / {t['first']:<13.2f} {goal:>6} {o['epoch']:>11.2f} / {t['epoch']:<10.2f} "
                  f"{o['epoch'] / t['epoch']:>6.2f} {f['first']:>11.2f}, {f['epoch']:<8.2f} {others.share():>6}",
                  flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
