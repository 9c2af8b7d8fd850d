"""PNG charts of a profile (matplotlib, optional): the pipeline Gantt chart, utilisation per IPU
and memory per tile per IPU. All three read only the profile.json document."""
from __future__ import annotations

import os

import numpy as np

KIND_COLOURS = {"compute": "#4c72b0", "exchange": "#dd8452", "sync": "#8c8c8c", "inter_ipu": "#c44e52",
                "host": "#55a868", "idle": "#f0f0f0"}
OP_COLOURS = {"F": "#7fb3d5", "B": "#f5b041", "W": "#82e0aa", "U": "#a9a9a9", "R": "#bb8fce", None: "#b0c4de"}
MEMORY_PARTS = (("always_live", "always-live", "#4c72b0"), ("not_always_live_peak", "not-always-live peak", "#dd8452"),
                ("vertex_state", "vertex state", "#55a868"), ("code", "code", "#8172b3"))


class ChartsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib():
    """matplotlib's Figure class, or ChartsUnavailable saying how to get it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ChartsUnavailable("Charts skipped: matplotlib is not installed (pip install 'ipusim[plot]' or "
                                "pip install matplotlib); profile.json and trace.json are complete without them.") from None
    return Figure


def _figure(width: float, height: float, rows: int = 1):
    """A matplotlib Figure with `rows` axes, drawn off screen (no pyplot, no global state)."""
    fig = require_matplotlib()(figsize=(width, height))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _time_axis(clock_hz: float, total_cycles: int) -> tuple[float, str]:
    """A scale from cycles to a readable unit."""
    seconds = total_cycles / clock_hz
    for scale, unit in ((1e6, "us"), (1e3, "ms"), (1.0, "s")):
        if seconds * scale < 5000:
            return scale / clock_hz, unit
    return 1.0 / clock_hz, "s"


MAX_CHART_STEPS = 80


def chart_steps(steps: list[dict]) -> tuple[list[dict], str]:
    """The steps the Gantt chart draws and how to name them: the first gradient-accumulation
    group of the first call (what the tutorial's figure shows), at most MAX_CHART_STEPS."""
    first = [s for s in steps if s["call"] == 1]
    groups = sorted({s["group"] for s in first if s["group"] is not None})
    if len(groups) > 1:
        first = [s for s in first if s["group"] == groups[0]]
    chosen = first[:MAX_CHART_STEPS]
    what = f"{len(chosen)} steps"
    if len(groups) > 1:
        what += f" of group 1 of {len(groups)}"
    if len(chosen) < len(first):
        what += f" (first {len(chosen)} of {len(first)})"
    return chosen, what


def pipeline_chart(doc: dict, path: str) -> str:
    """The executed steps as a Gantt chart in the style of the tutorial figure: one row per IPU,
    one box per op labelled F<k>/B<k>/W (micro-batches numbered from 1), box width = the IPU's
    busy time in that step, step boundaries dotted; the gap to the next boundary is idle."""
    from matplotlib.patches import Rectangle
    ex = doc["execution"]
    steps, shown = chart_steps(ex["steps"])
    n = doc["num_ipus"]
    origin = steps[0]["start_cycle"] if steps else 0
    span = sum(s["cycles"] for s in steps)
    scale, unit = _time_axis(doc["target"]["clock_hz"], max(span, 1))
    fig, (ax,) = _figure(min(max(8.0, 0.45 * len(steps)), 40.0), 1.2 + 0.55 * n)
    end = span * scale
    for s in steps:
        t0 = (s["start_cycle"] - origin) * scale
        ax.axvline(t0, color="#999999", lw=0.5, ls=":")
        busy = {b["ipu"]: b["total"] for b in s["busy"]}
        ops = {o["ipu"]: o for o in s["ops"]}   # an IPU's last op: its B when it recomputed first (R)
        recomputing = {o["ipu"] for o in s["ops"] if o["kind"] == "R"}
        for ipu in range(n):
            width = busy.get(ipu, 0) * scale
            if width <= 0:
                continue
            op = ops.get(ipu)
            colour = OP_COLOURS.get(op["kind"] if op else None, OP_COLOURS[None])
            hatch = None if op or not s["ops"] else "//"
            ax.broken_barh([(t0, width)], (ipu - 0.4, 0.8), facecolors=colour, edgecolors="#333333",
                           linewidth=0.4, hatch=hatch)
            text = (op["label"].split(" ")[0] if op["kind"] != "U" else "U") if op else ("" if s["ops"] else s["label"])
            if op and ipu in recomputing:
                text = "R" + text
            if text and width > end / 90 * max(1, len(text) / 2.5):
                ax.text(t0 + width / 2, ipu, text, ha="center", va="center", fontsize=7)
    ax.axvline(end, color="#999999", lw=0.5, ls=":")
    if len(steps) <= 60:
        for s in steps:
            ax.text((s["start_cycle"] - origin + s["cycles"] / 2) * scale, n - 0.35, str(s["index"] + 1), ha="center",
                    va="bottom", fontsize=6, color="#555555")
    ax.set_yticks(range(n), [f"IPU{i}" for i in range(n)])
    ax.set_ylim(n - 0.3, -0.7)
    ax.set_xlim(0, end)
    ax.set_xlabel(f"simulated time ({unit}) at {doc['target']['clock_hz'] / 1e9:.2f} GHz; steps numbered along the "
                  "bottom; box = busy time of the IPU in the step, blank = idle")
    sched = ex["schedule"]
    title = f"{doc['name']}: {shown}, {span:,} cycles"
    if sched:
        title += f" ({sched['strategy']}, {sched['micro_batches_per_group']} micro-batches per group)"
    ax.set_title(title, fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, fc=OP_COLOURS[k]) for k in ("F", "B", "U")]
    if sched:
        ax.legend(handles, ["forward", "backward", "weight update"], loc="upper right", fontsize=7,
                  bbox_to_anchor=(1.0, 1.25), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def schedule_chart(timing, schedule, path: str, title: str, clock_hz: float) -> str:
    """A priced schedule (ipusim.schedules.pricing.Timing) as a Gantt chart: one row per IPU, one
    box per op at its start and length, coloured by kind (F, B, W, weight update), labelled with
    its micro-batch (and stage when an IPU holds several); the gaps are idle time."""
    from matplotlib.patches import Rectangle
    n = schedule.num_ipus
    scale, unit = _time_axis(clock_hz, max(int(timing.cycles), 1))
    end = timing.cycles * scale
    fig, (ax,) = _figure(min(max(8.0, 0.12 * len(timing.intervals) / max(n, 1)), 40.0), 1.2 + 0.55 * n)
    shared = len(set(schedule.stage_ipus)) < len(schedule.stage_ipus)
    for iv in timing.intervals:
        width = (iv.end - iv.start) * scale
        if width <= 0:
            continue
        op = iv.op
        ax.broken_barh([(iv.start * scale, width)], (op.ipu - 0.4, 0.8), facecolors=OP_COLOURS.get(op.kind),
                       edgecolors="#333333", linewidth=0.3)
        text = "U" if op.kind == "U" else (f"{op.label}s{op.stage}" if shared else op.label)
        if width > end / 110 * max(1, len(text) / 2.5):
            ax.text(iv.start * scale + width / 2, op.ipu, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(n), [f"IPU{i}" for i in range(n)])
    ax.set_ylim(n - 0.3, -0.7)
    ax.set_xlim(0, end)
    ax.set_xlabel(f"{timing.mode} time ({unit}) at {clock_hz / 1e9:.2f} GHz; blank = idle")
    ax.set_title(f"{title}: {timing.cycles:,.0f} cycles per call, bubble {timing.bubble_fraction():.1%}", fontsize=9)
    kinds = [k for k in ("F", "R", "B", "W", "U") if any(iv.op.kind == k for iv in timing.intervals)]
    names = {"F": "forward", "B": "backward (input gradient)" if schedule.split_backward else "backward",
             "W": "weight gradient", "U": "weight update", "R": "recompute"}
    ax.legend([Rectangle((0, 0), 1, 1, fc=OP_COLOURS[k]) for k in kinds], [names[k] for k in kinds],
              loc="upper right", fontsize=7, bbox_to_anchor=(1.0, 1.25), ncol=len(kinds), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def utilisation_chart(doc: dict, path: str) -> str:
    """Per IPU, the run time split into compute, exchange, sync, inter-IPU, host I/O and idle."""
    ex = doc["execution"]
    total = max(ex["total_cycles"], 1)
    ipus = ex["ipus"]
    fig, (ax,) = _figure(8, 1.2 + 0.5 * len(ipus))
    left = np.zeros(len(ipus))
    for kind in ("compute", "exchange", "sync", "inter_ipu", "host", "idle"):
        values = np.array([(u["idle_cycles"] if kind == "idle" else u["busy"][kind]) / total for u in ipus])
        ax.barh(range(len(ipus)), values, left=left, color=KIND_COLOURS[kind], edgecolor="#333333", linewidth=0.3,
                label={"inter_ipu": "inter-IPU", "host": "host I/O"}.get(kind, kind))
        left += values
    for i, u in enumerate(ipus):
        ax.text(1.01, i, f"{100 * u['utilisation']:.1f}% busy", va="center", fontsize=8)
    ax.set_yticks(range(len(ipus)), [f"IPU{u['ipu']}" for u in ipus])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.18)
    ax.set_xlabel("share of the run time")
    ax.set_title(f"{doc['name']}: utilisation per IPU over {ex['calls']} call(s)", fontsize=9)
    ax.legend(loc="lower center", bbox_to_anchor=(0.45, 1.08), ncol=6, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def memory_chart(doc: dict, path: str) -> str:
    """Per IPU, the bytes of every tile stacked by kind (always-live, not-always-live peak,
    vertex state, code), with the tile capacity when it is within sight."""
    ipus = doc["memory"]["ipus"]
    fig, axes = _figure(9, 0.8 + 1.6 * len(ipus), rows=len(ipus))
    cap = doc["target"]["bytes_per_tile"]
    for ax, m in zip(axes, ipus):
        tiles = np.arange(len(m["per_tile"]["peak"]))
        ax.stackplot(tiles, *[np.asarray(m["per_tile"][k]) / 1024 for k, _, _ in MEMORY_PARTS],
                     colors=[c for _, _, c in MEMORY_PARTS], labels=[label for _, label, _ in MEMORY_PARTS],
                     linewidth=0)
        top = max(m["max_tile_bytes"], 1)
        if top * 3 >= cap:
            ax.axhline(cap / 1024, color="#c44e52", lw=1, ls="--", label="tile capacity")
            ax.set_ylim(0, max(cap, top) * 1.08 / 1024)
        else:
            ax.set_ylim(0, top * 1.15 / 1024)
        ax.set_ylabel(f"IPU{m['ipu']}\nKiB", fontsize=8)
        ax.text(0.995, 0.92, f"{m['total_bytes'] / 2**20:,.2f} MiB of {m['capacity_bytes'] / 2**20:,.1f} MiB; busiest "
                f"tile {m['max_tile']}: {m['max_tile_bytes'] / 1024:,.1f} of {cap / 1024:,.0f} KiB",
                transform=ax.transAxes, ha="right", va="top", fontsize=7)
    axes[-1].set_xlabel("tile")
    axes[0].set_title(f"{doc['name']}: memory per tile ({doc['target']['name']})", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    return path


# name -> (chart, whether the document has its data)
CHARTS = {"pipeline.png": (pipeline_chart, lambda doc: bool(doc["execution"]["steps"])),
          "utilisation.png": (utilisation_chart, lambda doc: bool(doc["execution"]["ipus"])),
          "memory.png": (memory_chart, lambda doc: bool(doc["memory"]["ipus"]))}


def write_charts(doc: dict, directory: str) -> list[str]:
    """Write every chart of `doc` into `directory`; raises ChartsUnavailable without matplotlib."""
    require_matplotlib()
    return [chart(doc, os.path.join(directory, name)) for name, (chart, has_data) in CHARTS.items() if has_data(doc)]
