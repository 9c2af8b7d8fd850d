"""The price of a schedule on given per-stage costs: time per call, bubble fraction in time and
peak stash memory per IPU.

Two timings of the same per-IPU orders:

- *lock-step*, as PopTorch's runtime (and this emulator's executor) runs a schedule: the ops of a
  step start together, and the step lasts as long as its slowest op plus, when any op of the
  step sends a result to another IPU, one inter-IPU copy;
- *event-driven*, as GPipe, 1F1B and the zero-bubble schedules are meant to run: each IPU runs
  its ops in order, each as soon as the IPU is free and what it needs has finished (plus one
  copy when that came from another IPU). A weight update still waits for every op of its group
  on every IPU, and the next group for every weight update: each group flushes.

At unit costs (every op 1, copies 0) both equal the number of steps. A backward "B" of a
schedule whose backward is not split costs `backward + weight_gradient`: the whole backward. A
recompute "R" costs the stage's `recompute` cycles (its forward's when not given) and runs on its
IPU just before its B: in lock-step the two add up within their step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .core import Op, Schedule, dependencies


@dataclass(frozen=True)
class StageCosts:
    """One stage's costs for one micro-batch: cycles of its forward, of its input-gradient
    backward B and of its weight gradient W (the whole backward is `backward + weight_gradient`),
    the bytes its forward stashes until its backward is done, and the cycles of its recompute R
    (None: as its forward) when the schedule recomputes it."""

    forward: float
    backward: float
    weight_gradient: float = 0.0
    activation_bytes: int = 0
    recompute: float | None = None


@dataclass(frozen=True)
class Costs:
    """Per-stage costs, the cycles of one inter-IPU copy (an activation forward or a gradient
    backward) and of the weight update on each IPU (one number for every IPU, or one per IPU)."""

    stages: tuple[StageCosts, ...]
    copy: float = 0.0
    update: float | tuple[float, ...] = 0.0

    def update_on(self, ipu: int) -> float:
        if isinstance(self.update, (int, float)):
            return float(self.update)
        return float(self.update[ipu])


@dataclass(frozen=True)
class Interval:
    """One op's place in a timing: cycles from the start of the call."""

    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Timing:
    """One timing of a call: its length, each IPU's busy cycles, and every op's interval."""

    mode: str                      # "lock-step" or "event-driven"
    cycles: float
    busy: tuple[float, ...]        # per IPU, weight updates included
    intervals: tuple[Interval, ...]

    def bubble_fraction(self, ipu: int | None = None) -> float:
        """Idle time / available time, for one IPU or all of them."""
        if self.cycles <= 0:
            return 0.0
        ipus = range(len(self.busy)) if ipu is None else [ipu]
        return 1.0 - sum(self.busy[i] for i in ipus) / (len(ipus) * self.cycles)


@dataclass(frozen=True)
class Price:
    """A schedule's price: both timings and the peak stash per IPU."""

    strategy: str
    lock_step: Timing
    event_driven: Timing
    peak_stash_bytes: tuple[int, ...]


def op_cycles(schedule: Schedule, costs: Costs, op: Op) -> float:
    """Cycles of one op (without copies)."""
    if op.kind == "U":
        return costs.update_on(op.ipu)
    stage = costs.stages[op.stage]
    if op.kind == "F":
        return stage.forward
    if op.kind == "R":
        return stage.forward if stage.recompute is None else stage.recompute
    if op.kind == "W":
        return stage.weight_gradient
    return stage.backward + (0.0 if schedule.split_backward else stage.weight_gradient)


def sends_across(schedule: Schedule, op: Op) -> bool:
    """Whether `op`'s result goes to another IPU: a forward to the next stage's IPU, a backward
    to the previous stage's."""
    if op.kind == "F" and op.stage + 1 < schedule.num_stages:
        return schedule.stage_ipus[op.stage + 1] != op.ipu
    if op.kind == "B" and op.stage > 0:
        return schedule.stage_ipus[op.stage - 1] != op.ipu
    return False


def _check(schedule: Schedule, costs: Costs) -> None:
    if len(costs.stages) != schedule.num_stages:
        raise ValueError(f"costs for {len(costs.stages)} stages given for a schedule of {schedule.num_stages} "
                         "stages: give one StageCosts per stage")
    if not isinstance(costs.update, (int, float)) and len(costs.update) < schedule.num_ipus:
        raise ValueError(f"weight-update cycles for {len(costs.update)} IPUs given for a schedule on "
                         f"{schedule.num_ipus} IPUs: give one number, or one per IPU")


def lock_step(schedule: Schedule, costs: Costs) -> Timing:
    """Each step lasts as long as its busiest IPU (an R and its B run one after the other), plus
    one copy when an op of the step sends to another IPU."""
    _check(schedule, costs)
    t = 0.0
    busy = [0.0] * schedule.num_ipus
    intervals = []
    for step in schedule.steps:
        length = 0.0
        for ops in step.by_ipu():
            u = t
            for op in ops:
                c = op_cycles(schedule, costs, op)
                intervals.append(Interval(op, u, u + c))
                busy[op.ipu] += c
                u += c
            length = max(length, u - t)
        if any(sends_across(schedule, op) for op in step.ops):
            length += costs.copy
        t += length
    return Timing("lock-step", t, tuple(busy), tuple(intervals))


def event_driven(schedule: Schedule, costs: Costs) -> Timing:
    """Each IPU runs its ops in order, each as soon as the IPU is free and what it needs has
    finished (one copy later when that ran on another IPU); weight updates flush each group."""
    _check(schedule, costs)
    orders = [schedule.order(i) for i in range(schedule.num_ipus)]
    pos = [0] * schedule.num_ipus
    free = [0.0] * schedule.num_ipus
    end: dict[tuple[str, int, int], float] = {}
    group_end: dict[int, float] = {}      # latest end of a compute op of the group
    flushed: dict[int, float] = {-1: 0.0}  # when the group's weight updates have all finished
    updates_left = {g: sum(1 for op in schedule.ops if op.kind == "U" and op.group == g)
                    for g in range(schedule.num_groups)}
    compute_left = {g: sum(1 for op in schedule.ops if op.kind != "U" and op.group == g)
                    for g in range(schedule.num_groups)}
    busy = [0.0] * schedule.num_ipus
    intervals = []
    left = sum(map(len, orders))
    while left:
        progressed = False
        for ipu, order in enumerate(orders):
            while pos[ipu] < len(order):
                op = order[pos[ipu]]
                ready = max(free[ipu], flushed.get(op.group - 1, 0.0) if schedule.training else 0.0)
                if op.kind == "U":
                    if compute_left[op.group]:
                        break
                    ready = max(ready, group_end.get(op.group, 0.0))
                else:
                    needs = dependencies(op.kind, op.stage, op.global_micro_batch, schedule.num_stages)
                    if schedule.training and (op.group - 1) in updates_left and updates_left[op.group - 1]:
                        break
                    if any(n not in end for n in needs):
                        break
                    for n in needs:
                        ready = max(ready, end[n] + (costs.copy if schedule.stage_ipus[n[1]] != ipu else 0.0))
                c = op_cycles(schedule, costs, op)
                finish = ready + c
                intervals.append(Interval(op, ready, finish))
                busy[ipu] += c
                free[ipu] = finish
                pos[ipu] += 1
                left -= 1
                progressed = True
                if op.kind == "U":
                    updates_left[op.group] -= 1
                    if not updates_left[op.group]:
                        flushed[op.group] = max(i.end for i in intervals
                                                if i.op.kind == "U" and i.op.group == op.group)
                else:
                    end[(op.kind, op.stage, op.global_micro_batch)] = finish
                    compute_left[op.group] -= 1
                    group_end[op.group] = max(group_end.get(op.group, 0.0), finish)
        if not progressed:
            raise ValueError("the schedule's per-IPU orders deadlock: check it with Schedule.order_errors()")
    total = max((i.end for i in intervals), default=0.0)
    return Timing("event-driven", total, tuple(busy), tuple(sorted(intervals, key=lambda i: (i.start, i.op.ipu))))


def peak_stash_bytes(schedule: Schedule, activation_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per IPU, the most bytes of stashed activations live at once: a stage's forward stashes
    `activation_bytes[stage]` until its backward is done (its W when the backward is split).
    Both timings run each IPU's ops in the same order, so they share this peak."""
    if len(activation_bytes) != schedule.num_stages:
        raise ValueError(f"activation bytes for {len(activation_bytes)} stages given for a schedule of "
                         f"{schedule.num_stages} stages")
    release = schedule.release_kind
    peaks = []
    for ipu in range(schedule.num_ipus):
        live = peak = 0
        for op in schedule.order(ipu) if schedule.training else ():
            if op.kind == "F":
                live += activation_bytes[op.stage]
            elif op.kind == release:
                live -= activation_bytes[op.stage]
            peak = max(peak, live)
        peaks.append(int(peak))
    return tuple(peaks)


def price(schedule: Schedule, costs: Costs) -> Price:
    """Both timings of `schedule` on `costs`, and its peak stash per IPU."""
    return Price(schedule.strategy, lock_step(schedule, costs), event_driven(schedule, costs),
                 peak_stash_bytes(schedule, [s.activation_bytes for s in costs.stages]))
