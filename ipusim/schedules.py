"""Execution schedules as plain data: which IPU runs which op of which micro-batch at each step.

Pure functions turn an execution strategy's parameters into a `Schedule`; the runtime executes
its steps in order (the ops of one step run concurrently, at most one per IPU) and the profiler
reads the same tables. See docs/schedules.md for the rules and the closed forms.

Vocabulary: a *stage* is a forward pipeline stage (0-based, in forward order); an op is the
forward "F", backward "B" (the whole backward, or only its input gradient when the weight
gradient "W" is a separate op) or recompute "R" of one stage for one micro-batch, or the weight
update "U" of every stage on one IPU. In training a *group* is one gradient-accumulation group
(one device iteration, closed by a weight update that flushes the pipeline); in inference the
whole call is one group of `device_iterations` micro-batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

KINDS = ("F", "B", "W", "U", "R")
PIPELINE_KINDS = ("grouped", "interleaved", "sequential")


@dataclass(frozen=True)
class Op:
    """One unit of work on one IPU. `stage`, `micro_batch` and `global_micro_batch` are None
    for a weight update "U", which updates the weights of every stage placed on `ipu`.
    `micro_batch` counts within the group, `global_micro_batch` within the call.
    `phase` is the execution-phase id in phased execution, else None."""

    kind: str
    stage: int | None
    micro_batch: int | None
    ipu: int
    group: int
    global_micro_batch: int | None
    phase: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"op kind {self.kind!r} is not one of {KINDS}")

    @property
    def label(self) -> str:
        """Figure label: "F3" = forward of micro-batch 3 (numbered from 1 in the call), "U"."""
        return "U" if self.kind == "U" else f"{self.kind}{self.global_micro_batch + 1}"


@dataclass(frozen=True)
class Step:
    """Ops that run concurrently, at most one per IPU."""

    ops: tuple[Op, ...]
    group: int

    def __post_init__(self):
        ipus = [op.ipu for op in self.ops]
        if len(set(ipus)) != len(ipus):
            raise ValueError(f"a step runs two ops on one IPU: {self.ops}")

    def op_on(self, ipu: int) -> Op | None:
        return next((op for op in self.ops if op.ipu == ipu), None)

    @property
    def is_weight_update(self) -> bool:
        return any(op.kind == "U" for op in self.ops)


@dataclass(frozen=True)
class Schedule:
    """A whole model call: `steps` in execution order, grouped by flush group.

    Phase lengths (`ramp_up`, `main`, `ramp_down`) split the compute steps of a group (its
    weight-update step excluded): `main` is the longest run of consecutive steps (the first, on
    a tie) in which as many IPUs are busy as ever are in that group (every IPU, once a pipeline
    fills); `ramp_up` and `ramp_down` are the steps before and after it. Pass `group=None` for
    the sum over groups.
    """

    strategy: str
    num_ipus: int
    stage_ipus: tuple[int, ...]
    training: bool
    micro_batches_per_group: int
    steps: tuple[Step, ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ipus)

    @property
    def num_groups(self) -> int:
        return 1 + max((s.group for s in self.steps), default=-1)

    @property
    def ops(self) -> list[Op]:
        return [op for step in self.steps for op in step.ops]

    def stages_on(self, ipu: int) -> tuple[int, ...]:
        return tuple(s for s, i in enumerate(self.stage_ipus) if i == ipu)

    def group_steps(self, group: int) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.group == group)

    def _phases(self, group: int | None) -> tuple[int, int, int]:
        if group is None:
            parts = [self._phases(g) for g in range(self.num_groups)]
            return tuple(sum(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} out of range: this schedule has {self.num_groups}")
        busy = [len(s.ops) for s in self.group_steps(group) if not s.is_weight_update]
        start, length, run = 0, 0, 0
        for i, b in enumerate(busy):
            run = run + 1 if b == max(busy) else 0
            if run > length:
                start, length = i - run + 1, run
        return start, length, len(busy) - start - length

    def ramp_up(self, group: int | None = None) -> int:
        """Steps before the pipeline is full (before steady state)."""
        return self._phases(group)[0]

    def main(self, group: int | None = None) -> int:
        """Steps of steady state."""
        return self._phases(group)[1]

    def ramp_down(self, group: int | None = None) -> int:
        """Steps after steady state, up to the weight update."""
        return self._phases(group)[2]

    def busy(self, ipu: int) -> int:
        """Number of steps in which `ipu` runs an op."""
        return sum(step.op_on(ipu) is not None for step in self.steps)

    def bubble_fraction(self, ipu: int | None = None) -> float:
        """Idle IPU-steps / IPU-steps, over all steps (weight updates included), for one IPU or
        for all `num_ipus` IPUs."""
        if not self.steps:
            return 0.0
        ipus = range(self.num_ipus) if ipu is None else [ipu]
        total = len(ipus) * self.num_steps
        return (total - sum(self.busy(i) for i in ipus)) / total

    def peak_in_flight(self, ipu: int) -> int:
        """Peak number of (stage, micro-batch) pairs whose forward ran on `ipu` and whose
        backward has not yet: the activations stashed on that IPU. 0 in inference."""
        if not self.training:
            return 0
        live: set[tuple[int, int]] = set()
        peak = 0
        for step in self.steps:
            op = step.op_on(ipu)
            if op is not None and op.kind == "F":
                live.add((op.stage, op.global_micro_batch))
            elif op is not None and op.kind == "B":
                live.discard((op.stage, op.global_micro_batch))
            peak = max(peak, len(live))
        return peak

    def grid(self) -> list[list[Op | None]]:
        """grid()[ipu][step] is the op `ipu` runs at that step, or None when it is idle."""
        return [[step.op_on(i) for step in self.steps] for i in range(self.num_ipus)]

    def render(self, start: int = 0, stop: int | None = None) -> str:
        """The figure of steps[start:stop]: a header "step 1 2 ..." (steps numbered from 1) and
        one row per IPU with `.` for idle. Each column is as wide as its widest cell, columns are
        separated by one space, the label column by three. When an IPU holds several stages,
        cells name the stage too ("F3s2": forward of micro-batch 3, stage 2)."""
        shared = len(set(self.stage_ipus)) < len(self.stage_ipus)

        def cell(op: Op | None) -> str:
            if op is None:
                return "."
            return f"{op.label}s{op.stage}" if shared and op.kind != "U" else op.label

        indices = range(len(self.steps))[start:stop]
        columns = [[str(t + 1)] + [cell(op) for op in col]
                   for t, col in zip(indices, zip(*[row[start:stop] for row in self.grid()]))]
        widths = [max(map(len, col)) for col in columns]
        labels = ["step"] + [f"IPU{i}" for i in range(self.num_ipus)]
        pad = max(map(len, labels)) + 3
        return "\n".join(
            (label.ljust(pad) + " ".join(c[r].ljust(w) for c, w in zip(columns, widths))).rstrip()
            for r, label in enumerate(labels))

    def __str__(self) -> str:
        return self.render()

    def to_dict(self) -> dict:
        """JSON-ready form: the parameters, the steps and the derived figures."""
        return {
            "strategy": self.strategy,
            "num_ipus": self.num_ipus,
            "stage_ipus": list(self.stage_ipus),
            "training": self.training,
            "micro_batches_per_group": self.micro_batches_per_group,
            "num_groups": self.num_groups,
            "steps": [{"group": s.group, "ops": [asdict(op) for op in s.ops]} for s in self.steps],
            "ramp_up": self.ramp_up(),
            "main": self.main(),
            "ramp_down": self.ramp_down(),
            "bubble_fraction": self.bubble_fraction(),
            "per_ipu": [{"ipu": i, "busy": self.busy(i), "bubble_fraction": self.bubble_fraction(i),
                         "peak_in_flight": self.peak_in_flight(i)} for i in range(self.num_ipus)],
        }


# --------------------------------------------------------------------------- validation

def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _batching(training: bool, gradient_accumulation: int,
              device_iterations: int) -> tuple[int, int]:
    """(groups, micro-batches per group) of one call, with PopTorch's meaning of the factors."""
    _positive("gradient_accumulation", gradient_accumulation)
    _positive("device_iterations", device_iterations)
    if not training and gradient_accumulation != 1:
        raise ValueError(
            f"gradient_accumulation={gradient_accumulation} for an inference model: gradient "
            "accumulation only exists in training. Use gradient_accumulation=1 and raise "
            "device_iterations to run more micro-batches per call.")
    return (device_iterations, gradient_accumulation) if training else (1, device_iterations)


def _placement(num_stages: int, stage_ipus: Sequence[int] | None) -> tuple[int, ...]:
    _positive("num_stages", num_stages)
    if stage_ipus is None:
        return tuple(range(num_stages))
    placement = tuple(stage_ipus)
    if len(placement) != num_stages:
        raise ValueError(f"stage_ipus has {len(placement)} entries for {num_stages} stages: "
                         "give one IPU per stage")
    for s, ipu in enumerate(placement):
        if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
            raise ValueError(f"stage {s} is placed on IPU {ipu!r}: IPUs are integers >= 0")
    return placement


# --------------------------------------------------------------------------- assembly

def _assemble(strategy: str, placement: tuple[int, ...], training: bool, groups: int,
              per_group: int, group_steps: list[list[tuple]]) -> Schedule:
    """Repeat one group's steps (lists of (kind, stage, micro_batch, phase)) for every group,
    closing each training group with a weight-update step on every IPU that holds a stage."""
    steps = []
    for g in range(groups):
        for step in group_steps:
            steps.append(Step(tuple(
                Op(kind, stage, m, placement[stage], g, g * per_group + m, phase)
                for kind, stage, m, phase in step), g))
        if training:
            steps.append(Step(tuple(Op("U", None, None, ipu, g, None)
                                    for ipu in sorted(set(placement))), g))
    return Schedule(strategy, max(placement) + 1, placement, training, per_group, tuple(steps))


def _one_at_a_time(order: Iterable[tuple[int, int | None]], per_group: int, training: bool,
                   backward_phase=lambda p: None) -> list[list[tuple]]:
    """One op per step: each micro-batch runs forward through `order` ((stage, phase) pairs in
    forward order), then backward in reverse order."""
    order = list(order)
    steps = []
    for m in range(per_group):
        steps += [[("F", s, m, p)] for s, p in order]
        if training:
            steps += [[("B", s, m, backward_phase(p))] for s, p in reversed(order)]
    return steps


def _pipelined_group(placement: tuple[int, ...], per_group: int, training: bool,
                     kind: str) -> list[list[tuple]]:
    """One flush group of a filled pipeline, simulated step by step.

    Each (kind, stage) has a queue of micro-batches in order; an op is ready when its
    dependency ran in an earlier step (F of s-1 for F of s; F of the last stage for its B; B of
    s+1 for B of s). In every step each IPU runs its oldest ready op of the kind it may run:
    "grouped" runs forward-only steps until a backward is ready, then alternates a backward step
    and a forward step on all IPUs; "interleaved" lets each IPU alternate on its own, forward on
    the steps of the parity of its first stage. Steps in which no IPU can run anything are
    skipped."""
    n = len(placement)
    kinds = ("F", "B") if training else ("F",)
    ipus = sorted(set(placement))
    parity = {i: placement.index(i) % 2 for i in ipus}
    head = {(k, s): 0 for k in kinds for s in range(n)}  # next micro-batch of each queue
    done: dict[tuple[str, int, int], int] = {}  # op -> index of the step that ran it
    steps: list[list[tuple]] = []

    def ready(k: str, s: int) -> bool:
        m = head[(k, s)]
        if m >= per_group:
            return False
        dep = (("F", s - 1, m) if s > 0 else None) if k == "F" else \
            ("F", s, m) if s == n - 1 else ("B", s + 1, m)
        return dep is None or done.get(dep, len(steps)) < len(steps)

    def any_ready(k: str) -> bool:
        return any(ready(k, s) for s in range(n))

    phase, alternating, tick = "F", False, 0
    while len(done) < len(kinds) * n * per_group:
        if kind == "grouped" and training:
            if not alternating and any_ready("B"):
                alternating, phase = True, "B"
            elif alternating:
                phase = "F" if phase == "B" else "B"
            if not any_ready(phase):
                phase = "F" if phase == "B" else "B"
        step = []
        for ipu in ipus:
            if not training:
                allowed = "F"
            elif kind == "grouped":
                allowed = phase
            else:
                allowed = "F" if (tick - parity[ipu]) % 2 == 0 else "B"
            candidates = [(head[(allowed, s)], s) for s in range(n)
                          if placement[s] == ipu and ready(allowed, s)]
            if candidates:
                m, s = min(candidates)
                step.append((allowed, s, m, None))
        tick += 1
        if not step:
            if kind == "grouped":
                raise AssertionError("no op ready although ops remain")  # acyclic: unreachable
            continue
        for k, s, m, _ in step:
            head[(k, s)] += 1
            done[(k, s, m)] = len(steps)
        steps.append(step)
    return steps


# --------------------------------------------------------------------------- strategies

def pipelined_schedule(num_stages: int, *, training: bool, gradient_accumulation: int = 1,
                       device_iterations: int = 1, stage_ipus: Sequence[int] | None = None,
                       kind: str = "grouped") -> Schedule:
    """PopTorch's PipelinedExecution.

    num_stages: forward pipeline stages; stage s runs on IPU `stage_ipus[s]` (default s), and
        so does its backward. Several stages may share an IPU: their ops queue on it.
    training: forward and backward ops, and a weight update "U" closing every group.
    gradient_accumulation: micro-batches per weight update (training only; 1 in inference).
    device_iterations: in training, groups per call (each flushed by its weight update); in
        inference, the micro-batches that flow through one filled pipeline.
    kind: "grouped" (the tutorial's figure: all IPUs run forward steps or backward steps
        together), "interleaved" (each IPU alternates forward and backward by itself) or
        "sequential" (one op at a time, for debugging). See docs/schedules.md.

    Like PopTorch, training needs gradient_accumulation >= 2*num_stages-1 (the pipeline stages
    once backward stages are added) and inference needs device_iterations >= num_stages.
    """
    placement = _placement(num_stages, stage_ipus)
    if kind not in PIPELINE_KINDS:
        raise ValueError(f"unknown pipeline schedule kind {kind!r}: use one of {PIPELINE_KINDS}")
    groups, per_group = _batching(training, gradient_accumulation, device_iterations)
    if training and gradient_accumulation < 2 * num_stages - 1:
        raise ValueError(
            f"gradient_accumulation={gradient_accumulation} is less than the number of pipeline "
            f"stages ({2 * num_stages - 1}): a training pipeline of {num_stages} stages gains "
            f"{num_stages - 1} backward stages. Set gradient_accumulation >= "
            f"{2 * num_stages - 1} (poptorch: options.Training.gradientAccumulation).")
    if not training and device_iterations < num_stages:
        raise ValueError(
            f"device_iterations={device_iterations} is less than the number of pipeline stages "
            f"({num_stages}) for pipelined inference: the pipeline needs one micro-batch per "
            f"stage to fill. Set device_iterations >= {num_stages} (poptorch: "
            "options.deviceIterations).")
    if kind == "sequential":
        group = _one_at_a_time(((s, None) for s in range(num_stages)), per_group, training)
    else:
        group = _pipelined_group(placement, per_group, training, kind)
    return _assemble(f"pipelined-{kind}", placement, training, groups, per_group, group)


def sharded_schedule(num_stages: int, *, training: bool, gradient_accumulation: int = 1,
                     device_iterations: int = 1,
                     stage_ipus: Sequence[int] | None = None) -> Schedule:
    """PopTorch's ShardedExecution: one IPU active at a time. Each micro-batch runs forward
    through stages 0..n-1, then (training) backward through n-1..0; a weight update closes every
    group of `gradient_accumulation` micro-batches. Parameters as in `pipelined_schedule`."""
    placement = _placement(num_stages, stage_ipus)
    groups, per_group = _batching(training, gradient_accumulation, device_iterations)
    group = _one_at_a_time(((s, None) for s in range(num_stages)), per_group, training)
    return _assemble("sharded", placement, training, groups, per_group, group)


def _phased(name: str, phases: Sequence[Sequence[tuple[int, int]]], training: bool,
            gradient_accumulation: int, device_iterations: int, separate_backward_phase: bool,
            parallel: bool) -> Schedule:
    if not phases or any(not phase for phase in phases):
        raise ValueError("phases must be a non-empty list of non-empty lists of (stage, ipu)")
    order = [(stage, p) for p, phase in enumerate(phases) for stage, _ in phase]
    stages = [stage for stage, _ in order]
    if stages != list(range(len(stages))):
        raise ValueError(f"phases hold stages {stages}: number the stages 0..{len(stages) - 1} "
                         "in forward order, phase after phase")
    placement = _placement(len(stages), [ipu for phase in phases for _, ipu in phase])
    if parallel:
        for p, phase in enumerate(phases):
            wrong = sorted({ipu for _, ipu in phase if ipu % 2 != p % 2})
            if wrong:
                raise ValueError(
                    f"phase {p} uses IPUs {wrong}: parallel phased execution alternates between "
                    f"two IPU sets, so phase {p} must run on {'even' if p % 2 == 0 else 'odd'} "
                    "IPUs only")
    groups, per_group = _batching(training, gradient_accumulation, device_iterations)
    last = 2 * len(phases) - (0 if separate_backward_phase else 2)
    group = _one_at_a_time(order, per_group, training, backward_phase=lambda p: last - p)
    return _assemble(name, placement, training, groups, per_group, group)


def serial_phased_schedule(phases: Sequence[Sequence[tuple[int, int]]], *, training: bool,
                           gradient_accumulation: int = 1, device_iterations: int = 1,
                           separate_backward_phase: bool = False) -> Schedule:
    """PopTorch's SerialPhasedExecution. `phases[p]` lists the (stage, ipu) pairs of phase p;
    stages are numbered 0.. in forward order. Each micro-batch runs the forward phases in
    order, then the backward phases in reverse order; the stages of a phase run one after
    the other. Forward phase p has phase id p and its backward has id 2(P-1)-p for P phases
    (the last forward phase and the first backward phase share an id), or 2P-p with
    `separate_backward_phase` (PopTorch's useSeparateBackwardPhase: id P stays empty).
    A weight update closes every group of `gradient_accumulation` micro-batches."""
    return _phased("serial-phased", phases, training, gradient_accumulation, device_iterations,
                   separate_backward_phase, parallel=False)


def parallel_phased_schedule(phases: Sequence[Sequence[tuple[int, int]]], *, training: bool,
                             gradient_accumulation: int = 1, device_iterations: int = 1,
                             separate_backward_phase: bool = False) -> Schedule:
    """PopTorch's ParallelPhasedExecution: as `serial_phased_schedule`, but phases alternate
    between two IPU sets, so phase p must use only IPUs of the parity of p (0, 2, ... for even
    phases; 1, 3, ... for odd ones) while the other set prepares the next phase."""
    return _phased("parallel-phased", phases, training, gradient_accumulation, device_iterations,
                   separate_backward_phase, parallel=True)
