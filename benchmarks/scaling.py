"""How compile time, time per call and memory scale with the model: poptorch_lite against plain PyTorch.

Every model trains on random data with the same batching on both sides (micro-batch m, gradient
accumulation G, device iterations D: one call = m * G * D samples and D optimiser steps). Each
side runs in a fresh process of its own, so peak RSS is that side's alone:
- poptorch_lite: the first call (compile + run), then `--repeats` calls; compile = first call
  minus the median warm call. The Numba cache is whatever NUMBA_CACHE_DIR holds (warm after a
  first run); the executable cache is off.
- PyTorch: the same training loop in plain PyTorch with its default threads.
Each side runs in `--processes` fresh processes, the two sides alternating (a first call is one
sample per process, and on a shared machine single samples vary by tens of percent). The table
gives the median compile time (and how many PyTorch calls it is worth), the median call of each
side and their ratio, and the highest peak RSS of each side's processes.

    python benchmarks/scaling.py [--models tutorial,mlp256,mlp1024,mlp4096,encoder] [--repeats 3] [--processes 3]

Models: the tutorial CNN on a 4-IPU pipeline (m=40, G=10, D=10); MLPs 784-W-W-10 on a 2-IPU
pipeline (W = 256, 1024, 4096; m=64, G=10, D=2); a 12-layer BERT-base-sized encoder (hidden 768,
12 heads, sequence 128, m=4) pipelined over 4 IPUs, 3 layers each (G=8, D=1), its activation stash
in Streaming Memory (TensorLocations): with it on chip, the stash of PopTorch's pipeline schedule
does not fit four GC200s in float32 (the compiler says so), as for BERT on real IPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import poptorch_lite as poptorch  # noqa: E402


class WithLoss(nn.Module):
    """The network and its loss; the loss runs in `loss_block` when the network's blocks end with
    one that closes (the tutorial's `with Block(...)` blocks), else in the network's last block."""

    def __init__(self, net: nn.Module, loss_block: str | None = None):
        super().__init__()
        self.net = net
        self.loss = nn.CrossEntropyLoss()
        self.loss_block = loss_block

    def forward(self, x, labels):
        out = self.net(x)
        if self.loss_block is None:
            return out, self._loss(out, labels)
        with poptorch.Block(self.loss_block):
            return out, self._loss(out, labels)

    def _loss(self, out, labels):
        return self.loss(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


def mlp(width: int) -> nn.Module:
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 10))
    poptorch.BeginBlock(net[1], "L1", ipu_id=0)
    poptorch.BeginBlock(net[3], "L2", ipu_id=1)
    return net


class EncoderLayer(nn.Module):
    """A BERT encoder layer written with explicit attention (matmul, softmax) and post-LayerNorm."""

    def __init__(self, hidden: int = 768, heads: int = 12, ffn: int = 3072):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.down = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5, dim=-1)
        ctx = torch.matmul(scores, v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.out(ctx))
        return self.norm2(x + self.down(self.act(self.up(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int = 12, hidden: int = 768, vocab: int = 1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        for i, layer in enumerate(self.layers):
            if i % (layers // 4) == 0:
                poptorch.BeginBlock(layer, f"layers{i}", ipu_id=i // (layers // 4))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tutorial_net() -> nn.Module:
    from tutorial_model import Network
    return Network()


# name -> (network factory, input factory (batch) -> (x, labels), micro-batch, G, D, pipeline stages)
# The tutorial's blocks are `with Block(...)` scopes without IPUs, as in its script: its loss runs
# in the last one, and its stages name their IPUs. Other models' blocks carry their ipu_id.
LOSS_BLOCKS = {"tutorial": "B4"}
OFF_CHIP_STASH = {"encoder"}
STRATEGIES = {"tutorial": lambda: poptorch.PipelinedExecution(*[poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4)])}
MODELS = {
    "tutorial": (tutorial_net, lambda n: (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))), 40, 10, 10, 4),
    "mlp256": (lambda: mlp(256), lambda n: (torch.randn(n, 784), torch.randint(0, 10, (n,))), 64, 10, 2, 2),
    "mlp1024": (lambda: mlp(1024), lambda n: (torch.randn(n, 784), torch.randint(0, 10, (n,))), 64, 10, 2, 2),
    "mlp4096": (lambda: mlp(4096), lambda n: (torch.randn(n, 784), torch.randint(0, 10, (n,))), 64, 10, 2, 2),
    "encoder": (Encoder, lambda n: (torch.randint(0, 1000, (n, 128)), torch.randint(0, 1000, (n, 128))), 4, 8, 1, 4),
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_side(name: str, side: str, repeats: int) -> dict:
    factory, inputs, micro, acc, its, stages = MODELS[name]
    torch.manual_seed(0)
    model = WithLoss(factory(), LOSS_BLOCKS.get(name))
    x, y = inputs(micro * acc * its)
    times = []
    if side == "ipu":
        opts = poptorch.Options().deviceIterations(its)
        opts.Training.gradientAccumulation(acc)
        strategy = STRATEGIES.get(name, lambda: poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
        opts.setExecutionStrategy(strategy())
        if name in OFF_CHIP_STASH:
            opts.TensorLocations.setActivationLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01))
        call = lambda: training(x, y)  # noqa: E731
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def call():
            for start in range(0, len(x), micro * acc):
                opt.zero_grad()
                for i in range(start, start + micro * acc, micro):
                    _, loss = model(x[i:i + micro], y[i:i + micro])
                    (loss / acc).backward()
                opt.step()
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    warm = statistics.median(times)
    return {"first": first, "call": warm, "rss_mb": peak_rss_mb(), "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters())}


def measure(name: str, side: str, repeats: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", name, "--side", side, "--repeats", str(repeats)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} ({side}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_sides(name: str, repeats: int, processes: int) -> tuple[dict, dict]:
    """Both sides over `processes` fresh processes each, alternating: median compile (first call
    minus that process's warm call) and call, highest peak RSS."""
    runs = {"ipu": [], "torch": []}
    for _ in range(processes):
        for side in runs:
            runs[side].append(measure(name, side, repeats))

    def summary(rs: list[dict]) -> dict:
        return {"compile": statistics.median(r["first"] - r["call"] for r in rs),
                "call": statistics.median(r["call"] for r in rs), "rss_mb": max(r["rss_mb"] for r in rs),
                "params": rs[0]["params"]}
    return summary(runs["ipu"]), summary(runs["torch"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per side (medians over them)")
    ap.add_argument("--one", choices=sorted(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("ipu", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_side(args.one, args.side, args.repeats)))
        return
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.processes < 1:
        ap.error(f"--processes must be at least 1, got {args.processes}")
    print(f"{'model':<10} {'params':>10} {'compile s':>10} {'= torch calls':>14} {'call s (ours/torch)':>22} "
          f"{'ratio':>6} {'peak RSS MB (ours/torch)':>26}")
    for name in names:
        try:
            ours, ref = measure_sides(name, args.repeats, args.processes)
        except RuntimeError as error:
            print(f"{name:<10} failed: {str(error).strip().splitlines()[-1]}", flush=True)
            continue
        compile_s = ours["compile"]
        print(f"{name:<10} {ours['params']:>10,} {compile_s:>10.1f} {compile_s / ref['call']:>14.1f} "
              f"{ours['call']:>10.3f} / {ref['call']:<9.3f} {ours['call'] / ref['call']:>6.2f} "
              f"{ours['rss_mb']:>12.0f} / {ref['rss_mb']:<11.0f}", flush=True)
    print(f"(PyTorch threads: {torch.get_num_threads()}; compile = first call minus the median warm call; "
          f"medians over {args.processes} processes per side)")


if __name__ == "__main__":
    main()
