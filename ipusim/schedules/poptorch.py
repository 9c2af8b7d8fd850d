"""PopTorch's schedules: PipelinedExecution (grouped, interleaved and sequential kinds),
ShardedExecution, SerialPhasedExecution and ParallelPhasedExecution. See docs/schedules.md for
the rules and the closed forms."""
from __future__ import annotations

from typing import Iterable, Sequence

from .core import Schedule, assemble, batching, dependencies, stage_placement

PIPELINE_KINDS = ("grouped", "interleaved", "sequential")


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


def _pipeline_cycles(placement: tuple[int, ...], per_group: int, training: bool) -> list[list[tuple]]:
    """One flush group of the grouped schedule: PopART's pipeline cycles, each split into a
    forward step and a backward step.

    Training turns N forward stages into 2N-1 pipeline stages, so the forward of stage s for
    micro-batch k runs in cycle k+s and its backward in cycle k+2N-2-s; in inference the forward
    runs in cycle k+s. Every stage runs once a cycle on its IPU, so an IPU that holds several
    stages runs all of their ops of the cycle in the cycle's step (forwards in stage order,
    backwards in reverse stage order), one after the other: the step lasts as long as that IPU's
    ops together. Steps with no op (the backward steps of the fill, the forward steps of the
    flush) are left out. With one stage per IPU every IPU runs one op a step: the tutorial's
    figure (docs/schedules.md)."""
    n = len(placement)
    cycles = per_group + (2 * n - 2 if training else n - 1)

    def step(kind: str, pairs) -> list[tuple]:
        ops = [(kind, s, k, None) for s, k in pairs if 0 <= k < per_group]
        order = (lambda op: (placement[op[1]], op[1])) if kind == "F" else (lambda op: (placement[op[1]], -op[1]))
        return sorted(ops, key=order)

    steps = []
    for c in range(cycles):
        forward = step("F", ((s, c - s) for s in range(n)))
        backward = step("B", ((s, c - (2 * n - 2 - s)) for s in range(n))) if training else []
        steps += [ops for ops in (forward, backward) if ops]
    return steps


def _interleaved_group(placement: tuple[int, ...], per_group: int, training: bool) -> list[list[tuple]]:
    """One flush group of the interleaved schedule, simulated step by step.

    Each (kind, stage) has a queue of micro-batches in order; an op is ready when its
    dependency ran in an earlier step (F of s-1 for F of s; F of the last stage for its B; B of
    s+1 for B of s). In every step each IPU runs its oldest ready op of the kind it may run: it
    alternates forward and backward on its own, forward on the steps of the parity of its first
    stage. Steps in which no IPU can run anything are skipped."""
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
        return all(done.get(need, len(steps)) < len(steps) for need in dependencies(k, s, m, n))

    tick = 0
    while len(done) < len(kinds) * n * per_group:
        step = []
        for ipu in ipus:
            allowed = "F" if not training or (tick - parity[ipu]) % 2 == 0 else "B"
            candidates = [(head[(allowed, s)], s) for s in range(n)
                          if placement[s] == ipu and ready(allowed, s)]
            if candidates:
                m, s = min(candidates)
                step.append((allowed, s, m, None))
        tick += 1
        if not step:
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
        so does its backward. Several stages may share an IPU: in the grouped kind the IPU runs
        each of its stages once a pipeline cycle, their ops one after the other in one step (as
        PopART's pipeline does); in the interleaved kind their ops queue on it.
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
    placement = stage_placement(num_stages, stage_ipus)
    if kind not in PIPELINE_KINDS:
        raise ValueError(f"unknown pipeline schedule kind {kind!r}: use one of {PIPELINE_KINDS}")
    groups, per_group = batching(training, gradient_accumulation, device_iterations)
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
    elif kind == "grouped":
        group = _pipeline_cycles(placement, per_group, training)
    else:
        group = _interleaved_group(placement, per_group, training)
    return assemble(f"pipelined-{kind}", placement, training, groups, per_group, group)


def sharded_schedule(num_stages: int, *, training: bool, gradient_accumulation: int = 1,
                     device_iterations: int = 1,
                     stage_ipus: Sequence[int] | None = None) -> Schedule:
    """PopTorch's ShardedExecution: one IPU active at a time. Each micro-batch runs forward
    through stages 0..n-1, then (training) backward through n-1..0; a weight update closes every
    group of `gradient_accumulation` micro-batches. Parameters as in `pipelined_schedule`."""
    placement = stage_placement(num_stages, stage_ipus)
    groups, per_group = batching(training, gradient_accumulation, device_iterations)
    group = _one_at_a_time(((s, None) for s in range(num_stages)), per_group, training)
    return assemble("sharded", placement, training, groups, per_group, group)


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
    placement = stage_placement(len(stages), [ipu for phase in phases for _, ipu in phase])
    if parallel:
        for p, phase in enumerate(phases):
            wrong = sorted({ipu for _, ipu in phase if ipu % 2 != p % 2})
            if wrong:
                raise ValueError(
                    f"phase {p} uses IPUs {wrong}: parallel phased execution alternates between "
                    f"two IPU sets, so phase {p} must run on {'even' if p % 2 == 0 else 'odd'} "
                    "IPUs only")
    groups, per_group = batching(training, gradient_accumulation, device_iterations)
    last = 2 * len(phases) - (0 if separate_backward_phase else 2)
    group = _one_at_a_time(order, per_group, training, backward_phase=lambda p: last - p)
    return assemble(name, placement, training, groups, per_group, group)


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
