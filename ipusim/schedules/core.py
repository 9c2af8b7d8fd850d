"""The data of a schedule: ops, lock-step steps, and the figures and checks derived from them.

Vocabulary: a *stage* is a forward pipeline stage (0-based, in forward order); an op is the
forward "F", backward "B" (the whole backward, or only its input gradient when the weight
gradient "W" is a separate op) or recompute "R" of one stage for one micro-batch, or the weight
update "U" of every stage on one IPU. An R re-runs its stage's forward from what the forward
stashed, just before that stage's backward and in the same step (PopART runs the recomputation
in the backward's pipeline stage). An IPU runs one op a step, or, when it holds several stages, one op of
each of them (PopART's pipeline cycle), each B after its R. In training a *group* is one gradient-accumulation group
(one device iteration, closed by a weight update that flushes the pipeline); in inference the
whole call is one group of `device_iterations` micro-batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Sequence

KINDS = ("F", "B", "W", "U", "R")


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


def recomputes(first: Op, then: Op) -> bool:
    """Whether `first` is the recompute R that `then`, a backward B, runs right after: the only
    pair of ops that may share an IPU's step."""
    return first.kind == "R" and then.kind == "B" and first.ipu == then.ipu and \
        (first.stage, first.global_micro_batch) == (then.stage, then.global_micro_batch)


@dataclass(frozen=True)
class Step:
    """Ops that run concurrently, one per IPU, except that an IPU holding several stages runs
    one op of each of them (PopART's pipeline cycle runs every stage once) and that a recompute
    R runs on its IPU right before the B it serves, in the same step (listed in that order).
    The ops of one IPU run one after the other, in their order in `ops`."""

    ops: tuple[Op, ...]
    group: int

    def __post_init__(self):
        for ops in self.by_ipu():
            if len(ops) == 1:
                continue
            ops_ = [op for i, op in enumerate(ops)
                    if not (op.kind == "R" and i + 1 < len(ops) and recomputes(op, ops[i + 1]))]
            stages = [op.stage for op in ops_]
            if any(op.kind in ("U", "R") for op in ops_) or len(set(stages)) < len(stages):
                raise ValueError(f"a step runs {', '.join(op.label for op in ops)} on IPU {ops[0].ipu}: an IPU runs "
                                 f"one op per stage it holds in a step (a weight update alone), and a recompute R "
                                 f"only right before the B of its stage and micro-batch: {self.ops}")

    def by_ipu(self) -> list[tuple[Op, ...]]:
        """The ops of each IPU in the step, in order (an R before its B), IPUs in order of their
        first op."""
        out: dict[int, list[Op]] = {}
        for op in self.ops:
            out.setdefault(op.ipu, []).append(op)
        return [tuple(ops) for ops in out.values()]

    def ops_on(self, ipu: int) -> tuple[Op, ...]:
        """Every op `ipu` runs in the step, in order: none, one, an R and its B, or one of each
        stage the IPU holds."""
        return tuple(op for op in self.ops if op.ipu == ipu)

    def op_on(self, ipu: int) -> Op | None:
        """The last op `ipu` runs in the step (the B when an R precedes it), or None."""
        ops = self.ops_on(ipu)
        return ops[-1] if ops else None

    @property
    def is_weight_update(self) -> bool:
        return any(op.kind == "U" for op in self.ops)


@dataclass(frozen=True)
class OrderError:
    """One way in which a schedule is not a valid order: what is wrong, and the step (0-based)
    where it shows."""

    step: int
    message: str

    def __str__(self) -> str:
        return self.message


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
    def num_micro_batches(self) -> int:
        """Micro-batches of the whole call."""
        return self.micro_batches_per_group * (self.num_groups if self.training else 1)

    @property
    def ops(self) -> list[Op]:
        return [op for step in self.steps for op in step.ops]

    @cached_property
    def split_backward(self) -> bool:
        """True when the weight gradients are separate "W" ops (zero-bubble schedules)."""
        return any(op.kind == "W" for op in self.ops)

    @cached_property
    def recomputed_stages(self) -> tuple[int, ...]:
        """The stages whose backward recomputes their forward first (their B ops have an R)."""
        return tuple(sorted({op.stage for op in self.ops if op.kind == "R"}))

    def with_recomputation(self, stages) -> "Schedule":
        """This schedule with every B of the given stages preceded, in its own step and on its
        IPU, by the R that recomputes the stage's forward for that micro-batch (PopART's
        recomputation runs in the backward's pipeline stage, so it adds no step). Training only;
        stages not in the schedule are an error. An empty `stages` gives the schedule back."""
        stages = sorted(set(stages))
        if not stages:
            return self
        if not self.training:
            raise ValueError("recomputation needs a training schedule: an inference call has no backward to recompute "
                             "for")
        wrong = [s for s in stages if not 0 <= s < self.num_stages]
        if wrong:
            raise ValueError(f"stages {wrong} recomputed in a schedule of {self.num_stages} stages")
        if self.recomputed_stages:
            raise ValueError(f"this schedule already recomputes stages {list(self.recomputed_stages)}")
        chosen = set(stages)
        steps = []
        for step in self.steps:
            ops = []
            for op in step.ops:
                if op.kind == "B" and op.stage in chosen:
                    ops.append(Op("R", op.stage, op.micro_batch, op.ipu, op.group, op.global_micro_batch, op.phase))
                ops.append(op)
            steps.append(Step(tuple(ops), step.group))
        return Schedule(self.strategy, self.num_ipus, self.stage_ipus, self.training, self.micro_batches_per_group,
                        tuple(steps))

    def stages_on(self, ipu: int) -> tuple[int, ...]:
        return tuple(s for s, i in enumerate(self.stage_ipus) if i == ipu)

    def group_steps(self, group: int) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.group == group)

    def order(self, ipu: int) -> list[Op]:
        """The ops `ipu` runs, in the order it runs them."""
        return [op for step in self.steps for op in step.ops if op.ipu == ipu]

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

    def busy(self, ipu: int, *, weight_update: bool = True) -> int:
        """Number of steps in which `ipu` runs an op (weight-update steps left out unless
        `weight_update`)."""
        return sum(step.op_on(ipu) is not None for step in self.steps
                   if weight_update or not step.is_weight_update)

    def bubble_fraction(self, ipu: int | None = None, *, weight_update: bool = True) -> float:
        """Idle IPU-steps / IPU-steps, for one IPU or for all `num_ipus` IPUs, over all steps, or
        over the compute steps alone when `weight_update` is False (the closed forms of the
        literature leave the weight update out)."""
        steps = [s for s in self.steps if weight_update or not s.is_weight_update]
        if not steps:
            return 0.0
        ipus = range(self.num_ipus) if ipu is None else [ipu]
        total = len(ipus) * len(steps)
        return (total - sum(self.busy(i, weight_update=weight_update) for i in ipus)) / total

    @property
    def release_kind(self) -> str:
        """The op after which a stage no longer needs a micro-batch's stashed activations: its
        "W" when the backward is split, else its "B"."""
        return "W" if self.split_backward else "B"

    def in_flight(self, ipu: int) -> list[int]:
        """After each step, the (stage, micro-batch) pairs whose forward ran on `ipu` and whose
        backward has not finished (see `release_kind`)."""
        if not self.training:
            return [0] * self.num_steps
        release = self.release_kind
        live: set[tuple[int, int]] = set()
        out = []
        for step in self.steps:
            for op in step.ops_on(ipu):
                if op.kind == "F":
                    live.add((op.stage, op.global_micro_batch))
                elif op.kind == release:
                    live.discard((op.stage, op.global_micro_batch))
            out.append(len(live))
        return out

    def peak_in_flight(self, ipu: int) -> int:
        """Peak number of (stage, micro-batch) pairs whose forward ran on `ipu` and whose
        backward has not finished (its "W" when the backward is split, else its "B"): the
        activations stashed on that IPU, the stash depth. 0 in inference."""
        return max(self.in_flight(ipu), default=0)

    def order_errors(self) -> list[OrderError]:
        """What makes this schedule an invalid order (empty when it is valid): every F (and in
        training every B, and W when the backward is split) of every stage and micro-batch runs
        exactly once, on its stage's IPU, after what it needs (see `dependencies`) and within
        its group's flush: after the weight update of the group before and before its own."""
        errors: list[OrderError] = []
        when: dict[tuple[str, int, int], int] = {}
        updates = {step.group: t for t, step in enumerate(self.steps) if step.is_weight_update}
        for t, step in enumerate(self.steps):
            for op in step.ops:
                if op.kind == "U":
                    continue
                where = f"{op.label} of stage {op.stage} (step {t + 1})"
                key = (op.kind, op.stage, op.global_micro_batch)
                if key in when:
                    errors.append(OrderError(t, f"{where} runs twice: it ran at step {when[key] + 1} already"))
                    continue
                when[key] = t
                if not 0 <= op.stage < self.num_stages:
                    errors.append(OrderError(t, f"{where} names a stage that does not exist: "
                                                f"this schedule has {self.num_stages}"))
                    continue
                if op.ipu != self.stage_ipus[op.stage]:
                    errors.append(OrderError(t, f"{where} runs on IPU {op.ipu}, not on its stage's "
                                                f"IPU {self.stage_ipus[op.stage]}"))
                if self.training and op.group in updates and t > updates[op.group]:
                    errors.append(OrderError(t, f"{where} runs after the weight update of its group "
                                                f"(step {updates[op.group] + 1})"))
                if self.training and op.group - 1 in updates and t < updates[op.group - 1]:
                    errors.append(OrderError(t, f"{where} runs before the weight update of the group "
                                                f"before (step {updates[op.group - 1] + 1}) flushed it"))
        kinds = ("F",) if not self.training else ("F", "B", "W") if self.split_backward else ("F", "B")
        for k in kinds + ("R",):
            for s in range(self.num_stages) if k != "R" else self.recomputed_stages:
                for m in range(self.num_micro_batches):
                    if (k, s, m) not in when:
                        errors.append(OrderError(self.num_steps - 1, f"{k}{m + 1} of stage {s} never runs"))
        for (k, s, m), t in when.items():
            if k == "R" and when.get(("B", s, m)) != t:
                errors.append(OrderError(t, f"R{m + 1} of stage {s} (step {t + 1}) does not run in the step of the "
                                            f"B{m + 1} it recomputes for"))
        for (k, s, m), t in when.items():
            if not 0 <= s < self.num_stages:
                continue
            for need in dependencies(k, s, m, self.num_stages):
                if need in when and when[need] >= t:
                    errors.append(OrderError(t, f"{k}{m + 1} of stage {s} (step {t + 1}) does not run after "
                                                f"{need[0]}{m + 1} of stage {need[1]} (step {when[need] + 1}) "
                                                "that it needs"))
        return sorted(errors, key=lambda e: e.step)

    def grid(self) -> list[list[Op | None]]:
        """grid()[ipu][step] is the op `ipu` runs at that step (the B when an R precedes it), or
        None when it is idle."""
        return [[step.op_on(i) for step in self.steps] for i in range(self.num_ipus)]

    def render(self, start: int = 0, stop: int | None = None, *, mark: int | None = None) -> str:
        """The figure of steps[start:stop]: a header "step 1 2 ..." (steps numbered from 1) and
        one row per IPU with `.` for idle. Each column is as wide as its widest cell, columns are
        separated by one space, the label column by three. When an IPU holds several stages,
        cells name the stage too ("F3s2": forward of micro-batch 3, stage 2). An IPU that
        recomputes before a backward shows "RB3": R3 then B3 in one step; an IPU that runs
        several stages' ops in a step shows them joined by "+" ("F5s0+F1s4"). `mark` (a step
        index within the range) adds a last line with "^" under that step's column."""
        shared = len(set(self.stage_ipus)) < len(self.stage_ipus)

        def cell(ops: tuple[Op, ...]) -> str:
            if not ops:
                return "."
            labels = []
            for i, op in enumerate(ops):
                if op.kind == "R" and i + 1 < len(ops) and recomputes(op, ops[i + 1]):
                    continue
                label = ("R" if i and recomputes(ops[i - 1], op) else "") + op.label  # "RB3": recompute, backward
                labels.append(f"{label}s{op.stage}" if shared and op.kind != "U" else label)
            return "+".join(labels)

        indices = range(len(self.steps))[start:stop]
        columns = [[str(t + 1)] + [cell(self.steps[t].ops_on(i)) for i in range(self.num_ipus)] for t in indices]
        widths = [max(map(len, col)) for col in columns]
        labels = ["step"] + [f"IPU{i}" for i in range(self.num_ipus)]
        pad = max(map(len, labels)) + 3
        lines = [(label.ljust(pad) + " ".join(c[r].ljust(w) for c, w in zip(columns, widths))).rstrip()
                 for r, label in enumerate(labels)]
        if mark is not None and mark in indices:
            k = indices.index(mark)
            lines.append(" " * (pad + sum(w + 1 for w in widths[:k])) + "^")
        return "\n".join(lines)

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


def dependencies(kind: str, stage: int, micro_batch: int, num_stages: int) -> list[tuple[str, int, int]]:
    """The ops (kind, stage, micro-batch) that op `kind` of `stage` needs first: F needs the F
    of the stage before; B needs the B of the stage after, or the F of the same stage on the
    last stage; W needs the B of its own stage; R (recompute) needs the F of its own stage, whose
    stash it starts from (and its B runs right after it, in the same step)."""
    if kind == "F":
        return [("F", stage - 1, micro_batch)] if stage > 0 else []
    if kind == "B":
        return [("F", stage, micro_batch)] if stage == num_stages - 1 else [("B", stage + 1, micro_batch)]
    if kind in ("W", "R"):
        return [("B" if kind == "W" else "F", stage, micro_batch)]
    return []


# --------------------------------------------------------------------------- validation

def positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def batching(training: bool, gradient_accumulation: int, device_iterations: int) -> tuple[int, int]:
    """(groups, micro-batches per group) of one call, with PopTorch's meaning of the factors."""
    positive("gradient_accumulation", gradient_accumulation)
    positive("device_iterations", device_iterations)
    if not training and gradient_accumulation != 1:
        raise ValueError(
            f"gradient_accumulation={gradient_accumulation} for an inference model: gradient "
            "accumulation only exists in training. Use gradient_accumulation=1 and raise "
            "device_iterations to run more micro-batches per call.")
    return (device_iterations, gradient_accumulation) if training else (1, device_iterations)


def stage_placement(num_stages: int, stage_ipus: Sequence[int] | None) -> tuple[int, ...]:
    positive("num_stages", num_stages)
    if stage_ipus is None:
        return tuple(range(num_stages))
    placed = tuple(stage_ipus)
    if len(placed) != num_stages:
        raise ValueError(f"stage_ipus has {len(placed)} entries for {num_stages} stages: "
                         "give one IPU per stage")
    for s, ipu in enumerate(placed):
        if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
            raise ValueError(f"stage {s} is placed on IPU {ipu!r}: IPUs are integers >= 0")
    return placed


# --------------------------------------------------------------------------- assembly

def assemble(strategy: str, stage_ipus: tuple[int, ...], training: bool, groups: int,
             per_group: int, group_steps: list[list[tuple]]) -> Schedule:
    """Repeat one group's steps (lists of (kind, stage, micro_batch, phase)) for every group,
    closing each training group with a weight-update step on every IPU that holds a stage."""
    steps = []
    for g in range(groups):
        for step in group_steps:
            steps.append(Step(tuple(
                Op(kind, stage, m, stage_ipus[stage], g, g * per_group + m, phase)
                for kind, stage, m, phase in step), g))
        if training:
            steps.append(Step(tuple(Op("U", None, None, ipu, g, None)
                                    for ipu in sorted(set(stage_ipus))), g))
    return Schedule(strategy, max(stage_ipus) + 1, stage_ipus, training, per_group, tuple(steps))
