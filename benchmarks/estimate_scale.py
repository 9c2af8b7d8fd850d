"""Time and peak memory of pricing each full-size config (benchmarks/full_size.py) in estimate mode.

Each config is compiled and one call priced in a fresh process (so its peak RSS is its own),
`--repeats` times; the table gives the median wall time of compile and call, the highest peak RSS,
and what the estimate says: fits or not, cycles per weight update, bubble, samples per second.
Targets: at most 60 s and 4 GB per config on a 2-core machine. CPU time (user + system of the
process) is printed beside the wall time: on a loaded machine it is the steadier figure.

    python benchmarks/estimate_scale.py [--configs bert_large_128_pod16,...] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def phases(record) -> dict:
    """Busy cycles of the priced call per IPU, by phase (the op kind: F forward, R recompute, B
    backward, U weight update; with "+copies" for the inter-IPU sends of its results) and by kind of
    cycles (compute, exchange, sync, inter_ipu, host)."""
    out: dict = {}
    for step in record.steps:
        for event in step.events:
            phase = event.op.kind + ("+copies" if event.part == "send" else "")
            for ipu, c in event.per_ipu.items():
                kinds = out.setdefault(str(ipu), {}).setdefault(phase, {})
                for k, v in c.to_dict().items():
                    kinds[k] = kinds.get(k, 0) + v
    return out


def one(name: str) -> dict:
    sys.path.insert(0, HERE)
    import full_size
    priced = full_size.estimate(name)
    est = priced.model.estimate()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": priced.compile_seconds, "cpu_seconds": priced.cpu_seconds, "peak_mb": usage.ru_maxrss / 1024,
            "fits": est.fits, "cycles_per_step": est.cycles_per_step, "bubble": est.bubble_fraction,
            "samples_per_second": est.samples_per_second, "call_cycles": est.call_cycles, "clock_hz": est.clock_hz,
            "micro_batches": priced.model._executable.schedule.num_micro_batches,
            "phases": phases(priced.model.last_run), "text": est.text()}


def main() -> None:
    sys.path.insert(0, HERE)
    import full_size
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(full_size.CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--show", action="store_true", help="print each config's estimate")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    rows = []
    for name in args.configs.split(","):
        if name not in full_size.CONFIGS:
            parser.error(f"unknown config {name!r}; choose from {', '.join(full_size.CONFIGS)}")
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                                                  os.environ.get("PYTHONPATH", "")])})
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        rows.append((name, statistics.median(x["seconds"] for x in runs), statistics.median(x["cpu_seconds"] for x in runs),
                     max(x["peak_mb"] for x in runs), r))
        times = ", ".join(f"{x['seconds']:.1f} s ({x['cpu_seconds']:.1f} s CPU)" for x in runs)
        print(f"{name}: {times}; "
              f"peak {max(x['peak_mb'] for x in runs):,.0f} MB", file=sys.stderr, flush=True)
        if args.show:
            print(r["text"], file=sys.stderr)
    print(f"\n| config | compile + call s (median of {args.repeats}) | CPU s | peak RSS MB | fits | cycles per weight "
          f"update | bubble | samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, seconds, cpu, peak, r in rows:
        print(f"| {name} | {seconds:.1f} | {cpu:.1f} | {peak:,.0f} | {'yes' if r['fits'] else 'no'} | {r['cycles_per_step']:,} "
              f"| {100 * r['bubble']:.1f}% | {r['samples_per_second']:,.0f} |")


if __name__ == "__main__":
    main()
