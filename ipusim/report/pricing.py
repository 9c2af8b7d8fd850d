"""Every schedule kind priced on a profiled model (`python -m ipusim.report DIR --schedules`): time
per call, bubble fraction, peak stash per IPU and whether it fits, and a Gantt chart per kind.

The stages' costs come from the profile: the forward and backward cycles per micro-batch of
every stage as executed (its compute and its copies), the weight update per IPU, and the bytes
a stage's backward needs from the forwards (the block table's flows into it), which its IPU
stashes per micro-batch in flight. A profile of a run under ZB-H1 or ZB-H2 has each stage's
weight gradient W measured apart, and the split kinds take it from there; other profiles do not
separate a backward's input gradient from its weight gradient (a linear layer's two backward
matmuls carry the same name), so the split kinds take W as a stated share of the profiled
backward (one half unless told).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import schedules
from ..schedules.pricing import Costs, Price, StageCosts, peak_stash_bytes, price

DEFAULT_WEIGHT_GRADIENT_SHARE = 0.5
INTERLEAVED_CHUNKS = 2


@dataclass(frozen=True)
class Row:
    """One priced schedule kind; `price` is None when the kind cannot run this model (`why`)."""

    kind: str
    schedule: schedules.Schedule | None
    price: Price | None
    fits: tuple[bool, ...] = ()
    totals: tuple[int, ...] = ()      # bytes per IPU with this schedule's stash
    why: str = ""


@dataclass(frozen=True)
class Comparison:
    name: str
    rows: tuple[Row, ...]
    clock_hz: float
    capacity: tuple[int, ...]
    header: tuple[str, ...]
    measured_cycles: int | None


def _stash_bytes(doc: dict) -> list[int]:
    """Per stage, the bytes one micro-batch in flight keeps on the stage's IPU: what its backward
    reads from forwards (the block table's fwd -> bwd flows into the stage's blocks; the table
    describes the model without recomputation). A profile that recomputes stashes less than
    that: there, the stashed activations each IPU holds, divided by the micro-batches the
    profiled schedule keeps in flight on it (the stages of one IPU in equal shares)."""
    stages = doc["execution"]["stages"]
    sched = doc["execution"]["schedule"]
    if sched and sched.get("recomputed_stages"):
        n = len(stages)
        profiled = _profiled_schedule(sched, n, sched["micro_batches_per_group"], sched["num_groups"])
        stashed = {m["ipu"]: m["by_category"].get("stashed_activations", 0) for m in doc["memory"]["ipus"]}
        return [int(stashed.get(st["ipu"], 0) // max(1, profiled.peak_in_flight(st["ipu"]))) for st in stages]
    blocks = doc.get("blocks")
    if not blocks:
        return [0] * len(stages)
    stage_of = {name: st["stage"] for st in stages for name in st["blocks"]}
    index = {b: stage_of.get(name) for b, name in enumerate(blocks["names"])}
    out = [0] * len(stages)
    for f in blocks["flows"]:
        s = index.get(f["dst_block"])
        if f["src_pass"] == "fwd" and f["dst_pass"] == "bwd" and s is not None:
            out[s] += int(f["bytes"])
    return out


def measured_weight_gradients(doc: dict) -> bool:
    """Whether the profiled run measured every stage's weight gradient W apart (it ran a
    schedule that splits the backward)."""
    stages = doc["execution"]["stages"]
    return bool(stages) and all(st.get("weight_gradient") is not None for st in stages)


def stage_costs(doc: dict, weight_gradient_share: float | None = None) -> Costs:
    """The profiled stages' costs: F and B cycles per micro-batch as executed (copies included,
    so `Costs.copy` is 0), the backward split into input gradient B and weight gradient W (W
    as measured when the profile has it and no share is given, else `weight_gradient_share` of
    the backward, one half by default), the weight update per IPU and the stash bytes per
    micro-batch."""
    ex = doc["execution"]
    if not ex["stages"] or any(st["forward"] is None for st in ex["stages"]):
        raise ValueError(f"profile {doc.get('name')!r} has no per-stage forward cycles: pricing schedules needs a "
                         "poptorch_lite model profile of at least one call")
    if any(st["backward"] is None for st in ex["stages"]):
        raise ValueError(f"profile {doc.get('name')!r} is of inference: the schedule kinds differ in how they order "
                         "backward passes, so compare them on a training profile")
    measured = weight_gradient_share is None and measured_weight_gradients(doc)
    share = DEFAULT_WEIGHT_GRADIENT_SHARE if weight_gradient_share is None else weight_gradient_share
    if not 0 <= share <= 1:
        raise ValueError(f"the weight-gradient share of the backward must be in [0, 1], got {share}")
    stash = _stash_bytes(doc)
    per_stage = []
    for st, nbytes in zip(ex["stages"], stash):
        backward = st["backward"]["cycles_per_micro_batch"]
        w = st["weight_gradient"]["cycles_per_micro_batch"] if measured else backward * share
        recompute = st.get("recompute")
        per_stage.append(StageCosts(st["forward"]["cycles_per_micro_batch"], backward - w, w, nbytes,
                                    recompute["cycles_per_micro_batch"] if recompute else None))
    updates = {u["ipu"]: u["cycles"] for u in ex["updates"]}
    return Costs(tuple(per_stage), 0.0, tuple(updates.get(i, 0.0) for i in range(doc["num_ipus"])))


def _chunked(costs: Costs, v: int) -> Costs:
    """Each stage cut into `v` chunks of 1/v of its cycles and stash (stage s, chunk c becomes
    stage c*N + s on IPU s)."""
    n = len(costs.stages)
    return Costs(tuple(StageCosts(st.forward / v, st.backward / v, st.weight_gradient / v, st.activation_bytes // v,
                                  None if st.recompute is None else st.recompute / v)
                       for _ in range(v) for st in costs.stages), costs.copy, costs.update)


def compare(doc: dict, weight_gradient_share: float | None = None) -> Comparison:
    """Price the profiled schedule and every training kind on the profiled model (W of the split
    kinds as in `stage_costs`)."""
    ex = doc["execution"]
    sched = ex["schedule"]
    if not sched or not sched["training"]:
        raise ValueError(f"profile {doc.get('name')!r} has no training schedule: compare schedules on a training "
                         "profile")
    costs = stage_costs(doc, weight_gradient_share)
    n = len(costs.stages)
    if list(sched["stage_ipus"]) != list(range(n)):
        raise ValueError(f"profile {doc.get('name')!r} places its {n} stages on IPUs {sched['stage_ipus']}: "
                         "schedules are compared with stage s on IPU s")
    g, d = sched["micro_batches_per_group"], sched["num_groups"]
    memory = doc["memory"]["ipus"]
    capacity = tuple(m["capacity_bytes"] for m in memory[:n])
    stash = [s.activation_bytes for s in costs.stages]
    recomputed = list(sched.get("recomputed_stages") or ())
    profiled = _profiled_schedule(sched, n, g, d).with_recomputation(recomputed)
    base = [m["total_bytes"] - b for m, b in zip(memory, peak_stash_bytes(profiled, stash))]
    whole = Costs(tuple(StageCosts(s.forward, s.backward + s.weight_gradient, 0.0, s.activation_bytes, s.recompute)
                        for s in costs.stages), costs.copy, costs.update)

    def row(kind: str, make, kind_costs: Costs) -> Row:
        try:
            s = make()
            chunks = s.num_stages // n   # interleaved: chunk c of stage k is stage c*n + k
            s = s.with_recomputation([c * n + k for k in recomputed for c in range(chunks)])
        except ValueError as error:
            return Row(kind, None, None, why=str(error))
        p = price(s, kind_costs)
        totals = tuple(int(b + p.peak_stash_bytes[i]) for i, b in enumerate(base))
        return Row(kind, s, p, tuple(t <= c for t, c in zip(totals, capacity)), totals)

    ran = f"{sched['strategy']} (profiled)" if sched["strategy"] in schedules.TRAINING_KINDS \
        else f"PopTorch ({sched['strategy']})"
    rows = [row(ran, lambda: _profiled_schedule(sched, n, g, d), costs if profiled.split_backward else whole),
            row("GPipe", lambda: schedules.gpipe_schedule(n, gradient_accumulation=g, device_iterations=d), whole),
            row("1F1B", lambda: schedules.one_f_one_b_schedule(n, gradient_accumulation=g, device_iterations=d), whole),
            row(f"Interleaved1F1B (V={INTERLEAVED_CHUNKS})",
                lambda: schedules.interleaved_1f1b_schedule(n, INTERLEAVED_CHUNKS, gradient_accumulation=g,
                                                            device_iterations=d), _chunked(whole, INTERLEAVED_CHUNKS)),
            row("ZB-H1", lambda: schedules.zb_h1_schedule(n, gradient_accumulation=g, device_iterations=d), costs),
            row("ZB-H2", lambda: schedules.zb_h2_schedule(n, gradient_accumulation=g, device_iterations=d), costs)]
    header = (
        f"{n} stages on {n} IPUs, {g} micro-batches per weight update, {d} update(s) per call; per-stage F and B "
        "cycles per micro-batch as profiled (copies included), the weight update per IPU as profiled.",
        _split_note(doc, weight_gradient_share),
        f"Interleaved1F1B cuts every stage into {INTERLEAVED_CHUNKS} chunks of equal cycles and stash (an assumption: "
        "the profile has one block table row per block, not per layer), chunk c of stage s on IPU s.",
        "lock-step: a step lasts as long as its slowest IPU (how PopTorch's runtime and this emulator run a "
        "schedule); event-driven: each IPU runs its ops as soon as their inputs are ready (how GPipe, 1F1B and "
        "ZB are meant to run). Bubble fraction and the charts use the event-driven timing.",
        "memory: each IPU's profiled total with the profiled stash replaced by the schedule's peak stash "
        "(bytes per micro-batch = the stage's fwd -> bwd flows); tile-level fit is not re-checked."
        + (f" Stages {recomputed} recompute their forward before each backward (R, as profiled), so every kind "
           "runs R there too and stashes per micro-batch what the profiled run stashed (its stashed activations "
           "per IPU over the micro-batches it kept in flight)." if recomputed else ""))
    measured = ex["cycles_per_call"][0] if ex.get("cycles_per_call") else None
    return Comparison(doc.get("name", ""), tuple(rows), doc["target"]["clock_hz"], capacity, header, measured)


def _split_note(doc: dict, weight_gradient_share: float | None) -> str:
    """How the split kinds' W was found, for the table's header."""
    if weight_gradient_share is None and measured_weight_gradients(doc):
        return "ZB-H1/ZB-H2 split each backward into B and W as measured: the profiled run split its backwards."
    share = DEFAULT_WEIGHT_GRADIENT_SHARE if weight_gradient_share is None else weight_gradient_share
    why = "given instead of the measured W" if measured_weight_gradients(doc) else \
        "the profile does not tell the weight-gradient ops apart"
    return f"ZB-H1/ZB-H2 split each backward into B and W with W = {share:g} x the profiled backward (an assumption: {why})."


def _profiled_schedule(sched: dict, n: int, g: int, d: int) -> schedules.Schedule:
    strategy = sched["strategy"]
    base, _, kind = strategy.partition("-")
    if base == "pipelined":
        return schedules.pipelined_schedule(n, training=True, gradient_accumulation=g, device_iterations=d,
                                            kind=kind or "grouped")
    if base == "sharded":
        return schedules.sharded_schedule(n, training=True, gradient_accumulation=g, device_iterations=d)
    makers = {"GPipe": schedules.gpipe_schedule, "1F1B": schedules.one_f_one_b_schedule,
              "ZB-H1": schedules.zb_h1_schedule, "ZB-H2": schedules.zb_h2_schedule}
    if strategy == "Interleaved1F1B":
        ipus = sched["num_ipus"]
        return schedules.interleaved_1f1b_schedule(ipus, n // ipus, gradient_accumulation=g, device_iterations=d)
    if strategy in makers:
        return makers[strategy](n, gradient_accumulation=g, device_iterations=d)
    raise ValueError(f"cannot rebuild the profiled schedule {strategy!r} to compare against")


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def text(c: Comparison) -> str:
    """The table, its assumptions first."""
    us = 1e6 / c.clock_hz
    lines = [f"Schedules for {c.name!r} (priced on the profiled stages):"] + [f"  {h}" for h in c.header]
    if c.measured_cycles:
        lines.append(f"  measured: {c.measured_cycles:,} cycles ({c.measured_cycles * us:,.1f} us) for the first "
                     "profiled call")
    head = ("schedule", "lock-step us/call", "event-driven us/call", "bubble", "peak stash per IPU (MiB)",
            "fits (of MiB per IPU)")
    body = []
    for r in c.rows:
        if r.price is None:
            body.append((r.kind, "-", "-", "-", "-", f"not priced: {r.why}"))
            continue
        p = r.price
        fits = "yes" if all(r.fits) else "no: IPU " + ", ".join(str(i) for i, f in enumerate(r.fits) if not f)
        body.append((r.kind, f"{p.lock_step.cycles * us:,.1f}", f"{p.event_driven.cycles * us:,.1f}",
                     f"{p.event_driven.bubble_fraction():.1%}", " / ".join(_mib(b) for b in p.peak_stash_bytes),
                     f"{fits} ({_mib(max(c.capacity))})"))
    widths = [max(len(str(x[k])) for x in [head] + body) for k in range(len(head))]
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  " + "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)


def chart_name(kind: str) -> str:
    """File name of a kind's Gantt chart: "schedule-zb-h1.png"."""
    slug = "".join(ch if ch.isalnum() else "-" for ch in kind.lower())
    return "schedule-" + "-".join(p for p in slug.split("-") if p) + ".png"


def write_charts(c: Comparison, directory: str) -> list[str]:
    """One Gantt chart per priced kind (event-driven timing) in `directory`; raises
    charts.ChartsUnavailable without matplotlib."""
    from .charts import require_matplotlib, schedule_chart
    require_matplotlib()
    return [schedule_chart(r.price.event_driven, r.schedule, os.path.join(directory, chart_name(r.kind)),
                           f"{c.name}: {r.kind}", c.clock_hz)
            for r in c.rows if r.price is not None]
