"""The compiled IR as PopTorch's `_debugGetPopartIR()` shows PopART's: a JSON document whose
"maingraph" lists the ops in order, each with its type, name, inputs, outputs and placement.
The convolutions of a `poptorch.MultiConv` are one op of type "MultiConv" (as PopART's IR has
them), listing every member's inputs and outputs."""
from __future__ import annotations

import json

import numpy as np


def _tensor(v) -> dict:
    return {"name": v.name or f"%{v.id}", "type": np.dtype(v.dtype).name, "shape": list(v.shape)}


def popart_ir(ir) -> str:
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
    return json.dumps({"maingraph": ops})
