"""The backward of each stage split into its input-gradient (B) and weight-gradient (W) halves,
as the zero-bubble schedules (ZB-H1, ZB-H2) run them.

A stage's B is every backward node of the stage that the gradients it sends on depend on: the
ancestors, within the stage's backward, of its values used by another stage program (the
gradients with respect to the stage's activation inputs, which the stage before waits for). Its
W is the rest of the stage's backward: nodes whose results only feed other W nodes or are
parameter gradients, accumulated where they are made. A node that makes both kinds of result
(a fused norm backward) belongs to B, which then accumulates that weight's gradient itself.

This is a relabelling of the IR: W nodes get the pass "wgrad", so the lowering builds a third
stage program ("wgrad", stage) beside ("fwd", stage) and ("bwd", stage), with channels for what
W needs from its forward and from its B, kept per micro-batch until W runs.
"""
from __future__ import annotations

from .ir import IRGraph

WEIGHT_GRADIENT = "wgrad"
"""The pass of the weight-gradient nodes once the backward is split."""


def partition_backward(ir: IRGraph, split: bool) -> None:
    """Label every backward node of `ir` "bwd" (B) or, when `split`, "wgrad" (W) for the nodes of
    its stage's backward that the gradients sent to other stages do not need. Idempotent: the
    labels follow the nodes' current stages, so a graph placed again can be split again."""
    for n in ir.nodes:
        if n.pass_ == WEIGHT_GRADIENT:
            n.pass_ = "bwd"
    if not split:
        return
    backward = [n for n in ir.nodes if n.pass_ == "bwd"]
    made_by = {v.id: n for n in backward for v in n.outputs}
    needed: set[int] = set()   # ids of nodes in B
    frontier = []
    for n in ir.nodes:
        for v in n.inputs:
            producer = made_by.get(v.id)
            if producer is not None and (n.pass_ != "bwd" or n.stage != producer.stage):
                frontier.append(producer)
    while frontier:
        n = frontier.pop()
        if id(n) in needed:
            continue
        needed.add(id(n))
        frontier += [p for v in n.inputs if (p := made_by.get(v.id)) is not None and p.stage == n.stage]
    for n in backward:
        if id(n) not in needed:
            n.pass_ = WEIGHT_GRADIENT
