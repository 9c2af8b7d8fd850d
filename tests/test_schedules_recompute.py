"""Schedules with recomputation (Schedule.with_recomputation): an R op runs on its stage's IPU
right before each B of a recomputed stage, in the B's step, as PopART runs the recomputation in
the backward's pipeline stage; every schedule kind stays a valid order, and pricing adds R to its
step."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipusim import schedules
from ipusim.schedules import Costs, Op, StageCosts, Step, price


def test_r_runs_in_its_b_step_before_it():
    plain = schedules.pipelined_schedule(4, training=True, gradient_accumulation=8)
    s = plain.with_recomputation([0, 1, 2])
    assert s.num_steps == plain.num_steps and s.recomputed_stages == (0, 1, 2)
    assert s.order_errors() == []
    for step, before in zip(s.steps, plain.steps):
        assert [op for op in step.ops if op.kind != "R"] == list(before.ops)
        for ops in step.by_ipu():
            if ops[-1].kind == "B" and ops[-1].stage < 3:
                assert [o.kind for o in ops] == ["R", "B"]
                assert (ops[0].stage, ops[0].global_micro_batch) == (ops[1].stage, ops[1].global_micro_batch)
    assert s.render(8, 13).splitlines()[1].split()[1:] == [".", "F7", "RB1", "F8", "RB2"]
    assert [s.peak_in_flight(i) for i in range(4)] == [plain.peak_in_flight(i) for i in range(4)]
    assert s.with_recomputation([]) is s and plain.with_recomputation(()) is plain


def test_r_needs_its_b_and_training():
    with pytest.raises(ValueError, match="a recompute R only right before the B of its stage and micro-batch"):
        Step((Op("R", 0, 0, 0, 0, 0), Op("B", 0, 1, 0, 0, 1)), 0)
    with pytest.raises(ValueError, match="a recompute R only right before the B of its stage and micro-batch"):
        Step((Op("B", 0, 0, 0, 0, 0), Op("R", 0, 0, 0, 0, 0)), 0)
    with pytest.raises(ValueError, match="inference"):
        schedules.pipelined_schedule(2, training=False, device_iterations=2).with_recomputation([0])
    with pytest.raises(ValueError, match="stages \\[5\\]"):
        schedules.pipelined_schedule(2, training=True, gradient_accumulation=3).with_recomputation([5])
    s = schedules.sharded_schedule(2, training=True, gradient_accumulation=2).with_recomputation([0])
    steps = list(s.steps)
    alone = Step(tuple(op for op in steps[3].ops if op.kind == "R"), 0)   # R1 of stage 0 moved a step early
    steps[2:4] = [Step(steps[2].ops + alone.ops, 0), Step(tuple(op for op in steps[3].ops if op.kind != "R"), 0)]
    moved = schedules.Schedule(s.strategy, s.num_ipus, s.stage_ipus, True, s.micro_batches_per_group, tuple(steps))
    assert any("does not run in the step of the B1" in str(e) for e in moved.order_errors())


KINDS = {"grouped": lambda n, g: schedules.pipelined_schedule(n, training=True, gradient_accumulation=g),
         "interleaved": lambda n, g: schedules.pipelined_schedule(n, training=True, gradient_accumulation=g,
                                                                  kind="interleaved"),
         "GPipe": lambda n, g: schedules.gpipe_schedule(n, gradient_accumulation=g),
         "1F1B": lambda n, g: schedules.one_f_one_b_schedule(n, gradient_accumulation=g),
         "ZB-H1": lambda n, g: schedules.zb_h1_schedule(n, gradient_accumulation=g),
         "ZB-H2": lambda n, g: schedules.zb_h2_schedule(n, gradient_accumulation=g),
         "sharded": lambda n, g: schedules.sharded_schedule(n, training=True, gradient_accumulation=g)}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.integers(1, 6), st.integers(0, 4), st.data())
def test_recomputation_keeps_every_schedule_valid_and_prices_r_in_its_step(kind, n, extra, data):
    plain = KINDS[kind](n, 2 * n - 1 + extra)
    stages = data.draw(st.sets(st.integers(0, n - 1)))
    s = plain.with_recomputation(stages)
    assert s.order_errors() == [] and s.num_steps == plain.num_steps
    assert sum(op.kind == "R" for op in s.ops) == len(stages) * s.num_micro_batches
    forward, recomputed, backward = 3.0, 2.0, 5.0
    costs = Costs(tuple(StageCosts(forward, backward, 1.0, 10, recomputed) for _ in range(n)))
    p, q = price(plain, costs), price(s, costs)
    assert q.peak_stash_bytes == p.peak_stash_bytes
    assert q.lock_step.cycles >= p.lock_step.cycles and q.event_driven.cycles >= p.event_driven.cycles
    assert sum(q.lock_step.busy) == pytest.approx(sum(p.lock_step.busy) + recomputed * len(stages) * s.num_micro_batches)
    # lock-step: a step lasts as long as its busiest IPU, an R and its B adding up
    weight = 0.0 if s.split_backward else 1.0
    cost = {"F": forward, "R": recomputed, "B": backward + weight, "W": 1.0, "U": 0.0}
    assert q.lock_step.cycles == pytest.approx(sum(max(sum(cost[o.kind] for o in ops) for ops in step.by_ipu())
                                                   for step in s.steps))
