"""When each input and output of a call moved between host and device: PopTorch's performance
counters (``PoplarExecutor.getPerfCounters``) and the latencies derived from them.

The times come from the call's run record (``executor.RunRecord``): the emulated cycles of every
program each IPU ran, step by step, at the target's clock. Within a step every IPU starts at the
step's start and runs its programs one after the other; a program that spans IPUs (an inter-IPU
copy) starts when all of them are free. A stage program reads its inputs from the host at the
start of its body (``input``) and has them after the body's host-transfer cycles
(``input_complete``); its outputs program starts sending the results to the host (``output``)
and ends with them on the host (``output_complete``). Times are seconds from the start of the
call (PopTorch's reference point is unspecified; only differences mean anything).
"""
from __future__ import annotations

from typing import Callable

EVENTS = ("input", "input_complete", "output", "output_complete")


def perf_counters(record, exe, num_outputs: int) -> dict[str, list[list[float]]]:
    """The four counters of a call: per input (or output) index, one time per micro-batch and
    replica it moved for, in time order."""
    clock = record.clock_hz
    body_of, outputs_of = {}, {}      # engine program -> (replica, stage program)
    for r, low in enumerate(exe.lowerings):
        for sp in low.stage_programs.values():
            body_of[sp.body] = (r, sp)
            if sp.outputs >= 0:
                outputs_of[sp.outputs] = (r, sp)
    inputs = {i: {} for i in range(len(exe.ir.inputs))}
    outputs = {i: {} for i in range(num_outputs)}
    start = 0
    for step in record.steps:
        free: dict[int, int] = {}
        for event in step.events:
            ipus = list(event.per_ipu)
            begin = max((free.get(i, 0) for i in ipus), default=0)
            for ipu, cycles in event.per_ipu.items():
                free[ipu] = begin + cycles.total
            length = max((c.total for c in event.per_ipu.values()), default=0)
            host = max((c.host for c in event.per_ipu.values()), default=0)
            at = (start + begin) / clock
            if event.part == "compute" and event.program in body_of:
                replica, sp = body_of[event.program]
                for _, index in sp.inputs:
                    inputs[index].setdefault((event.op.global_micro_batch, replica),
                                             (at, (start + begin + host) / clock))
            elif event.part == "outputs" and event.program in outputs_of:
                replica, sp = outputs_of[event.program]
                for _, index in sp.output_streams:
                    if index in outputs:
                        outputs[index].setdefault((event.op.global_micro_batch, replica),
                                                  (at, (start + begin + length) / clock))
        start += step.cycles

    def lists(table: dict, which: int) -> list[list[float]]:
        rows = [[times[which] for _, times in sorted(per.items(), key=lambda kv: kv[1])] for per in table.values()]
        return rows or [[]]

    return {"input": lists(inputs, 0), "input_complete": lists(inputs, 1),
            "output": lists(outputs, 0), "output_complete": lists(outputs, 1)}


def empty() -> dict[str, list[list[float]]]:
    """The counters before any call (PopTorch's shape: one empty list per event)."""
    return {name: [[]] for name in EVENTS}


def latency(counters: dict, start: str, start_reduce: Callable, end: str, end_reduce: Callable
            ) -> tuple[float, float, float]:
    """(min, max, mean) over the call's iterations of the time from event `start` (reduced over
    the inputs or outputs with `start_reduce`) to event `end` (with `end_reduce`); a group of
    starting iterations per ending one (gradient accumulation, output modes) counts from its
    earliest start, as in PopTorch."""
    starts = [start_reduce(values) for values in zip(*counters[start])]
    ends = [end_reduce(values) for values in zip(*counters[end])]
    if not ends or not starts:
        return (0.0, 0.0, 0.0)
    factor = max(len(starts) // len(ends), 1)
    firsts = [min(starts[i:i + factor]) for i in range(0, factor * len(ends), factor)]
    durations = [e - s for s, e in zip(firsts, ends)]
    return (min(durations), max(durations), sum(durations) / len(durations))
