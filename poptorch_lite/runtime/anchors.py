"""Anchored tensors: device tensors other than the outputs that a run returns to the host
(`Options.anchorTensor(short_name, long_name, ...)`, read with `model.getAnchoredTensor(short_name)`).

Long names are PopART's for the tensors of a weight update, which is where a training model has
tensors worth returning besides its outputs:

- `Gradient___<parameter>`: the gradient the update applies, as accumulated on the device: the sum
  over the accumulated micro-batches, scaled by the optimizer's loss scaling, before any mean
  reduction (with gradientAccumulation(1), the micro-batch's gradient);
- `UpdatedVar___<parameter>`: the parameter after the update;
- `finalLossScale` (with automatic loss scaling): the loss scale the update's gradients were
  computed with (the optimiser's loss_scaling times the update factor before the update).

Each is read from device memory once per weight update (once per device iteration). The anchor's
output mode picks which of a call's updates are returned, as the model's output mode picks among
micro-batches: `All` stacks them (one update keeps the tensor's shape), `Final` the last one,
`EveryN` the last of every N, `Sum` their sum. With replicas, each value stacks the replicas'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..api import batching
from ..api.enums import OutputMode
from ..api.errors import Error

KINDS = {"Gradient___": "gradient", "UpdatedVar___": "updated"}
LOSS_SCALE = "finalLossScale"   # automatic loss scaling: the loss scale of the update's gradients


@dataclass
class Anchor:
    short_name: str
    kind: str                   # "gradient" | "updated" | "loss_scale"
    weight: str                 # the parameter's name in the model
    mode: OutputMode            # resolved (never Default)
    period: int
    dtype: torch.dtype          # the parameter's (float32 for the loss scale)
    values: list = field(default_factory=list)   # one tensor per weight update of the current call

    def result(self) -> torch.Tensor:
        values = self.values
        if self.mode == OutputMode.Final:
            values = values[-1:]
        elif self.mode == OutputMode.EveryN:
            values = values[self.period - 1::self.period]
        elif self.mode == OutputMode.Sum:
            return torch.stack(values).sum(dim=0)
        return values[0] if len(values) == 1 else torch.stack(values)


def names(trained: set[str]) -> list[str]:
    """The long names a model can anchor, given the parameters it trains."""
    return [f"{p}{w}" for p in KINDS for w in sorted(trained)]


def resolve(anchored: dict, options, training: bool, trained: set[str], dtypes: dict,
            scaled: bool = False) -> list[Anchor]:
    """The anchors of `Options.anchored_tensors`, checked against the compiled model (`trained`:
    the parameters it updates, `dtypes` the model's); an Error names any it does not have."""
    anchors = []
    for short, (long_name, mode, period) in anchored.items():
        if long_name == LOSS_SCALE and scaled:
            if mode is None or mode == OutputMode.Default:
                mode = batching.resolve_output_mode(options, training)
                period = options.output_return_period if mode == OutputMode.EveryN else 1
            anchors.append(Anchor(short, "loss_scale", "", mode, period, torch.float32))
            continue
        prefix = next((p for p in KINDS if long_name.startswith(p)), None)
        weight = long_name[len(prefix):] if prefix else None
        if prefix is None or weight not in trained:
            if not training:
                why = "an inference model has no weight updates, so it has no tensor to anchor"
            else:
                known = names(trained)
                shown = ", ".join(known[:6]) + (", ..." if len(known) > 6 else "")
                why = (f"the anchorable tensors are a trained parameter's gradient and updated value "
                       f"({shown})")
            raise Error(f"Options.anchorTensor({short!r}, {long_name!r}): the model has no tensor {long_name!r}: "
                        f"{why}")
        if mode is None or mode == OutputMode.Default:
            mode = batching.resolve_output_mode(options, training)
            period = options.output_return_period if mode == OutputMode.EveryN else 1
        anchors.append(Anchor(short, KINDS[prefix], weight, mode, period, dtypes[weight]))
    updates = batching.batch_factors(options, training)[0]   # one weight update per device iteration
    for anchor in anchors:
        if anchor.mode == OutputMode.EveryN and (anchor.period > updates or updates % anchor.period):
            raise Error(f"Options.anchorTensor({anchor.short_name!r}, ..., OutputMode.EveryN, {anchor.period}): "
                        f"a call makes {updates} weight update(s) (Options.deviceIterations), and the anchor "
                        f"returns the value of every {anchor.period}-th, so the period must divide "
                        f"{updates}. Pick a period that divides it or change deviceIterations.")
    return anchors


def _read(exe, low, name: str, kind: str):
    engine = exe.engine
    if kind == "gradient":
        buffers, tensors = low.accumulator_buffers, low.accumulators
    else:
        buffers, tensors = low.weight_buffers, low.weights
    return engine.readRemoteBuffer(buffers[name]) if name in buffers else engine.readTensor(tensors[name])


def record(anchors: list[Anchor], exe, ipu: int, kind: str) -> None:
    """Read the `kind` anchors of the weights on `ipu` (replica 0's numbering) from every replica."""
    for anchor in anchors:
        if anchor.kind == "loss_scale" and kind == "gradient" and ipu == exe.updates.loss_scaling.scales[0].ipu:
            values = [torch.from_numpy(exe.engine.readTensor(t).reshape(())) for t in exe.updates.loss_scaling.scales]
            anchor.values.append(values[0] if len(values) == 1 else torch.stack(values))
            continue
        if anchor.kind != kind or exe.lowering.weights[anchor.weight].ipu != ipu:
            continue
        per_replica = [torch.from_numpy(_read(exe, low, anchor.weight, kind).copy()).to(anchor.dtype)
                       for low in exe.lowerings]
        anchor.values.append(per_replica[0] if len(per_replica) == 1 else torch.stack(per_replica))
