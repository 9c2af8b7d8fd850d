"""Assertions for unit tests of pipeline schedules (`ipusim.schedules.Schedule`).

Each helper raises AssertionError with a message that says what differs and draws the part of
the schedule where it shows, in the tutorial's figure format, with "^" under the step in question:

    from ipusim import schedules, testing
    s = schedules.one_f_one_b_schedule(4, gradient_accumulation=8)
    testing.assert_valid_order(s)
    testing.assert_ramp_up(s, 7)
    testing.assert_bubble_fraction(s, 3 / 11, weight_update=False)
    testing.assert_in_flight_at_most(s, 4)

See docs/schedules.md.
"""
from __future__ import annotations

import math

from .schedules import Schedule

CONTEXT_STEPS = 6


def excerpt(schedule: Schedule, step: int, context: int = CONTEXT_STEPS) -> str:
    """The figure of the steps around `step` (0-based), marked with "^" under it."""
    start = max(0, step - context)
    stop = min(schedule.num_steps, step + context + 1)
    return schedule.render(start, stop, mark=step)


def _group_start(schedule: Schedule, group: int) -> int:
    return next(t for t, s in enumerate(schedule.steps) if s.group == group)


def assert_valid_order(schedule: Schedule) -> None:
    """Every op of every stage and micro-batch runs exactly once, on its stage's IPU, after
    what it needs (a stage's F of micro-batch k after the previous stage's F of k; B after the
    next stage's B, or after its own F on the last stage; W after its B) and within its group's
    flush."""
    errors = schedule.order_errors()
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more: {'; '.join(map(str, errors[1:4]))}" \
               f"{'; ...' if len(errors) > 4 else ''})" if len(errors) > 1 else ""
        raise AssertionError(f"{schedule.strategy} schedule is not a valid order: {first}{more}\n"
                             f"{excerpt(schedule, first.step)}")


def assert_ramp_up(schedule: Schedule, expected: int, group: int | None = 0) -> None:
    """The ramp-up of `group` (default the first; None: summed over groups) is `expected`
    steps: the steps before the first run of steady state (see Schedule.ramp_up)."""
    got = schedule.ramp_up(group)
    if got != expected:
        g = 0 if group is None else group
        start = _group_start(schedule, g)
        first_full = start + schedule.ramp_up(g)
        raise AssertionError(
            f"{schedule.strategy} schedule: ramp-up of {'all groups' if group is None else f'group {group}'} "
            f"is {got} steps, expected {expected}; steady state (as many IPUs busy as ever in the group) "
            f"starts at step {first_full + 1}:\n"
            f"{schedule.render(start, min(schedule.num_steps, first_full + CONTEXT_STEPS), mark=first_full)}")


def assert_bubble_fraction(schedule: Schedule, expected: float, *, ipu: int | None = None,
                           weight_update: bool = True, rel: float = 1e-9) -> None:
    """The schedule's bubble fraction (idle IPU-steps / IPU-steps, for one IPU or all; the
    weight-update steps left out when `weight_update` is False) is `expected` within `rel`."""
    got = schedule.bubble_fraction(ipu, weight_update=weight_update)
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=rel):
        ipus = range(schedule.num_ipus) if ipu is None else [ipu]
        counted = sum(1 for step in schedule.steps if weight_update or not step.is_weight_update)
        idle = {i: counted - schedule.busy(i, weight_update=weight_update) for i in ipus}
        worst = max(idle, key=idle.get)
        first_idle = next((t for t, s in enumerate(schedule.steps) if s.op_on(worst) is None), 0)
        raise AssertionError(
            f"{schedule.strategy} schedule: bubble fraction {got:.6g}"
            f"{'' if ipu is None else f' on IPU{ipu}'}, expected {expected:.6g} "
            f"({'weight updates counted' if weight_update else 'weight updates left out'}); idle steps per IPU "
            f"{idle}; IPU{worst} first idles at step {first_idle + 1}:\n{excerpt(schedule, first_idle)}")


def assert_in_flight_at_most(schedule: Schedule, limit: int, ipu: int | None = None) -> None:
    """At no step does an IPU (or `ipu`) hold more than `limit` micro-batches in flight: forwards
    run whose backward (its W when the backward is split) has not."""
    for i in range(schedule.num_ipus) if ipu is None else [ipu]:
        counts = schedule.in_flight(i)
        over = next((t for t, c in enumerate(counts) if c > limit), None)
        if over is not None:
            raise AssertionError(
                f"{schedule.strategy} schedule: IPU{i} holds {counts[over]} micro-batches in flight after step "
                f"{over + 1} (at most {limit} expected; its peak is {max(counts)}):\n{excerpt(schedule, over)}")
