"""ipusim.testing: the assertions pass on good schedules and fail with a message that says what
differs and draws the offending steps."""
import dataclasses

import pytest

from ipusim import schedules as S
from ipusim import testing


def swapped(s: S.Schedule, a: int, b: int) -> S.Schedule:
    """`s` with steps a and b exchanged."""
    steps = list(s.steps)
    steps[a], steps[b] = steps[b], steps[a]
    return dataclasses.replace(s, steps=tuple(steps))


def test_good_schedules_pass():
    s = S.one_f_one_b_schedule(4, gradient_accumulation=8)
    testing.assert_valid_order(s)
    testing.assert_ramp_up(s, 7)    # IPU0 first runs a backward at step 2N = 8
    testing.assert_bubble_fraction(s, 3 / 11, weight_update=False)
    testing.assert_in_flight_at_most(s, 4)
    testing.assert_in_flight_at_most(s, 1, ipu=3)
    tutorial = S.pipelined_schedule(4, training=True, gradient_accumulation=8)
    testing.assert_ramp_up(tutorial, 9)
    testing.assert_bubble_fraction(tutorial, 6 / 23)


def test_dependency_violation_names_both_ops_and_marks_the_step():
    s = swapped(S.one_f_one_b_schedule(3, gradient_accumulation=4), 1, 2)   # steps 2 and 3 exchanged
    with pytest.raises(AssertionError) as info:
        testing.assert_valid_order(s)
    text = str(info.value)
    assert "1F1B schedule is not a valid order: F2 of stage 1 (step 2) does not run after F2 of stage 0 (step 3)" in text
    lines = text.splitlines()
    assert lines[1].startswith("step   1  2  3") and lines[-1].index("^") == lines[1].index("2 ")


def test_missing_and_repeated_ops_and_flush_violations_are_reported():
    s = S.gpipe_schedule(2, gradient_accumulation=2, device_iterations=2)
    steps = list(s.steps)
    dropped = dataclasses.replace(s, steps=tuple(steps[:3] + steps[4:]))
    with pytest.raises(AssertionError, match="never runs|does not run after"):
        testing.assert_valid_order(dropped)
    repeated = dataclasses.replace(s, steps=tuple(steps[:2] + [steps[1]] + steps[2:]))
    with pytest.raises(AssertionError, match=r"runs twice: it ran at step 2 already"):
        testing.assert_valid_order(repeated)
    u = next(t for t, step in enumerate(steps) if step.is_weight_update)
    late = swapped(s, u, u + 1)   # a forward of group 1 before the weight update of group 0
    with pytest.raises(AssertionError, match=r"before the weight update of the group before"):
        testing.assert_valid_order(late)


def test_ramp_up_failure_draws_the_ramp():
    s = S.gpipe_schedule(3, gradient_accumulation=4)
    with pytest.raises(AssertionError) as info:
        testing.assert_ramp_up(s, 3)
    text = str(info.value)
    assert "GPipe schedule: ramp-up of group 0 is 2 steps, expected 3; steady state" in text
    assert "starts at step 3" in text and text.splitlines()[-1].strip() == "^"


def test_bubble_fraction_failure_names_the_idle_steps():
    s = S.gpipe_schedule(3, gradient_accumulation=4)
    with pytest.raises(AssertionError, match=r"bubble fraction 0\.333333, expected 0\.25 \(weight updates "
                                             r"left out\); idle steps per IPU \{0: 4, 1: 4, 2: 4\}"):
        testing.assert_bubble_fraction(s, 0.25, weight_update=False)


def test_in_flight_failure_names_the_ipu_and_the_step():
    s = S.zb_h2_schedule(3, gradient_accumulation=6)
    with pytest.raises(AssertionError) as info:
        testing.assert_in_flight_at_most(s, 3)
    text = str(info.value)
    assert "ZB-H2 schedule: IPU0 holds 4 micro-batches in flight after step 4 (at most 3 expected; its peak is 5)" in text
    assert "^" in text.splitlines()[-1]
