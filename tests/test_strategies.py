"""Stages, phases, strategies: construction rules, reprs, placement, count checks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poptorch_lite.api.blocks import DEFAULT_REGION, BlockRef
from poptorch_lite.api.strategies import (
    AutoStage,
    ExecutionStrategy,
    Liveness,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    StrategyError,
    validate_counts,
)

TUTORIAL_BLOCKS = [BlockRef("B1"), BlockRef("B2"), BlockRef("B3"), BlockRef("B4")]


def tutorial_stages():
    return [Stage(f"B{i + 1}").ipu(i) for i in range(4)]


def summary(placement):
    """(block id, ipu_id, stage, ipu, phase) per placed block."""
    return [(p.block.user_id, p.block.ipu_id, p.stage, p.ipu, p.phase) for p in placement.blocks]


# Construction and reprs


def test_stage_chaining_and_repr():
    stage = Stage("B1", "B2")
    assert stage.ipu(3) is stage
    assert stage.blocks == ("B1", "B2") and stage.assigned_ipu == 3
    assert repr(stage) == 'Stage("B1", "B2").ipu(3)'
    assert repr(Stage("A")) == 'Stage("A")'


def test_strategy_reprs():
    assert repr(PipelinedExecution(*tutorial_stages())) == (
        'PipelinedExecution(Stage("B1").ipu(0), Stage("B2").ipu(1), '
        'Stage("B3").ipu(2), Stage("B4").ipu(3))'
    )
    assert repr(ShardedExecution("A", ["B", "C"])) == (
        'ShardedExecution(Stage("A"), Stage("B", "C"))'
    )
    assert repr(PipelinedExecution()) == "PipelinedExecution(AutoStage.SameAsIpu)"
    assert repr(PipelinedExecution(AutoStage.AutoIncrement)) == (
        "PipelinedExecution(AutoStage.AutoIncrement)"
    )
    serial = SerialPhasedExecution(Phase(Stage("A"), Stage("A2")), Phase("B", "B2"))
    serial.phase(0).ipus(0, 1)
    serial.setTensorsLiveness(Liveness.OffChipAfterEachPhase).useSeparateBackwardPhase()
    assert repr(serial) == (
        'SerialPhasedExecution(Phase(Stage("A").ipu(0), Stage("A2").ipu(1)), '
        'Phase(Stage("B", "B2"))).setTensorsLiveness(Liveness.OffChipAfterEachPhase)'
        ".useSeparateBackwardPhase()"
    )


def test_all_strategies_share_the_base_class():
    for strategy in (
        PipelinedExecution(),
        ShardedExecution(),
        SerialPhasedExecution("A"),
        ParallelPhasedExecution("A"),
    ):
        assert isinstance(strategy, ExecutionStrategy)
    assert [s.schedule_kind for s in (PipelinedExecution(), ShardedExecution())] == [
        "pipelined",
        "sharded",
    ]


def test_enum_values_match_poptorch():
    assert [(m.name, m.value) for m in Liveness] == [
        ("AlwaysLive", 0),
        ("OffChipAfterFwd", 1),
        ("OffChipAfterFwdNoOverlap", 2),
        ("OffChipAfterEachPhase", 3),
    ]
    assert [(m.name, m.value) for m in AutoStage] == [("SameAsIpu", 0), ("AutoIncrement", 1)]


@pytest.mark.parametrize("bad", [(), (3.0,), (True,), ("",)])
def test_stage_needs_block_ids(bad):
    with pytest.raises(StrategyError):
        Stage(*bad)


@pytest.mark.parametrize("ipu", [-1, 1.5, True, "0"])
def test_stage_ipu_must_be_a_non_negative_int(ipu):
    with pytest.raises(StrategyError, match="non-negative IPU"):
        Stage("A").ipu(ipu)


def test_block_in_two_stages_is_an_error():
    with pytest.raises(StrategyError, match="'B' is in two stages.*exactly one stage"):
        PipelinedExecution(Stage("A", "B"), Stage("B"))
    with pytest.raises(StrategyError, match="'A' is in two stages"):
        SerialPhasedExecution(Phase("A"), Phase(Stage("A")))


def test_auto_stage_cannot_be_mixed_with_stages():
    with pytest.raises(StrategyError, match="either one AutoStage or a list of stages"):
        PipelinedExecution(AutoStage.SameAsIpu, "A")


def test_pipelined_rejects_other_arguments():
    with pytest.raises(StrategyError, match="takes Stages"):
        PipelinedExecution(0)


def test_phase_arguments_must_not_mix_stages_and_strings():
    with pytest.raises(StrategyError, match=r"all Stages or all block ids.*\(Stage, str\)"):
        Phase(Stage("A"), "B")
    with pytest.raises(StrategyError, match="at least one"):
        Phase()


def test_phase_ipus_count_must_match_stages():
    phase = Phase(Stage("A"), Stage("B"))
    assert phase.ipus(0, 2) is phase
    assert [s.assigned_ipu for s in phase.stages] == [0, 2]
    with pytest.raises(StrategyError, match="2 stage\\(s\\) but ipus\\(\\) got 1"):
        phase.ipus(1)


def test_phased_execution_needs_phases():
    with pytest.raises(StrategyError, match="no automatic phasing"):
        SerialPhasedExecution()


def test_phased_accepts_poptorch_argument_forms():
    from_list = ParallelPhasedExecution([Phase(Stage("0"), Stage("1")), Phase(Stage("2"))])
    assert len(from_list.phases) == 2
    forms = SerialPhasedExecution(Phase("A"), [Stage("B"), Stage("C")], ["D", "E"], "F")
    assert [[s.blocks for s in p.stages] for p in forms.phases] == [
        [("A",)],
        [("B",), ("C",)],
        [("D", "E")],
        [("F",)],
    ]


def test_liveness_setters_chain_and_validate():
    serial = SerialPhasedExecution("A")
    for liveness in Liveness:
        assert serial.setTensorsLiveness(liveness) is serial
        assert serial.liveness == liveness
    parallel = ParallelPhasedExecution("A")
    assert parallel.sendTensorsOffChipAfterFwd() is parallel
    assert parallel.liveness == Liveness.OffChipAfterFwd
    parallel.sendTensorsOffChipAfterFwd(False)
    assert parallel.liveness == Liveness.AlwaysLive
    for serial_only in (Liveness.OffChipAfterFwdNoOverlap, Liveness.OffChipAfterEachPhase):
        with pytest.raises(StrategyError, match="only supported by SerialPhasedExecution"):
            parallel.setTensorsLiveness(serial_only)
    with pytest.raises(StrategyError, match="takes a Liveness"):
        serial.setTensorsLiveness(1)
    with pytest.raises(StrategyError, match="takes a bool"):
        serial.useSeparateBackwardPhase(1)
    assert serial.useSeparateBackwardPhase() is serial and serial.separate_backward_phase


def test_stage_lookup():
    strategy = PipelinedExecution(Stage("A", "B").ipu(1), "C")
    assert strategy.stage("B") is strategy.stages[0]
    with pytest.raises(StrategyError, match="'Z' is in no stage"):
        strategy.stage("Z")


# Placement: pipelined


def test_tutorial_pipeline_placement():
    placement = PipelinedExecution(*tutorial_stages()).place(TUTORIAL_BLOCKS)
    assert summary(placement) == [(f"B{i + 1}", None, i, i, None) for i in range(4)]
    assert placement.num_stages == 4 and placement.num_ipus == 4
    assert placement.schedule_arguments() == {"num_stages": 4, "stage_ipus": (0, 1, 2, 3)}


def test_stage_ipu_overrides_block_ipu_id():
    placement = PipelinedExecution(Stage("A").ipu(1), Stage("B")).place(
        [BlockRef("A", 3), BlockRef("B", 2)]
    )
    assert summary(placement) == [("A", 3, 0, 1, None), ("B", 2, 1, 2, None)]


def test_block_without_any_ipu_runs_on_the_ipu_numbered_like_its_stage():
    blocks = [BlockRef("A"), BlockRef("B"), BlockRef("C")]
    placement = PipelinedExecution("A", "B", "C").place(blocks)
    assert placement.stage_ipus == (0, 1, 2)


def test_unknown_block_is_an_error_naming_the_known_blocks():
    with pytest.raises(StrategyError, match=r"'X' was traced but is in no stage.*'A', 'B'"):
        PipelinedExecution("A", "B").place([BlockRef("A"), BlockRef("X")])


def test_listed_block_without_ops_warns_and_takes_no_stage():
    with pytest.warns(UserWarning, match="'B'.*no op was traced"):
        placement = PipelinedExecution(
            Stage("A").ipu(0), Stage("B").ipu(1), Stage("C").ipu(2)
        ).place([BlockRef("A"), BlockRef("C")])
    assert summary(placement) == [("A", None, 0, 0, None), ("C", None, 1, 2, None)]
    assert placement.stage_ipus == (0, 2)


def test_same_as_ipu_uses_ipu_id_as_stage():
    placement = PipelinedExecution().place([BlockRef("0", 0), BlockRef("1", 1), BlockRef("2", 3)])
    assert summary(placement) == [("0", 0, 0, 0, None), ("1", 1, 1, 1, None), ("2", 3, 2, 3, None)]


def test_same_as_ipu_without_ipu_id_is_an_error():
    with pytest.raises(StrategyError, match="block 'B1' has no ipu_id.*ipu_id=0"):
        PipelinedExecution(AutoStage.SameAsIpu).place([BlockRef("B1")])


def test_same_as_ipu_restart_without_ipu_id_keeps_the_first_ipu():
    placement = PipelinedExecution().place([BlockRef("A", 1), BlockRef("B", 2), BlockRef("A")])
    assert summary(placement)[2] == ("A", None, 0, 1, None)


def test_auto_increment_opens_a_stage_per_block():
    blocks = [BlockRef("0", 0), BlockRef("1", 1), BlockRef("2", 2), BlockRef("3", 1)]
    placement = PipelinedExecution(AutoStage.AutoIncrement).place(blocks)
    assert [(p.stage, p.ipu) for p in placement.blocks] == [(0, 0), (1, 1), (2, 2), (3, 1)]


def test_auto_increment_block_without_ipu_runs_on_its_stage_number():
    placement = PipelinedExecution(AutoStage.AutoIncrement).place([BlockRef("a"), BlockRef("b")])
    assert placement.stage_ipus == (0, 1)


def test_default_region_is_stage_zero_on_ipu_zero():
    placement = PipelinedExecution(AutoStage.AutoIncrement).place(
        [DEFAULT_REGION, BlockRef("l2", 1), BlockRef("l3", 2)]
    )
    assert [(p.stage, p.ipu) for p in placement.blocks] == [(0, 0), (1, 1), (2, 2)]
    placement = PipelinedExecution().place([DEFAULT_REGION, BlockRef("a", 0), BlockRef("b", 1)])
    assert [(p.stage, p.ipu) for p in placement.blocks] == [(0, 0), (0, 0), (1, 1)]


def test_no_blocks_at_all_is_one_stage_on_ipu_zero():
    placement = PipelinedExecution().place([])
    assert summary(placement) == [(None, None, 0, 0, None)]


def test_default_region_cannot_share_stage_zero_with_another_ipu():
    with pytest.raises(StrategyError, match="stage 0 .*several IPUs.*before first block.*IPU 0"):
        PipelinedExecution(Stage("B1").ipu(2), Stage("B2").ipu(3)).place(
            [DEFAULT_REGION, BlockRef("B1"), BlockRef("B2")]
        )


def test_pipeline_stage_on_two_ipus_is_an_error():
    with pytest.raises(StrategyError, match=r"'A' on IPU 0; 'B' on IPU 1.*one IPU"):
        PipelinedExecution(Stage("A", "B")).place([BlockRef("A", 0), BlockRef("B", 1)])


def test_consecutive_stages_on_one_ipu_merge():
    placement = PipelinedExecution(Stage("A").ipu(0), Stage("B").ipu(0), Stage("C").ipu(1)).place(
        [BlockRef("A"), BlockRef("B"), BlockRef("C")]
    )
    assert [p.stage for p in placement.blocks] == [0, 0, 1]
    assert placement.stage_ipus == (0, 1)


def test_placement_lookup():
    placement = PipelinedExecution(*tutorial_stages()).place(TUTORIAL_BLOCKS)
    assert placement[BlockRef("B3")].ipu == 2
    with pytest.raises(KeyError):
        placement[BlockRef("B9")]


# Placement: sharded


def test_sharded_tutorial_placement():
    placement = ShardedExecution(*tutorial_stages()).place(TUTORIAL_BLOCKS)
    assert placement.schedule_kind == "sharded"
    assert placement.schedule_arguments() == {"num_stages": 4, "stage_ipus": (0, 1, 2, 3)}


def test_sharded_runs_in_trace_order_and_allows_returning_to_an_ipu():
    blocks = [BlockRef("0", 0), BlockRef("1", 1), BlockRef("2", 0)]
    placement = ShardedExecution().place(blocks)
    assert [(p.stage, p.ipu) for p in placement.blocks] == [(0, 0), (1, 1), (2, 0)]


def test_sharded_stage_may_span_ipus():
    placement = ShardedExecution(Stage("A", "B"), Stage("C").ipu(0)).place(
        [BlockRef("A", 0), BlockRef("B", 1), BlockRef("C")]
    )
    assert [(p.stage, p.ipu) for p in placement.blocks] == [(0, 0), (1, 1), (2, 0)]


# Placement: phased


def test_serial_phases():
    strategy = SerialPhasedExecution(
        Phase(Stage("A"), Stage("A2")), Phase(Stage("B"), Stage("B2"))
    )
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0, 1)
    placement = strategy.place([BlockRef("A"), BlockRef("A2"), BlockRef("B"), BlockRef("B2")])
    assert [(p.stage, p.ipu, p.phase) for p in placement.blocks] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    assert placement.schedule_arguments() == {
        "phases": (((0, 0), (1, 1)), ((2, 0), (3, 1))),
        "separate_backward_phase": False,
    }
    strategy.useSeparateBackwardPhase()
    placement = strategy.place([BlockRef("A"), BlockRef("A2"), BlockRef("B"), BlockRef("B2")])
    assert placement.schedule_arguments()["separate_backward_phase"]


def test_parallel_phases_alternate_ipu_groups():
    strategy = ParallelPhasedExecution(
        Phase(Stage("0"), Stage("1")), Phase(Stage("2"), Stage("3")), Phase(Stage("4"), Stage("5"))
    )
    strategy.phase(0).ipus(0, 2)
    strategy.phase(1).ipus(1, 3)
    strategy.phase(2).ipus(0, 2)
    strategy.sendTensorsOffChipAfterFwd()
    placement = strategy.place([BlockRef(str(i)) for i in range(6)])
    assert placement.phase_ipus == ((0, 2), (1, 3), (0, 2))
    assert placement.liveness == Liveness.OffChipAfterFwd


def test_one_phase_block_may_run_on_several_ipus():
    # PopTorch's 2x2 test: Block("1", ipu_id=1) and Block("1", ipu_id=3) in phase 1.
    strategy = ParallelPhasedExecution("0", "1")
    blocks = [BlockRef("0", 0), BlockRef("0", 2), BlockRef("1", 1), BlockRef("1", 3)]
    placement = strategy.place(blocks)
    # Each (Stage, IPU) pair is a stage of the schedule.
    assert placement.phases == (((0, 0), (1, 2)), ((2, 1), (3, 3)))
    assert [p.stage for p in placement.blocks] == [0, 1, 2, 3]


def test_parallel_phase_on_wrong_ipu_parity_is_an_error():
    strategy = ParallelPhasedExecution(Phase(Stage("A").ipu(0)), Phase(Stage("B").ipu(2)))
    with pytest.raises(StrategyError, match="'B' is in phase 1 on IPU 2.*even phases on even IPUs"):
        strategy.place([BlockRef("A"), BlockRef("B")])
    serial = SerialPhasedExecution(Phase(Stage("A").ipu(0)), Phase(Stage("B").ipu(2)))
    assert serial.place([BlockRef("A"), BlockRef("B")]).phases == (((0, 0),), ((1, 2),))


def test_phased_block_without_ipu_is_an_error():
    with pytest.raises(StrategyError, match="'A' \\(phase 0\\) has no IPU"):
        SerialPhasedExecution("A").place([BlockRef("A")])


def test_phased_unknown_block_is_an_error():
    with pytest.raises(StrategyError, match="'Z' was traced but is in no stage"):
        SerialPhasedExecution(Phase(Stage("A").ipu(0))).place([BlockRef("Z", 0)])


# Schedules


def test_placement_builds_its_schedule():
    placement = four_stage_pipeline()
    schedule = placement.schedule(training=True, gradient_accumulation=8, device_iterations=2)
    assert schedule.stage_ipus == (0, 1, 2, 3) and schedule.training
    forwards = [op for step in schedule.steps for op in step.ops if op.kind == "F"]
    assert len(forwards) == 4 * 8 * 2
    assert {(op.stage, op.ipu) for op in forwards} == {(s, s) for s in range(4)}
    sharded = ShardedExecution(AutoStage.AutoIncrement).place([BlockRef("a", 1), BlockRef("b", 0)])
    assert sharded.schedule(training=False).stage_ipus == (1, 0)


def test_phased_placement_builds_its_schedule():
    strategy = ParallelPhasedExecution("0", "1")
    placement = strategy.place([BlockRef("0", 0), BlockRef("0", 2), BlockRef("1", 1)])
    schedule = placement.schedule(training=True)
    assert {(op.stage, op.ipu, op.phase) for step in schedule.steps for op in step.ops
            if op.kind == "F"} == {(0, 0, 0), (1, 2, 0), (2, 1, 1)}


# Count validation


def four_stage_pipeline():
    return PipelinedExecution(*tutorial_stages()).place(TUTORIAL_BLOCKS)


def test_training_pipeline_needs_gradient_accumulation_of_2n_minus_1():
    placement = four_stage_pipeline()
    validate_counts(placement, training=True, gradient_accumulation=7, device_iterations=1)
    with pytest.raises(StrategyError, match=r"pipeline stages \(7\).*4 pipeline stages.*additional 3.*"
                                              r"gradientAccumulation\(6\).*gradientAccumulation\(7\) or more"):
        validate_counts(placement, training=True, gradient_accumulation=6, device_iterations=100)


def test_inference_pipeline_needs_device_iterations_of_n():
    placement = four_stage_pipeline()
    validate_counts(placement, training=False, gradient_accumulation=1, device_iterations=4)
    with pytest.raises(StrategyError, match=r"pipeline stages \(4\).*deviceIterations\(3\).*"
                                              r"deviceIterations\(4\) or more"):
        validate_counts(placement, training=False, gradient_accumulation=1, device_iterations=3)


def test_sharded_phased_and_single_stage_have_no_depth_requirement():
    sharded = ShardedExecution(*tutorial_stages()).place(TUTORIAL_BLOCKS)
    single = PipelinedExecution().place([BlockRef("A", 0)])
    phased = SerialPhasedExecution(Phase(Stage("A").ipu(0))).place([BlockRef("A")])
    for placement in (sharded, single, phased):
        validate_counts(placement, training=True, gradient_accumulation=1, device_iterations=1)
        validate_counts(placement, training=False, gradient_accumulation=1, device_iterations=1)


@pytest.mark.parametrize("value", [0, -1, 1.0, True])
def test_counts_must_be_positive_integers(value):
    placement = four_stage_pipeline()
    with pytest.raises(StrategyError, match="positive integer"):
        validate_counts(placement, training=True, gradient_accumulation=value, device_iterations=8)
    with pytest.raises(StrategyError, match="positive integer"):
        validate_counts(placement, training=True, gradient_accumulation=8, device_iterations=value)


# Properties


ipu_ids = st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12)


@given(ipu_ids)
def test_auto_increment_stages_follow_first_appearance(ipus):
    blocks = [BlockRef(str(i), ipu) for i, ipu in enumerate(ipus)]
    placement = PipelinedExecution(AutoStage.AutoIncrement).place(blocks)
    stages = [p.stage for p in placement.blocks]
    assert stages[0] == 0
    assert all(b - a in (0, 1) for a, b in zip(stages, stages[1:]))
    # A new stage exactly when the IPU changes; each stage on one IPU.
    assert all((b == a) == (x == y) for a, b, x, y in zip(stages, stages[1:], ipus, ipus[1:]))
    assert [p.ipu for p in placement.blocks] == ipus
    assert len(placement.stage_ipus) == placement.num_stages == stages[-1] + 1


@given(ipu_ids)
def test_same_as_ipu_orders_stages_by_ipu(ipus):
    blocks = [BlockRef(str(i), ipu) for i, ipu in enumerate(ipus)]
    placement = PipelinedExecution().place(blocks)
    assert placement.stage_ipus == tuple(sorted(set(ipus)))
    assert all(placement.stage_ipus[p.stage] == p.ipu for p in placement.blocks)


@given(
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=20),
)
def test_count_rules(stages, accumulation, iterations):
    placement = PipelinedExecution(AutoStage.AutoIncrement).place(
        [BlockRef(str(i), i) for i in range(stages)]
    )
    training_ok = stages == 1 or accumulation >= 2 * stages - 1
    inference_ok = stages == 1 or iterations >= stages

    def passes(**kwargs):
        try:
            validate_counts(placement, **kwargs)
            return True
        except StrategyError:
            return False

    trained = passes(
        training=True, gradient_accumulation=accumulation, device_iterations=iterations
    )
    inferred = passes(training=False, gradient_accumulation=1, device_iterations=iterations)
    assert (trained, inferred) == (training_ok, inference_ok)


def test_phased_strategies_give_the_stage_of_a_block():
    strategy = SerialPhasedExecution("B1", "B2", "B3")
    strategy.stage("B2").ipu(1)
    assert strategy.phase(1).stage(0).assigned_ipu == 1
    with pytest.raises(StrategyError, match="block 'B4' is in no stage"):
        strategy.stage("B4")
