""":func:`op_placement`: every ATen op of a captured model with the block, stage, IPU and phase
the compiler gives it. PopTorch only prints this in its debug log; here it is data.

The model is captured exactly as the compiler captures it (:mod:`.export`, forward only, in the
module's current train/eval mode) and placed by the same rule (:func:`.aten.place`), so the table
is what a compiled model would run, including the errors: an op outside every block is a
``BlockError``, data flowing back to an earlier stage or phase a ``StrategyError``. The rows are
the ops of the user's calls; the capture's own bookkeeping (detaching the outputs) has none. The
backward ops of a training model need no rows either: each runs on the stage of the forward op it
derives from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..api.strategies import ExecutionStrategy, PipelinedExecution, Placement
from .aten import decompositions, op_nodes, place
from .export import annotation_of, capture_joint


@dataclass(frozen=True)
class OpPlacement:
    """Where one ATen op of the captured forward graph runs."""

    node: str                  # the fx node's name
    call: int                  # which call of the user's code made it (0, 1, ... in call order)
    op: str                    # the op, "aten.convolution" (ops of our own: "poptorch_lite.print_tensor")
    origin: str                # the user's call it came from: "module layer1.conv (Conv2d)", "function add()"
    block: Optional[str]       # the block's user id; None for ops before the first block
    stage: int
    ipu: int
    phase: Optional[int]
    source: str                # the user's file:line
    scope: str = ""            # the NameScopes it was made in, "encoder/attention"


@dataclass(frozen=True)
class PlacementTable:
    """Every forward op of a captured model with its block, stage, IPU and phase."""

    strategy: ExecutionStrategy
    placement: Placement
    rows: tuple[OpPlacement, ...]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def by_origin(self) -> list[tuple[str, Optional[str], int, int, Optional[int]]]:
        """One row per call of the user's code, in call order: (origin, block, stage, ipu, phase).
        The ATen ops of one call run where the call's block runs."""
        calls = {}
        for r in self.rows:
            calls.setdefault(r.call, (r.origin, r.block, r.stage, r.ipu, r.phase))
        return [calls[c] for c in sorted(calls)]

    def __str__(self) -> str:
        phased = self.placement.schedule_kind.endswith("phased")
        scoped = any(r.scope for r in self.rows)
        header = ["node", "op", "from"] + (["scope"] if scoped else []) + ["block", "stage", "ipu"] + \
            (["phase"] if phased else [])
        lines = [[r.node, r.op, r.origin] + ([r.scope or "-"] if scoped else []) +
                 ["-" if r.block is None else r.block, str(r.stage), str(r.ipu)]
                 + ([str(r.phase)] if phased else []) for r in self.rows]
        widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]
        text = [repr(self.strategy)]
        for row in [header] + lines:
            text.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(text)


def aten_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None:
        return getattr(node.target, "__name__", str(node.target))
    return packet._qualified_op_name.replace("::", ".")  # "aten.addmm", "poptorch_lite.print_tensor"


def op_placement(model: torch.nn.Module, strategy: Optional[ExecutionStrategy] = None, *example_inputs,
                 **example_kwargs) -> PlacementTable:
    """Capture ``model`` on the example inputs (called as the user calls it: positional, keyword,
    nested) and place every forward op under ``strategy``, by default
    ``PipelinedExecution(AutoStage.SameAsIpu)`` as in PopTorch. ``print(op_placement(...))`` shows
    the table; ``.by_origin()`` gives one row per call of the user's code."""
    strategy = PipelinedExecution() if strategy is None else strategy
    if not isinstance(strategy, ExecutionStrategy):
        raise TypeError(f"op_placement expects an ExecutionStrategy (PipelinedExecution, ShardedExecution, "
                        f"SerialPhasedExecution, ParallelPhasedExecution), got {strategy!r}")
    joint = capture_joint(model, example_inputs, example_kwargs, training=False, decompositions=decompositions())
    joint.graph_module.graph.eliminate_dead_code()
    placement, sites = place(joint, strategy)
    rows, calls = [], {}
    for node in op_nodes(joint.graph_module.graph):
        site, annotation = sites[node], annotation_of(node)
        if annotation is None:
            continue
        call = calls.setdefault(id(annotation), len(calls))   # one Annotation per call of the user's code
        rows.append(OpPlacement(node=node.name, call=call, op=aten_name(node), origin=annotation.describe(), block=site.block,
                                stage=site.stage, ipu=site.ipu, phase=site.phase, source=annotation.source,
                                scope=annotation.scope))
    return PlacementTable(strategy, placement, tuple(rows))
