#!/usr/bin/env python3
"""The tutorial's model trained under every pipeline schedule the emulator runs
(`Options.Emulator.setPipelineSchedule`): PopTorch's own, GPipe, 1F1B, interleaved 1F1B, ZB-H1
and ZB-H2, each on emulated GC200 IPUs, with the figures of one call as executed.

Every kind compiles the model and times its second training call on random images (the numbers
depend on shapes, not values). Emulated time per call and idle cycles come from the call's step
record (`executor.last_run`): the executor runs a schedule in lock-step, as PopTorch's runtime
does, each step as long as its slowest IPU. The event-driven time (each IPU runs its next op as
soon as what it needs is done, as GPipe, 1F1B and the zero-bubble schedules are meant to run) is
`ipusim.schedules.price` of the same schedule on the cycles each op took in the profiled calls
(`ipusim.report.pricing.stage_costs` of the model's profile: F, B and, for the split kinds, W of
every stage, the weight update of every IPU). The bubble (idle
IPU-steps) and the stash depth (micro-batches in flight per IPU) come from the schedule, memory
per IPU from the engine's reports.

    python schedules.py        # writes schedules.md beside this file
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

import poptorch_lite as poptorch
from ipusim.report import pricing
from ipusim.report import profile as ipprofile
from ipusim.schedules import price

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_pipeline import Network, TrainingModelWithLoss  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MICRO_BATCH = 40
RUNS = [  # (schedule kind, IPU of blocks B1..B4)
    ("PopTorch", (0, 1, 2, 3)), ("GPipe", (0, 1, 2, 3)), ("1F1B", (0, 1, 2, 3)),
    ("ZB-H1", (0, 1, 2, 3)), ("ZB-H2", (0, 1, 2, 3)),
    ("PopTorch", (0, 1, 0, 1)), ("Interleaved1F1B", (0, 1, 0, 1)),
]


def measure(kind: str, ipus: tuple[int, ...], gradient_accumulation: int) -> str:
    """One table row: the second call of the tutorial's model trained under `kind`."""
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        *[poptorch.Stage(f"B{b + 1}").ipu(i) for b, i in enumerate(ipus)]))
    opts.Training.gradientAccumulation(gradient_accumulation)
    opts.Emulator.setPipelineSchedule(kind)
    profile_dir = tempfile.mkdtemp(prefix="schedules-")
    opts.enableProfiling(profile_dir)
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.01))
    images = MICRO_BATCH * gradient_accumulation
    x, y = torch.randn(images, 1, 28, 28), torch.randint(0, 10, (images,))
    training(x, y)  # compiles
    training(x, y)
    record, exe = training.last_run, training._executable
    schedule = exe.schedule
    n = schedule.num_ipus
    busy = sum(step.busy[i].total for step in record.steps for i in step.busy)
    training._profiler.session.echo = lambda text: None   # the summary is not wanted here
    training.destroy()
    costs = pricing.stage_costs(ipprofile.load(os.path.join(profile_dir, "training")))
    shutil.rmtree(profile_dir)
    event_driven = price(schedule, costs).event_driven.cycles / record.clock_hz
    name = f"PopTorch ({schedule.strategy.partition('-')[2]})" if kind == "PopTorch" else kind
    row = (f"| {name} | {', '.join(map(str, ipus))} | {schedule.num_steps} | {record.seconds * 1e6:,.1f} | "
           f"{event_driven * 1e6:,.1f} | {schedule.bubble_fraction():.0%} | {1 - busy / (n * record.cycles):.0%} | "
           f"{' / '.join(str(schedule.peak_in_flight(i)) for i in range(n))} | "
           f"{' / '.join(f'{m.total / 2**20:.2f}' for m in exe.engine.memory)} |")
    print(row, flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gradient-accumulation", type=int, default=10,
                        help="micro-batches per weight update (at least 7: 4 stages train as 7 in PopTorch's schedule)")
    parser.add_argument("--output", default=os.path.join(HERE, "schedules.md"), help="where to write the table")
    args = parser.parse_args(argv)
    g = args.gradient_accumulation
    text = (f"The tutorial's model, micro-batch {MICRO_BATCH}, gradient accumulation {g} (one weight update per "
            "call), SGD, emulated GC200 IPUs; one call as executed.\n\n"
            "| schedule | IPUs of B1..B4 | steps | emulated us per call (lock-step, as run) | event-driven us per call "
            "(priced) | idle IPU-steps | idle IPU-cycles | stash depth per IPU | memory per IPU (MiB) |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    text += "\n".join(measure(kind, ipus, g) for kind, ipus in RUNS) + "\n"
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"table: {args.output}")


if __name__ == "__main__":
    main()
