"""Profiling overhead: host wall time of training calls with profiling on against off.

Two copies of the tutorial network (4 pipeline stages on GC200, gradient accumulation 8) run in
one process, one with Options.enableProfiling, one without; their calls alternate so both see
the same machine load. Reported, as medians over the calls:

- per call: the profiled call's time / the plain call's time (the hook accounts each call);
- one-off: the profiler's set-up at compile time, writing profile.json and trace.json after
  the first call, and the end of the run (files again, the PNG charts, the summary);
- the whole run: (calls x profiled call + one-off) / (calls x plain call), for the calls measured
  and for a longer run (--run-calls, default one epoch of MNIST at this batch size).

    python benchmarks/profiling_overhead.py [--calls 30] [--micro-batch 8] [--run-calls 938]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

import poptorch_lite as poptorch
from poptorch_lite.runtime import profiling

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss  # noqa: E402


def model(profile_dir: str | None, accumulation: int):
    torch.manual_seed(0)
    opts = poptorch.Options().setExecutionStrategy(TUTORIAL_STRATEGY)
    opts.Training.gradientAccumulation(accumulation)
    if profile_dir is not None:
        opts.enableProfiling(profile_dir)
    return poptorch.trainingModel(TrainingModelWithLoss(Network()), opts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30, help="calls measured per model")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=8)
    ap.add_argument("--run-calls", type=int, default=None,
                    help="calls of the longer run to amortise the one-off costs over (default: one MNIST epoch)")
    args = ap.parse_args(argv)
    per_call = args.micro_batch * args.accumulation
    run_calls = args.run_calls or 60000 // per_call
    setup: list[float] = []
    original = profiling.Profiler.__init__

    def timed_init(self, *a, **k):
        t0 = time.perf_counter()
        original(self, *a, **k)
        setup.append(time.perf_counter() - t0)

    profiling.Profiler.__init__ = timed_init
    with tempfile.TemporaryDirectory() as tmp:
        plain, profiled = model(None, args.accumulation), model(tmp, args.accumulation)
        gen = torch.Generator().manual_seed(0)
        batches = [(torch.randn(per_call, 1, 28, 28, generator=gen), torch.randint(0, 10, (per_call,), generator=gen))
                   for _ in range(4)]
        plain(*batches[0])                       # compile both
        t0 = time.perf_counter()
        profiled(*batches[0])
        first_profiled = time.perf_counter() - t0
        session = profiled._profiler.session
        t0 = time.perf_counter()
        session.write_early()                    # what the first call wrote, timed on its own
        early = time.perf_counter() - t0
        times = {"off": [], "on": []}
        for i in range(args.calls):
            x, y = batches[i % len(batches)]
            for name, m in (("off", plain), ("on", profiled)):
                t0 = time.perf_counter()
                m(x, y)
                times[name].append(time.perf_counter() - t0)
        session.echo = lambda text: None
        t0 = time.perf_counter()
        profiled.destroy()
        end = time.perf_counter() - t0
        files = sorted(os.listdir(os.path.join(tmp, "training")))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    one_off = setup[0] + early + end
    print(f"tutorial network, 4 IPUs (GC200), {per_call} samples per call, {args.calls} calls per model "
          f"(first profiled call with compile: {first_profiled:.2f} s)")
    print(f"per call (median): off {1e3 * off:.1f} ms, on {1e3 * on:.1f} ms, ratio on/off {on / off:.3f} "
          f"({100 * (on / off - 1):+.1f}%)")
    print(f"one-off: profiler set-up {1e3 * setup[0]:.0f} ms, files after the first call {1e3 * early:.0f} ms, "
          f"end of run {end:.2f} s (wrote {', '.join(files)})")
    for calls in (args.calls, run_calls):
        ratio = (calls * on + one_off) / (calls * off)
        print(f"whole run of {calls} calls: ratio on/off {ratio:.3f} ({100 * (ratio - 1):+.1f}%)"
              f"{'  [target: under +10%]' if calls == run_calls else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
