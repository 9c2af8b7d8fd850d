"""The cycle model against published IPU measurements: emulated, published, relative error.

For every measurement in `ipu_measurements.py` this builds the measured program with ipusim itself
(graph, tile mapping, the op library, exchanges, inter-IPU copies, stream copies), compiles it
with an `Engine` (which computes the program's static cycles, never running it) and turns the
cycles into the published unit with the target's clock. A row that misses by more than 10% says
what the model leaves out. ipusim.device.model_error states each part's error for profiles and
reports; tests/test_calibration.py keeps that table equal to what this benchmark measures.

    python benchmarks/calibration.py [--tiles 16] [--markdown] [--chart calibration.png] [--json rows.json]

`--tiles K` builds the per-tile matmul on K tiles instead of the whole chip: every tile runs the
same matmul, so the chip's throughput is the published tile count times one tile's, and the rows
do not change; it only makes the run quicker.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # appended, so the benchmark scripts never shadow another module
    sys.path.append(_HERE)

import ipusim as ip  # noqa: E402
from ipusim.ops.matmul import matmul, plan_matmul  # noqa: E402
from ipu_measurements import MEASUREMENTS, Measurement  # noqa: E402

TOLERANCE = 0.10
TARGETS = {"Bow": ip.BOW, "GC200": ip.GC200, "GC200 (IPU-M2000)": ip.GC200, "GC2": ip.GC2}

# What the model leaves out, per workload family: printed on a row that misses by more than 10%.
MISSES = {
    "amp_matmul": ("matmul partial estimator (ipusim/ops/matmul.py, amp_partial_cycles): PopLibs' ConvPartial1x1Out "
                   "structure no longer matches this size"),
    "exchange_all_tiles": ("exchange cost = busiest tile's bytes / 4 B per cycle plus one sync; a nominal all-pattern "
                           "figure leaves out whatever exchange code and sync cost on the chip"),
    "exchange_latency_full_over_no_load": ("the exchange model has no contention: a superstep costs its busiest "
                                           "tile's bytes whatever the other tiles send, so full load costs the same "
                                           "as one message; the measured +24% comes from congestion on the fabric, "
                                           "and the summary quoting it gives neither the message size nor the load "
                                           "pattern, so a congestion term would be fitted to assumptions"),
    "ipu_link_bidirectional": ("InterIpuCopy costs one direction at one link's rate (links_per_ipu_pair=1, "
                               "efficiency 0.85) and overlaps the opposite direction in a Parallel"),
    "host_to_tiles": ("StreamCopy costs a fixed latency (host_copy_latency_cycles, a default, not published) plus "
                      "bytes at the PCIe Gen4 x16 rate; on an IPU-M2000 host transfers are remotely buffered over the "
                      "host's network link (the tool's manual says so), a path the model does not describe, and "
                      "the row depends on how the published bytes split into transfers, which is not stated"),
}

FITTED = ("; per tile it costs {e_slope:.2f} cycles per output row + {e_fixed:.0f} fixed where the measurement "
          "shows {p_slope:.2f} per row + {p_fixed:.0f} fixed (least squares over the matmul rows)")


@dataclass
class Emulated:
    value: float        # in the published unit
    cycles: int         # the cycles the value comes from
    detail: str


@dataclass
class Row:
    measurement: Measurement
    emulated: Emulated
    why: str = ""

    @property
    def error(self) -> float:
        """Relative error of the emulated value against the published one."""
        return self.emulated.value / self.measurement.value - 1.0

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE


def family(key: str) -> str:
    return "amp_matmul" if key.startswith("amp_matmul") else key


# ---- workloads -----------------------------------------------------------------------------------
@dataclass
class Workload:
    """A measured program rebuilt in ipusim: what to compile, and its named tensors (for a run)."""
    device: ip.Graph | ip.Device
    program: ip.Program
    tensors: dict

    def compile(self) -> ip.Engine:
        return ip.Engine(self.device, self.program)


def _rows_on_tiles(graph: ip.Graph, t: ip.Tensor, tiles) -> None:
    """Map row i of a 2-D or 3-D tensor (its first dimension) to tiles[i]."""
    per = t.numel // t.shape[0]
    graph.setTileMappingIntervals(t, [(int(tile), i * per, (i + 1) * per) for i, tile in enumerate(tiles)])


def amp_matmul_workload(n: int, k: int, m: int, target: ip.Target, dtype: str = "float16") -> Workload:
    """Every tile multiplies its own [n, k] by a [k, m] with the op library's matmul; both operands
    already live on the tile, so nothing is exchanged."""
    tiles = target.num_tiles
    graph = ip.Graph(target)
    lhs = graph.addVariable(dtype, (tiles, n, k), "lhs")
    rhs = graph.addVariable(dtype, (tiles, k, m), "rhs")
    _rows_on_tiles(graph, lhs, range(tiles))
    _rows_on_tiles(graph, rhs, range(tiles))
    plan = plan_matmul(target, lhs.shape, rhs.shape, dtype)
    if plan.splits != (tiles, 1, 1, 1):
        raise RuntimeError(f"matmul planner split [{tiles},{n},{k}] @ [{tiles},{k},{m}] as {plan.splits}, not one "
                           "matrix per tile: that is no longer the published per-tile workload")
    prog = ip.Sequence()
    out = matmul(graph, lhs, rhs, prog, "amp_matmul")
    return Workload(graph, prog, {"lhs": lhs, "rhs": rhs, "out": out})


def amp_matmul(n: int, k: int, m: int, target: ip.Target, published_tiles: int,
               dtype: str = "float16") -> Emulated:
    """TFLOP/s of `published_tiles` tiles, each as fast as the slowest emulated tile; the compute
    phase only, as the measurement reads the cycle counter around the vertex."""
    cycles = amp_matmul_workload(n, k, m, target, dtype).compile().costs[0].per_ipu[0]
    if cycles.exchange:
        raise RuntimeError(f"per-tile matmul exchanged data ({cycles.exchange} cycles): operands were not local")
    tflops = 2 * n * k * m * published_tiles / target.seconds(cycles.compute) / 1e12
    return Emulated(tflops, cycles.compute, f"{cycles.compute} cycles per tile (compute phase only, as measured)")


def exchange_workload(target: ip.Target, senders: int, words: int, shift: int) -> Workload:
    """One exchange in which tiles 0..senders-1 each send `words` float32 to the tile `shift` on."""
    tiles = target.num_tiles
    graph = ip.Graph(target)
    src = graph.addVariable("float32", (senders, words), "sent")
    dst = graph.addVariable("float32", (senders, words), "received")
    _rows_on_tiles(graph, src, range(senders))
    _rows_on_tiles(graph, dst, [(t + shift) % tiles for t in range(senders)])
    return Workload(graph, ip.Copy(src, dst), {"sent": src, "received": dst})


def exchange_all_tiles(target: ip.Target, bytes_per_tile: int) -> Emulated:
    """Every tile sends `bytes_per_tile` to the tile half the chip away; TB/s of them all,
    exchange and its sync."""
    tiles, words = target.num_tiles, bytes_per_tile // 4
    cost = exchange_workload(target, tiles, words, tiles // 2).compile().costs[0]
    return Emulated(tiles * words * 4 / target.seconds(cost.total) / 1e12, cost.total,
                    f"{cost.total} cycles for {words * 4} bytes from each of {tiles} tiles (exchange + sync)")


def exchange_latency_full_over_no_load(target: ip.Target, bytes_per_message: int) -> Emulated:
    """Latency of one message from a tile to its neighbour with every tile sending one (full load)
    over the same message alone on the chip (no load)."""
    words = max(1, bytes_per_message // 4)
    alone = exchange_workload(target, 1, words, 1).compile().costs[0].total
    loaded = exchange_workload(target, target.num_tiles, words, 1).compile().costs[0].total
    return Emulated(loaded / alone, loaded, f"{loaded} cycles under full load, {alone} alone")


def ipu_link_workload(target: ip.Target, tiles_per_direction: int, bytes_per_tile: int, iterations: int) -> Workload:
    """Two IPUs send each other `bytes_per_tile` from each of `tiles_per_direction` tiles,
    `iterations` times, both directions at once (a Parallel: the links are full duplex)."""
    device = ip.Device(target, 2)
    words = bytes_per_tile // 4
    ends = {}
    for ipu in (0, 1):
        for name in ("out", "in"):
            t = device[ipu].addVariable("float32", (tiles_per_direction, words), f"{name}{ipu}")
            _rows_on_tiles(device[ipu], t, range(tiles_per_direction))
            ends[f"{name}{ipu}"] = t
    step = ip.Parallel(ip.InterIpuCopy(ends["out0"], ends["in1"]), ip.InterIpuCopy(ends["out1"], ends["in0"]))
    return Workload(device, ip.Repeat(iterations, step), ends)


def ipu_link_bidirectional(target: ip.Target, tiles_per_direction: int, bytes_per_tile: int,
                           iterations: int) -> Emulated:
    """Gbit/s of both directions together."""
    cost = ipu_link_workload(target, tiles_per_direction, bytes_per_tile, iterations).compile().costs[0]
    moved = 2 * iterations * tiles_per_direction * bytes_per_tile // 4 * 4
    return Emulated(moved * 8 / target.seconds(cost.total) / 1e9, cost.total,
                    f"{cost.total} cycles for {moved:,} bytes in {iterations} iterations")


def host_workload(target: ip.Target, tiles: int, bytes_per_transfer_per_tile: int, transfers: int) -> Workload:
    """`transfers` stream copies from the host, each bringing `bytes_per_transfer_per_tile` to
    each of `tiles` tiles."""
    words = bytes_per_transfer_per_tile // 4
    graph = ip.Graph(target)
    landing = graph.addVariable("float32", (tiles, words), "landing")
    _rows_on_tiles(graph, landing, range(tiles))
    stream = graph.addHostToDeviceFIFO("host_data", "float32", (tiles, words))
    return Workload(graph, ip.Repeat(transfers, ip.StreamCopy(stream, landing)), {"landing": landing})


def host_to_tiles(target: ip.Target, tiles: int, bytes_per_transfer_per_tile: int, tile_bytes: int) -> Emulated:
    """The host streams `tile_bytes` into `tiles` tiles, `bytes_per_transfer_per_tile` to each tile
    per stream copy; Gbit/s arriving at the tiles."""
    per_copy = tiles * (bytes_per_transfer_per_tile // 4) * 4
    transfers = tile_bytes // per_copy
    if transfers * per_copy != tile_bytes:
        raise ValueError(f"{tile_bytes} bytes are not a whole number of {per_copy}-byte transfers")
    cost = host_workload(target, tiles, bytes_per_transfer_per_tile, transfers).compile().costs[0]
    return Emulated(tile_bytes * 8 / target.seconds(cost.total) / 1e9, cost.total,
                    f"{cost.total} cycles for {transfers:,} stream copies of {per_copy} bytes")


# ---- the table -----------------------------------------------------------------------------------
def emulate(m: Measurement, *, tiles: int | None = None, scale: float = 1.0) -> Emulated:
    """Build and cost the workload of one published measurement.

    `tiles` builds the per-tile matmul on that many tiles (see the module doc); the exchange rows
    always use the whole chip, as their aggregate depends on it. `scale` < 1 shrinks the other
    workloads (bytes, iterations) for quick checks, which moves their rows a little (fixed costs
    weigh more)."""
    target = TARGETS[m.system]
    w = m.workload
    shrink = lambda v, least=1: max(least, int(v * scale))  # noqa: E731
    if family(m.key) == "amp_matmul":
        t = target if tiles is None else replace(target, num_tiles=tiles)
        return amp_matmul(w["n"], w["k"], w["m"], t, w["tiles"], w["dtype"])
    if m.key == "exchange_all_tiles":
        return exchange_all_tiles(target, shrink(w["bytes_per_tile"], 4) // 4 * 4)
    if m.key == "exchange_latency_full_over_no_load":
        return exchange_latency_full_over_no_load(target, w["bytes_per_message"])
    if m.key == "ipu_link_bidirectional":
        return ipu_link_bidirectional(target, w["tiles_per_direction"], w["bytes_per_tile"], shrink(w["iterations"]))
    if m.key == "host_to_tiles":
        per_copy = w["tiles"] * w["bytes_per_transfer_per_tile"]
        copies = max(1, int(w["tile_bytes"] // per_copy * scale))
        return host_to_tiles(target, w["tiles"], w["bytes_per_transfer_per_tile"], copies * per_copy)
    raise KeyError(f"no workload builds the published measurement {m.key!r}")


def fit_line(x, y) -> tuple[float, float]:
    """Least-squares slope and intercept of y over x."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(slope), float(intercept)


def matmul_fit(rows: list[Row]) -> dict | None:
    """Cycles per tile against N, emulated and published (from the published TFLOP/s and the
    Bow clock), as straight lines; None with fewer than two matmul rows."""
    mm = [r for r in rows if family(r.measurement.key) == "amp_matmul"]
    if len(mm) < 2:
        return None
    n = [r.measurement.workload["n"] for r in mm]
    published = []
    for r in mm:
        w, target = r.measurement.workload, TARGETS[r.measurement.system]
        flops = 2 * w["n"] * w["k"] * w["m"]
        published.append(flops * w["tiles"] / (r.measurement.value * 1e12) * target.clock_hz)
    e_slope, e_fixed = fit_line(n, [r.emulated.cycles for r in mm])
    p_slope, p_fixed = fit_line(n, published)
    return {"e_slope": e_slope, "e_fixed": e_fixed, "p_slope": p_slope, "p_fixed": p_fixed,
            "n": n, "published_cycles": published}


def calibrate(measurements=MEASUREMENTS, *, tiles: int | None = None, scale: float = 1.0,
              progress=None) -> list[Row]:
    rows = []
    for m in measurements:
        t0 = time.perf_counter()
        rows.append(Row(m, emulate(m, tiles=tiles, scale=scale)))
        if progress:
            progress(f"  {m.key}: {time.perf_counter() - t0:.1f} s")
    fit = matmul_fit(rows)
    for r in rows:
        if not r.within:
            fam = family(r.measurement.key)
            r.why = MISSES[fam] + (FITTED.format(**fit) if fam == "amp_matmul" and fit else "")
    return rows


def format_table(rows: list[Row], markdown: bool = False) -> str:
    head = ("measurement", "system", "published", "emulated", "unit", "error", "kind")
    body = [(r.measurement.what, r.measurement.system, f"{r.measurement.value:.4g}", f"{r.emulated.value:.4g}",
             r.measurement.unit, f"{r.error:+.1%}",
             r.measurement.kind + (", read off a figure" if r.measurement.read_off_figure else "")) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def format_misses(rows: list[Row]) -> str:
    seen, out = set(), []
    for r in rows:
        if r.why and r.why not in seen:
            seen.add(r.why)
            keys = [x.measurement.key for x in rows if x.why == r.why]
            out.append(f"- {', '.join(keys)}: {r.why}")
    return "\n".join(out) or "- none: every row within 10%"


def to_records(rows: list[Row]) -> list[dict]:
    """The rows as plain data (for comparing runs before and after an estimator change)."""
    return [{"key": r.measurement.key, "what": r.measurement.what, "system": r.measurement.system,
             "unit": r.measurement.unit, "published": r.measurement.value, "emulated": r.emulated.value,
             "error": r.error, "cycles": r.emulated.cycles, "detail": r.emulated.detail, "why": r.why,
             "kind": r.measurement.kind, "source": r.measurement.source} for r in rows]


def chart(rows: list[Row], path: str) -> bool:
    """Per-tile matmul throughput over N, published against emulated; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mm = [r for r in rows if family(r.measurement.key) == "amp_matmul"]
    n = [r.measurement.workload["n"] for r in mm]
    peak = ip.BOW.fp16_flops_per_cycle * ip.BOW.num_tiles * ip.BOW.clock_hz / 1e12
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n, [r.measurement.value for r in mm], "o-", label="published (tessellate-ipu, Bow)")
    ax.plot(n, [r.emulated.value for r in mm], "s--", label="emulated (ipusim matmul)")
    ax.axhline(peak, color="grey", lw=0.8, ls=":", label=f"Bow peak {peak:.0f}")
    ax.set_ylim(0, peak * 1.08)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (fp16 [N,16] @ [16,16] on every tile)")
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=None, help="build the per-tile matmul on this many tiles")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--chart", default=None, help="write a PNG chart of the matmul rows (needs matplotlib)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--quiet", action="store_true", help="no per-row build times")
    args = ap.parse_args(argv)
    rows = calibrate(tiles=args.tiles, progress=None if args.quiet else print)
    print(format_table(rows, markdown=args.markdown))
    within = sum(r.within for r in rows)
    print(f"\n{within} of {len(rows)} rows within {TOLERANCE:.0%} of their published value.")
    fit = matmul_fit(rows)
    if fit:
        print(f"per-tile matmul cycles over N: emulated {fit['e_slope']:.2f} N + {fit['e_fixed']:.0f}, "
              f"published {fit['p_slope']:.2f} N + {fit['p_fixed']:.0f}")
    print("\nMisses (what the model leaves out):")
    print(format_misses(rows))
    print("\nSources:")
    for src in dict.fromkeys(r.measurement.source for r in rows):
        print(f"- {src}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_records(rows), f, indent=1)
        print(f"\nrows: {args.json}")
    if args.chart:
        print(f"\nchart: {args.chart}" if chart(rows, args.chart) else "\nchart skipped: matplotlib is not installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
