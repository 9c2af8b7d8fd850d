"""The training schedules of the literature (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2): their
figures, closed forms at unit costs for N = 1..16 stages and M = 1..64 micro-batches, stash
depths, flushes, errors and, by hypothesis, that every one is a valid order."""
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ipusim import schedules as S
from ipusim import testing
from ipusim.schedules.pricing import Costs, StageCosts, event_driven

KINDS = {"GPipe": S.gpipe_schedule, "1F1B": S.one_f_one_b_schedule, "ZB-H1": S.zb_h1_schedule,
         "ZB-H2": S.zb_h2_schedule}


def compute_bubble(s: S.Schedule) -> Fraction:
    """Idle IPU-steps / IPU-steps over the compute steps (weight updates left out), exactly."""
    steps = [t for t in s.steps if not t.is_weight_update]
    total = len(steps) * s.num_ipus
    return Fraction(total - sum(len(t.ops) for t in steps), total)


def peak(s: S.Schedule) -> int:
    return max(s.peak_in_flight(i) for i in range(s.num_ipus))


# --------------------------------------------------------------------------- figures

def test_1f1b_figure():
    assert str(S.one_f_one_b_schedule(4, gradient_accumulation=8)) == """\
step   1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23
IPU0   F1 F2 F3 F4 .  .  .  B1 F5 B2 F6 B3 F7 B4 F8 B5 .  B6 .  B7 .  B8 U
IPU1   .  F1 F2 F3 .  .  B1 F4 B2 F5 B3 F6 B4 F7 B5 F8 B6 .  B7 .  B8 .  U
IPU2   .  .  F1 F2 .  B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 F8 B7 .  B8 .  .  U
IPU3   .  .  .  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8 .  .  .  U"""


def test_gpipe_runs_all_forwards_then_all_backwards():
    s = S.gpipe_schedule(3, gradient_accumulation=4)
    for ipu in range(3):
        assert [op.label for op in s.order(ipu)] == ["F1", "F2", "F3", "F4", "B1", "B2", "B3", "B4", "U"]
    assert [s.peak_in_flight(i) for i in range(3)] == [4, 4, 4]


def test_zero_bubble_orders_are_the_papers_figure():
    """Qi et al. 2023, figure 3 (4 stages, 8 micro-batches): the first and last device of ZB-H1
    and ZB-H2, op for op."""
    h1 = S.zb_h1_schedule(4, gradient_accumulation=8)
    h2 = S.zb_h2_schedule(4, gradient_accumulation=8)

    def order(s, ipu):
        return " ".join(op.label for op in s.order(ipu) if op.kind != "U")

    assert order(h1, 0) == ("F1 F2 F3 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 B7 W7 B8 W8")
    assert order(h1, 3) == ("F1 B1 F2 B2 F3 B3 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 F8 B8 W5 W6 W7 W8")
    assert order(h2, 0) == ("F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8")
    assert order(h2, 3) == ("F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8")
    # the paper's figure: device 1 idles 3 slots before B1 in ZB-H1 and never in ZB-H2
    assert h1.render(0, 9).splitlines()[1] == "IPU0   F1 F2 F3 F4 .  .  .  B1 W1"
    assert h2.render(0, 9).splitlines()[1] == "IPU0   F1 F2 F3 F4 F5 F6 F7 B1 W1"


def test_interleaved_places_stage_s_on_ipu_s_mod_n_and_goes_chunk_by_chunk():
    s = S.interleaved_1f1b_schedule(2, 2, gradient_accumulation=4)
    assert s.stage_ipus == (0, 1, 0, 1) and s.num_stages == 4 and s.num_ipus == 2
    labels = [f"{op.label}s{op.stage}" for op in s.order(0) if op.kind != "U"]
    # rounds of 2 micro-batches: F on stage 0 then stage 2 for each round; warm-up (V-1)*2 + 2*(N-1) = 4
    assert labels[:4] == ["F1s0", "F2s0", "F1s2", "F2s2"]
    assert labels[4:8] == ["F3s0", "B1s2", "F4s0", "B2s2"]
    testing.assert_valid_order(s)


# --------------------------------------------------------------------------- closed forms

@pytest.mark.parametrize("n", range(1, 17))
def test_gpipe_and_1f1b_bubble_is_n_minus_1_over_m_plus_n_minus_1(n):
    for m in range(1, 65):
        for kind in ("GPipe", "1F1B"):
            s = KINDS[kind](n, gradient_accumulation=m)
            assert compute_bubble(s) == Fraction(n - 1, m + n - 1), (kind, n, m)
            assert s.num_steps == 2 * (m + n - 1) + 1
        assert peak(S.gpipe_schedule(n, gradient_accumulation=m)) == m
        one_f_one_b = S.one_f_one_b_schedule(n, gradient_accumulation=m)
        assert [one_f_one_b.peak_in_flight(i) for i in range(n)] == [min(n - i, m) for i in range(n)]


@pytest.mark.parametrize("n", range(2, 17))
def test_ramps_of_the_literature_kinds(n):
    """Ramp-up / steady state / ramp-down in steps for M >= 2N-1 (docs/schedules.md)."""
    for m in range(2 * n - 1, 65, 3):
        assert S.gpipe_schedule(n, gradient_accumulation=m).ramp_up() == n - 1
        testing.assert_ramp_up(S.one_f_one_b_schedule(n, gradient_accumulation=m), 2 * n - 1)
        for make, phases in ((S.one_f_one_b_schedule, (2 * n - 1, 2 * (m - n) + 1, 2 * n - 2)),
                             (S.zb_h1_schedule, (2 * n - 1, 3 * m - n, 0)),
                             (S.zb_h2_schedule, (n - 1, 3 * m - n + 1, n - 1))):
            s = make(n, gradient_accumulation=m)
            assert (s.ramp_up(), s.main(), s.ramp_down()) == phases, (s.strategy, n, m)


@pytest.mark.parametrize("n", range(1, 17))
def test_interleaved_bubble_is_n_minus_1_over_vm_plus_n_minus_1(n):
    for v in (2, 3, 4):
        for m in range(1, 65):
            rounds = max(1, m // n)
            if m % rounds:
                with pytest.raises(ValueError, match=f"not a multiple of {rounds}"):
                    S.interleaved_1f1b_schedule(n, v, gradient_accumulation=m)
                continue
            s = S.interleaved_1f1b_schedule(n, v, gradient_accumulation=m)
            closed = Fraction(n - 1, v * m + n - 1)
            if m >= n:
                assert compute_bubble(s) == closed, (n, v, m)
            else:   # one round of m < n micro-batches cannot fill the pipeline
                assert compute_bubble(s) > closed, (n, v, m)


@pytest.mark.parametrize("n", range(1, 17))
def test_zero_bubble_closed_forms_at_unit_costs(n):
    """At F = B = W = 1 (one step each) ZB-H1 idles N-1 steps per IPU once M >= N, ZB-H2 once
    M >= 2N-2; 1F1B's backward is B+W there, so it idles 3(N-1)."""
    equal = Costs(tuple(StageCosts(1, 1, 1) for _ in range(n)))
    for m in sorted(set(range(1, 2 * n + 3)) | {3 * n, 64}):  # both thresholds, beyond them, and far
        h1 = S.zb_h1_schedule(n, gradient_accumulation=m)
        h2 = S.zb_h2_schedule(n, gradient_accumulation=m)
        if m >= n:
            assert compute_bubble(h1) == Fraction(n - 1, 3 * m + n - 1), (n, m)
        if m >= 2 * n - 2:
            assert compute_bubble(h2) == Fraction(n - 1, 3 * m + n - 1), (n, m)
        one_f_one_b = event_driven(S.one_f_one_b_schedule(n, gradient_accumulation=m), equal)
        assert one_f_one_b.cycles == 3 * (m + n - 1)
        assert event_driven(h1, equal).cycles <= one_f_one_b.cycles
        assert peak(h1) == peak(S.one_f_one_b_schedule(n, gradient_accumulation=m)) == min(n, m)
        assert [h1.peak_in_flight(i) for i in range(n)] == [min(n, m)] * n
        assert peak(h2) == min(2 * n - 1, m)


@pytest.mark.parametrize("n", range(1, 17))
def test_zero_bubble_priced_closed_forms(n):
    """Event-driven, uniform stages, a flush per group: per IPU 1F1B idles (N-1)(F+B+W), ZB-H1
    (N-1)max(F, F+B-W) (M >= N), ZB-H2 (N-1)F (M >= 2N-1, F = B). So ZB-H1 never loses to 1F1B, and
    ZB-H2 beats ZB-H1 when B > W, once M >= 2N-1 (PopTorch's minimum gradient accumulation)."""
    for f, b, w in ((1, 1, 1), (1, 1, 0.5), (2, 3, 1)):
        costs = Costs(tuple(StageCosts(f, b, w) for _ in range(n)))
        work = f + b + w
        for m in sorted(set(range(1, 2 * n + 2)) | {24, 37, 64}):
            t1 = event_driven(S.one_f_one_b_schedule(n, gradient_accumulation=m), costs).cycles
            h1 = event_driven(S.zb_h1_schedule(n, gradient_accumulation=m), costs).cycles
            h2 = event_driven(S.zb_h2_schedule(n, gradient_accumulation=m), costs).cycles
            assert t1 == pytest.approx((m + n - 1) * work)
            assert h1 <= t1 + 1e-9
            if m >= n:
                assert h1 == pytest.approx(m * work + (n - 1) * max(f, f + b - w))
            if m >= 2 * n - 1:
                if f == b:
                    assert h2 == pytest.approx(m * work + (n - 1) * f)
                assert h2 <= h1 + 1e-9
                if n > 1 and b > w:
                    assert h2 < h1


def test_zb_h2_below_2n_minus_1_micro_batches_can_lose_to_zb_h1():
    """Documented limit: with fewer micro-batches than its warm-up, ZB-H2's deferred Ws pile up
    at the end of the last stage."""
    costs = Costs(tuple(StageCosts(1, 1, 1) for _ in range(4)))
    h1 = event_driven(S.zb_h1_schedule(4, gradient_accumulation=4), costs).cycles
    h2 = event_driven(S.zb_h2_schedule(4, gradient_accumulation=4), costs).cycles
    assert (h1, h2) == (15, 16)


# --------------------------------------------------------------------------- flushes, errors

@pytest.mark.parametrize("make", [
    lambda g, d: S.gpipe_schedule(3, gradient_accumulation=g, device_iterations=d),
    lambda g, d: S.one_f_one_b_schedule(3, gradient_accumulation=g, device_iterations=d),
    lambda g, d: S.zb_h1_schedule(3, gradient_accumulation=g, device_iterations=d),
    lambda g, d: S.zb_h2_schedule(3, gradient_accumulation=g, device_iterations=d),
    lambda g, d: S.interleaved_1f1b_schedule(3, 2, gradient_accumulation=g, device_iterations=d),
])
@pytest.mark.parametrize("g,d", [(3, 1), (6, 3), (9, 2)])
def test_each_group_ends_with_a_weight_update(make, g, d):
    s = make(g, d)
    updates = [t for t, step in enumerate(s.steps) if step.is_weight_update]
    assert len(updates) == d == s.num_groups and updates[-1] == s.num_steps - 1
    for group, t in enumerate(updates):
        assert sorted(op.ipu for op in s.steps[t].ops) == list(range(s.num_ipus))
        assert all(op.group == group for op in s.steps[t].ops)
    assert s.ramp_up() == d * s.ramp_up(0)
    testing.assert_valid_order(s)


@pytest.mark.parametrize("call,message", [
    (lambda: S.gpipe_schedule(0, gradient_accumulation=4), r"num_stages must be a positive integer"),
    (lambda: S.one_f_one_b_schedule(2, gradient_accumulation=0), r"gradient_accumulation must be a positive"),
    (lambda: S.zb_h1_schedule(2, gradient_accumulation=2, device_iterations=0),
     r"device_iterations must be a positive"),
    (lambda: S.interleaved_1f1b_schedule(4, 0, gradient_accumulation=8), r"virtual_stages must be a positive"),
    (lambda: S.interleaved_1f1b_schedule(4, 2, gradient_accumulation=9),
     r"2 rounds of 4, and gradient_accumulation=9 is not a multiple of 2: use a gradient_accumulation that "
     r"is a multiple of 4"),
])
def test_errors_say_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_deadlocking_orders_are_refused():
    with pytest.raises(ValueError, match="deadlock after 0 steps"):
        S.steps_from_orders({0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}, 2)


# --------------------------------------------------------------------------- properties

@st.composite
def training_schedules(draw):
    kind = draw(st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "ZB-H2"]))
    n = draw(st.integers(1, 8))
    d = draw(st.integers(1, 3))
    if kind == "Interleaved1F1B":
        v = draw(st.integers(1, 4))
        m = draw(st.integers(1, 24))
        assume(m % max(1, m // n) == 0)   # the rounds must divide the micro-batches
        return S.interleaved_1f1b_schedule(n, v, gradient_accumulation=m, device_iterations=d)
    return KINDS[kind](n, gradient_accumulation=draw(st.integers(1, 24)), device_iterations=d)


@settings(max_examples=300, deadline=None)
@given(training_schedules())
def test_every_training_schedule_is_a_valid_order(s):
    assert s.order_errors() == []
    testing.assert_valid_order(s)
    kinds = ("F", "B", "W") if s.strategy.startswith("ZB") else ("F", "B")
    done = [(op.kind, op.stage, op.global_micro_batch) for op in s.ops if op.kind != "U"]
    assert sorted(done) == sorted((k, st_, m) for k in kinds for st_ in range(s.num_stages)
                                  for m in range(s.num_micro_batches))
    assert s.split_backward == s.strategy.startswith("ZB")
    assert s.ramp_up() + s.main() + s.ramp_down() + s.num_groups == s.num_steps
    assert 0 <= s.bubble_fraction() < 1
