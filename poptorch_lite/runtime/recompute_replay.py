"""Recomputation on the host: the values a recompute program would make again, copied from its
forward instead of computed a second time.

A recompute program ("recompute", s; compiler/recompute.py) makes, bit for bit, values the
stage's forward made for the same micro-batch. What the device does is fixed when the model is
compiled and recorded by the first call (cycles per step, memory; runtime/executor.py), so the
calls after it only have to give the backward the right values. Here they come from the
forward: after the forward of micro-batch k runs, the values its backward reads from the
recompute program are copied aside; when the recompute op of micro-batch k runs, its stash is
received as always and the copies are written where the recompute program puts its results.

It is checked, not assumed. A stage copies only when
- the compiler chose it (`Lowering._choose_copied_recomputations`): its recompute program makes
  nothing but values (no host call, no print), and the copies it holds at once (one set per
  micro-batch between its forward and its recompute op) fit, with the other chosen stages',
  in `IPUSIM_RECOMPUTE_REPLAY_MB` megabytes of host memory per replica (default 256; 0: none),
  the stages with the fewest bytes first;
- on the first call, which runs every recompute program, each copy equals in every bit what the
  recompute program computed, for every micro-batch.
Only the fast mode copies: strict mode runs every program, so that it checks the fast one.
"""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("poptorch_lite")


class RecomputeReplay:
    """Which stages copy their recomputation, and the copies in flight."""

    def __init__(self, exe):
        self.engine = exe.engine
        self.candidates: dict[int, list[tuple[int, list]]] = {}  # stage -> [(replica, [(fwd, rec)])]
        self.failed: set[int] = set()      # stages whose first-call copies differed
        self.copies: dict[tuple[int, int], list[list[np.ndarray]]] = {}   # (stage, micro-batch) -> per replica
        self._receives: dict[int, list] = {}   # id(R op) -> its programs but the compute (made on its first copy)
        if exe.engine.mode == "fast":
            for r, low in enumerate(exe.lowerings):
                for key, pairs in low.recomputed_from.items():
                    if pairs:
                        self.candidates.setdefault(key[1], []).append((r, pairs))
        self.enabled: set[int] = set(self.candidates)
        self.checking: set[int] = set(self.enabled)   # until the first call has compared them

    def after_forward(self, op) -> None:
        """Copy aside what the backward of `op`'s micro-batch will read (`op` an F that just ran)."""
        if op.stage in self.enabled:
            self.copies[(op.stage, op.global_micro_batch)] = [
                [np.array(self.engine.readTensor(f), copy=True) for f, _ in pairs]
                for _, pairs in self.candidates[op.stage]]

    def replaces(self, op) -> bool:
        """Whether the recompute op `op` is written from copies instead of run."""
        return op.kind == "R" and op.stage in self.enabled and op.stage not in self.checking

    def runs_without_compute(self, op, runs: list) -> list:
        """The programs a copied recompute op still runs (its stash received as always)."""
        kept = self._receives.get(id(op))
        if kept is None:
            kept = self._receives[id(op)] = [run for run in runs if run[0] != "compute"]
        return kept

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
        """The first call has compared every copying stage: from now on they copy."""
        self.checking.clear()
