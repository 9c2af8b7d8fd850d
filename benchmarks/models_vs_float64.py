"""How closely the emulator trains models beyond the tutorial: torchvision's resnet18 and
mobilenet_v3_small and a BERT-style encoder, each over four emulated IPUs with one BeginBlock per
layer group, pipelined and sharded, 5 SGD and 5 AdamW steps (gradient accumulation 8).

For each run it prints the parameters' relative distance to float64 training (PyTorch eager in
float64, micro-batch by micro-batch, the same steps), beside PyTorch's own float32 training's
distance, and their ratio: the emulator trains as well as PyTorch does when the ratio is at most 2.
For the CNNs it also prints PyTorch float32's distance in channels_last memory format, whose
convolutions round in another order, and the emulator's ratio to the larger of PyTorch's two: a
few steps of AdamW turn each rounding difference into a full learning-rate step, and a ReLU input
that float32 rounding puts on either side of zero sends its gradient one way or the other, so
float32 training itself is only determined to within that spread.
The forward of each model (eval mode, pipelined) is compared with PyTorch eager too.

    python benchmarks/models_vs_float64.py [--models resnet18,bert_style] [--markdown]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import model_zoo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(model_zoo.MODELS))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in model_zoo.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(model_zoo.MODELS)}")
    header = ["model", "strategy", "optimiser", "emulated vs float64", "PyTorch float32 vs float64", "ratio",
              "PyTorch float32 channels_last", "ratio to PyTorch's larger", "moved", "seconds"]
    rows = []
    for name in names:
        emulated, eager = model_zoo.inference_against_eager(name)
        print(f"{name}: forward, pipelined, largest difference to PyTorch eager "
              f"{(emulated - eager).abs().max().item():.2e}", flush=True)
        for strategy in ("pipelined", "sharded"):
            for optimiser in ("SGD", "AdamW"):
                start = time.perf_counter()
                c = model_zoo.train_against_float64(name, strategy, optimiser)
                last = "-" if c.float32_channels_last is None else f"{c.float32_channels_last:.3e}"
                rows.append([name, strategy, optimiser, f"{c.emulated:.3e}", f"{c.float32:.3e}", f"{c.ratio:.2f}",
                             last, f"{c.emulated / c.float32_spread:.2f}", f"{c.moved:.1e}",
                             f"{time.perf_counter() - start:.0f}"])
                print("  ".join(rows[-1]), flush=True)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    worst, spread = max(float(r[5]) for r in rows), max(float(r[7]) for r in rows)
    print(f"largest ratio {worst:.2f} ({'within' if worst <= 2 else 'beyond'} 2x); to the larger of PyTorch's "
          f"float32 distances {spread:.2f} ({'within' if spread <= 2 else 'beyond'} 2x)")


if __name__ == "__main__":
    main()
