#!/usr/bin/env python3
"""How gradient accumulation, device iterations and the block-to-stage split change the
tutorial's pipelined training on emulated IPUs: emulated throughput, idle time (bubbles and
imbalance), memory per IPU, and host time.

Every configuration compiles the tutorial's model and times its second training call on random images
(the numbers depend on shapes, not values); the figures come from the call's step record
(`executor.last_run`) and the engine's memory reports.

    python sweep.py            # writes sweep.md and, with matplotlib, sweep.png beside this file
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

import poptorch_lite as poptorch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_pipeline import Network, TrainingModelWithLoss  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MICRO_BATCH = 40
SPLITS = {  # name -> blocks of each stage, stage k on IPU k
    "B1 | B2 | B3 | B4": (("B1",), ("B2",), ("B3",), ("B4",)),
    "B1 | B2 | B3+B4": (("B1",), ("B2",), ("B3", "B4")),
    "B1+B2 | B3+B4": (("B1", "B2"), ("B3", "B4")),
    "B1 | B2+B3+B4": (("B1",), ("B2", "B3", "B4")),
}


@dataclass
class Point:
    split: str
    gradient_accumulation: int
    device_iterations: int
    images: int
    emulated_s: float        # emulated IPU time of the call
    step_idle: float         # idle IPU-steps / IPU-steps of the schedule (the pipeline bubbles)
    cycle_idle: float        # idle IPU-cycles / IPU-cycles of the call (bubbles and imbalance)
    busy_cycles: list[int]   # per IPU, over the call
    memory_mb: list[float]   # peak on-chip bytes per IPU
    off_chip_mb: list[float]  # Streaming Memory (remote buffers) per IPU
    update_cycles: int       # emulated cycles of the call's weight-update steps
    host_s: float            # host wall time of the call (compilation excluded)
    offload: bool = False    # optimiser state off chip

    @property
    def images_per_s(self) -> float:
        return self.images / self.emulated_s


def measure(split: str, gradient_accumulation: int, device_iterations: int, offload: bool = False) -> Point:
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    stages = [poptorch.Stage(*blocks).ipu(i) for i, blocks in enumerate(SPLITS[split])]
    opts = poptorch.Options().deviceIterations(device_iterations)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*stages))
    opts.Training.gradientAccumulation(gradient_accumulation)
    if offload:
        opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.AdamW(model.parameters(), lr=0.001))
    images = MICRO_BATCH * gradient_accumulation * device_iterations
    x, y = torch.randn(images, 1, 28, 28), torch.randint(0, 10, (images,))
    training(x, y)  # compiles
    start = time.perf_counter()
    training(x, y)
    host_s = time.perf_counter() - start
    record, exe = training.last_run, training._executable
    ipus = len(SPLITS[split])
    busy = [sum(step.busy[i].total for step in record.steps if i in step.busy) for i in range(ipus)]
    point = Point(split, gradient_accumulation, device_iterations, images,
                  record.seconds, exe.schedule.bubble_fraction(),
                  1 - sum(busy) / (ipus * record.cycles), busy,
                  [m.total / 2**20 for m in exe.engine.memory], [m.off_chip_bytes / 2**20 for m in exe.engine.memory],
                  sum(step.cycles for step in record.steps if any(op.kind == "U" for op in step.ops)), host_s, offload)
    training.destroy()
    return point


def per_ipu(values, unit: str = "") -> str:
    """One figure per IPU, as "a / b / c" with two decimals."""
    return " / ".join(f"{v:.2f}{unit}" for v in values)


def offload_table(points: list[Point]) -> str:
    rows = ["| optimiser state | on-chip memory per IPU (MiB) | off-chip per IPU (MiB) | weight-update cycles | "
            "emulated images/s |", "|---|---|---|---|---|"]
    rows += [f"| {'off chip' if p.offload else 'on chip'} | {per_ipu(p.memory_mb)} | "
             f"{per_ipu(p.off_chip_mb)} | {p.update_cycles:,} | {p.images_per_s:,.0f} |"
             for p in points]
    return "\n".join(rows)


def batching_table(points: list[Point]) -> str:
    rows = ["| gradient accumulation | device iterations | images per call | emulated images/s | idle steps | "
            "idle cycles | memory per IPU (MiB) | host s per 1k images |", "|---|---|---|---|---|---|---|---|"]
    rows += [f"| {p.gradient_accumulation} | {p.device_iterations} | {p.images} | {p.images_per_s:,.0f} | "
             f"{p.step_idle:.0%} | {p.cycle_idle:.0%} | {per_ipu(p.memory_mb)} | "
             f"{1000 * p.host_s / p.images:.2f} |" for p in points]
    return "\n".join(rows)


def balance_table(points: list[Point]) -> str:
    rows = ["| stages (IPU 0 \\| IPU 1 ...) | IPUs | emulated images/s | idle steps | idle cycles | "
            "busy cycles per IPU | memory per IPU (MiB) |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {p.split.replace('|', chr(92) + '|')} | {len(p.busy_cycles)} | {p.images_per_s:,.0f} | "
             f"{p.step_idle:.0%} | {p.cycle_idle:.0%} | {per_ipu((b / 1e6 for b in p.busy_cycles), 'M')} | "
             f"{per_ipu(p.memory_mb)} |" for p in points]
    return "\n".join(rows)


def chart(batching: list[Point], balance: list[Point], path: str) -> bool:
    """Throughput and idle fraction against gradient accumulation, and busy cycles per IPU for
    each split. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for d in sorted({p.device_iterations for p in batching}):
        pts = [p for p in batching if p.device_iterations == d]
        left.plot([p.gradient_accumulation for p in pts], [p.images_per_s / 1e3 for p in pts], "o-",
                  label=f"images/s, {d} device iteration{'s' if d > 1 else ''}")
    left.set_xscale("log", base=2)
    left.set_xlabel("gradient accumulation (micro-batches per weight update)")
    left.set_ylabel("emulated thousand images/s")
    idle = left.twinx()
    pts = [p for p in batching if p.device_iterations == batching[0].device_iterations]
    idle.plot([p.gradient_accumulation for p in pts], [100 * p.cycle_idle for p in pts], "s--", color="grey",
              label="idle IPU time (%)")
    idle.set_ylabel("idle IPU time (%)")
    idle.set_ylim(0, 100)
    lines = left.get_legend_handles_labels()
    more = idle.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center right")
    left.set_title("4 stages: batching")
    width = 0.8 / max(len(p.busy_cycles) for p in balance)
    for k, p in enumerate(balance):
        for i, b in enumerate(p.busy_cycles):
            right.bar(k + (i - (len(p.busy_cycles) - 1) / 2) * width, b / 1e6, width,
                      color=f"C{i}", label=f"IPU {i}" if k == 0 or i >= len(balance[0].busy_cycles) else None)
    right.set_xticks(range(len(balance)), [f"{p.split}\n{p.images_per_s / 1e3:,.0f}k img/s" for p in balance],
                     fontsize=8)
    right.set_ylabel("busy cycles per IPU (millions)")
    right.set_title(f"block-to-stage splits (gradient accumulation {balance[0].gradient_accumulation})")
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    right.legend(unique.values(), unique.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gradient-accumulation", default="8,16,32,64",
                        help="comma-separated values to sweep (at least 7: 4 stages train as 7)")
    parser.add_argument("--device-iterations", default="1,4", help="comma-separated values to sweep")
    parser.add_argument("--split-accumulation", type=int, default=16,
                        help="gradient accumulation used to compare the splits")
    parser.add_argument("--parts", default="batching,splits,offload",
                        help="what to measure: batching (accumulation x iterations), splits, offload")
    parser.add_argument("--output", default=os.path.join(HERE, "sweep"),
                        help="path prefix of the table (.md) and chart (.png)")
    args = parser.parse_args(argv)
    accumulations = [int(v) for v in args.gradient_accumulation.split(",")]
    iterations = [int(v) for v in args.device_iterations.split(",")]
    parts = args.parts.split(",")
    batching = [measure("B1 | B2 | B3 | B4", g, d) for d in iterations for g in accumulations] \
        if "batching" in parts else []
    balance = [measure(s, args.split_accumulation, 1) for s in SPLITS] if "splits" in parts else []
    offload = [measure("B1 | B2 | B3 | B4", args.split_accumulation, 1, o) for o in (False, True)] \
        if "offload" in parts else []
    text = f"Pipelined tutorial model, micro-batch {MICRO_BATCH}, AdamW, emulated GC200 IPUs.\n"
    for points, table in ((batching, batching_table), (balance, balance_table), (offload, offload_table)):
        if points:
            text += f"\n{table(points)}\n"
    with open(args.output + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    if not (batching and balance):
        return
    if chart(batching, balance, args.output + ".png"):
        print(f"chart: {args.output}.png")
    else:
        print("matplotlib is not installed (pip install matplotlib): no chart")


if __name__ == "__main__":
    main()
