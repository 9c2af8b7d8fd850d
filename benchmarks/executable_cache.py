"""Executable cache: cold compile against a cached start of the MNIST tutorial model.

The tutorial network (TrainingModelWithLoss(Network()), four pipeline stages on four IPUs) with
the tutorial's batching is compiled in fresh processes, as a user's runs would be:
- "compile": caching off (the compiler alone);
- "cold": caching on, empty cache directory (compile, then save the entry);
- "cached": caching on, the entry of the cold run present (load instead of compiling).
Each figure is the median over the repeats of the model's compile step (`_compile_or_load`) and
of the whole process (interpreter start, imports, compile step). A first, unmeasured run fills
Numba's and the OS's caches so that no variant pays for them.

    python benchmarks/executable_cache.py [--repeats 3] [--micro-batch 40] [--mode fast|strict]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")

CHILD = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch
import poptorch_lite as poptorch
from poptorch_lite.runtime import cache
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss

cache_dir = sys.argv[1]
micro, accumulation, iterations = {micro}, 10, 10
torch.manual_seed(0)
model = TrainingModelWithLoss(Network())
opts = poptorch.Options().deviceIterations(iterations)
opts.Training.gradientAccumulation(accumulation)
opts.setExecutionStrategy(TUTORIAL_STRATEGY)
opts.Emulator.setMode({mode!r})
if cache_dir != "-":
    opts.enableExecutableCaching(cache_dir)
training = poptorch.trainingModel(model, opts, poptorch.optim.AdamW(model.parameters(), lr=1e-3))
n = micro * accumulation * iterations
args = (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
start = time.perf_counter()
loaded = training._compile_or_load(args, {{}})
seconds = time.perf_counter() - start
entries = [f for f in os.listdir(cache_dir) if f.endswith(cache.SUFFIX)] if cache_dir != "-" else []
size = sum(os.path.getsize(os.path.join(cache_dir, f)) for f in entries)
print(json.dumps({{"loaded": loaded, "seconds": seconds, "entry_bytes": size}}))
"""


def run(script: str, cache_dir: str | None) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, script, cache_dir or "-"], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=40)
    parser.add_argument("--mode", choices=["fast", "strict"], default="fast")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "child.py")
        with open(script, "w") as f:
            f.write(CHILD.format(tests=os.path.abspath(TESTS), micro=args.micro_batch, mode=args.mode))
        warm = os.path.join(work, "warm-up")
        run(script, warm)
        run(script, warm)
        results: dict[str, list[dict]] = {"compile": [], "cold": [], "cached": []}
        for r in range(args.repeats):
            cache_dir = os.path.join(work, f"cache{r}")
            results["compile"].append(run(script, None))
            results["cold"].append(run(script, cache_dir))
            results["cached"].append(run(script, cache_dir))
            if results["cold"][-1]["loaded"] or not results["cached"][-1]["loaded"]:
                raise RuntimeError(f"repeat {r}: the cold run loaded or the cached run compiled: {results}")
    print(f"tutorial model, micro-batch {args.micro_batch}, gradient accumulation 10, device iterations 10, "
          f"{args.mode} mode; medians of {args.repeats} fresh processes each")
    print(f"{'':8} {'compile step':>14} {'whole process':>15}")
    median = {k: (statistics.median(r["seconds"] for r in v), statistics.median(r["process"] for r in v))
              for k, v in results.items()}
    for name, (step, process) in median.items():
        print(f"{name:8} {step:13.2f}s {process:14.2f}s")
    print(f"entry size: {results['cold'][-1]['entry_bytes'] / 1e6:.1f} MB")
    print(f"cached start vs cold compile (compile step): {median['cold'][0] / median['cached'][0]:.1f}x faster "
          f"({median['compile'][0] / median['cached'][0]:.1f}x vs compiling without the cache)")
    print(f"cached start vs cold compile (whole process): {median['cold'][1] / median['cached'][1]:.1f}x faster")


if __name__ == "__main__":
    main()
