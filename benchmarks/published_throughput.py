"""Estimated training throughput of full-size configs against the figures Graphcore published.

Every row prices one config of benchmarks/full_size.py in estimate mode on the Bow target
(1.85 GHz) and sets its samples per second beside Graphcore's published figure for the same
model, platform, batch and precision (16.16), with the source and what the estimate leaves out.
The cycle model is not fitted to these figures (docs/calibration.md says why a row is off).

    python benchmarks/published_throughput.py [--rows bert_large_128_pod16,...] [--phases]

`--phases` prints, under the table, each row's busy cycles per micro-batch on each IPU of a
replica by phase (forward F, recompute R, backward B, weight update U, the inter-IPU copies of
each) and kind (compute, exchange, sync, inter-IPU, host), the call's cycles per micro-batch and
the cycles per micro-batch of the published figure: docs/calibration.md's breakdown.

Packed BERT rows: Graphcore's figure counts sequences, a packed row of 128 tokens holding 1.17 on
average and one of 512 tokens 2.0 (the application's packing factors, configs_pretraining.yml);
the estimate prices rows of that many tokens and multiplies by the factor.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
PERFORMANCE_RESULTS = "https://www.graphcore.ai/performance-results"


@dataclass
class Row:
    config: str            # benchmarks/full_size.py
    published: float       # items per second
    what: str              # the published row
    source: str
    per_sample: float = 1.0   # published items per priced sample (sequences per packed row)


ROWS = [
    Row("bert_large_128_pod16", 5600, "BERT Large Ph1 pre-training SL128, packed, Bow Pod16, SDK 3.3, PyTorch, "
        "batch 56,064, 16.16", PERFORMANCE_RESULTS, 1.17),
    Row("bert_large_128_pod64", 18442, "BERT Large Ph1 pre-training SL128, packed, Bow Pod64, SDK 3.2, PyTorch, "
        "batch 56,064, 16.16", PERFORMANCE_RESULTS, 1.17),
    Row("bert_large_512_pod16", 1973, "BERT Large Ph2 pre-training SL512, packed, Bow Pod16, SDK 3.3, PyTorch, "
        "batch 8,192, 16.16", PERFORMANCE_RESULTS, 2.0),
    Row("bert_base_128_pod16", 15911, "BERT Base Ph1 pre-training SL128, Bow Pod16, SDK 3.3, PyTorch, batch 65,536, "
        "16.16", PERFORMANCE_RESULTS),
    Row("optimum_bert_large_pod64", 18442, "BERT Large Ph1 pre-training SL128, packed, Bow Pod64 (the closest "
        "published row: same model, platform and precision)", PERFORMANCE_RESULTS, 1.17),
]


def price(config: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(HERE, "estimate_scale.py"), "--one", config],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                                          os.environ.get("PYTHONPATH", "")])})
    if out.returncode:
        raise RuntimeError(f"{config} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, HERE)
    import full_size
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(r.config for r in ROWS))
    parser.add_argument("--phases", action="store_true", help="break each row down by IPU and phase")
    args = parser.parse_args()
    wanted = args.rows.split(",")
    print("| config | published | source | estimated | ratio | fits | leaves out |")
    print("|---|---|---|---|---|---|---|")
    within = 0
    rows = [r for r in ROWS if r.config in wanted]
    unknown = sorted(set(wanted) - {r.config for r in ROWS})
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(r.config for r in ROWS)}")
    breakdowns = []
    for r in rows:
        got = price(r.config)
        breakdowns.append((r, got))
        estimated = got["samples_per_second"] * r.per_sample
        ratio = estimated / r.published
        within += abs(ratio - 1) <= 0.15
        leaves = "; ".join(full_size.CONFIGS[r.config].leaves_out)
        print(f"| {r.config} | {r.published:,.0f} ({r.what}) | {r.source} | {estimated:,.0f} | {ratio:.2f} | "
              f"{'yes' if got['fits'] else 'no'} | {leaves} |", flush=True)
    print(f"\n{within} of {len(rows)} rows within 15%")
    if args.phases:
        for r, got in breakdowns:
            print(breakdown(r, got))


def breakdown(row: Row, got: dict) -> str:
    """Busy cycles per micro-batch by IPU and phase of one priced row (see the module doc)."""
    m, clock = got["micro_batches"], got["clock_hz"]
    samples = got["samples_per_second"] * got["call_cycles"] / clock / m  # of one micro-batch on every replica
    published = clock * samples / (row.published / row.per_sample)
    lines = [f"\n{row.config}: {got['call_cycles'] / m:,.0f} cycles per micro-batch in the call, "
             f"{published:,.0f} in the published figure",
             "| IPU | phase | total | compute | exchange | sync | inter-IPU | host |", "|---|---|---|---|---|---|---|---|"]
    for ipu, phases in sorted(got["phases"].items(), key=lambda kv: int(kv[0])):
        for phase, c in sorted(phases.items()):
            lines.append(f"| {ipu} | {phase} | " + " | ".join(f"{c[k] / m:,.0f}" for k in
                         ("total", "compute", "exchange", "sync", "inter_ipu", "host")) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
