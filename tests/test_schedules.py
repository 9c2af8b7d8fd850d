"""Schedules as data: the tutorial figure, closed forms, flushes, errors and invariants."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipusim.schedules import (
    Op, Schedule, Step, parallel_phased_schedule, pipelined_schedule, serial_phased_schedule,
    sharded_schedule)

# DESIGN.md section 4: Graphcore's tutorial figure, 4 IPUs, training, micro-batches 1..8.
TUTORIAL_FIGURE = """\
step   1  2  3  4  5  6  7  8  9  10 11 12 13
IPU0   F1 F2 F3 F4 .  F5 .  F6 .  F7 B1 F8 B2
IPU1   .  F1 F2 F3 .  F4 .  F5 B1 F6 B2 F7 B3
IPU2   .  .  F1 F2 .  F3 B1 F4 B2 F5 B3 F6 B4
IPU3   .  .  .  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"""


def tutorial():
    return pipelined_schedule(4, training=True, gradient_accumulation=8)


def step_of(schedule):
    """(kind, stage, global micro-batch) -> step index, for F and B ops."""
    return {(op.kind, op.stage, op.global_micro_batch): t
            for t, step in enumerate(schedule.steps) for op in step.ops if op.kind != "U"}


def popart_cycles(pipeline_stages, micro_batches):
    """PopART: P pipeline stages and G micro-batches take 2(P-1) + (G-(P-1)) cycles."""
    return 2 * (pipeline_stages - 1) + (micro_batches - (pipeline_stages - 1))


# --------------------------------------------------------------------------- the figure

def test_tutorial_figure_cell_by_cell():
    grid = tutorial().grid()
    rows = [line.split()[1:] for line in TUTORIAL_FIGURE.splitlines()[1:]]
    for ipu, row in enumerate(rows):
        for t, expected in enumerate(row):
            op = grid[ipu][t]
            assert (op.label if op else ".") == expected, f"IPU{ipu} step {t + 1}"


def test_tutorial_figure_rendering_is_exact():
    assert tutorial().render(0, 13) == TUTORIAL_FIGURE
    assert str(tutorial()) == tutorial().render()


def test_full_tutorial_schedule_flushes_then_updates_weights():
    s = tutorial()
    assert s.num_steps == 23 and s.num_groups == 1
    assert [op.kind for op in s.steps[-1].ops] == ["U"] * 4
    assert s.render().splitlines()[1].split()[-5:] == ["B5", "B6", "B7", "B8", "U"]


def test_inference_runs_stage_s_on_micro_batch_k_at_step_k_plus_s():
    s = pipelined_schedule(3, training=False, device_iterations=7)
    assert s.num_steps == 7 + 3 - 1
    for (kind, stage, k), t in step_of(s).items():
        assert kind == "F" and t == k + stage
    assert not any(step.is_weight_update for step in s.steps)


def test_shared_ipu_cells_name_the_stage():
    s = pipelined_schedule(2, training=False, device_iterations=2, stage_ipus=[0, 0])
    assert s.render() == "step   1    2         3\nIPU0   F1s0 F2s0+F1s1 F2s1"


# --------------------------------------------------------------------------- closed forms

def test_tutorial_ramp_up_is_2n_plus_1_for_n_4():
    assert tutorial().ramp_up() == 2 * 4 + 1 == 9


@pytest.mark.parametrize("n", range(1, 17))
def test_grouped_phase_lengths_closed_form(n):
    for g in (2 * n - 1, 2 * n + 3):
        s = pipelined_schedule(n, training=True, gradient_accumulation=g)
        assert s.ramp_up() == 3 * (n - 1)
        assert s.main() == 2 * (g - 2 * (n - 1))
        assert s.ramp_down() == 3 * (n - 1)
        assert s.num_steps == 2 * (g + n - 1) + 1  # compute steps + the weight update


def test_tutorial_2n_plus_1_agrees_with_the_rule_only_at_n_4():
    agree = [n for n in range(1, 17)
             if pipelined_schedule(n, training=True, gradient_accumulation=2 * n - 1).ramp_up()
             == 2 * n + 1]
    assert agree == [4]


@pytest.mark.parametrize("n", range(1, 9))
def test_interleaved_phase_lengths_closed_form(n):
    g = 2 * n + 1
    s = pipelined_schedule(n, training=True, gradient_accumulation=g, kind="interleaved")
    assert (s.ramp_up(), s.main(), s.ramp_down()) == (2 * (n - 1), 2 * (g - n + 1), 2 * (n - 1))
    assert s.num_steps == pipelined_schedule(n, training=True, gradient_accumulation=g).num_steps


@pytest.mark.parametrize("n", range(1, 9))
def test_grouped_step_count_against_popart_closed_form(n):
    for g in range(2 * n - 1, 2 * n + 6):
        cycles = popart_cycles(2 * n - 1, g)
        s = pipelined_schedule(n, training=True, gradient_accumulation=g)
        # Each PopART cycle is a forward step and a backward step, except the n-1 fill cycles
        # (forwards only) and the n-1 flush cycles (backwards only): one step each.
        assert s.num_steps - 1 == 2 * cycles - 2 * (n - 1)
        # PopART's fill / main / flush phases are exactly this schedule's ramp-up / main /
        # ramp-down.
        fill = 2 * n - 2
        assert s.ramp_up() == (n - 1) + 2 * (fill - (n - 1))
        assert s.main() == 2 * (g - fill)


@pytest.mark.parametrize("n", range(1, 8))
def test_every_op_sits_in_its_popart_cycle(n):
    g = 2 * n + 2
    cycles = popart_cycles(2 * n - 1, g)
    fill_only, flush_start = n - 1, cycles - (n - 1)
    for (kind, stage, k), t in step_of(pipelined_schedule(
            n, training=True, gradient_accumulation=g)).items():
        cycle = k + (stage if kind == "F" else 2 * n - 2 - stage)
        if cycle < fill_only:
            expected = cycle
        elif cycle < flush_start:
            expected = fill_only + 2 * (cycle - fill_only) + (kind == "B")
        else:
            expected = fill_only + 2 * (flush_start - fill_only) + cycle - flush_start
        assert t == expected, (kind, stage, k)


@pytest.mark.parametrize("n,d", [(1, 1), (3, 3), (4, 9), (6, 20)])
def test_inference_step_count_is_popart_closed_form(n, d):
    s = pipelined_schedule(n, training=False, device_iterations=d)
    assert s.num_steps == popart_cycles(n, d)
    assert (s.ramp_up(), s.main(), s.ramp_down()) == (n - 1, d - n + 1, n - 1)


@pytest.mark.parametrize("n", range(1, 7))
def test_stash_sizes(n):
    g = 2 * n + 1
    grouped = pipelined_schedule(n, training=True, gradient_accumulation=g)
    interleaved = pipelined_schedule(n, training=True, gradient_accumulation=g, kind="interleaved")
    assert [grouped.peak_in_flight(i) for i in range(n)] == [2 * (n - i) - 1 for i in range(n)]
    assert [interleaved.peak_in_flight(i) for i in range(n)] == [n - i for i in range(n)]
    sharded = sharded_schedule(n, training=True, gradient_accumulation=g)
    assert all(sharded.peak_in_flight(i) == 1 for i in range(n))
    assert pipelined_schedule(n, training=False, device_iterations=n).peak_in_flight(0) == 0


@pytest.mark.parametrize("n,g", [(1, 3), (2, 3), (4, 8), (5, 12)])
def test_bubble_fraction_closed_form(n, g):
    s = pipelined_schedule(n, training=True, gradient_accumulation=g)
    # every IPU idles 2(n-1) of the 2(g+n-1) compute steps; the weight update keeps all busy
    expected = 2 * (n - 1) / (2 * (g + n - 1) + 1)
    assert s.bubble_fraction() == pytest.approx(expected)
    assert all(s.bubble_fraction(i) == pytest.approx(expected) for i in range(n))
    assert all(s.busy(i) == 2 * g + 1 for i in range(n))


def test_sharded_is_one_ipu_at_a_time_without_ramp():
    s = sharded_schedule(3, training=True, gradient_accumulation=2, device_iterations=2)
    compute = [step for step in s.steps if not step.is_weight_update]
    assert all(len(step.ops) == 1 for step in compute)
    assert [(op.kind, op.stage) for step in compute[:6] for op in step.ops] == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    assert (s.ramp_up(0), s.main(0), s.ramp_down(0)) == (0, 12, 0)
    assert s.bubble_fraction() == pytest.approx(1 - (24 + 6) / (3 * 26))


def test_sequential_pipeline_kind_matches_sharded_steps():
    seq = pipelined_schedule(3, training=True, gradient_accumulation=5, kind="sequential")
    sharded = sharded_schedule(3, training=True, gradient_accumulation=5)
    assert seq.steps == sharded.steps and seq.strategy == "pipelined-sequential"


def test_all_stages_on_one_ipu_serialise():
    s = pipelined_schedule(3, training=True, gradient_accumulation=5, stage_ipus=[0, 0, 0])
    assert s.num_ipus == 1 and len(s.ops) == 2 * 3 * 5 + 1
    assert s.bubble_fraction() == 0


@pytest.mark.parametrize("stage_ipus", [(0, 1, 2, 3, 0), (0, 1, 0, 1), (0, 0, 1), (1, 0, 2)])
@pytest.mark.parametrize("g", [9, 12])
def test_grouped_runs_popart_pipeline_cycles_on_shared_ipus(stage_ipus, g):
    """Every stage runs once a PopART pipeline cycle, an IPU holding several stages running all
    of theirs in the cycle's step: F of stage s for micro-batch k in cycle k+s, its B in cycle
    k+2N-2-s; each cycle is a forward step then a backward step (empty ones left out)."""
    n = len(stage_ipus)
    s = pipelined_schedule(n, training=True, gradient_accumulation=g, stage_ipus=stage_ipus)
    cycle_steps = [(c, kind) for c in range(g + 2 * n - 2) for kind in "FB"
                   if any(0 <= (c - st if kind == "F" else c - (2 * n - 2 - st)) < g for st in range(n))]
    assert s.num_steps == len(cycle_steps) + 1
    for (kind, stage, k), t in step_of(s).items():
        assert cycle_steps[t] == (k + (stage if kind == "F" else 2 * n - 2 - stage), kind)
    assert not s.order_errors()
    # the BERT placement (heads back on IPU 0): IPU 0 runs F of stages 0 and 4, then B of 4 and 0
    if stage_ipus == (0, 1, 2, 3, 0):
        mid = next(step for step in s.steps if len(step.ops_on(0)) == 2 and step.ops[0].kind == "B")
        assert [(op.kind, op.stage) for op in mid.ops_on(0)] == [("B", 4), ("B", 0)]
        assert s.peak_in_flight(0) == (2 * n - 1) + 1  # stage 0's stash 2N-1 and stage 4's one


def test_shared_ipu_step_lasts_as_long_as_its_ops_together():
    """Lock-step pricing: a step in which IPU 0 runs two stages costs their sum; BERT's placement
    (stage 4 back on IPU 0) costs per micro-batch in steady state the busiest IPU's work."""
    from ipusim.schedules import pricing
    placement, g = (0, 1, 2, 3, 0), 64
    s = pipelined_schedule(5, training=True, gradient_accumulation=g, stage_ipus=placement)
    stage = [pricing.StageCosts(1.0, 2.0)] * 4 + [pricing.StageCosts(0.25, 0.5)]
    timing = pricing.lock_step(s, pricing.Costs(tuple(stage)))
    # IPU 0: 1 + 0.25 forward and 2 + 0.5 backward a cycle; the call is G + 2N - 2 cycles at most
    assert timing.cycles <= (g + 2 * 5 - 2) * (1.25 + 2.5)
    assert timing.cycles >= g * (1.25 + 2.5)


def test_a_step_refuses_two_ops_of_one_stage_on_an_ipu():
    from ipusim.schedules.core import Op, Step
    with pytest.raises(ValueError, match="one op per stage"):
        Step((Op("F", 0, 0, 0, 0, 0), Op("F", 0, 1, 0, 0, 1)), 0)
    with pytest.raises(ValueError, match="one op per stage"):
        Step((Op("F", 0, 0, 0, 0, 0), Op("U", None, None, 0, 0, None)), 0)
    Step((Op("F", 0, 2, 0, 0, 2), Op("F", 2, 0, 0, 0, 0)), 0)  # two stages of IPU 0: fine


# --------------------------------------------------------------------------- flushes

@pytest.mark.parametrize("make", [
    lambda g, d: pipelined_schedule(3, training=True, gradient_accumulation=g, device_iterations=d),
    lambda g, d: pipelined_schedule(3, training=True, gradient_accumulation=g,
                                    device_iterations=d, kind="interleaved"),
    lambda g, d: sharded_schedule(3, training=True, gradient_accumulation=g, device_iterations=d),
    lambda g, d: serial_phased_schedule([[(0, 0)], [(1, 1), (2, 0)]], training=True,
                                        gradient_accumulation=g, device_iterations=d),
])
@pytest.mark.parametrize("g,d", [(5, 1), (5, 3), (7, 2)])
def test_weight_update_flushes_each_group(make, g, d):
    s = make(g, d)
    updates = [t for t, step in enumerate(s.steps) if step.is_weight_update]
    assert len(updates) == d == s.num_groups
    for group, t in enumerate(updates):
        assert s.steps[t].group == group
        assert sorted(op.ipu for op in s.steps[t].ops) == sorted(set(s.stage_ipus))
        before = [op for step in s.steps[:t] for op in step.ops if op.kind != "U"]
        assert all(op.group <= group for op in before)
        assert sum(op.group == group for op in before) == 2 * s.num_stages * g
    assert updates[-1] == s.num_steps - 1
    for op in s.ops:
        if op.kind != "U":
            assert op.global_micro_batch == op.group * g + op.micro_batch
    assert s.ramp_up() == d * s.ramp_up(0) and s.main() == d * s.main(0)


# --------------------------------------------------------------------------- phased

def test_phase_ids_shared_and_separate_backward_phase():
    phases = [[(0, 0), (1, 2)], [(2, 1), (3, 3)], [(4, 0), (5, 2)]]
    for separate, backward in [(False, {0: 4, 1: 3, 2: 2}), (True, {0: 6, 1: 5, 2: 4})]:
        s = parallel_phased_schedule(phases, training=True, separate_backward_phase=separate)
        stage_phase = {stage: p for p, phase in enumerate(phases) for stage, _ in phase}
        for op in s.ops:
            if op.kind == "F":
                assert op.phase == stage_phase[op.stage]
            elif op.kind == "B":
                assert op.phase == backward[stage_phase[op.stage]]
        ids = [op.phase for op in s.ops if op.kind != "U"]
        assert ids == sorted(ids)  # phases run in order
        assert s.stage_ipus == (0, 2, 1, 3, 0, 2) and s.num_ipus == 4


def test_phased_inference_and_serial_ipu_reuse():
    s = serial_phased_schedule([[(0, 0), (1, 1)], [(2, 0), (3, 1)]], training=False,
                               device_iterations=2)
    assert [(op.stage, op.ipu, op.phase, op.micro_batch) for op in s.ops] == [
        (0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 0), (3, 1, 1, 0),
        (0, 0, 0, 1), (1, 1, 0, 1), (2, 0, 1, 1), (3, 1, 1, 1)]


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("call,message", [
    (lambda: pipelined_schedule(4, training=True, gradient_accumulation=6),
     r"gradient_accumulation=6 is less than the number of pipeline stages \(7\).*>= 7"),
    (lambda: pipelined_schedule(4, training=False, device_iterations=3),
     r"device_iterations=3 is less than the number of pipeline stages \(4\).*>= 4"),
    (lambda: pipelined_schedule(2, training=False, gradient_accumulation=2, device_iterations=4),
     r"gradient_accumulation=2 for an inference model"),
    (lambda: sharded_schedule(2, training=False, gradient_accumulation=3),
     r"gradient_accumulation=3 for an inference model"),
    (lambda: pipelined_schedule(2, training=True, gradient_accumulation=3, kind="default"),
     r"unknown pipeline schedule kind 'default'"),
    (lambda: pipelined_schedule(0, training=False), r"num_stages must be a positive integer"),
    (lambda: sharded_schedule(2, training=True, device_iterations=0),
     r"device_iterations must be a positive integer"),
    (lambda: sharded_schedule(3, training=True, stage_ipus=[0, 1]),
     r"stage_ipus has 2 entries for 3 stages"),
    (lambda: sharded_schedule(2, training=True, stage_ipus=[0, -1]),
     r"stage 1 is placed on IPU -1"),
    (lambda: parallel_phased_schedule([[(0, 0)], [(1, 2)]], training=True),
     r"phase 1 uses IPUs \[2\].*odd IPUs only"),
    (lambda: serial_phased_schedule([[(1, 0)], [(0, 1)]], training=True),
     r"phases hold stages \[1, 0\]"),
    (lambda: serial_phased_schedule([[(0, 0)], []], training=True), r"non-empty"),
])
def test_errors_say_what_is_wrong_and_how_to_fix_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_data_types_validate():
    with pytest.raises(ValueError, match="op kind 'X'"):
        Op("X", 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="one op per stage"):
        Step((Op("F", 1, 0, 0, 0, 0), Op("F", 1, 1, 0, 0, 1)), 0)
    with pytest.raises(ValueError, match="group 1 out of range"):
        tutorial().ramp_up(1)


def test_to_dict_is_json_and_complete():
    s = pipelined_schedule(2, training=True, gradient_accumulation=3, device_iterations=2)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["strategy"] == "pipelined-grouped" and d["num_groups"] == 2
    assert len(d["steps"]) == s.num_steps
    assert sum(len(step["ops"]) for step in d["steps"]) == len(s.ops)
    assert d["steps"][0]["ops"][0] == {"kind": "F", "stage": 0, "micro_batch": 0, "ipu": 0,
                                       "group": 0, "global_micro_batch": 0, "phase": None}
    assert d["per_ipu"][0]["peak_in_flight"] == s.peak_in_flight(0) == 3


# --------------------------------------------------------------------------- properties

@st.composite
def schedules(draw):
    training = draw(st.booleans())
    n = draw(st.integers(1, 6))
    strategy = draw(st.sampled_from(["grouped", "interleaved", "sequential", "sharded",
                                     "serial", "parallel"]))
    d = draw(st.integers(1, 3))
    g = draw(st.integers(2 * n - 1, 2 * n + 4)) if training else 1
    if strategy in ("serial", "parallel"):
        sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
        phases, stage = [], 0
        for p, size in enumerate(sizes):
            ipus = [p % 2 + 2 * draw(st.integers(0, 2)) if strategy == "parallel"
                    else draw(st.integers(0, 4)) for _ in range(size)]
            phases.append([(stage + i, ipu) for i, ipu in enumerate(ipus)])
            stage += size
        make = serial_phased_schedule if strategy == "serial" else parallel_phased_schedule
        return make(phases, training=training, gradient_accumulation=g, device_iterations=d,
                    separate_backward_phase=draw(st.booleans()))
    ipus = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    if strategy == "sharded":
        return sharded_schedule(n, training=training, gradient_accumulation=g,
                                device_iterations=d, stage_ipus=ipus)
    d = d if training else draw(st.integers(n, n + 6))
    return pipelined_schedule(n, training=training, gradient_accumulation=g,
                              device_iterations=d, stage_ipus=ipus, kind=strategy)


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_schedule_invariants(s: Schedule):
    n, total = s.num_stages, s.num_groups * s.micro_batches_per_group
    at = step_of(s)
    kinds = ("F", "B") if s.training else ("F",)
    # every op exactly once, on its stage's IPU, and nothing else
    assert sorted(at) == sorted((k, stage, m) for k in kinds for stage in range(n)
                                for m in range(total))
    assert len([op for op in s.ops if op.kind != "U"]) == len(at)
    for op in s.ops:
        assert op.kind == "U" or op.ipu == s.stage_ipus[op.stage]
    # an IPU runs one op a step, or (grouped pipelines) one op of each stage it holds
    for step in s.steps:
        for ops in step.by_ipu():
            assert len(ops) == 1 or (s.strategy == "pipelined-grouped" and len({op.stage for op in ops}) == len(ops))
    # dependencies: each op runs in a later step than the op it needs
    for m in range(total):
        for stage in range(1, n):
            assert at[("F", stage, m)] > at[("F", stage - 1, m)]
        if s.training:
            assert at[("B", n - 1, m)] > at[("F", n - 1, m)]
            for stage in range(n - 1):
                assert at[("B", stage, m)] > at[("B", stage + 1, m)]
    # groups: one weight update closing each training group, nothing of g+1 before it
    updates = [t for t, step in enumerate(s.steps) if step.is_weight_update]
    assert len(updates) == (s.num_groups if s.training else 0)
    for t, step in enumerate(s.steps):
        assert all(op.group == step.group for op in step.ops)
        assert step.group == sum(u < t for u in updates)
    # derived figures are consistent
    assert s.ramp_up() + s.main() + s.ramp_down() + len(updates) == s.num_steps
    assert s.main() >= 1 and 0 <= s.bubble_fraction() < 1
    assert sum(s.busy(i) for i in range(s.num_ipus)) == sum(len(step.by_ipu()) for step in s.steps)
    assert [len([op for op in row if op]) for row in s.grid()] == [
        s.busy(i) for i in range(s.num_ipus)]
