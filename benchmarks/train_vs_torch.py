"""Training the tutorial network through poptorch_lite against the same training in plain PyTorch.

Both train the MNIST tutorial model with the tutorial's batching (micro-batch 40, gradient
accumulation 10, device iterations 10: one call = 4000 samples = 10 optimiser steps) on the same
random data, in the same process, alternating, and the wall time per call is compared (median of
repeats). Then compile time: a fresh process with an empty Numba cache (cold) and with the cache
filled (warm).

    python benchmarks/train_vs_torch.py [--repeats 5] [--strategy pipelined|sharded] [--micro-batch 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import poptorch_lite as poptorch  # noqa: E402
from tutorial_model import Network, TrainingModelWithLoss  # noqa: E402

STRATEGIES = {
    "pipelined": lambda: poptorch.PipelinedExecution(*[poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4)]),
    "sharded": lambda: poptorch.ShardedExecution(*[poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4)]),
}


def build(strategy: str, micro: int, accumulation: int, iterations: int, threads: int):
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Training.gradientAccumulation(accumulation)
    opts.setExecutionStrategy(STRATEGIES[strategy]())
    opts.Emulator.setHostThreads(threads)
    ipu = poptorch.trainingModel(model, opts, poptorch.optim.AdamW(model.parameters(), lr=1e-3))
    ref = TrainingModelWithLoss(Network())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    return ipu, ref, ref_opt


def torch_call(model, opt, x, y, micro, accumulation):
    """What one poptorch_lite call does, in plain PyTorch."""
    for start in range(0, len(x), micro * accumulation):
        opt.zero_grad()
        for i in range(start, start + micro * accumulation, micro):
            _, loss = model(x[i:i + micro], y[i:i + micro])
            (loss / accumulation).backward()
        opt.step()


COMPILE = """
import sys, time; sys.path.insert(0, {tests!r})
import torch, poptorch_lite as poptorch
from tutorial_model import Network, TrainingModelWithLoss
t0 = time.perf_counter()
opts = poptorch.Options().deviceIterations(2); opts.Training.gradientAccumulation(8)
opts.setExecutionStrategy(poptorch.PipelinedExecution(*[poptorch.Stage(f"B{{i+1}}").ipu(i) for i in range(4)]))
m = poptorch.trainingModel(TrainingModelWithLoss(Network()), opts)
m.compile(torch.randn(16 * 40, 1, 28, 28), torch.randint(0, 10, (16 * 40,)))
print(time.perf_counter() - t0)
"""


def compile_times() -> tuple[float, float]:
    code = COMPILE.format(tests=os.path.join(HERE, "..", "tests"))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        run = lambda: float(subprocess.run([sys.executable, "-c", code], env=env, check=True,  # noqa: E731
                                           capture_output=True, text=True).stdout.split()[-1])
        cold = run()
        warm = statistics.median(run() for _ in range(2))
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--strategy", choices=sorted(STRATEGIES), default="pipelined")
    ap.add_argument("--micro-batch", type=int, default=40)
    ap.add_argument("--gradient-accumulation", type=int, default=10)
    ap.add_argument("--device-iterations", type=int, default=10)
    ap.add_argument("--host-threads", type=int, default=1)
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    micro, acc, its = args.micro_batch, args.gradient_accumulation, args.device_iterations
    ipu, ref, ref_opt = build(args.strategy, micro, acc, its, args.host_threads)
    n = micro * acc * its
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    t0 = time.perf_counter()
    ipu(x, y)
    first = time.perf_counter() - t0
    torch_call(ref, ref_opt, x, y, micro, acc)
    t_ipu, t_torch = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ipu(x, y)
        t_ipu.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch_call(ref, ref_opt, x, y, micro, acc)
        t_torch.append(time.perf_counter() - t0)
    mi, mt = statistics.median(t_ipu), statistics.median(t_torch)
    cycles = ipu.last_run.cycles
    clock = ipu._executable.engine.target.clock_hz
    print(f"{args.strategy}: micro-batch {micro}, gradient accumulation {acc}, device iterations {its} "
          f"({n} samples, {its} optimiser steps per call), torch threads {torch.get_num_threads()}")
    print(f"  first call (compile + run): {first:.2f} s")
    print(f"  per call: poptorch_lite {mi:.3f} s, PyTorch {mt:.3f} s -> ratio {mi / mt:.2f} (target: 2x or better)")
    print(f"  simulated IPU time per call: {cycles / clock * 1e3:.2f} ms ({cycles} cycles at {clock / 1e9:.2f} GHz)")
    if not args.skip_compile:
        cold, warm = compile_times()
        print(f"  compile (fresh process): cold Numba cache {cold:.1f} s, warm {warm:.1f} s")


if __name__ == "__main__":
    main()
