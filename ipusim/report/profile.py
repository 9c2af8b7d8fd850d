"""Profiles of executed programs: the data behind profile.json, trace.json, the charts, the page and
the end-of-run summary (see docs/profile-schema.md for the document).

A profile joins what compiling knows (memory per tile, the static cycles of every program, the
schedule) with what running did (the steps executed, each a list of program runs with their
cycles per IPU). Both front ends produce the same records:

- poptorch_lite's executor runs a schedule step by step; its `RunRecord.steps` have the shape of
  `ExecutedStep` (ops, events of `op, part, program, per_ipu`, busy cycles, cycles) and a step
  lasts as long as its busiest IPU;
- a plain `Engine(..., profile_dir=DIR)` records each `run()` as one step whose single event also
  lists the program nodes it executed, in order; the IPUs advance in lockstep through a program.

Cycles are exact for the model: they come from the static estimates of ipusim.device.cost, so a profile
costs bookkeeping only. Times are cycles at the target clock.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np

from ..device.cost import Cost, Cycles
from ..device.memory import KINDS, MemoryReport, supersteps
from ..device.model_error import known_errors
from ..device.program import If, OpProgram, Parallel, Program, Repeat, Sequence
from ..device.target import Target

SCHEMA_NAME = "ipusim.profile"
SCHEMA_VERSION = 3
READABLE_VERSIONS = (2, 3)      # version 2 lacks the kinds of memory, the operations and the superstep names
# Kinds of busy cycles, in the order a superstep spends them (its sync comes last).
SEGMENT_KINDS = ("compute", "exchange", "inter_ipu", "host", "sync")
LANES = ("ops", "programs", "compute", "exchange", "sync", "inter_ipu", "host")
LANE_TITLES = {"ops": "ops (stage, micro-batch)", "programs": "programs", "compute": "compute",
               "exchange": "exchange", "sync": "sync", "inter_ipu": "inter-IPU", "host": "host I/O"}
# A Repeat whose body would give more trace segments than this is drawn as one segment per kind.
REPEAT_EXPAND_LIMIT = 256
# trace.json details the IPUs' lanes of the steps that begin before it holds this many events (some
# 100 MB); later steps keep their schedule event and live bytes (a full-size model's call has
# thousands of steps of thousands of events each).
TRACE_EVENT_LIMIT = 600_000


# =========================================================================================
# Records
# =========================================================================================
@dataclass(frozen=True)
class Segment:
    """A stretch of one IPU's time inside a program run: `cycles` of one kind."""
    name: str
    kind: str
    cycles: int


@dataclass
class ProgramEvent:
    """One program run: the schedule op it serves (None for a plain engine run), its part
    ("receive", "compute", "outputs", "send", "update", "run"), the engine program index and the
    busy cycles on every IPU it touched. `nodes` are the executed program nodes in order (a
    tuple of node lists for a Parallel), kept by the Engine profiler."""
    op: object
    part: str
    program: int
    per_ipu: dict[int, Cycles]
    nodes: list | None = None


@dataclass
class ExecutedStep:
    """One executed step: its ops (at most one per IPU), its program runs and how long it took."""
    index: int
    ops: list
    events: list
    busy: dict[int, Cycles]
    cycles: int


def executed_step(index: int, ops: list, events: list, cycles: int | None = None) -> ExecutedStep:
    """Sum the busy cycles of `events` per IPU; a step lasts as long as its busiest IPU unless
    `cycles` says otherwise (a lockstep engine run lasts its program's total)."""
    busy: dict[int, Cycles] = {}
    for e in events:
        for ipu, c in e.per_ipu.items():
            busy[ipu] = busy.get(ipu, Cycles()) + c
    if cycles is None:
        cycles = max((c.total for c in busy.values()), default=0)
    return ExecutedStep(index, list(ops), list(events), busy, cycles)


def simulate(schedule, events_of: Callable[[object], list[ProgramEvent]],
             sends_of: Callable[[object], list[ProgramEvent]] | None = None) -> list[ExecutedStep]:
    """The steps of `schedule` executed with static costs: each op's events from `events_of`,
    then (like the poptorch_lite runtime) the sends of every op of the step from `sends_of`.
    This is how a profile is estimated without running the numbers."""
    steps = []
    for t, step in enumerate(schedule.steps):
        events = [e for op in step.ops for e in events_of(op)]
        if sends_of is not None:
            events += [e for op in step.ops for e in sends_of(op)]
        steps.append(executed_step(t, list(step.ops), events))
    return steps


# =========================================================================================
# Static description of programs
# =========================================================================================
@dataclass
class ProgramInfo:
    """An engine program as a profile sees it: its static cost, its time line per IPU as
    segments, the bytes it moves over each IPU pair, and its supersteps in the liveness order."""
    index: int
    name: str
    cost: Cost
    segments: dict[int, list[Segment]]
    links: dict[tuple[int, int], int]
    first_superstep: int
    num_supersteps: int
    superstep_names: list[str] = field(default_factory=list)


def leaf_name(p: Program) -> str:
    """A readable name for a superstep node."""
    cs = getattr(p, "compute_set", None)
    if cs is not None:
        return cs.name
    src, dst = getattr(p, "src", None), getattr(p, "dst", None)
    kind = type(p).__name__
    if src is not None and dst is not None:
        return f"{kind} {getattr(src, 'name', '?')} -> {getattr(dst, 'name', '?')}"
    return kind


def kind_segments(name: str, c: Cycles) -> list[Segment]:
    """The busy cycles of one node on one IPU as segments, in the order a superstep spends them."""
    return [Segment(name, k, getattr(c, k)) for k in SEGMENT_KINDS if getattr(c, k)]


def _heavier_branch(p: If, cost_of) -> Program:
    """The branch the static estimate charges (ipusim.device.cost takes the worse one)."""
    return p.then if cost_of(p.then).total >= cost_of(p.else_).total else p.else_


def _flatten(p: Program, cost_of, segs: dict, links: dict, times: int = 1) -> None:
    if isinstance(p, (Sequence, OpProgram, Parallel)):
        for c in p.children():
            _flatten(c, cost_of, segs, links, times)
    elif isinstance(p, If):
        _flatten(_heavier_branch(p, cost_of), cost_of, segs, links, times)
    elif isinstance(p, Repeat):
        body: dict[int, list[Segment]] = {}
        _flatten(p.body, cost_of, body, links, times * p.count)
        for ipu, s in body.items():
            if p.count * len(s) <= REPEAT_EXPAND_LIMIT:
                segs.setdefault(ipu, []).extend(s * p.count)
            else:
                name = f"{getattr(p.body, 'name', '') or 'repeat'} x{p.count}"
                sums = {k: p.count * sum(x.cycles for x in s if x.kind == k) for k in SEGMENT_KINDS}
                segs.setdefault(ipu, []).extend(Segment(name, k, v) for k, v in sums.items() if v)
    else:
        cost = cost_of(p)
        name = leaf_name(p)
        for ipu, c in cost.per_ipu.items():
            segs.setdefault(ipu, []).extend(kind_segments(name, c))
        if cost.inter_ipu_bytes and hasattr(p, "src") and hasattr(p, "dst"):
            pair = (p.src.ipu, p.dst.ipu)
            links[pair] = links.get(pair, 0) + cost.inter_ipu_bytes * times


def describe_programs(programs: list[Program], cost_of: Callable[[Program], Cost]) -> list[ProgramInfo]:
    """ProgramInfo for every engine program (`cost_of` is `Engine.cost`)."""
    out, first = [], 0
    for i, p in enumerate(programs):
        segs: dict[int, list[Segment]] = {}
        links: dict[tuple[int, int], int] = {}
        _flatten(p, cost_of, segs, links)
        names = [leaf_name(s) for s in supersteps(p)]
        out.append(ProgramInfo(i, getattr(p, "name", "") or f"program {i}", cost_of(p), segs, links, first,
                               len(names), names))
        first += len(names)
    return out


@dataclass
class StageInfo:
    """A pipeline stage: the IPU it runs on and the blocks placed on it."""
    stage: int
    ipu: int
    blocks: list[str]


@dataclass
class StaticProfile:
    """What compiling knows. `blocks` is the advisor's block table as a dict (or None) and
    `settings` the batching of one call (micro_batch_size, gradient_accumulation, ...)."""
    name: str
    source: str                                  # "poptorch_lite" or "ipusim"
    target: Target
    num_ipus: int
    memory: list[MemoryReport]
    programs: list[ProgramInfo]
    schedule: object = None                      # ipusim.schedules.Schedule or None
    stages: list[StageInfo] = field(default_factory=list)
    blocks: dict | None = None
    settings: dict = field(default_factory=dict)
    estimated: bool = False
    notes: list[str] = field(default_factory=list)
    operations: list[dict] = field(default_factory=list)   # the front end's ops (the `operations` field)


def static_profile(name: str, engine, *, source: str = "ipusim", **kw) -> StaticProfile:
    """The StaticProfile of a compiled Engine (loaded or not)."""
    return StaticProfile(name, source, engine.target, engine.device.num_ipus, engine.memory,
                         describe_programs(engine.programs, engine.cost), **kw)


# =========================================================================================
# Recording calls
# =========================================================================================
class Recording:
    """Runs accumulated over calls: totals of every call (cheap), and the steps of the first
    `trace_calls` calls, kept for the trace and the per-step tables."""

    def __init__(self, num_ipus: int, trace_calls: int = 1):
        if trace_calls < 1:
            raise ValueError(f"trace_calls must be at least 1, got {trace_calls}")
        self.num_ipus = num_ipus
        self.trace_calls = trace_calls
        self.traced: list[list[ExecutedStep]] = []
        self.call_cycles: list[int] = []
        self.busy = [Cycles() for _ in range(num_ipus)]
        self.bubble = [0] * num_ipus        # idle cycles in steps without an op of the IPU
        self.imbalance = [0] * num_ipus     # idle cycles in steps with one (waiting for the slowest IPU)

    @property
    def calls(self) -> int:
        return len(self.call_cycles)

    @property
    def total_cycles(self) -> int:
        return sum(self.call_cycles)

    def add(self, steps: list) -> None:
        """Account one call (a list of ExecutedStep-shaped records)."""
        cycles = 0
        n = self.num_ipus
        for s in steps:
            cycles += s.cycles
            own = {op.ipu for op in s.ops} if s.ops else {i for i, c in s.busy.items() if c.total}
            for i in range(n):
                c = s.busy.get(i)
                spent = 0
                if c is not None:
                    self.busy[i] = self.busy[i] + c
                    spent = c.total
                if i in own:
                    self.imbalance[i] += s.cycles - spent
                else:
                    self.bubble[i] += s.cycles - spent
        self.call_cycles.append(cycles)
        if len(self.traced) < self.trace_calls:
            self.traced.append(list(steps))


# =========================================================================================
# The profile document
# =========================================================================================
def _cycles(c: Cycles) -> dict:
    return c.to_dict()


def op_label(op) -> str:
    """"F3 s0" (forward of micro-batch 3 on stage 0), "U ipu1" (the weight update on IPU 1), or "" for no op."""
    if op is None:
        return ""
    label = getattr(op, "label", None) or str(op)
    if getattr(op, "stage", None) is not None:
        return f"{label} s{op.stage}"
    if getattr(op, "kind", None) == "U":
        return f"U ipu{op.ipu}"
    return label


def _op_dict(op) -> dict:
    return {"label": op_label(op), "kind": getattr(op, "kind", None), "stage": getattr(op, "stage", None),
            "micro_batch": getattr(op, "global_micro_batch", None), "group": getattr(op, "group", None),
            "ipu": op.ipu}


def step_label(static: StaticProfile, step) -> str:
    if step.ops:
        return " ".join(op_label(op) for op in step.ops)
    return " ".join(static.programs[e.program].name for e in step.events)


WORST_TILES = 10            # tiles listed per IPU with what they hold at their peak
TENSORS_PER_TILE = 5
TENSORS_AT_PEAK = 20         # tensors listed at the liveness peak of an IPU


def _tensor_rows(rows: list[tuple[str, str, int]], n: int) -> list[dict]:
    return [{"name": name, "kind": kind, "bytes": b} for name, kind, b in rows[:n]]


def _superstep_name(static: StaticProfile, superstep: int) -> tuple[str, str]:
    """(superstep name, program name) of a superstep in liveness order."""
    for p in static.programs:
        if p.first_superstep <= superstep < p.first_superstep + p.num_supersteps:
            return p.superstep_names[superstep - p.first_superstep], p.name
    return "", ""


def _worst_tiles(static: StaticProfile, r: MemoryReport) -> list[dict]:
    """The busiest tiles of an IPU and the largest tensors on each at its peak."""
    order = np.argsort(-r.peak, kind="stable")[:WORST_TILES]
    out = []
    for t in order:
        t = int(t)
        if not r.peak[t]:
            break
        at = int(r.peak_superstep[t])
        name, program = _superstep_name(static, at) if at >= 0 else ("", "")
        out.append({"tile": t, "bytes": int(r.peak[t]), "fits": bool(r.peak[t] <= r.target.bytes_per_tile),
                    "superstep": at, "superstep_name": name, "program": program,
                    "tensors": _tensor_rows(r.live_tensors(at, t), TENSORS_PER_TILE)})
    return out


def _liveness_peak(static: StaticProfile, r: MemoryReport) -> dict | None:
    """The superstep where most not-always-live bytes of the IPU are live, and those tensors."""
    if r.liveness is None or not r.liveness.size or not r.liveness.max():
        return None
    at = int(np.argmax(r.liveness))
    name, program = _superstep_name(static, at)
    rows = [row for row in r.live_tensors(at) if row[0] in r.live_ranges]
    by_kind: dict[str, int] = {}
    for _, kind, b in rows:
        by_kind[kind] = by_kind.get(kind, 0) + b
    return {"superstep": at, "superstep_name": name, "program": program, "bytes": int(r.liveness[at]),
            "by_kind": by_kind, "tensors": _tensor_rows(rows, TENSORS_AT_PEAK)}


def _memory_section(static: StaticProfile) -> dict:
    ipus = []
    for r in static.memory:
        totals = {name: int(b.sum()) for name, b in r.tensors.items()}
        largest = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
        ipus.append({
            "ipu": r.ipu, "capacity_bytes": r.target.bytes_per_ipu, "tile_capacity_bytes": r.target.bytes_per_tile,
            "total_bytes": r.total, "max_tile_bytes": r.max_tile, "max_tile": int(np.argmax(r.peak)) if r.peak.size else 0,
            "fits": r.fits, "always_live_bytes": int(r.always_live.sum()),
            "not_always_live_peak_bytes": int(r.not_always_live_peak.sum()),
            "vertex_state_bytes": int(r.vertex_state.sum()), "code_bytes": int(r.code.sum()),
            "by_category": {k: int(v.sum()) for k, v in r.by_category.items()},
            "live_peak_by_category": dict(r.live_peak_by_category),
            "per_tile": {"always_live": r.always_live.tolist(), "not_always_live_peak": r.not_always_live_peak.tolist(),
                         "vertex_state": r.vertex_state.tolist(), "code": r.code.tolist(), "peak": r.peak.tolist()},
            "by_kind": {k: int(r.peak_by_kind[k].sum()) for k in KINDS},
            "per_tile_by_kind": {k: r.peak_by_kind[k].tolist() for k in KINDS},
            "per_tile_peak_superstep": r.peak_superstep.tolist(),
            "worst_tiles": _worst_tiles(static, r),
            "largest_tensors": [{"name": n, "bytes": b} for n, b in largest],
            "liveness": (r.liveness if r.liveness is not None else np.zeros(0, np.int64)).tolist(),
            "liveness_peak": _liveness_peak(static, r),
        })
    return {"ipus": ipus,
            "supersteps": [{"program": p.index, "first": p.first_superstep, "count": p.num_supersteps}
                           for p in static.programs],
            "superstep_names": [name for p in static.programs for name in p.superstep_names]}


def _program_section(static: StaticProfile) -> list[dict]:
    return [{"index": p.index, "name": p.name, "cycles": p.cost.total,
             "per_ipu": [{"ipu": i, **_cycles(c)} for i, c in sorted(p.cost.per_ipu.items())],
             "exchange_bytes": p.cost.exchange_bytes, "inter_ipu_bytes": p.cost.inter_ipu_bytes,
             "host_bytes": p.cost.host_bytes} for p in static.programs]


def _program_live_peaks(static: StaticProfile) -> np.ndarray:
    """[program, ipu]: the most not-always-live bytes live during the program's supersteps."""
    out = np.zeros((len(static.programs), static.num_ipus), dtype=np.int64)
    for r in static.memory:
        curve = r.liveness if r.liveness is not None else np.zeros(0, np.int64)
        for p in static.programs:
            window = curve[p.first_superstep:p.first_superstep + p.num_supersteps]
            out[p.index, r.ipu] = int(window.max()) if window.size else 0
    return out


def _stage_section(static: StaticProfile, steps: list) -> tuple[list[dict], list[dict]]:
    """Per stage: forward/backward cycles per micro-batch (all its program runs on its IPU, and
    the compute body alone; the backward is B and W together when a schedule splits it, and
    `weight_gradient` is then W alone; `recompute`, R, when the stage recomputes its forward
    before its backward); per IPU: the weight update. `steps` are (call, step) pairs."""
    per_op: dict[tuple, dict[tuple, list[int]]] = {}
    for call, s in steps:
        for e in s.events:
            op = e.op
            if op is None or getattr(op, "kind", None) is None or op.ipu not in e.per_ipu:
                continue
            key = (op.kind, op.stage) if op.kind != "U" else ("U", op.ipu)
            c = e.per_ipu[op.ipu].total
            mb = (call, getattr(op, "global_micro_batch", None), getattr(op, "group", None))
            for k in [key, ("B", op.stage)] if op.kind == "W" else [key]:   # W is also part of the backward
                slot = per_op.setdefault(k, {}).setdefault(mb, [0, 0])
                slot[0] += c
                if e.part in ("compute", "update"):
                    slot[1] += c

    def summary(key):
        runs = per_op.get(key)
        if not runs:
            return None
        n = len(runs)
        return {"cycles_per_micro_batch": sum(v[0] for v in runs.values()) / n,
                "body_cycles": sum(v[1] for v in runs.values()) / n, "runs": n}

    stages = [{"stage": st.stage, "ipu": st.ipu, "blocks": list(st.blocks),
               "forward": summary(("F", st.stage)), "backward": summary(("B", st.stage)),
               "weight_gradient": summary(("W", st.stage)), "recompute": summary(("R", st.stage))}
              for st in static.stages]
    updates = [{"ipu": ipu, "cycles": v["cycles_per_micro_batch"]}
               for ipu in range(static.num_ipus) if (v := summary(("U", ipu))) is not None]
    return stages, updates


def _stage_work(stage: dict) -> float:
    return sum((stage.get(k) or {}).get("cycles_per_micro_batch", 0.0) for k in ("forward", "backward", "recompute"))


def _longest_stage(stages: list[dict], steps: list[dict]) -> dict | None:
    if not stages:
        return None
    work = [_stage_work(s) for s in stages]
    total = sum(work)
    if total <= 0:
        return None
    k = int(np.argmax(work))
    st = stages[k]
    critical = sum(s["cycles"] for s in steps
                   if s["critical_ipu"] == st["ipu"] and any(o["stage"] == st["stage"] and o["ipu"] == st["ipu"]
                                                            for o in s["ops"]))
    run = sum(s["cycles"] for s in steps)
    return {"stage": st["stage"], "ipu": st["ipu"], "blocks": st["blocks"], "cycles_per_micro_batch": work[k],
            "forward_cycles": (st["forward"] or {}).get("cycles_per_micro_batch", 0.0),
            "backward_cycles": (st["backward"] or {}).get("cycles_per_micro_batch", 0.0),
            "recompute_cycles": (st.get("recompute") or {}).get("cycles_per_micro_batch", 0.0),
            "share_of_work": work[k] / total, "balanced_share": 1.0 / len(stages),
            "critical_fraction": critical / run if run else 0.0}


def schedule_summary(schedule) -> dict | None:
    if schedule is None:
        return None
    return {"strategy": schedule.strategy, "num_ipus": schedule.num_ipus, "stage_ipus": list(schedule.stage_ipus),
            "training": schedule.training, "micro_batches_per_group": schedule.micro_batches_per_group,
            "num_groups": schedule.num_groups, "num_steps": schedule.num_steps, "ramp_up": schedule.ramp_up(),
            "main": schedule.main(), "ramp_down": schedule.ramp_down(),
            "bubble_fraction": schedule.bubble_fraction(),
            "bubble_fraction_per_ipu": [schedule.bubble_fraction(i) for i in range(schedule.num_ipus)],
            "recomputed_stages": list(schedule.recomputed_stages)}


def _execution_section(static: StaticProfile, rec: Recording) -> dict:
    n = static.num_ipus
    traced = [(call, s) for call, steps in enumerate(rec.traced) for s in steps]
    live_peaks = _program_live_peaks(static)
    base = [r.always_live.sum() + r.vertex_state.sum() + r.code.sum() for r in static.memory]
    steps, start = [], 0
    links: dict[tuple[int, int], int] = {}
    exchange = inter = host = 0
    for call, s in traced:
        critical = max(s.busy, key=lambda i: (s.busy[i].total, -i)) if s.busy else None
        programs = [e.program for e in s.events]
        for e in [*s.events, *getattr(s, "overlapped", ())] if call == 0 else ():
            info = static.programs[e.program]
            exchange += info.cost.exchange_bytes
            inter += info.cost.inter_ipu_bytes
            host += info.cost.host_bytes
            for pair, b in info.links.items():
                links[pair] = links.get(pair, 0) + b
        live = [int(base[i] + (live_peaks[programs, i].max() if programs else 0)) for i in range(len(static.memory))]
        steps.append({"call": call + 1, "index": s.index, "label": step_label(static, s),
                      "group": s.ops[0].group if s.ops and hasattr(s.ops[0], "group") else None,
                      "start_cycle": start, "cycles": int(s.cycles), "critical_ipu": critical,
                      "ops": [_op_dict(op) for op in s.ops],
                      "busy": [{"ipu": i, **_cycles(c)} for i, c in sorted(s.busy.items())],
                      "live_bytes": [{"ipu": i, "bytes": b} for i, b in enumerate(live)]})
        start += int(s.cycles)
    total = rec.total_cycles
    ipus = []
    sched = static.schedule
    for i in range(n):
        busy = rec.busy[i]
        idle = total - busy.total
        ipus.append({"ipu": i, "busy": _cycles(busy), "idle_cycles": idle,
                     "utilisation": busy.total / total if total else 0.0,
                     "compute_utilisation": busy.compute / total if total else 0.0,
                     "bubble_fraction": rec.bubble[i] / total if total else 0.0,
                     "imbalance_fraction": rec.imbalance[i] / total if total else 0.0,
                     "schedule_bubble_fraction": sched.bubble_fraction(i) if sched is not None and i < sched.num_ipus
                     else None})
    stages, updates = _stage_section(static, traced)
    return {
        "calls": rec.calls, "traced_calls": len(rec.traced), "cycles_per_call": list(rec.call_cycles),
        "total_cycles": total, "total_seconds": static.target.seconds(total),
        "cycles": start, "steps": steps, "ipus": ipus,
        "schedule": schedule_summary(sched), "stages": stages, "updates": updates,
        "longest_stage": _longest_stage(stages, steps),
        "exchange_bytes_per_call": exchange, "host_bytes_per_call": host,
        "inter_ipu": {"bytes_per_call": inter,
                      "links": [{"src": a, "dst": b, "bytes": v} for (a, b), v in sorted(links.items())]},
    }


def target_dict(target: Target) -> dict:
    return {f.name: getattr(target, f.name) for f in fields(target)}


def build_profile(static: StaticProfile, rec: Recording) -> dict:
    """The profile.json document (schema `ipusim.profile`, version SCHEMA_VERSION)."""
    return {
        "schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "name": static.name, "source": static.source,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "estimated": static.estimated, "notes": list(static.notes),
        "target": target_dict(static.target), "num_ipus": static.num_ipus, "settings": dict(static.settings),
        "memory": _memory_section(static), "programs": _program_section(static),
        "execution": _execution_section(static, rec), "blocks": static.blocks,
        "operations": list(static.operations), "model_error": known_errors(),
    }


# =========================================================================================
# Chrome trace (Perfetto / chrome://tracing)
# =========================================================================================
class _Trace:
    def __init__(self, clock_hz: float):
        self.scale = 1e6 / clock_hz     # microseconds per cycle
        self.events: list[dict] = []

    def us(self, cycles: int) -> float:
        return round(cycles * self.scale, 6)

    def x(self, name: str, pid: int, lane: str, start: int, cycles: int, args: dict) -> None:
        if cycles <= 0:
            return
        ts, end = self.us(start), self.us(start + cycles)
        self.events.append({"name": name, "cat": lane, "ph": "X", "pid": pid, "tid": LANES.index(lane) + 1,
                            "ts": ts, "dur": round(end - ts, 6),
                            "args": {**args, "start_cycle": start, "cycles": cycles}})


def _segments_for(info: ProgramInfo, ipu: int, c: Cycles, prefix: str) -> list[Segment]:
    segs = info.segments.get(ipu, [])
    if sum(s.cycles for s in segs) == c.total:
        return segs
    return kind_segments(f"{prefix} {info.name}", c)    # the run took another branch than the static walk


def _lay_out_scheduled(tr: _Trace, static: StaticProfile, step, start: int, args: dict) -> None:
    """Executor steps: each IPU runs its program runs one after the other from the step start."""
    cursor = {i: start for i in range(static.num_ipus)}
    spans: dict[int, list] = {}
    for e in step.events:
        info = static.programs[e.program]
        label = op_label(e.op)
        for ipu, c in sorted(e.per_ipu.items()):
            if c.total <= 0:
                continue
            t0 = cursor[ipu]
            eargs = {**args, "op": label, "part": e.part, "program": info.name}
            tr.x(f"{label} {e.part}".strip(), ipu + 1, "programs", t0, c.total, eargs)
            t = t0
            for seg in _segments_for(info, ipu, c, label):
                tr.x(seg.name, ipu + 1, seg.kind, t, seg.cycles, eargs)
                t += seg.cycles
            cursor[ipu] = t0 + c.total
            if e.op is not None and e.op.ipu == ipu:   # an op's span on the ops lane (an R, then its B)
                span = spans.setdefault((ipu, id(e.op)), [t0, t0 + c.total, e.op])
                span[1] = t0 + c.total
    for (ipu, _), (t0, t1, op) in spans.items():
        tr.x(op_label(op), ipu + 1, "ops", t0, t1 - t0,
             {**args, "kind": op.kind, "stage": op.stage, "micro_batch": op.global_micro_batch})
    io = {i: start for i in range(static.num_ipus)}
    for e in getattr(step, "overlapped", ()):   # host transfers on IO tiles, alongside the step's compute
        for ipu, c in sorted(e.per_ipu.items()):
            tr.x(f"{op_label(e.op)} {e.part} (overlapped)".strip(), ipu + 1, "host", io[ipu], c.total,
                 {**args, "op": op_label(e.op), "part": e.part, "program": static.programs[e.program].name})
            io[ipu] += c.total


def _lay_out_node(tr: _Trace, node: Program, cost_of, t: int, args: dict) -> int:
    """One node in lockstep from cycle t (a container's static leaves, e.g. an op run as one
    kernel in fast mode); returns the cycle it ends."""
    if isinstance(node, Parallel):
        return max((_lay_out_node(tr, c, cost_of, t, args) for c in node.children()), default=t)
    if isinstance(node, If):
        return _lay_out_node(tr, _heavier_branch(node, cost_of), cost_of, t, args)
    if isinstance(node, Repeat) and node.count > REPEAT_EXPAND_LIMIT:
        node_args = {**args, "repeat": node.count}
        for ipu, c in cost_of(node).per_ipu.items():
            u = t
            for seg in kind_segments(f"{getattr(node.body, 'name', '') or 'repeat'} x{node.count}", c):
                tr.x(seg.name, ipu + 1, seg.kind, u, seg.cycles, node_args)
                u += seg.cycles
        return t + cost_of(node).total
    if isinstance(node, Repeat):
        for _ in range(node.count):
            t = _lay_out_node(tr, node.body, cost_of, t, args)
        return t
    if isinstance(node, (Sequence, OpProgram)):
        for c in node.children():
            t = _lay_out_node(tr, c, cost_of, t, args)
        return t
    cost = cost_of(node)
    for ipu, c in cost.per_ipu.items():
        u = t
        for seg in kind_segments(leaf_name(node), c):
            tr.x(seg.name, ipu + 1, seg.kind, u, seg.cycles, args)
            u += seg.cycles
    return t + cost.total


def _lay_out_nodes(tr: _Trace, nodes: list, cost_of, t: int, args: dict) -> int:
    """Engine runs: all IPUs advance in lockstep, node after node as the engine charged them
    (a tuple holds the node lists of a Parallel's branches, which run together)."""
    for n in nodes:
        if isinstance(n, tuple):
            t = max((_lay_out_nodes(tr, branch, cost_of, t, args) for branch in n), default=t)
        else:
            t = _lay_out_node(tr, n, cost_of, t, args)
    return t


def chrome_trace(static: StaticProfile, rec: Recording, cost_of=None) -> dict:
    """The traced calls as Chrome trace events: one process per IPU with lanes for ops, program
    runs, compute, exchange, sync, inter-IPU and host I/O, and a "schedule" process with the
    steps. Complete events ("X"), timestamps in microseconds at the target clock, sorted per
    lane. `cost_of` resolves engine-recorded nodes (plain Engine profiles). The IPUs' lanes detail
    the steps that begin before the trace holds `TRACE_EVENT_LIMIT` events, the schedule all
    (`otherData`: `steps_detailed` of `steps`)."""
    tr = _Trace(static.target.clock_hz)
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "schedule"}},
            {"name": "process_sort_index", "ph": "M", "pid": 0, "tid": 0, "args": {"sort_index": 0}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "steps"}}]
    for i in range(static.num_ipus):
        meta += [{"name": "process_name", "ph": "M", "pid": i + 1, "tid": 0, "args": {"name": f"IPU {i}"}},
                 {"name": "process_sort_index", "ph": "M", "pid": i + 1, "tid": 0, "args": {"sort_index": i + 1}}]
        for k, lane in enumerate(LANES):
            meta += [{"name": "thread_name", "ph": "M", "pid": i + 1, "tid": k + 1, "args": {"name": LANE_TITLES[lane]}},
                     {"name": "thread_sort_index", "ph": "M", "pid": i + 1, "tid": k + 1, "args": {"sort_index": k + 1}}]
    live_peaks = _program_live_peaks(static)
    base = [int(r.always_live.sum() + r.vertex_state.sum() + r.code.sum()) for r in static.memory]
    t, summarised, total = 0, 0, sum(len(steps) for steps in rec.traced)
    for call, steps in enumerate(rec.traced):
        for s in steps:
            args = {"call": call + 1, "step": s.index + 1}
            detailed = len(tr.events) < TRACE_EVENT_LIMIT
            if static.source == "ipusim":
                name = f"run {call + 1}: {step_label(static, s)}"
            else:
                name = f"step {s.index + 1}" + (f" (call {call + 1})" if len(rec.traced) > 1 else "")
            tr.events.append({"name": name, "cat": "step", "ph": "X", "pid": 0, "tid": 1, "ts": tr.us(t),
                              "dur": round(tr.us(t + s.cycles) - tr.us(t), 6),
                              "args": {**args, "ops": step_label(static, s), "cycles": int(s.cycles)}})
            programs = [e.program for e in s.events]
            for r in static.memory:
                live = base[r.ipu] + (int(live_peaks[programs, r.ipu].max()) if programs else 0)
                tr.events.append({"name": "live bytes", "ph": "C", "pid": r.ipu + 1, "ts": tr.us(t),
                                  "args": {"bytes": live}})
            if not detailed:
                summarised += 1
            elif any(e.nodes is not None for e in s.events if isinstance(e, ProgramEvent)) and cost_of is not None:
                for e in s.events:
                    info = static.programs[e.program]
                    for ipu in sorted(e.per_ipu):
                        tr.x(info.name, ipu + 1, "programs", t, s.cycles, {**args, "program": info.name})
                    _lay_out_nodes(tr, e.nodes or [], cost_of, t, {**args, "program": info.name})
            else:
                _lay_out_scheduled(tr, static, s, t, args)
            t += int(s.cycles)
    body = sorted(tr.events, key=lambda e: (e["pid"], e.get("tid", 0), e["ts"], -e.get("dur", 0)))
    return {"traceEvents": meta + body, "displayTimeUnit": "ns",
            "otherData": {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "name": static.name,
                          "target": static.target.name, "clock_hz": static.target.clock_hz,
                          "time_unit": "microseconds at the target clock",
                          "steps_detailed": total - summarised, "steps": total}}


# =========================================================================================
# Text: summary and comparison
# =========================================================================================
def _mib(b: float) -> str:
    """Bytes in a readable binary unit."""
    if b >= 2**20:
        return f"{b / 2**20:,.2f} MiB"
    if b >= 2**10:
        return f"{b / 2**10:,.1f} KiB"
    return f"{int(b):,} B"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def _time(cycles: float, clock: float) -> str:
    s = cycles / clock
    if s >= 1:
        return f"{s:,.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.3f} ms"
    return f"{s * 1e6:,.1f} us"


def _run_line(doc: dict) -> str:
    ex, clock = doc["execution"], doc["target"]["clock_hz"]
    if doc["source"] == "ipusim":
        return (f"  {ex['calls']} program run{'s' if ex['calls'] != 1 else ''}, {ex['total_cycles']:,} cycles = "
                f"{_time(ex['total_cycles'], clock)}")
    first = ex["cycles_per_call"][0] if ex["cycles_per_call"] else 0
    steps = sum(1 for s in ex["steps"] if s["call"] == 1)
    line = f"  per call: {steps} steps, {first:,} cycles = {_time(first, clock)}"
    samples = doc["settings"].get("samples_per_call")
    if samples and first:
        line += f" ({samples / (first / clock):,.0f} samples/s)"
    if ex["calls"] > 1:
        line += f"; {ex['calls']} calls, {ex['total_cycles']:,} cycles = {_time(ex['total_cycles'], clock)} in all"
    return line


def summary(doc: dict) -> str:
    """The end-of-run summary: per-IPU busy and idle time, the longest stage and its share of the
    work and of the step time, memory per IPU against capacity."""
    ex, tgt = doc["execution"], doc["target"]
    clock = tgt["clock_hz"]
    sched = ex["schedule"]
    compiled_only = not doc["estimated"] and not ex["calls"] and doc["source"] != "ipusim"
    kind = "estimate, not run" if doc["estimated"] else "compiled, not run (memory only)" if compiled_only else (
        f"{ex['calls']} call{'s' if ex['calls'] != 1 else ''}" if doc["source"] != "ipusim" else "plain programs")
    lines = [f"Profile {doc['name']!r}: {doc['num_ipus']} x {tgt['name']} ({clock / 1e9:.2f} GHz)"
             + (f", {sched['strategy']} schedule" if sched else "") + f"; {kind}"]
    if not compiled_only:
        lines += _run_table(doc)
    lines += _memory_lines(doc)
    return "\n".join(lines)


def _run_table(doc: dict) -> list[str]:
    """The summary's lines on the calls that ran: per-IPU time shares and the longest stage."""
    ex = doc["execution"]
    lines = [_run_line(doc)]
    total = ex["total_cycles"] or 1
    lines.append(f"  {'IPU':>3}  {'busy':>6}  {'idle':>6} {'(bubble':>8} {'wait)':>7}   {'compute':>7} {'exchange':>8} "
                 f"{'sync':>6} {'inter-IPU':>9} {'host':>6}")
    for u in ex["ipus"]:
        b = u["busy"]
        lines.append(f"  {u['ipu']:>3}  {_pct(u['utilisation'])}  {_pct(1 - u['utilisation'])}  "
                     f"({_pct(u['bubble_fraction'])}  {_pct(u['imbalance_fraction'])})   "
                     + " ".join(f"{_pct(b[k] / total):>{w}}" for k, w in
                                (("compute", 7), ("exchange", 8), ("sync", 6), ("inter_ipu", 9), ("host", 6))))
    lines.append("  (shares of the run time; bubble: idle in steps without an op of the IPU; wait: idle in its "
                 "own steps until the slowest IPU finishes)")
    ls = ex["longest_stage"]
    if ls:
        parts = f"forward {ls['forward_cycles']:,.0f}" + (f" + backward {ls['backward_cycles']:,.0f}"
                                                          if ls["backward_cycles"] else "") + \
            (f" + recompute {ls['recompute_cycles']:,.0f}" if ls.get("recompute_cycles") else "")
        lines.append(f"Longest stage: stage {ls['stage']} on IPU {ls['ipu']} (blocks {', '.join(map(str, ls['blocks']))}), "
                     f"{ls['cycles_per_micro_batch']:,.0f} cycles per micro-batch ({parts}): "
                     f"{100 * ls['share_of_work']:.1f}% of the work of all stages ({100 * ls['balanced_share']:.1f}% "
                     f"if balanced); its IPU sets the step time for {100 * ls['critical_fraction']:.1f}% of the run.")
    return lines


def _memory_lines(doc: dict) -> list[str]:
    """The summary's lines on memory, recomputation, traffic, the cycle model and the notes."""
    ex, tgt = doc["execution"], doc["target"]
    lines = []
    if doc["memory"]["ipus"]:
        lines.append(f"Memory per IPU (capacity {_mib((tgt['num_tiles'] + tgt.get('io_tiles', 0)) * tgt['bytes_per_tile'])}, "
                     f"{tgt['bytes_per_tile']:,} B per tile):")
        for m in doc["memory"]["ipus"]:
            top = sorted(m["by_category"].items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"  IPU {m['ipu']}  {_mib(m['total_bytes']):>12} ({_pct(m['total_bytes'] / m['capacity_bytes']).strip()})"
                         f"  busiest tile {m['max_tile']}: {m['max_tile_bytes']:,} B "
                         f"({_pct(m['max_tile_bytes'] / m['tile_capacity_bytes']).strip()})"
                         + ("  OUT OF MEMORY" if not m["fits"] else "")
                         + "  largest: " + ", ".join(f"{k.replace('_', ' ')} {_mib(v)}" for k, v in top))
    recomputed = [st for st in ex["stages"] if st.get("recompute")]
    if recomputed:
        stash = {m["ipu"]: m["by_category"].get("stashed_activations", 0) for m in doc["memory"]["ipus"]}
        lines.append("Recomputation: " + ", ".join(
            f"stage {st['stage']} (IPU {st['ipu']}) {st['recompute']['cycles_per_micro_batch']:,.0f} cycles per "
            "micro-batch" for st in recomputed) + " recomputing the forward before the backward (R ops); stashed "
            "activations per IPU " + " / ".join(_mib(stash.get(i, 0)).strip() for i in range(doc["num_ipus"])) + ".")
    if ex["inter_ipu"]["bytes_per_call"] or ex["host_bytes_per_call"]:
        lines.append(f"Traffic per {'call' if doc['source'] != 'ipusim' else 'first run'}: inter-IPU "
                     f"{ex['inter_ipu']['bytes_per_call']:,} B, host I/O {ex['host_bytes_per_call']:,} B.")
    if doc.get("model_error"):
        lines.append("Cycle model against published IPU measurements (benchmarks/calibration.py):")
        lines += [f"  {e['statement']}" for e in doc["model_error"]]
    for note in doc.get("notes", []):
        lines.append(f"Note: {note}")
    return lines


def comparison_rows(a: dict, b: dict) -> list[tuple[str, float | None, float | None]]:
    """(metric, value in a, value in b) rows for two profiles."""
    ea, eb = a["execution"], b["execution"]

    def per_ipu(doc, key):
        return {u["ipu"]: u[key] for u in doc["execution"]["ipus"]}

    def mem(doc, key):
        return {m["ipu"]: m[key] for m in doc["memory"]["ipus"]}

    rows = [("IPUs", a["num_ipus"], b["num_ipus"]),
            ("clock (GHz)", a["target"]["clock_hz"] / 1e9, b["target"]["clock_hz"] / 1e9),
            ("steps per call", len(ea["steps"]), len(eb["steps"])),
            ("cycles per call", ea["cycles"], eb["cycles"]),
            ("time per call (us)", ea["cycles"] / a["target"]["clock_hz"] * 1e6,
             eb["cycles"] / b["target"]["clock_hz"] * 1e6)]
    sa, sb = a.get("settings", {}), b.get("settings", {})
    if sa.get("samples_per_call") and sb.get("samples_per_call"):
        rows.append(("time per sample (us)", ea["cycles"] / a["target"]["clock_hz"] * 1e6 / sa["samples_per_call"],
                     eb["cycles"] / b["target"]["clock_hz"] * 1e6 / sb["samples_per_call"]))
    ua, ub = per_ipu(a, "utilisation"), per_ipu(b, "utilisation")
    rows.append(("mean utilisation", float(np.mean(list(ua.values()))) if ua else None,
                 float(np.mean(list(ub.values()))) if ub else None))
    for i in sorted(set(ua) | set(ub)):
        rows.append((f"IPU {i} utilisation", ua.get(i), ub.get(i)))
    ta, tb = mem(a, "total_bytes"), mem(b, "total_bytes")
    rows.append(("memory, all IPUs (MiB)", sum(ta.values()) / 2**20, sum(tb.values()) / 2**20))
    for i in sorted(set(ta) | set(tb)):
        rows.append((f"IPU {i} memory (MiB)", ta[i] / 2**20 if i in ta else None, tb[i] / 2**20 if i in tb else None))
    xa, xb = mem(a, "max_tile_bytes"), mem(b, "max_tile_bytes")
    rows.append(("busiest tile (bytes)", max(xa.values(), default=None), max(xb.values(), default=None)))
    rows.append(("inter-IPU bytes per call", ea["inter_ipu"]["bytes_per_call"], eb["inter_ipu"]["bytes_per_call"]))
    rows.append(("host bytes per call", ea["host_bytes_per_call"], eb["host_bytes_per_call"]))
    la, lb = ea["longest_stage"], eb["longest_stage"]
    if la or lb:
        rows.append(("longest stage (cycles per micro-batch)", la and la["cycles_per_micro_batch"],
                     lb and lb["cycles_per_micro_batch"]))
    if ea["schedule"] or eb["schedule"]:
        rows.append(("schedule bubble fraction", ea["schedule"] and ea["schedule"]["bubble_fraction"],
                     eb["schedule"] and eb["schedule"]["bubble_fraction"]))
    return rows


def comparison(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two profiles side by side with the ratio B / A."""
    rows = comparison_rows(a, b)

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float) and not v.is_integer():
            return f"{v:,.4g}" if abs(v) < 1 else f"{v:,.2f}"
        return f"{int(v):,}"

    width = max(len(r[0]) for r in rows)
    head = [f"A = {names[0]!s}: {a['name']!r} ({a['num_ipus']} x {a['target']['name']}"
            f"{', ' + a['execution']['schedule']['strategy'] if a['execution']['schedule'] else ''})",
            f"B = {names[1]!s}: {b['name']!r} ({b['num_ipus']} x {b['target']['name']}"
            f"{', ' + b['execution']['schedule']['strategy'] if b['execution']['schedule'] else ''})",
            f"{'metric':<{width}}  {'A':>14}  {'B':>14}  {'B / A':>8}"]
    out = []
    for name, va, vb in rows:
        ratio = "-"
        if va is not None and vb is not None and va != 0:
            ratio = f"{vb / va:.3f}"
        out.append(f"{name:<{width}}  {fmt(va):>14}  {fmt(vb):>14}  {ratio:>8}")
    return "\n".join(head + out)


# =========================================================================================
# Schema and validation
# =========================================================================================
_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number", "minimum": 0}
_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}
_CYCLES = {"type": "object", "required": ["compute", "exchange", "sync", "inter_ipu", "host", "total"],
           "properties": {k: _INT for k in ("compute", "exchange", "sync", "inter_ipu", "host", "total")},
           "additionalProperties": False}
_IPU_CYCLES = {"type": "object", "required": ["ipu", "total"],
               "properties": {"ipu": _INT, **_CYCLES["properties"]}, "additionalProperties": False}
_INTS = {"type": "array", "items": _INT}
_STAGE_PASS = {"type": ["object", "null"], "required": ["cycles_per_micro_batch", "body_cycles", "runs"],
               "properties": {"cycles_per_micro_batch": _NUM, "body_cycles": _NUM, "runs": _INT}}
_SUPERSTEPS = {"type": "array", "items": {"type": "integer", "minimum": -1}}
_TENSORS = {"type": "array", "items": {
    "type": "object", "required": ["name", "kind", "bytes"],
    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}, "bytes": _INT}}}
_KIND_BYTES = {"type": "object", "required": list(KINDS), "additionalProperties": _INT}
_OPERATION = {
    "type": "object",
    "required": ["name", "op", "aten", "source", "module", "block", "stage", "ipu", "pass", "cycles", "compute",
                 "exchange", "sync", "inter_ipu", "host", "exchange_bytes", "bytes", "tiles"],
    "properties": {"name": {"type": "string"}, "op": {"type": "string"}, "aten": {"type": "string"},
                   "source": {"type": "string"}, "module": {"type": "string"}, "block": {"type": ["string", "null"]},
                   "stage": _INT, "ipu": _INT, "pass": {"type": "string"},
                   **{k: _INT for k in ("cycles", "compute", "exchange", "sync", "inter_ipu", "host",
                                        "exchange_bytes", "bytes", "tiles")}}}

PROFILE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "ipusim profile", "type": "object",
    "required": ["schema", "version", "name", "source", "created", "estimated", "notes", "target", "num_ipus",
                 "settings", "memory", "programs", "execution", "blocks", "operations"],
    "properties": {
        "schema": {"const": SCHEMA_NAME}, "version": {"const": SCHEMA_VERSION},
        "name": {"type": "string"}, "source": {"enum": ["poptorch_lite", "ipusim"]},
        "created": {"type": "string"}, "estimated": {"type": "boolean"},
        "notes": {"type": "array", "items": {"type": "string"}},
        "target": {"type": "object", "required": ["name", "num_tiles", "bytes_per_tile", "clock_hz"],
                   "properties": {"name": {"type": "string"}, "num_tiles": _INT, "bytes_per_tile": _INT,
                                  "clock_hz": _NUM}},
        "num_ipus": {"type": "integer", "minimum": 1},
        "settings": {"type": "object"},
        "memory": {
            "type": "object", "required": ["ipus", "supersteps", "superstep_names"],
            "properties": {
                "ipus": {"type": "array", "items": {
                    "type": "object",
                    "required": ["ipu", "capacity_bytes", "tile_capacity_bytes", "total_bytes", "max_tile_bytes",
                                 "max_tile", "fits", "always_live_bytes", "not_always_live_peak_bytes",
                                 "vertex_state_bytes", "code_bytes", "by_category", "by_kind", "per_tile",
                                 "per_tile_by_kind", "per_tile_peak_superstep", "worst_tiles", "largest_tensors",
                                 "liveness", "liveness_peak"],
                    "properties": {
                        "ipu": _INT, "capacity_bytes": _INT, "tile_capacity_bytes": _INT, "total_bytes": _INT,
                        "max_tile_bytes": _INT, "max_tile": _INT, "fits": {"type": "boolean"},
                        "always_live_bytes": _INT, "not_always_live_peak_bytes": _INT, "vertex_state_bytes": _INT,
                        "code_bytes": _INT, "by_category": {"type": "object", "additionalProperties": _INT},
                        "per_tile": {"type": "object",
                                     "required": ["always_live", "not_always_live_peak", "vertex_state", "code", "peak"],
                                     "additionalProperties": _INTS},
                        "by_kind": _KIND_BYTES,
                        "per_tile_by_kind": {"type": "object", "required": list(KINDS), "additionalProperties": _INTS},
                        "per_tile_peak_superstep": _SUPERSTEPS,
                        "worst_tiles": {"type": "array", "items": {
                            "type": "object",
                            "required": ["tile", "bytes", "fits", "superstep", "superstep_name", "program", "tensors"],
                            "properties": {"tile": _INT, "bytes": _INT, "fits": {"type": "boolean"},
                                           "superstep": {"type": "integer", "minimum": -1},
                                           "superstep_name": {"type": "string"}, "program": {"type": "string"},
                                           "tensors": _TENSORS}}},
                        "largest_tensors": {"type": "array", "items": {
                            "type": "object", "required": ["name", "bytes"],
                            "properties": {"name": {"type": "string"}, "bytes": _INT}}},
                        "liveness": _INTS,
                        "liveness_peak": {"type": ["object", "null"],
                                          "required": ["superstep", "superstep_name", "program", "bytes", "by_kind",
                                                       "tensors"],
                                          "properties": {"superstep": _INT, "superstep_name": {"type": "string"},
                                                         "program": {"type": "string"}, "bytes": _INT,
                                                         "by_kind": {"type": "object", "additionalProperties": _INT},
                                                         "tensors": _TENSORS}}}}},
                "supersteps": {"type": "array", "items": {
                    "type": "object", "required": ["program", "first", "count"],
                    "properties": {"program": _INT, "first": _INT, "count": _INT}}},
                "superstep_names": {"type": "array", "items": {"type": "string"}}}},
        "programs": {"type": "array", "items": {
            "type": "object",
            "required": ["index", "name", "cycles", "per_ipu", "exchange_bytes", "inter_ipu_bytes", "host_bytes"],
            "properties": {"index": _INT, "name": {"type": "string"}, "cycles": _INT,
                           "per_ipu": {"type": "array", "items": _IPU_CYCLES}, "exchange_bytes": _INT,
                           "inter_ipu_bytes": _INT, "host_bytes": _INT}}},
        "execution": {
            "type": "object",
            "required": ["calls", "traced_calls", "cycles_per_call", "total_cycles", "total_seconds", "cycles",
                         "steps", "ipus", "schedule", "stages", "updates", "longest_stage",
                         "exchange_bytes_per_call", "host_bytes_per_call", "inter_ipu"],
            "properties": {
                "calls": _INT, "traced_calls": _INT, "cycles_per_call": _INTS, "total_cycles": _INT,
                "total_seconds": _NUM, "cycles": _INT,
                "steps": {"type": "array", "items": {
                    "type": "object",
                    "required": ["call", "index", "label", "group", "start_cycle", "cycles", "critical_ipu", "ops",
                                 "busy", "live_bytes"],
                    "properties": {
                        "call": {"type": "integer", "minimum": 1}, "index": _INT, "label": {"type": "string"}, "group": {"type": ["integer", "null"]},
                        "start_cycle": _INT, "cycles": _INT, "critical_ipu": {"type": ["integer", "null"]},
                        "ops": {"type": "array", "items": {
                            "type": "object", "required": ["label", "kind", "stage", "micro_batch", "ipu"],
                            "properties": {"label": {"type": "string"}, "kind": {"enum": ["F", "B", "W", "U", "R"]},
                                           "stage": {"type": ["integer", "null"]},
                                           "micro_batch": {"type": ["integer", "null"]},
                                           "group": {"type": ["integer", "null"]}, "ipu": _INT}}},
                        "busy": {"type": "array", "items": _IPU_CYCLES},
                        "live_bytes": {"type": "array", "items": {
                            "type": "object", "required": ["ipu", "bytes"],
                            "properties": {"ipu": _INT, "bytes": _INT}}}}}},
                "ipus": {"type": "array", "items": {
                    "type": "object",
                    "required": ["ipu", "busy", "idle_cycles", "utilisation", "compute_utilisation", "bubble_fraction",
                                 "imbalance_fraction", "schedule_bubble_fraction"],
                    "properties": {"ipu": _INT, "busy": _CYCLES, "idle_cycles": _INT, "utilisation": _FRACTION,
                                   "compute_utilisation": _FRACTION, "bubble_fraction": _FRACTION,
                                   "imbalance_fraction": _FRACTION,
                                   "schedule_bubble_fraction": {"type": ["number", "null"]}}}},
                "schedule": {"type": ["object", "null"],
                             "required": ["strategy", "num_ipus", "stage_ipus", "training", "micro_batches_per_group",
                                          "num_groups", "num_steps", "ramp_up", "main", "ramp_down",
                                          "bubble_fraction", "bubble_fraction_per_ipu"]},
                "stages": {"type": "array", "items": {
                    "type": "object", "required": ["stage", "ipu", "blocks", "forward", "backward"],
                    "properties": {"stage": _INT, "ipu": _INT, "blocks": {"type": "array", "items": {"type": "string"}},
                                   "forward": _STAGE_PASS, "backward": _STAGE_PASS, "weight_gradient": _STAGE_PASS,
                                   "recompute": _STAGE_PASS}}},
                "updates": {"type": "array", "items": {"type": "object", "required": ["ipu", "cycles"],
                                                       "properties": {"ipu": _INT, "cycles": _NUM}}},
                "longest_stage": {"type": ["object", "null"],
                                  "required": ["stage", "ipu", "blocks", "cycles_per_micro_batch", "forward_cycles",
                                               "backward_cycles", "share_of_work", "balanced_share",
                                               "critical_fraction"]},
                "exchange_bytes_per_call": _INT, "host_bytes_per_call": _INT,
                "inter_ipu": {"type": "object", "required": ["bytes_per_call", "links"],
                              "properties": {"bytes_per_call": _INT, "links": {"type": "array", "items": {
                                  "type": "object", "required": ["src", "dst", "bytes"],
                                  "properties": {"src": _INT, "dst": _INT, "bytes": _INT}}}}}}},
        "blocks": {"type": ["object", "null"],
                   "required": ["names", "forward_cycles", "backward_cycles", "update_cycles", "tile_bytes", "flows",
                                "current_split", "source"]},
        "operations": {"type": "array", "items": _OPERATION},
        "model_error": {"type": "array", "items": {
            "type": "object", "required": ["part", "what", "error", "over", "leaves_out", "statement"],
            "properties": {"part": {"type": "string"}, "what": {"type": "string"},
                           "error": {"type": ["number", "null"]}, "over": {"type": "string"},
                           "leaves_out": {"type": "string"}, "statement": {"type": "string"}}}},
    },
}


def _version_2_schema() -> dict:
    """The schema of version 2 documents, which this ipusim still reads: no kinds of memory at the
    tiles' peaks (`per_tile_by_category` instead: every tensor of a category, live at the peak
    or not), no worst tiles, liveness peak, superstep names or operations."""
    schema = json.loads(json.dumps(PROFILE_SCHEMA))
    schema["properties"]["version"] = {"const": 2}
    schema["required"].remove("operations")
    del schema["properties"]["operations"]
    memory = schema["properties"]["memory"]
    memory["required"].remove("superstep_names")
    del memory["properties"]["superstep_names"]
    ipu = memory["properties"]["ipus"]["items"]
    for key in ("by_kind", "per_tile_by_kind", "per_tile_peak_superstep", "worst_tiles", "liveness_peak"):
        ipu["required"].remove(key)
        del ipu["properties"][key]
    ipu["required"].append("per_tile_by_category")
    ipu["properties"]["per_tile_by_category"] = {"type": "object", "additionalProperties": _INTS}
    return schema


class ProfileError(ValueError):
    """A profile document that does not follow the schema."""


_TYPE_TESTS = {"object": lambda v: type(v) is dict, "array": lambda v: type(v) is list,
               "string": lambda v: type(v) is str, "boolean": lambda v: type(v) is bool, "null": lambda v: v is None,
               "integer": lambda v: type(v) is int, "number": lambda v: type(v) is int or type(v) is float}
_PREDICATES: dict[int, tuple[dict, Callable]] = {}


def _predicate(schema: dict) -> Callable[[object], bool]:
    """A quick yes or no for `schema` (the keywords `_check` knows; stricter about types, so a no
    only means the detailed check must look): a large valid profile is checked in one pass."""
    known = _PREDICATES.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    tests = []
    types = schema.get("type")
    names = () if types is None else (types,) if isinstance(types, str) else tuple(types)
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if names == ("integer",) and hi is None and set(schema) <= {"type", "minimum"}:
        lo = float("-inf") if lo is None else lo
        check = lambda v: type(v) is int and v >= lo          # noqa: E731  (the long arrays: one call per value)
        _PREDICATES[id(schema)] = (schema, check)
        return check
    if names:
        fs = [_TYPE_TESTS[n] for n in names]
        tests.append(fs[0] if len(fs) == 1 else (lambda v: any(f(v) for f in fs)))
    if "const" in schema:
        const = schema["const"]
        tests.append(lambda v: v == const)
    if "enum" in schema:
        enum = schema["enum"]
        tests.append(lambda v: v in enum)
    if lo is not None or hi is not None:
        lo = float("-inf") if lo is None else lo
        hi = float("inf") if hi is None else hi + 1e-12
        tests.append(lambda v: not (type(v) is int or type(v) is float) or lo <= v <= hi)
    if "required" in schema or "properties" in schema or "additionalProperties" in schema:
        required = tuple(schema.get("required", ()))
        props = {k: _predicate(v) for k, v in schema.get("properties", {}).items()}
        extra = schema.get("additionalProperties", True)
        extra = _predicate(extra) if isinstance(extra, dict) else extra
        get = props.get

        def fields_ok(v) -> bool:
            if type(v) is not dict:
                return True
            for k in required:
                if k not in v:
                    return False
            for k, x in v.items():
                f = get(k)
                if f is not None:
                    if not f(x):
                        return False
                elif extra is False or (extra is not True and not extra(x)):
                    return False
            return True
        tests.append(fields_ok)
    if "items" in schema:
        item = _predicate(schema["items"])
        tests.append(lambda v: type(v) is not list or all(map(item, v)))
    if not tests:
        check = lambda v: True                                  # noqa: E731
    elif len(tests) == 1:
        check = tests[0]
    elif len(tests) == 2:
        first, second = tests
        check = lambda v: first(v) and second(v)               # noqa: E731
    else:
        check = lambda v: all(t(v) for t in tests)             # noqa: E731
    _PREDICATES[id(schema)] = (schema, check)
    return check


def _check(value, schema: dict, path: str, errors: list[str]) -> None:
    """A small JSON Schema checker for the keywords PROFILE_SCHEMA uses."""
    if _predicate(schema)(value):
        return
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        ok = {"object": isinstance(value, dict), "array": isinstance(value, list),
              "string": isinstance(value, str), "boolean": isinstance(value, bool), "null": value is None,
              "integer": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool)}
        if not any(ok[n] for n in names):
            errors.append(f"{path}: expected {' or '.join(names)}, got {type(value).__name__}")
            return
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"] + 1e-12:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing required field {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                _check(v, props[key], f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected field {key!r}")
            elif isinstance(extra, dict):
                _check(v, extra, f"{path}.{key}", errors)
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{path}[{i}]", errors)
            if len(errors) > 20:
                return


_SCHEMAS = {SCHEMA_VERSION: PROFILE_SCHEMA, 2: _version_2_schema()}


def validate(doc: dict) -> None:
    """Raise ProfileError listing what in `doc` does not follow PROFILE_SCHEMA (or the schema of
    version 2, for a version 2 document)."""
    errors: list[str] = []
    version = doc.get("version") if isinstance(doc, dict) else None
    _check(doc, _SCHEMAS.get(version, PROFILE_SCHEMA), "profile", errors)
    if errors:
        hint = (f" (this ipusim reads versions {' and '.join(map(str, READABLE_VERSIONS))}; the file has version "
                f"{version})" if version is not None and version not in READABLE_VERSIONS else "")
        raise ProfileError("not a valid ipusim profile" + hint + ":\n  " + "\n  ".join(errors[:20]))


def load(path: str) -> dict:
    """Read and validate a profile.json (or the profile.json inside a directory)."""
    if os.path.isdir(path):
        path = os.path.join(path, "profile.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no profile at {path}: run with profiling on (POPLAR_ENGINE_OPTIONS="
                                "'{\"autoReport.all\":\"true\",\"autoReport.directory\":DIR}') or pass the directory "
                                "that holds profile.json")
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as error:
            raise ProfileError(f"{path} is not JSON: {error}") from None
    validate(doc)
    return doc


# =========================================================================================
# Writing, and the session that writes once at the end
# =========================================================================================
def _write_json(path: str, obj: dict) -> None:
    """Write atomically (readers never see half a file); one dumps call keeps the C encoder."""
    text = json.dumps(obj, separators=(",", ":"))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_profile(directory: str, static: StaticProfile, rec: Recording, *, trace: bool = True,
                  charts: bool = True, page: bool = True, advice: Callable[[dict], str | None] | None = None,
                  cost_of=None) -> tuple[dict, list[str], list[str]]:
    """Write profile.json (and trace.json, the PNG charts and the page, profile.html) into
    `directory`; `advice(doc)` gives the balance advice the page shows. Returns the document,
    the files written and messages (e.g. charts skipped without matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    doc = build_profile(static, rec)
    files, messages = [], []
    path = os.path.join(directory, "profile.json")
    _write_json(path, doc)
    files.append(path)
    if trace:
        path = os.path.join(directory, "trace.json")
        _write_json(path, chrome_trace(static, rec, cost_of))
        files.append(path)
    if charts:
        from .charts import ChartsUnavailable, write_charts
        try:
            files += write_charts(doc, directory)
        except ChartsUnavailable as why:
            messages.append(str(why))
    if page:
        from .page import PAGE_NAME, write_page
        files.append(write_page(os.path.join(directory, PAGE_NAME), [(static.name, doc)],
                                advice=[advice(doc) if advice is not None else None]))
    return doc, files, messages


class ProfileSession:
    """Collects calls for one compiled program and writes its profile into `directory`.

    `write_early()` writes profile.json and trace.json once the traced calls are in; `finish()`
    writes everything (profile with the totals of all calls, trace, charts, the page) and prints
    the summary. `finish` runs once: at the end of the owner's life (`finish_on_collect`: when it is
    freed, or at the next safe point when the garbage collector freed it, or at interpreter exit) or
    when called."""

    def __init__(self, directory: str, static: StaticProfile, *, trace_calls: int = 1, cost_of=None,
                 advice: Callable[[dict], str] | None = None, echo: Callable[[str], None] = print):
        self.directory = directory
        self.static = static
        self.recording = Recording(static.num_ipus, trace_calls)
        self.cost_of = cost_of
        self.advice = advice
        self.echo = echo
        self.finished = False
        self.files: list[str] = []
        finish_collected()

    def add(self, steps: list) -> None:
        finish_collected()
        self.recording.add(steps)

    def write_compiled(self) -> None:
        """profile.json of the compiled program before any call: memory, static costs, schedule."""
        _, self.files, _ = write_profile(self.directory, self.static, self.recording, trace=False, charts=False,
                                         page=False, cost_of=self.cost_of)

    def write_early(self) -> None:
        _, self.files, _ = write_profile(self.directory, self.static, self.recording, charts=False, page=False,
                                         cost_of=self.cost_of)

    def finish(self) -> str | None:
        """Write the files and print the summary; returns the summary (None if nothing ran or
        it already finished)."""
        if self.finished:
            return None
        self.finished = True
        if not self.recording.calls:
            return None
        advice: list[str] = []

        def advise(doc: dict) -> str | None:     # once, for the page and the summary
            advice.append(self.advice(doc) if self.advice is not None else "")
            return advice[-1] or None

        try:
            doc, self.files, messages = write_profile(self.directory, self.static, self.recording, advice=advise,
                                                      cost_of=self.cost_of)
        except OSError as error:
            self.echo(f"Profiling: could not write the profile to {self.directory}: {error}")
            return None
        text = summary(doc)
        if advice and advice[0]:
            text += "\n" + advice[0]
        text += f"\nProfile written to {self.directory}: " + ", ".join(os.path.basename(f) for f in self.files)
        for m in messages:
            text += f"\n{m}"
        self.echo(text)
        return text


# Finishing a profile writes files, draws charts (importing matplotlib on first use) and prints:
# work that must not run inside Python's cyclic garbage collector, which starts at any allocation
# (in the middle of an `ast.parse`, whose C state a nested compile corrupts, of a print to the same
# stream, of an import). An owner the collector frees is finished at the next safe point instead:
# `finish_collected()`, called when a profile session is made or records a call, by poptorch_lite's
# model calls, and at interpreter exit.
_collecting = False
_collected: list[Callable[[], object]] = []
_collected_lock = threading.Lock()


def _track_collection(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_track_collection)


def _finish_when_safe(finish: Callable[[], object]):
    """`finish()` now, and what it returns; inside the garbage collector, at the next safe point."""
    if _collecting:
        with _collected_lock:
            _collected.append(finish)
        return None
    return finish()


def finish_collected() -> None:
    """Finish the profiles whose owners the garbage collector freed since the last call."""
    if _collecting or not _collected:
        return
    with _collected_lock:
        ready = list(_collected)
        _collected.clear()
    for finish in ready:
        finish()


atexit.register(finish_collected)


def finish_on_collect(owner, finish: Callable[[], object]) -> weakref.finalize:
    """Call `finish()` once: when `owner` is freed (by the garbage collector: at the next safe
    point, see `finish_collected`) or at interpreter exit. Calling the returned finalizer runs it now."""
    return weakref.finalize(owner, _finish_when_safe, finish)


class EngineProfiler:
    """Profiling of a plain Engine (`Engine(..., profile_dir=DIR)`): every `run()` / `execute()`
    is one step; the first `trace_calls` runs keep their executed nodes for the trace. Files are
    written when the engine is closed or collected, or at interpreter exit."""

    def __init__(self, engine, directory: str, name: str = "engine", trace_calls: int = 16):
        costs = engine._costs
        self.session = ProfileSession(
            directory, static_profile(name, engine, source="ipusim"), trace_calls=trace_calls,
            cost_of=lambda node: costs[id(node)][1])
        self._finalizer = finish_on_collect(engine, self.session.finish)
        self._lock = threading.Lock()     # programs may run from several host threads

    def ran(self, index: int, report) -> None:
        with self._lock:
            runs = self.session.recording.calls
            keep = runs < self.session.recording.trace_calls
            event = ProgramEvent(None, "run", index, dict(report.per_ipu), report.nodes if keep else None)
            self.session.add([executed_step(0, [], [event], cycles=report.total)])

    def close(self) -> None:
        self._finalizer()


__all__ = ["ExecutedStep", "EngineProfiler", "ProfileError", "ProfileSession", "ProgramEvent", "ProgramInfo",
           "PROFILE_SCHEMA", "Recording", "SCHEMA_VERSION", "Segment", "StageInfo", "StaticProfile",
           "build_profile", "chrome_trace", "comparison", "describe_programs",
           "executed_step", "finish_collected", "finish_on_collect", "load", "simulate", "static_profile", "summary",
           "validate", "write_profile"]
