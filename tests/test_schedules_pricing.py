"""Pricing schedules on per-stage costs: lock-step and event-driven timings, bubble fraction in
time, peak stash, copies and weight updates, errors."""
import pytest

from ipusim import schedules as S
from ipusim.schedules.pricing import Costs, StageCosts, event_driven, lock_step, peak_stash_bytes, price


def test_unit_costs_make_both_timings_the_step_count():
    for s in (S.pipelined_schedule(4, training=True, gradient_accumulation=8),
              S.gpipe_schedule(3, gradient_accumulation=5, device_iterations=2),
              S.zb_h1_schedule(4, gradient_accumulation=6),
              S.interleaved_1f1b_schedule(2, 2, gradient_accumulation=4)):
        costs = Costs(tuple(StageCosts(1, 1, 1 if s.split_backward else 0) for _ in range(s.num_stages)), update=1)
        p = price(s, costs)
        assert p.lock_step.cycles == p.event_driven.cycles == s.num_steps, s.strategy
        assert p.lock_step.bubble_fraction() == pytest.approx(s.bubble_fraction())
        assert p.event_driven.bubble_fraction(1) == pytest.approx(s.bubble_fraction(1))


def test_lock_step_charges_the_slowest_op_of_each_step_and_one_copy():
    s = S.one_f_one_b_schedule(2, gradient_accumulation=3)
    costs = Costs((StageCosts(10, 30), StageCosts(20, 40)), copy=5, update=7)
    t = lock_step(s, costs)
    expected = 0.0
    for step in s.steps:
        cost = {"F": lambda st: (10, 20)[st], "B": lambda st: (30, 40)[st]}
        length = max(7 if op.kind == "U" else cost[op.kind](op.stage) for op in step.ops)
        sends = any((op.kind == "F" and op.stage == 0) or (op.kind == "B" and op.stage == 1) for op in step.ops)
        expected += length + (5 if sends else 0)
    assert t.cycles == expected
    assert t.busy == (3 * 40 + 7, 3 * 60 + 7)


def test_event_driven_runs_each_ipu_as_soon_as_it_can():
    # 2 stages, 1F1B, 2 micro-batches: IPU0 F1 F2 . B1 B2; IPU1 F1 B1 F2 B2
    s = S.one_f_one_b_schedule(2, gradient_accumulation=2)
    t = event_driven(s, Costs((StageCosts(1, 2), StageCosts(3, 4)), copy=1, update=5))
    at = {(i.op.kind, i.op.stage, i.op.global_micro_batch): (i.start, i.end) for i in t.intervals if i.op.kind != "U"}
    assert at[("F", 0, 0)] == (0, 1) and at[("F", 0, 1)] == (1, 2)
    assert at[("F", 1, 0)] == (2, 5)            # after F1 of stage 0 and one copy
    assert at[("B", 1, 0)] == (5, 9)
    assert at[("F", 1, 1)] == (9, 12)           # IPU1 runs in its order: B1 before F2
    assert at[("B", 0, 0)] == (10, 12)          # B1 of stage 1 plus one copy
    assert at[("B", 1, 1)] == (12, 16) and at[("B", 0, 1)] == (17, 19)
    updates = [i for i in t.intervals if i.op.kind == "U"]
    assert all((u.start, u.end) == (19, 24) for u in updates)   # the flush waits for every IPU
    assert t.cycles == 24 and t.busy == (1 + 1 + 2 + 2 + 5, 3 + 3 + 4 + 4 + 5)
    assert t.bubble_fraction() == pytest.approx(1 - (11 + 19) / 48)


def test_groups_flush_in_both_timings():
    s = S.zb_h2_schedule(3, gradient_accumulation=5, device_iterations=3)
    t = event_driven(s, Costs(tuple(StageCosts(2, 3, 1) for _ in range(3)), copy=1, update=4))
    for g in range(1, 3):
        flushed = max(i.end for i in t.intervals if i.op.kind == "U" and i.op.group == g - 1)
        assert min(i.start for i in t.intervals if i.op.group == g) >= flushed
    one = event_driven(S.zb_h2_schedule(3, gradient_accumulation=5), Costs(tuple(StageCosts(2, 3, 1) for _ in range(3)),
                                                                            copy=1, update=4))
    assert t.cycles == pytest.approx(3 * one.cycles)


def test_whole_backward_costs_b_plus_w_when_not_split():
    costs = Costs((StageCosts(1, 2, 3),))
    assert event_driven(S.one_f_one_b_schedule(1, gradient_accumulation=2), costs).cycles == 2 * (1 + 2 + 3)
    assert event_driven(S.zb_h1_schedule(1, gradient_accumulation=2), costs).cycles == 2 * (1 + 2 + 3)


def test_event_driven_1f1b_beats_lock_step_when_backward_is_dearer():
    """1F1B mixes forwards and backwards in a step: in lock-step every such step costs a
    backward. That is why the figures use the event-driven timing for these kinds."""
    costs = Costs(tuple(StageCosts(1, 2) for _ in range(4)))
    s = S.one_f_one_b_schedule(4, gradient_accumulation=8)
    assert event_driven(s, costs).cycles == (8 + 3) * 3
    assert lock_step(s, costs).cycles > event_driven(s, costs).cycles


def test_peak_stash_bytes_follow_the_in_flight_counts():
    s = S.one_f_one_b_schedule(3, gradient_accumulation=6)
    assert peak_stash_bytes(s, [100, 10, 1]) == (300, 20, 1)
    h1 = S.zb_h1_schedule(3, gradient_accumulation=6)
    assert peak_stash_bytes(h1, [100, 10, 1]) == (300, 30, 3)   # released at W
    inter = S.interleaved_1f1b_schedule(2, 2, gradient_accumulation=4)
    # IPU0 peaks after step 7 with F1..F4 of stage 0 and F2 of stage 2; IPU1 with three of stage 1
    assert peak_stash_bytes(inter, [1000, 100, 10, 1]) == (4010, 300)
    assert peak_stash_bytes(S.pipelined_schedule(2, training=False, device_iterations=4), [5, 5]) == (0, 0)


@pytest.mark.parametrize("call,message", [
    (lambda: lock_step(S.gpipe_schedule(3, gradient_accumulation=3), Costs((StageCosts(1, 1),))),
     r"costs for 1 stages given for a schedule of 3 stages"),
    (lambda: event_driven(S.gpipe_schedule(2, gradient_accumulation=3), Costs((StageCosts(1, 1),) * 2,
                                                                                update=(1.0,))),
     r"weight-update cycles for 1 IPUs given for a schedule on 2 IPUs"),
    (lambda: peak_stash_bytes(S.gpipe_schedule(2, gradient_accumulation=3), [1]),
     r"activation bytes for 1 stages given for a schedule of 2 stages"),
])
def test_errors_name_the_mismatch(call, message):
    with pytest.raises(ValueError, match=message):
        call()
