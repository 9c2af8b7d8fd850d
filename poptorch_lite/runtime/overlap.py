"""Overlapped host I/O in the timeline of a call (PopTorch's OverlapMode; compiler/host_io.py).

An overlapped input's host-to-IO-tile stream (a "prefetch" program run) belongs to the step of the
op that uses it, but on the IPU it runs on the IO tiles while the compute tiles work on the step
before; an overlapped output's IO-tile-to-host stream (a "drain") runs while the compute tiles
work on the step after. Such a run moves to that neighbouring step's `overlapped` runs, out of the
IPU's busy cycles, when the mode allows:
- `OverlapAccumulationLoop`: the neighbouring step is in the same gradient accumulation group
  (training only; inference has no accumulation loop, so nothing is hidden);
- `OverlapDeviceIterationLoop`: the neighbouring step is in the same call.
A step then lasts as long as its busiest IPU's compute-tile work or its longest overlapped
transfer, whichever is longer: a transfer longer than the compute it overlaps still shows.
The first micro-batch's input (and the last one's output) of a window is never hidden.
"""
from __future__ import annotations

import ipusim as ip

from ..api.enums import OverlapMode

COMPUTE_KINDS = frozenset("FBWR")


def overlap_modes(exe) -> dict[int, OverlapMode]:
    """Engine program index -> mode of every prefetch and drain program of an executable."""
    modes = {}
    for low in exe.lowerings:
        for sp in low.stage_programs.values():
            for mode, index in (*sp.prefetch, *sp.drain):
                modes[index] = mode
    return modes


def _in_window(op, step, mode: OverlapMode, training: bool) -> bool:
    if mode == OverlapMode.OverlapDeviceIterationLoop:
        return True
    return training and any(o.kind in COMPUTE_KINDS and o.group == op.group for o in step.ops)


def hide_host_io(record, modes: dict[int, OverlapMode], training: bool) -> None:
    """Move the overlapped transfers of a call's record to the steps they overlap (see above)."""
    if not modes:
        return
    steps = record.steps
    for t, step in enumerate(steps):
        kept = []
        for e in step.events:
            mode = modes.get(e.program)
            there = t - 1 if e.part == "prefetch" else t + 1
            if mode is not None and 0 <= there < len(steps) and _in_window(e.op, steps[there], mode, training):
                steps[there].overlapped.append(e)
            else:
                kept.append(e)
        step.events = kept
    for step in steps:
        busy: dict[int, ip.Cycles] = {}
        for e in step.events:
            for ipu, c in e.per_ipu.items():
                busy[ipu] = busy.get(ipu, ip.Cycles()) + c
        io: dict[int, int] = {}
        for e in step.overlapped:
            for ipu, c in e.per_ipu.items():
                io[ipu] = io.get(ipu, 0) + c.total
        step.busy = busy
        step.cycles = max([c.total for c in busy.values()] + list(io.values()) + [0])
