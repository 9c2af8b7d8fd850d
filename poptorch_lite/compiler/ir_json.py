"""The compiled IR as PopTorch's `_debugGetPopartIR()` shows PopART's: a JSON document whose
"maingraph" lists the ops in order, each with its type, name, inputs, outputs and placement.
The convolutions of a `poptorch.MultiConv` are one op of type "MultiConv" (as PopART's IR has
them), listing every member's inputs and outputs. A training model's weight updates follow, one
entry per op PopART would run for each weight (e.g. Adam's AdamUpdater, which computes the update
term, then AdamVarUpdate, which applies it): the emulator runs them as one update vertex per
weight region."""
from __future__ import annotations

import json

import numpy as np


def _tensor(v) -> dict:
    return {"name": v.name or f"%{v.id}", "type": np.dtype(v.dtype).name, "shape": list(v.shape)}


def _update_types(config) -> list[str]:
    """The PopART ops updating one weight with device optimiser `config`."""
    from ipusim.ops import optim as dev
    if isinstance(config, dev.SGD):   # PopART's SGD0 without a velocity; SGD1 and SGD2 share their VarUpdate
        return ["SGD1VarUpdate" if config.layout().slots[0] else "SGD0VarUpdate"]
    if isinstance(config, dev.LAMB):
        return ["AdamUpdater", "LambSquare", "LambSquare", "AdamVarUpdate"]
    if isinstance(config, dev.Adam):
        return ["AdamUpdater", "AdamVarUpdate"]
    if isinstance(config, dev.RMSprop):
        return ["RMSPropUpdater", "ScaledVarUpdate"]
    raise TypeError(f"no PopART update ops known for {type(config).__name__}")


def _updates(plan, weights: dict) -> list[dict]:
    ops = []
    for name, parts in plan.states.items():
        w = weights[name]
        tensor = {"name": name, "type": np.dtype(w.dtype).name, "shape": list(w.shape)}
        for i, op_type in enumerate(_update_types(parts[0][0])):
            ops.append({"type": op_type, "name": f"{op_type}/{name}" + (f"/{i}" if op_type == "LambSquare" else ""),
                        "inputs": [tensor], "outputs": [{**tensor, "name": f"UpdatedVar___{name}"}]
                        if op_type.endswith("VarUpdate") else [],
                        "attributes": {"ipu": w.ipu}})
    return ops


def popart_ir(ir, updates=None, weights: dict | None = None) -> str:
    """The JSON document; `updates` (a training model's UpdatePlan) and its device `weights` by
    name add the weight updates."""
    ops, seen = [], set()
    for n in ir.nodes:
        group = n.attrs.get("multiconv")
        if group is not None:
            if id(group) in seen:
                continue
            seen.add(id(group))
            members = group.members
            ops.append({"type": "MultiConv", "name": f"multiconv{group.id}", "num_convs": len(members),
                        "inputs": [_tensor(v) for m in members for v in m.inputs],
                        "outputs": [_tensor(v) for m in members for v in m.outputs],
                        "attributes": {"ipu": n.ipu, "stage": n.stage, "pass": n.pass_}})
            continue
        ops.append({"type": n.op, "name": n.outputs[0].name if n.outputs else n.op,
                    "inputs": [_tensor(v) for v in n.inputs], "outputs": [_tensor(v) for v in n.outputs],
                    "attributes": {"ipu": n.ipu, "stage": n.stage, "pass": n.pass_}})
    if updates is not None:
        ops += _updates(updates, weights)
    return json.dumps({"maingraph": ops})
