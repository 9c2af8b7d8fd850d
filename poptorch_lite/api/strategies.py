"""Execution strategies: how blocks are grouped into stages and placed on IPUs.

A strategy is set with ``Options.setExecutionStrategy(strategy)``. After a model is
captured, :meth:`ExecutionStrategy.place` turns the blocks seen in the trace into a
:class:`Placement`: for every block its stage, IPU and (phased strategies) phase.
The placement gives the arguments of the ``ipusim.schedules`` functions
(:meth:`Placement.schedule_arguments`) and is checked against the batching options
by :func:`validate_counts`.

Placement rules, as in PopTorch:

- a block's IPU is its Stage's ``.ipu(n)``, else the block's ``ipu_id``, else the
  number of its stage;
- ``AutoStage.SameAsIpu`` (the default): stage = the block's ``ipu_id``; a block
  without ``ipu_id`` is an error;
- ``AutoStage.AutoIncrement``: each new block opens the next stage;
- ops before the first block (the default region) run in stage 0 on IPU 0;
- a pipeline stage runs on one IPU; consecutive stages on the same IPU merge into
  one stage, as PopART merges them;
- stages are numbered 0, 1, ... counting only stages that hold ops. (PopTorch
  numbers AutoIncrement stages from 1, keeping 0 for the default region, and an
  AutoIncrement block without IPU then runs on the IPU of that 1-based number;
  here the first stage holding ops is always stage 0 and such a block runs on the
  IPU numbered like its stage.)
"""

from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

from .blocks import DEFAULT_REGION, BlockRef
from .enums import AutoStage, Liveness
from .errors import Error

if TYPE_CHECKING:
    from ipusim import schedules


class StrategyError(Error, ValueError):
    """An execution strategy is malformed or does not fit the traced blocks."""


def _check_block_id(block_id, where: str) -> str | int:
    if isinstance(block_id, bool) or not isinstance(block_id, (str, int)) or block_id == "":
        raise StrategyError(
            f"{where} takes block ids (the user_id strings or integers of Blocks), got {block_id!r}"
        )
    return block_id


def _check_ipu(ipu, where: str) -> int:
    if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
        raise StrategyError(f"{where} takes a non-negative IPU number, got {ipu!r}")
    return ipu


class Stage:
    """One or more blocks that run together on one IPU.

    >>> Stage("B1", "B2").ipu(0)
    """

    def __init__(self, *block_ids: str):
        if not block_ids:
            raise StrategyError("a Stage needs at least one block id, e.g. Stage(\"B1\")")
        self._blocks = tuple(_check_block_id(b, "Stage") for b in block_ids)
        self._ipu: Optional[int] = None

    @property
    def blocks(self) -> tuple[str, ...]:
        """The ids of the blocks this stage is made of."""
        return self._blocks

    @property
    def assigned_ipu(self) -> Optional[int]:
        """The IPU set with :meth:`ipu`, or None."""
        return self._ipu

    def ipu(self, ipu: int) -> "Stage":
        """Run this stage on ``ipu``; returns the stage for chaining."""
        self._ipu = _check_ipu(ipu, "Stage.ipu()")
        return self

    def __repr__(self) -> str:
        text = "Stage(" + ", ".join(f'"{b}"' for b in self._blocks) + ")"
        return text if self._ipu is None else f"{text}.ipu({self._ipu})"


class Phase:
    """Stages that run in parallel, each on its own IPU, in one execution phase.

    ``Phase(Stage("A").ipu(0), Stage("B").ipu(1))`` has two stages;
    ``Phase("A", "B")`` has one stage made of blocks "A" and "B".
    """

    def __init__(self, *args: Union[str, Stage]):
        if not args:
            raise StrategyError("a Phase needs at least one Stage or block id")
        if all(isinstance(a, Stage) for a in args):
            self._stages = tuple(args)
        elif all(isinstance(a, str) for a in args):
            self._stages = (Stage(*args),)
        else:
            kinds = ", ".join(type(a).__name__ for a in args)
            raise StrategyError(
                f"Phase arguments must be all Stages or all block ids (strings), got ({kinds}); "
                "write Phase(Stage(\"A\"), Stage(\"B\")) for two stages or "
                "Phase(\"A\", \"B\") for one stage of two blocks"
            )

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self._stages

    def stage(self, index: int) -> Stage:
        return self._stages[index]

    def ipus(self, *ipus: int) -> "Phase":
        """Give each stage of the phase its IPU, in order; returns the phase."""
        if len(ipus) != len(self._stages):
            raise StrategyError(
                f"{self!r} has {len(self._stages)} stage(s) but ipus() got {len(ipus)} "
                f"IPU(s) {ipus}: give one IPU per stage"
            )
        for stage, ipu in zip(self._stages, ipus):
            stage.ipu(ipu)
        return self

    def __repr__(self) -> str:
        return "Phase(" + ", ".join(repr(s) for s in self._stages) + ")"


@dataclass(frozen=True)
class BlockPlacement:
    """Where the ops of one traced block run.

    ``phase`` is the index of the block's Phase (phased strategies only). A stage
    always runs on one IPU: in phased strategies, a Stage whose blocks run on
    several IPUs makes one stage per IPU, numbered in phase order.
    """

    block: BlockRef
    stage: int
    ipu: int
    phase: Optional[int] = None


@dataclass(frozen=True)
class Placement:
    """The placement of every traced block under one strategy."""

    schedule_kind: str
    blocks: tuple[BlockPlacement, ...]
    num_phases: int = 0
    liveness: Liveness = Liveness.AlwaysLive
    separate_backward_phase: bool = False

    def __getitem__(self, block: BlockRef) -> BlockPlacement:
        for placed in self.blocks:
            if placed.block == block:
                return placed
        raise KeyError(f"block {block} was not traced")

    @property
    def num_stages(self) -> int:
        return 1 + max(p.stage for p in self.blocks)

    @property
    def num_ipus(self) -> int:
        """IPUs used: one more than the highest IPU number."""
        return 1 + max(p.ipu for p in self.blocks)

    @property
    def stage_ipus(self) -> tuple[int, ...]:
        """The IPU of each stage, by stage number (every stage runs on one IPU)."""
        ipu_of = {p.stage: p.ipu for p in self.blocks}
        return tuple(ipu_of[stage] for stage in range(self.num_stages))

    @property
    def phases(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each phase, its (stage, IPU) pairs in stage order (phased strategies)."""
        pairs = sorted({(p.phase, p.stage, p.ipu) for p in self.blocks})
        return tuple(
            tuple((stage, ipu) for phase, stage, ipu in pairs if phase == index)
            for index in range(self.num_phases)
        )

    @property
    def phase_ipus(self) -> tuple[tuple[int, ...], ...]:
        """For each phase, the IPUs that run ops in it (phased strategies)."""
        return tuple(tuple(sorted({ipu for _, ipu in phase})) for phase in self.phases)

    def schedule_arguments(self) -> dict:
        """The placement-dependent arguments of this strategy's ``ipusim.schedules`` function."""
        if self.schedule_kind in ("pipelined", "sharded"):
            return {"num_stages": self.num_stages, "stage_ipus": self.stage_ipus}
        return {"phases": self.phases, "separate_backward_phase": self.separate_backward_phase}

    def schedule(
        self,
        *,
        training: bool,
        gradient_accumulation: int = 1,
        device_iterations: int = 1,
        **options,
    ) -> schedules.Schedule:
        """The execution schedule of this placement (``ipusim.schedules``).

        ``options`` go to the schedule function, e.g. ``kind="interleaved"`` for a pipeline;
        PopTorch's own schedule (no options) first checks the counts as PopTorch does
        (:func:`validate_counts`).
        """
        from ipusim import schedules  # here, not at import: Options (and a data-only process) need no emulator

        if not options:
            validate_counts(self, training=training, gradient_accumulation=gradient_accumulation,
                            device_iterations=device_iterations)
        function = getattr(schedules, f"{self.schedule_kind}_schedule")
        return function(
            **self.schedule_arguments(),
            training=training,
            gradient_accumulation=gradient_accumulation,
            device_iterations=device_iterations,
            **options,
        )


class ExecutionStrategy(abc.ABC):
    """Base of all execution strategies accepted by ``Options.setExecutionStrategy``."""

    schedule_kind: str
    _stages: tuple[Stage, ...]
    _block_stage: dict[str, int]     # block id -> index in _stages

    def stage(self, block_id: str) -> Stage:
        """The Stage the given block belongs to (to change its IPU: ``.stage("B1").ipu(0)``)."""
        if block_id not in self._block_stage:
            raise StrategyError(f"block {block_id!r} is in no stage of {self!r}")
        return self._stages[self._block_stage[block_id]]

    @abc.abstractmethod
    def place(self, blocks: Sequence[BlockRef]) -> Placement:
        """Place the traced blocks, given in order of first appearance.

        The default region (ops before the first block) is ``DEFAULT_REGION``.
        """


def _to_stages(args, what: str) -> list[Stage]:
    """Normalise ``PipelinedExecution`` arguments into a list of Stages."""
    stages = []
    for arg in args:
        if isinstance(arg, Stage):
            stages.append(arg)
        elif isinstance(arg, str):
            stages.append(Stage(arg))
        elif isinstance(arg, (list, tuple)):
            stages.append(Stage(*arg))
        elif isinstance(arg, AutoStage):
            raise StrategyError(
                f"{what} takes either one AutoStage or a list of stages, not both: got {args!r}"
            )
        else:
            raise StrategyError(
                f"{what} takes Stages, block ids or lists of block ids, got {arg!r}"
            )
    return stages


def _index_blocks(stages: Sequence[Stage], what: str) -> dict[str, int]:
    """Map block id -> index of its stage; a block may be in one stage only."""
    where: dict[str, int] = {}
    for index, stage in enumerate(stages):
        for block in stage.blocks:
            if block in where:
                raise StrategyError(
                    f"block {block!r} is in two stages of {what}: {stages[where[block]]!r} "
                    f"and {stage!r}; a block belongs to exactly one stage"
                )
            where[block] = index
    return where


def _name(block: BlockRef) -> str:
    return str(block) if block.is_default else repr(block.user_id)


def _unknown_block(block: BlockRef, known, strategy) -> StrategyError:
    listed = ", ".join(repr(b) for b in known)
    return StrategyError(
        f"block {block.user_id!r} was traced but is in no stage of {strategy!r} "
        f"(its blocks are {listed}); add it to a Stage or rename the Block"
    )


def _warn_unused(known, traced: Sequence[BlockRef], strategy) -> None:
    seen = {b.user_id for b in traced}
    unused = [b for b in known if b not in seen]
    if unused:
        warnings.warn(
            f"{strategy!r} lists block(s) {', '.join(map(repr, unused))} but no op was "
            "traced in them",
            stacklevel=3,
        )


class PipelinedExecution(ExecutionStrategy):
    """Run stages as a pipeline: each stage on its IPU, micro-batches in flight at once.

    Arguments are either stages (``Stage`` objects, block ids, or lists of block ids
    forming one stage), one per pipeline stage in order, or a single
    :class:`AutoStage`. With no argument: ``AutoStage.SameAsIpu``.
    """

    schedule_kind = "pipelined"

    def __init__(self, *args: Union[Stage, str, Sequence[str], AutoStage]):
        name = type(self).__name__
        if len(args) == 1 and isinstance(args[0], AutoStage):
            self._auto_stage: Optional[AutoStage] = args[0]
            self._stages: tuple[Stage, ...] = ()
        elif not args:
            self._auto_stage, self._stages = AutoStage.SameAsIpu, ()
        else:
            self._auto_stage = None
            self._stages = tuple(_to_stages(args, name))
        self._block_stage = _index_blocks(self._stages, name)

    @property
    def auto_stage(self) -> Optional[AutoStage]:
        return self._auto_stage

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self._stages

    def __repr__(self) -> str:
        if self._auto_stage is not None:
            return f"{type(self).__name__}(AutoStage.{self._auto_stage.name})"
        return f"{type(self).__name__}(" + ", ".join(repr(s) for s in self._stages) + ")"

    def place(self, blocks: Sequence[BlockRef]) -> Placement:
        blocks = list(blocks) or [DEFAULT_REGION]
        raw = self._raw_stages(blocks)
        # Dense numbering over the stages that hold ops, in stage order.
        dense = {r: i for i, r in enumerate(sorted({stage for stage, _ in raw}))}
        stages = [dense[stage] for stage, _ in raw]
        ipus = [s if ipu is None else ipu for s, (_, ipu) in zip(stages, raw)]
        numbers = self._number_stages(blocks, stages, ipus)
        placed = tuple(BlockPlacement(*entry) for entry in zip(blocks, numbers, ipus))
        return Placement(self.schedule_kind, placed)

    def _raw_stages(self, blocks: Sequence[BlockRef]) -> list[tuple[int, Optional[int]]]:
        """PopTorch's (stage id, IPU or None) of each traced block."""
        raw: list[tuple[int, Optional[int]]] = []
        if self._auto_stage is None:
            for block in blocks:
                if block.is_default:
                    raw.append((0, 0))
                    continue
                if block.user_id not in self._block_stage:
                    raise _unknown_block(block, self._block_stage, self)
                index = self._block_stage[block.user_id]
                ipu = self._stages[index].assigned_ipu
                raw.append((index, block.ipu_id if ipu is None else ipu))
            _warn_unused(self._block_stage, blocks, self)
        elif self._auto_stage == AutoStage.SameAsIpu:
            first_ipu: dict[str, int] = {}
            for block in blocks:
                if block.is_default:
                    raw.append((0, 0))
                    continue
                if block.user_id not in first_ipu:
                    if block.ipu_id is None:
                        raise StrategyError(
                            f"{self!r} puts each block in the stage of its IPU, but block "
                            f"{block.user_id!r} has no ipu_id; give it one, e.g. "
                            f"Block({block.user_id!r}, ipu_id=0), or list the stages: "
                            f"{type(self).__name__}(Stage({block.user_id!r}).ipu(0), ...)"
                        )
                    first_ipu[block.user_id] = block.ipu_id
                stage = first_ipu[block.user_id]
                raw.append((stage, stage if block.ipu_id is None else block.ipu_id))
        else:
            opened: dict[str, int] = {}
            for block in blocks:
                if block.is_default:
                    raw.append((0, 0))
                    continue
                stage = opened.setdefault(block.user_id, len(opened) + 1)
                raw.append((stage, block.ipu_id))
        return raw

    def _number_stages(self, blocks, stages: list[int], ipus: list[int]) -> list[int]:
        """Check one IPU per stage; merge consecutive stages on the same IPU."""
        by_stage: dict[int, dict[int, list[BlockRef]]] = {}
        for block, stage, ipu in zip(blocks, stages, ipus):
            by_stage.setdefault(stage, {}).setdefault(ipu, []).append(block)
        for stage, on in by_stage.items():
            if len(on) > 1:
                spread = "; ".join(
                    f"{', '.join(_name(b) for b in bs)} on IPU {ipu}"
                    for ipu, bs in sorted(on.items())
                )
                hint = ""
                if any(b.is_default for bs in on.values() for b in bs):
                    hint = (
                        " Ops before the first block run in stage 0 on IPU 0: start a block "
                        "before them or place the first stage on IPU 0."
                    )
                raise StrategyError(
                    f"stage {stage} of {self!r} would run on several IPUs ({spread}). "
                    "A pipeline stage runs on one IPU: set Stage(...).ipu(n), give its "
                    "blocks the same ipu_id, or split it into several stages." + hint
                )
        merged, number, last_ipu = {}, -1, None
        for stage in sorted(by_stage):
            (ipu,) = by_stage[stage]
            if ipu != last_ipu:
                number, last_ipu = number + 1, ipu
            merged[stage] = number
        return [merged[stage] for stage in stages]


class ShardedExecution(PipelinedExecution):
    """Run the model one IPU at a time, without pipelining.

    Takes the same arguments as :class:`PipelinedExecution`, which here only decide
    each block's IPU. Blocks run in the order they were traced; each run of
    consecutive blocks on one IPU is a stage, so a stage list may also put blocks of
    one Stage on several IPUs.
    """

    schedule_kind = "sharded"

    def _number_stages(self, blocks, stages: list[int], ipus: list[int]) -> list[int]:
        numbers, number, last_ipu = [], -1, None
        for ipu in ipus:
            if ipu != last_ipu:
                number, last_ipu = number + 1, ipu
            numbers.append(number)
        return numbers


class _PhasedExecution(ExecutionStrategy):
    """Common part of the phased strategies: phases of stages, liveness options."""

    def __init__(self, *phases: Union[Phase, Sequence[Stage], Sequence[str], str, Stage]):
        name = type(self).__name__
        if len(phases) == 1 and isinstance(phases[0], (list, tuple)) and phases[0] and all(
            isinstance(p, Phase) for p in phases[0]
        ):
            phases = tuple(phases[0])
        if not phases:
            raise StrategyError(
                f"{name} needs its phases listed explicitly, e.g. "
                f"{name}(Phase(\"A\"), Phase(\"B\")); there is no automatic phasing"
            )
        self._phases = tuple(self._to_phase(p) for p in phases)
        stages = [stage for phase in self._phases for stage in phase.stages]
        self._block_stage = _index_blocks(stages, name)
        self._stages = tuple(stages)
        self._phase_of_stage = tuple(
            index for index, phase in enumerate(self._phases) for _ in phase.stages
        )
        self._liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False

    @staticmethod
    def _to_phase(arg) -> Phase:
        if isinstance(arg, Phase):
            return arg
        if isinstance(arg, (list, tuple)):
            return Phase(*arg)
        return Phase(arg)

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self._phases

    @property
    def liveness(self) -> Liveness:
        return self._liveness

    @property
    def separate_backward_phase(self) -> bool:
        return self._separate_backward_phase

    def phase(self, index: int) -> Phase:
        """The Phase with the given index."""
        return self._phases[index]

    def useSeparateBackwardPhase(self, use: bool = True):
        """Give the backward pass phases of its own instead of sharing the last one.

        Forward phases 0, 1, 2 run backward in phases 4, 3, 2 by default, and in
        6, 5, 4 with a separate backward phase.
        """
        if not isinstance(use, bool):
            raise StrategyError(f"useSeparateBackwardPhase() takes a bool, got {use!r}")
        self._separate_backward_phase = use
        return self

    def setTensorsLiveness(self, liveness: Liveness):
        """Choose where tensors live between phases (see :class:`Liveness`)."""
        if not isinstance(liveness, Liveness):
            raise StrategyError(
                f"setTensorsLiveness() takes a Liveness value, got {liveness!r}; "
                "e.g. Liveness.OffChipAfterFwd"
            )
        self._check_liveness(liveness)
        self._liveness = liveness
        return self

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True):
        """Shorthand for ``setTensorsLiveness(Liveness.OffChipAfterFwd)`` (or AlwaysLive)."""
        if not isinstance(off_chip, bool):
            raise StrategyError(f"sendTensorsOffChipAfterFwd() takes a bool, got {off_chip!r}")
        return self.setTensorsLiveness(
            Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        )

    def _check_liveness(self, liveness: Liveness) -> None:
        """Serial phases accept every liveness."""

    def _check_parity(self, block: BlockRef, phase: int, ipu: int) -> None:
        """Serial phases run on any IPU."""

    def __repr__(self) -> str:
        text = f"{type(self).__name__}(" + ", ".join(repr(p) for p in self._phases) + ")"
        if self._liveness != Liveness.AlwaysLive:
            text += f".setTensorsLiveness(Liveness.{self._liveness.name})"
        if self._separate_backward_phase:
            text += ".useSeparateBackwardPhase()"
        return text

    def place(self, blocks: Sequence[BlockRef]) -> Placement:
        blocks = list(blocks) or [DEFAULT_REGION]
        units = []  # (phase, index of the Stage object, ipu) per block
        for block in blocks:
            if block.is_default:
                units.append((0, 0, 0))
                continue
            if block.user_id not in self._block_stage:
                raise _unknown_block(block, self._block_stage, self)
            index = self._block_stage[block.user_id]
            phase = self._phase_of_stage[index]
            ipu = self._stages[index].assigned_ipu
            if ipu is None:
                ipu = block.ipu_id
            if ipu is None:
                raise StrategyError(
                    f"block {block.user_id!r} (phase {phase}) has no IPU: set it with "
                    f"Phase(...).ipus(...), Stage({block.user_id!r}).ipu(n) or "
                    f"Block({block.user_id!r}, ipu_id=n)"
                )
            self._check_parity(block, phase, ipu)
            units.append((phase, index, ipu))
        _warn_unused(self._block_stage, blocks, self)
        # A stage of the schedule is one Stage on one IPU, numbered in phase order.
        number = {unit: n for n, unit in enumerate(sorted(set(units)))}
        placed = tuple(
            BlockPlacement(block, number[unit], unit[2], unit[0])
            for block, unit in zip(blocks, units)
        )
        return Placement(
            self.schedule_kind,
            placed,
            num_phases=len(self._phases),
            liveness=self._liveness,
            separate_backward_phase=self._separate_backward_phase,
        )


class SerialPhasedExecution(_PhasedExecution):
    """Run the phases one after the other on the same group of IPUs."""

    schedule_kind = "serial_phased"


class ParallelPhasedExecution(_PhasedExecution):
    """Run phases alternately on two groups of IPUs: even phases on even IPUs,
    odd phases on odd IPUs, so one group computes while the other loads."""

    schedule_kind = "parallel_phased"

    def _check_liveness(self, liveness: Liveness) -> None:
        if liveness in (Liveness.OffChipAfterFwdNoOverlap, Liveness.OffChipAfterEachPhase):
            raise StrategyError(
                f"Liveness.{liveness.name} is only supported by SerialPhasedExecution; parallel "
                "phases "
                "accept Liveness.AlwaysLive or Liveness.OffChipAfterFwd"
            )

    def _check_parity(self, block: BlockRef, phase: int, ipu: int) -> None:
        if phase % 2 != ipu % 2:
            raise StrategyError(
                f"block {block} is in phase {phase} on IPU {ipu}: parallel phased execution "
                "runs even phases on even IPUs and odd phases on odd IPUs; e.g. "
                "strategy.phase(0).ipus(0, 2) and strategy.phase(1).ipus(1, 3)"
            )


def check_data_flow(kind: str, op: str, source: str, here, producer: str, there) -> None:
    """Data flows only to the same or a later stage (pipelined and sharded execution) or phase
    (phased execution). `here` and `there` are where the op and the producer of one of its
    inputs run (anything with `block`, `stage` and `phase`); a StrategyError names both ops when
    the producer runs later."""
    unit = "phase" if kind.endswith("phased") else "stage"
    a, b = getattr(here, unit), getattr(there, unit)
    if b <= a:
        return
    hint = ("move the blocks so that the phases follow the data" if unit == "phase" else
            "use AutoStage.AutoIncrement (a new stage per block) or reorder the stages" if kind == "pipelined" else
            "give a block that starts again after other IPUs ran a name of its own")
    raise StrategyError(f"{op} at {source} (block {here.block}, {unit} {a}) uses the result of {producer} "
                        f"(block {there.block}, {unit} {b}): data can only flow to the same or a later {unit}; {hint}")


def validate_counts(
    placement: Placement,
    *,
    training: bool,
    gradient_accumulation: int,
    device_iterations: int,
) -> None:
    """Check the batching options against the placement, as PopTorch does at compile time
    (an inference model's gradient accumulation is checked when the model is created:
    ``batching.check_inference_options``).

    - a training pipeline of n stages runs 2n - 1 pipeline stages (each stage's
      backward pass is a stage too; the last IPU's forward and backward merge), and
      needs gradient accumulation >= 2n - 1 micro-batches to fill it;
    - an inference pipeline of n stages needs deviceIterations >= n.
    """
    for name, value in (
        ("gradient_accumulation", gradient_accumulation),
        ("device_iterations", device_iterations),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StrategyError(f"{name} must be a positive integer, got {value!r}")
    if placement.schedule_kind != "pipelined" or placement.num_stages < 2:
        return
    stages = placement.num_stages
    if training:
        depth = 2 * stages - 1
        if gradient_accumulation < depth:
            # PopTorch's words first (programs match them), then what was given
            raise StrategyError(
                f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to the "
                f"number of pipeline stages ({depth}) when using poptorch.PipelinedExecution. Please note "
                f"that a model with {stages} pipeline stages in PopTorch will have an additional "
                f"{stages - 1} stages when training. Got gradientAccumulation({gradient_accumulation}): set "
                f"opts.Training.gradientAccumulation({depth}) or more, or use fewer stages"
            )
    elif device_iterations < stages:
        raise StrategyError(
            f"poptorch.Options().deviceIterations must be greater than or equal to the number of "
            f"pipeline stages ({stages}) when using PopTorch.PipelinedExecution. Got "
            f"deviceIterations({device_iterations}): set opts.deviceIterations({stages}) or more, or use "
            f"fewer stages"
        )
