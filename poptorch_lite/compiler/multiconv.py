"""`poptorch.MultiConv` in the compiler: the forward convolutions made inside a MultiConv block
become one multi-convolution (`ipusim.ops.multiconv`).

- Capture (`api/multiconv.py`): the block annotates the ops made inside it with its group; the
  ATen lowering of a forward convolution (`aten._convolution`) puts the group in the IR node's
  attributes (`member_attrs`).
- `group_multiconvs` (after lowering to IR): PopTorch's errors (a block without a convolution is
  "Unexpected end_multi_conv"), the members' independence (no member may use another's result)
  and placement (one IPU), and the per-convolution options' counts; then it moves the members
  next to each other in the IR, at the last one's place (ops between them that use a member's
  result move after them), so the lowering builds them as one.
- `lower_member` (the lowering of a member): the first plans the multi-convolution and allocates
  every member's output, each member returns its output, the last builds the program.
"""
from __future__ import annotations

import logging

from ipusim.ops import multiconv as mc

from ..api.enums import MultiConvPlanType
from ..api.errors import Error
from ..api.multiconv import KEY, MultiConvGroup

logger = logging.getLogger("poptorch_lite")


def member_attrs(c) -> dict:
    """{"multiconv": group} when the ATen node being lowered was made inside a MultiConv block."""
    group = (c.node.meta.get("custom") or {}).get(KEY) if c.node is not None else None
    return {"multiconv": group} if isinstance(group, MultiConvGroup) else {}


def _per_conv(group: MultiConvGroup, name: str, values, count: int):
    if values is None:
        return [None] * count
    if len(values) == 1:
        return list(values) * count
    if len(values) != count:
        raise Error(f"poptorch.MultiConv {name}: {len(values)} values given for {count} convolutions; give one "
                    "value for all or one per convolution")
    return list(values)


def group_multiconvs(ir, groups: list[MultiConvGroup]) -> None:
    """Check the MultiConv groups of a lowered IR and make each one's members adjacent."""
    members: dict[int, list] = {}
    for n in ir.nodes:
        g = n.attrs.get("multiconv")
        if g is not None:
            members.setdefault(id(g), []).append(n)
    for g in groups:
        nodes = members.get(id(g), [])
        if not nodes:
            raise Error("Unexpected end_multi_conv: a poptorch.MultiConv block must make at least one convolution")
        if len({(n.ipu, n.stage) for n in nodes}) > 1:
            raise Error(f"poptorch.MultiConv: its convolutions run on different IPUs or stages "
                        f"({sorted({(n.ipu, n.stage) for n in nodes})}); keep a MultiConv block inside one Block")
        g.members = nodes
        _per_conv(g, "availableMemoryProportions", g.available_memory_proportions, len(nodes))
        partials = _per_conv(g, "partialsTypes", g.partials_types, len(nodes))
        if any(p == 1 for p in partials):
            raise Error("poptorch.MultiConv partialsTypes(torch.half): the emulated convolutions accumulate their "
                        "partials in float32 only; use torch.float")
        _per_conv(g, "enableConvDithering", g.enable_conv_dithering, len(nodes))
        if g.cycle_back_off is not None or any(g.enable_conv_dithering or ()):
            logger.warning("poptorch.MultiConv: cycleBackOff and enableConvDithering tune PopLibs' planner search, "
                           "which the emulator's convolution planner does not have: they do not change the plan")
        _make_adjacent(ir, nodes)


def _make_adjacent(ir, nodes: list) -> None:
    order = {id(n): i for i, n in enumerate(ir.nodes)}
    first, last = order[id(nodes[0])], order[id(nodes[-1])]
    member_ids = {id(n) for n in nodes}
    tainted = set()   # values depending on a member's result, between the first and the last member
    before, after = [], []
    for n in ir.nodes[first:last + 1]:
        uses = any(v.id in tainted for v in n.inputs)
        if id(n) in member_ids:
            if uses:
                raise Error(f"poptorch.MultiConv: the convolution at {n.source} uses the result of another "
                            "convolution of the same MultiConv; the convolutions of a MultiConv must be independent")
            tainted.update(v.id for v in n.outputs)
        elif uses:
            tainted.update(v.id for v in n.outputs)
            after.append(n)
        else:
            before.append(n)
    ir.nodes[first:last + 1] = before + list(nodes) + after


def lower_member(ctx, n, ins, conv_args) -> list:
    """Lower one member convolution of a multi-convolution (see the module docstring)."""
    group: MultiConvGroup = n.attrs["multiconv"]
    index = next(i for i, m in enumerate(group.members) if m is n)
    built = ctx.lowering.__dict__.setdefault("multiconvs", {})
    state = built.get(id(group))
    if state is None:
        count = len(group.members)
        proportions = _per_conv(group, "availableMemoryProportions", group.available_memory_proportions, count)
        specs = []
        for m, p in zip(group.members, proportions):
            a = conv_args(m.attrs)
            specs.append(mc.ConvSpec(m.inputs[0].shape, m.inputs[1].shape, a["stride"], a["padding"], a["dilation"],
                                     a["groups"], str(m.inputs[0].dtype), p if p is not None else
                                     m.attrs.get("available_memory_proportion", mc.AVAILABLE_MEMORY_PROPORTION)))
        plan = "serial" if group.plan_type == MultiConvPlanType.Serial else "parallel"
        reserved = group.per_conv_reserved_tiles if group.per_conv_reserved_tiles is not None else 50
        state = built[id(group)] = (mc.MultiConv(ctx.graph, specs, plan, reserved, f"{ctx.name}/multiconv{group.id}"),
                                    [None] * count)
    planned, inputs = state
    inputs[index] = ins
    if index == len(group.members) - 1:
        planned.build([i[0] for i in inputs], [i[1] for i in inputs], ctx.prog)
    return [planned.outputs[index]]
