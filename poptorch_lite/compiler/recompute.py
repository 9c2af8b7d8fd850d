"""Recomputation: a stage's backward re-runs the stage's forward instead of reading its stashed
activations (PopART's `autoRecomputation`, which PopTorch sets to `RecomputationType::Pipeline`
for pipelined training over more than one IPU).

The forward of a recomputed stage stashes only what the recomputation starts from: the stage's
inputs (values from the stage before and the model's inputs), the values marked with
`recomputationCheckpoint`, and the random seed its dropout and random ops drew from. Just before
the stage's backward, in the same schedule step, a *recompute* stage program ("recompute", s)
runs the forward nodes the backward needs again from that stash (the schedule's "R" op); the
backward reads their results, which are live only from R to B. Stashed bytes fall, cycles rise,
values stay bit-identical: a random op recomputes with the seed its forward used and the same
seed modifier, so dropout draws the same mask, and BatchNorm's running statistics are updated
by the forward alone.

This is a rewrite of the IR: clones of the recomputed forward nodes get the pass "recompute"
(`attrs["recomputes"]` names the node they repeat) and the stage's backward nodes read the
clones. Like `backward_split`, it can be applied again to a graph placed again: it first undoes
itself.

Which forward nodes are recomputed, following PopART (willow/src/transforms/pipeline.cpp and
recompute.cpp, transforms/streamingmemory.cpp):

- pipelined execution, `RecomputationType::Pipeline` (3): every forward node of a stage that its
  backward needs, except checkpoints (the stage's inputs, `recomputationCheckpoint` values). The
  stage holding the loss keeps everything after its last checkpoints (PopART's
  `setFinalFwdStageRecomputation`: recomputing there would run ops twice in a row for nothing),
  so without a checkpoint of its own it is not recomputed;
- pipelined execution, `Standard` (1), `NormOnly` (2), `RecomputeAll` (4): PopART's implicit
  pipeline recomputation, which also stashes every value a stage sends to the next stage (it
  must be copied on unchanged), and otherwise as above;
- phased execution, any mode but `None`: every forward node of every stage is recomputed in its
  backward phase from the phase's inputs (PopART's streaming-memory transform);
- sharded execution: PopART applies `Pipeline` only to pipelines and annotates the other modes
  within one graph (liveness-driven checkpoints), which this emulator does not model: an error;
- a pipeline over one IPU is not pipelined by PopTorch, so `Pipeline` there is an error too;
- inference: nothing to recompute (no backward);
- a loop or branch (poptorch.for_loop, cond, the recurrent layers) is stashed, not recomputed:
  its body is lowered once, for the values it was made with (and draws in a body advance the
  seed as they go).
"""
from __future__ import annotations

import os

import numpy as np

from ..api.errors import Error
from .ir import VIEW_OPS, IRGraph, Node, Value

RECOMPUTE = "recompute"
"""The pass of the recomputed forward nodes (stage program ("recompute", stage), schedule op R)."""

MODES = {0: "None", 1: "Standard", 2: "NormOnly", 3: "Pipeline", 4: "RecomputeAll"}
"""PopART's RecomputationType values (popart/sessionoptions.hpp) and names."""
NONE, PIPELINE = 0, 3

RANDOM_OPS = frozenset({"dropout", "random"})
"""IR ops that draw from the IPU's seed: recomputed with the seed their forward used."""
CHECKPOINT = "checkpoint"
SEED_SNAPSHOT = "seed_snapshot"
_KEPT = frozenset({CHECKPOINT, "assign", SEED_SNAPSHOT})   # never recomputed
_PASS_THROUGH = frozenset({"print_tensor"})                # recomputed as their input: printed once


class RecomputationError(Error, ValueError):
    """An autoRecomputation setting this model cannot run with."""


def mode_name(mode: int) -> str:
    return f"{mode} (RecomputationType::{MODES[mode]})"


def recomputation_mode(options, schedule_kind: str, training: bool, stage_ipus) -> int:
    """The RecomputationType this model compiles with: `_Popart.set("autoRecomputation", n)` if
    set, else PopTorch's default (Pipeline for pipelined training over more than one IPU, None
    otherwise); None for inference. Settings the strategy cannot run are a RecomputationError."""
    if not training:
        return NONE
    ipus = len(set(stage_ipus))
    value = options._Popart.get("autoRecomputation")   # a RecomputationType: checked when the model was made
    if value is None:
        return PIPELINE if schedule_kind == "pipelined" and ipus > 1 else NONE
    mode = int(value)
    if mode == NONE:
        return NONE
    if schedule_kind == "sharded":
        raise RecomputationError(
            f"autoRecomputation={mode_name(mode)} with ShardedExecution: PopART recomputes pipeline stages only in "
            "a pipeline (PipelinedExecution) or phases (SerialPhasedExecution, ParallelPhasedExecution); its "
            "recomputation within one sharded graph is not emulated. Use autoRecomputation 0, or "
            "PipelinedExecution.")
    if schedule_kind == "pipelined" and ipus == 1:
        raise RecomputationError(
            f"autoRecomputation={mode_name(mode)} on a pipeline of one IPU: PopTorch pipelines only over more than "
            "one IPU, and PopART recomputes only pipelined (or phased) stages. Use autoRecomputation 0, or place "
            "the blocks on several IPUs.")
    return mode


def undo(ir: IRGraph) -> None:
    """Remove the recomputation of `ir` (clones, seed snapshots), the backward reading the
    forward's values again."""
    original: dict[int, Value] = {}
    for n in ir.nodes:
        if n.pass_ == RECOMPUTE:
            for clone, v in zip(n.outputs, n.attrs["recomputes"].outputs):
                original[clone.id] = v
    if not original and not any(n.op == SEED_SNAPSHOT for n in ir.nodes):
        return
    ir.nodes = [n for n in ir.nodes if n.pass_ != RECOMPUTE and n.op != SEED_SNAPSHOT]
    for n in ir.nodes:
        n.inputs = [original.get(v.id, v) for v in n.inputs]


def apply(ir: IRGraph, mode: int, schedule_kind: str) -> tuple[int, ...]:
    """Rewrite `ir` for RecomputationType `mode` (see the module doc) and return the stages
    that recompute (those with an R op). Undoes any earlier recomputation first."""
    undo(ir)
    if mode == NONE:
        return ()
    phased = schedule_kind not in ("pipelined", "sharded")
    loss_stage = ir.loss.producer.stage if ir.loss is not None and ir.loss.producer is not None else None
    stages = sorted({n.stage for n in ir.nodes if n.pass_ == "fwd"})
    out = []
    for s in stages:
        final = not phased and s == (loss_stage if loss_stage is not None else stages[-1])
        if _recompute_stage(ir, s, keep_sent=not phased and mode != PIPELINE, final=final):
            out.append(s)
    return tuple(out)


def _recompute_stage(ir: IRGraph, stage: int, *, keep_sent: bool, final: bool) -> bool:
    fwd = [n for n in ir.nodes if n.pass_ == "fwd" and n.stage == stage]
    backward = [n for n in ir.nodes if n.pass_ != "fwd" and n.stage == stage]
    made_by = {v.id: n for n in fwd for v in n.outputs}
    kept = {id(n) for n in fwd if n.op in _KEPT or _has_body(n)} | _weight_views(fwd, made_by)
    if keep_sent:   # PopART's implicit pipeline recomputation stashes what goes to another stage
        elsewhere = {v.id for n in ir.nodes if n.stage != stage for v in n.inputs}
        kept |= {id(n) for n in fwd if any(v.id in elsewhere for v in n.outputs)}
    if final:
        kept |= _after_last_checkpoints(fwd, made_by)
    # walk back from what the backward reads, through the nodes recomputed
    recomputed: set[int] = set()
    frontier = [made_by[v.id] for n in backward for v in n.inputs if v.id in made_by]
    while frontier:
        n = frontier.pop()
        if id(n) in recomputed or id(n) in kept:
            continue
        recomputed.add(id(n))
        frontier += [made_by[v.id] for v in n.inputs if v.id in made_by]
    if all(n.op in _PASS_THROUGH or n.op in VIEW_OPS for n in fwd if id(n) in recomputed):
        return False    # nothing to compute again (views of weights the backward takes itself)
    clone_of: dict[int, Value] = {}
    snapshot = None
    for n in fwd:   # IR order is topological
        if id(n) not in recomputed:
            continue
        inputs = [clone_of.get(v.id, v) for v in n.inputs]
        if n.op in _PASS_THROUGH:
            clone_of[n.outputs[0].id] = inputs[0]
            continue
        if n.op in RANDOM_OPS:
            if snapshot is None:
                snapshot = ir.add(SEED_SNAPSHOT, [], [((2,), np.uint32)], like=n)[0]
            inputs.append(snapshot)
        clones = ir.add(n.op, inputs, [(v.shape, v.dtype) for v in n.outputs], like=n, **n.attrs, recomputes=n)
        clones[0].producer.pass_ = RECOMPUTE
        for v, c in zip(n.outputs, clones):
            c.name = f"{v.name}/recomputed"
            clone_of[v.id] = c
    for n in backward:
        n.inputs = [clone_of.get(v.id, v) for v in n.inputs]
    return True


def _has_body(n: Node) -> bool:
    """Whether `n` is a loop or a branch: its body nodes read the values it was made with, so it
    is kept, not recomputed."""
    return any(isinstance(m, Node) for key in ("body", "then", "else") for m in n.attrs.get(key, ()))


def _weight_views(fwd: list[Node], made_by: dict) -> set[int]:
    """The view nodes of weights (a transposed weight the backward multiplies by): the
    backward takes the same views of the weight itself, so they are never recomputed."""
    out: set[int] = set()
    for n in fwd:   # topological order
        if n.op in VIEW_OPS:
            v = n.inputs[0]
            p = made_by.get(v.id)
            if (p is None and v.kind in ("param", "buffer")) or (p is not None and id(p) in out):
                out.add(id(n))
    return out


def _after_last_checkpoints(fwd: list[Node], made_by: dict) -> set[int]:
    """Forward nodes of the stage holding the loss that PopART does not recompute: those that
    descend from its last checkpoints. A checkpoint is a `recomputationCheckpoint` or a value
    entering the stage (from another stage, or a model input: PopART's IpuCopy and host loads);
    the last ones are those that are no ancestor of a `recomputationCheckpoint`."""
    ancestors: dict[int, set[int]] = {}          # node -> its ancestors within the stage (ids)
    readers: dict[int, list[int]] = {}           # value entering the stage -> the nodes reading it
    for n in fwd:
        anc: set[int] = set()
        for v in n.inputs:
            p = made_by.get(v.id)
            if p is not None:
                anc |= ancestors[id(p)] | {id(p)}
            elif v.kind in ("activation", "input"):
                readers.setdefault(v.id, []).append(id(n))
        ancestors[id(n)] = anc
    marked = {id(n) for n in fwd if n.op == CHECKPOINT}
    under = set().union(*(ancestors[c] for c in marked))
    seeds = marked - under
    for nodes in readers.values():
        if not any(r in under or r in marked for r in nodes):
            seeds |= set(nodes)
    return {id(n) for n in fwd if id(n) in seeds or ancestors[id(n)] & seeds}


# ---- copying a recomputation on the host (runtime/recompute_replay.py) ---------------------------
COPY_BUDGET_ENV = "IPUSIM_RECOMPUTE_REPLAY_MB"
DEFAULT_COPY_BUDGET_MB = 256
UNCOPYABLE = frozenset({"cpu_op", "print_tensor"})   # recomputed ops that do more than make values


def copy_budget_bytes() -> int:
    """Host memory the copies of recomputed values may hold at once, per replica
    (`IPUSIM_RECOMPUTE_REPLAY_MB`, default 256 MB; 0: every recomputation runs)."""
    raw = os.environ.get(COPY_BUDGET_ENV, str(DEFAULT_COPY_BUDGET_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{COPY_BUDGET_ENV}={raw!r}: give the host memory for copied recomputations in "
                         "megabytes (0 turns copying off)") from None
    if mb < 0:
        raise ValueError(f"{COPY_BUDGET_ENV}={raw!r} is negative: give megabytes, 0 to turn copying off")
    return int(mb * 2**20)


def in_flight(schedule, stage: int) -> int:
    """The most micro-batches of `stage` whose forward has run and whose recompute op has not."""
    live, most = set(), 0
    for step in schedule.steps:
        for op in step.ops:
            if op.stage != stage:
                continue
            if op.kind == "F":
                live.add(op.global_micro_batch)
            elif op.kind == "R":
                live.discard(op.global_micro_batch)
        most = max(most, len(live))
    return most
