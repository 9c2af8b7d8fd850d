"""Recomputation on the host: the values a recompute program would make again, copied from its
forward instead of computed a second time.

A recompute program ("recompute", s; compiler/recompute.py) makes, bit for bit, values the
stage's forward made for the same micro-batch. What the device does is fixed when the model is
compiled and recorded by the first call (cycles per step, memory; runtime/executor.py), so the
calls after it only have to give the backward the right values. Here they come from the
forward: after the forward of micro-batch k runs, the values its backward reads from the
recompute program are copied aside; when the recompute op of micro-batch k runs, its stash is
received as always and the copies are written where the recompute program puts its results.

It is checked, not assumed. A stage replays only when
- its recompute program makes nothing but values (no host call, no print);
- on the first call, which runs every recompute program, each copy equals in every bit what the
  recompute program computed, for every micro-batch;
- the copies it holds at once (one set per micro-batch between its forward and its recompute
  op, the most the schedule keeps in flight) fit, with the other replaying stages', in
  `IPUSIM_RECOMPUTE_REPLAY_MB` megabytes of host memory (default 256; 0 turns replaying off),
  the stages with the fewest bytes first.
Only the fast layout replays: strict mode runs every program, so that it checks the fast one.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from ..compiler.lowering import program_key

logger = logging.getLogger("poptorch_lite")

BUDGET_ENV = "IPUSIM_RECOMPUTE_REPLAY_MB"
DEFAULT_BUDGET_MB = 256
UNCOPYABLE = frozenset({"cpu_op", "print_tensor"})   # recomputed ops that do more than make values


def budget_bytes() -> int:
    raw = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={raw!r}: give the host memory for copied recomputations in "
                         "megabytes (0 turns copying off)") from None
    if mb < 0:
        raise ValueError(f"{BUDGET_ENV}={raw!r} is negative: give megabytes, 0 to turn copying off")
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


class RecomputeReplay:
    """Which stages copy their recomputation, and the copies in flight."""

    def __init__(self, exe):
        self.engine = exe.engine
        self.candidates: dict[int, list[tuple[int, list]]] = {}  # stage -> [(replica, [(fwd, rec)])]
        self.enabled: set[int] = set()
        self.failed: set[int] = set()      # stages whose first-call copies differed
        self.copies: dict[tuple[int, int], list[list[np.ndarray]]] = {}   # (stage, micro-batch) -> per replica
        self.checking: set[int] = set()
        self.need: dict[int, int] = {}
        if exe.engine.mode != "fast":
            return
        for r, low in enumerate(exe.lowerings):
            for key, pairs in low.recomputed_from.items():
                sp = low.stage_programs[key]
                if pairs is None or not pairs or any(n.op in UNCOPYABLE for n in sp.nodes):
                    self.candidates[key[1]] = None
                    continue
                if self.candidates.get(key[1], []) is not None:
                    self.candidates.setdefault(key[1], []).append((r, pairs))
        stages = [s for s, c in self.candidates.items() if c]
        # stage -> bytes of the copies it holds at once
        self.need = {s: in_flight(exe.schedule, s) * sum(f.numel * f.var.dtype.itemsize
                                                         for _, p in self.candidates[s] for f, _ in p)
                     for s in stages}
        left = budget_bytes()
        for s in sorted(stages, key=self.need.get):
            if self.need[s] <= left:
                self.enabled.add(s)
                left -= self.need[s]
        self.checking = set(self.enabled)   # until the first call has compared them

    def after_forward(self, op) -> None:
        """Copy aside what the backward of `op`'s micro-batch will read (`op` an F that just ran)."""
        if op.stage in self.enabled:
            self.copies[(op.stage, op.global_micro_batch)] = [
                [np.array(self.engine.readTensor(f), copy=True) for f, _ in pairs]
                for _, pairs in self.candidates[op.stage]]

    def replaces(self, op) -> bool:
        """Whether the recompute op `op` is written from copies instead of run."""
        return op.kind == "R" and op.stage in self.enabled and op.stage not in self.checking

    def write(self, op) -> None:
        """Give the recompute program's results of `op`'s micro-batch their copied values."""
        for (_, pairs), values in zip(self.candidates[op.stage], self.copies.pop((op.stage, op.global_micro_batch))):
            for (_, rec), value in zip(pairs, values):
                self.engine.writeTensor(rec, value)

    def ran(self, op) -> None:
        """The recompute op `op` ran its program: its copies are done with; on the first call,
        compared with what the program made."""
        values = self.copies.pop((op.stage, op.global_micro_batch), None)
        if values is None or op.stage not in self.checking:
            return
        for (r, pairs), got in zip(self.candidates[op.stage], values):
            for (_, rec), value in zip(pairs, got):
                made = self.engine.readTensor(rec)
                if made.shape != value.shape or made.tobytes() != value.tobytes():
                    logger.debug("stage %d recomputes (replica %d: %s differs from its forward's value)",
                                 op.stage, r, rec.name)
                    self.enabled.discard(op.stage)
                    self.checking.discard(op.stage)
                    self.failed.add(op.stage)
                    for key in [k for k in self.copies if k[0] == op.stage]:
                        del self.copies[key]
                    return

    def checked(self) -> None:
        """The first call has compared every replaying stage: from now on they copy."""
        self.checking.clear()
