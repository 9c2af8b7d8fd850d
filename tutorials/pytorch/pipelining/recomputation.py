#!/usr/bin/env python3
"""Recomputation's trade on the tutorial's model: memory for cycles.

PopTorch turns PopART's `autoRecomputation = RecomputationType::Pipeline` on for every pipelined
training model over more than one IPU: each stage but the last re-runs its forward just before
its backward (the schedule's R op, in the backward's step) from what its forward stashed (the
stage's inputs and the random seed), instead of stashing every activation its backward reads.
`opts._Popart.set("autoRecomputation", 0)` turns it off.

This script trains the tutorial's model (4 blocks on 4 emulated GC200s) both ways, profiled, and
writes a table of one call from the two profiles: emulated time per call, the stashed
activations and total memory of every IPU, and each stage's R and B cycles per micro-batch. The
trained parameters of the two runs are compared too: recomputation changes no value.

    python recomputation.py        # writes recomputation.md beside this file
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

import poptorch_lite as poptorch
from ipusim.report import profile as ipprofile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_pipeline import Network, TrainingModelWithLoss, four_stages  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MICRO_BATCH = 40


def train(recompute: bool, gradient_accumulation: int) -> tuple[dict, dict]:
    """The profile of the second call and the parameters after it."""
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().randomSeed(0)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*four_stages()))
    opts.Training.gradientAccumulation(gradient_accumulation)
    if not recompute:
        opts._Popart.set("autoRecomputation", 0)   # PopART's RecomputationType::None
    profile_dir = tempfile.mkdtemp(prefix="recomputation-")
    opts.enableProfiling(profile_dir)
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.01))
    images = MICRO_BATCH * gradient_accumulation
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(images, 1, 28, 28, generator=generator), torch.randint(0, 10, (images,), generator=generator)
    training(x, y)  # compiles
    training(x, y)
    training._profiler.session.echo = lambda text: None   # the summary is not wanted here
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    training.destroy()
    doc = ipprofile.load(os.path.join(profile_dir, "training"))
    shutil.rmtree(profile_dir)
    return doc, params


def per_ipu(values, fmt) -> str:
    return " / ".join(fmt(v) for v in values)


def row(name: str, doc: dict) -> str:
    ex, clock = doc["execution"], doc["target"]["clock_hz"]
    cycles = ex["cycles_per_call"][-1]
    memory = doc["memory"]["ipus"]
    stages = ex["stages"]

    def cycles_of(st, key):
        part = st.get(key)
        return f"{part['cycles_per_micro_batch']:,.0f}" if part else "-"

    return (f"| {name} | {cycles / clock * 1e6:,.1f} | {cycles:,} | "
            f"{per_ipu([m['by_category'].get('stashed_activations', 0) for m in memory], lambda b: f'{b / 1024:,.0f}')} | "
            f"{per_ipu([m['total_bytes'] for m in memory], lambda b: f'{b / 2**20:.2f}')} | "
            f"{per_ipu(stages, lambda st: cycles_of(st, 'recompute'))} | "
            f"{per_ipu(stages, lambda st: cycles_of(st, 'backward'))} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gradient-accumulation", type=int, default=10,
                        help="micro-batches per weight update (at least 7 for 4 pipeline stages)")
    parser.add_argument("--output", default=os.path.join(HERE, "recomputation.md"), help="where to write the table")
    args = parser.parse_args(argv)
    g = args.gradient_accumulation
    on, on_params = train(True, g)
    off, off_params = train(False, g)
    same = all(torch.equal(on_params[k], off_params[k]) for k in on_params)
    recomputed = on["execution"]["schedule"]["recomputed_stages"]
    text = (f"The tutorial's model, micro-batch {MICRO_BATCH}, gradient accumulation {g} (one weight update per call), "
            "SGD, emulated GC200 IPUs, PopTorch's pipelined schedule; the second call of each run, from its profile. "
            f"Recomputed stages: {recomputed}. Parameters after two calls bit-identical with and without: "
            f"{'yes' if same else 'NO'}.\n\n"
            "| autoRecomputation | emulated us per call | cycles per call | stashed activations per IPU (KiB) | "
            "memory per IPU (MiB) | R cycles per micro-batch per stage | B cycles per micro-batch per stage |\n"
            "|---|---|---|---|---|---|---|\n"
            + row("Pipeline (3, PopTorch's default)", on) + "\n" + row("None (0)", off) + "\n")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"table: {args.output}")


if __name__ == "__main__":
    main()
