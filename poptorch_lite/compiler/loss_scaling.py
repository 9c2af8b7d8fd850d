"""The loss scale of a training model, and automatic loss scaling
(`Options.Training.setAutomaticLossScaling(True)`) as PopART's automatic loss scaling transform
does it.

- The optimiser's `loss_scaling` is a variable hyperparameter, as in PopTorch: the gradient seed
  reads it from the device, so `setOptimizer` with another `loss_scaling` takes effect at the next
  call without compiling again.
- The gradient seed is the loss times the loss scale held in a device tensor (`loss_scale`, one
  per replica on the IPU of the loss; library op `poptorch_lite::loss_scale`), starting at the
  optimiser's `loss_scaling`; the optimisers divide by the same scale (their `loss_scaling`
  hyperparameter column on the device), so the update does not depend on it.
- Gradient statistics: every float16 gradient of the backward made by an op that is not a view
  and does not read a weight (PopART's `AllNonViewChangingGradientTensors`, method 0; method 1,
  `ConvAndMatmulGradients`, tracks matmul and convolution gradients only) is counted into a
  two-bin histogram of absolute values around `binEdgeLocation * 65504` (`ipusim.ops.loss_scaling`),
  accumulated per IPU over the micro-batches of a weight update.
- Update: after the weight update that closes a gradient-accumulation group, the statistics of
  every IPU and replica are gathered on the first replica's loss IPU and PopART's rule (halve when
  the upper-bin proportion exceeds `thresholdUpperCountProportion`, double otherwise) changes the
  update factor there, every `updatePeriod`-th update; the change multiplies every replica's loss
  scale and every optimiser's loss-scaling column, and the statistics are cleared. With
  `updatePeriod` P > 1 the histograms run only in the groups whose update applies the rule (a
  window flag on every IPU), as PopART's `executeOpNTimesEveryMTimes` arranges it.

PopART's session options read (`options._Popart.set("automaticLossScalingSettings.<name>", v)`):
`binEdgeLocation` (0.125), `thresholdUpperCountProportion` (1e-7), `updatePeriod` (1),
`gradientTensorTrackingMethod` (0). The factor is `optimizer.state_dict()["ipu_state"]
["lossScaleUpdateFactor"]`; `Options.anchorTensor(name, "finalLossScale")` returns the loss scale
each weight update's gradients were computed with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import ipusim as ip
from ipusim.ops import elementwise as ew
from ipusim.ops import loss_scaling as als

from ..api.errors import Error
from .ir import VIEW_OPS

PREFIX = "automaticLossScalingSettings."
TRACKING = {0: "AllNonViewChangingGradientTensors", 1: "ConvAndMatmulGradients"}
CONV_AND_MATMUL = frozenset({"matmul", "conv", "conv_backward_input", "conv_backward_weights"})


@dataclass(frozen=True)
class Settings:
    bin_edge_location: float = 0.125
    threshold: float = 1e-7
    update_period: int = 1
    tracking: int = 0


def automatic_loss_scaling(options) -> Settings | None:
    """The automatic loss scaling settings of these options, None when it is off; PopART's range
    checks as errors naming the option."""
    popart = options._Popart.options
    if not popart.get(PREFIX + "enabled", False):
        return None

    def proportion(name, default):
        value = popart.get(PREFIX + name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
            raise Error(f"Out of range value for '{name}' ({PREFIX}{name}). The current value is {value!r}, but it "
                        "should be in the range [0, 1].")
        return float(value)

    period = popart.get(PREFIX + "updatePeriod", 1)
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise Error(f"{PREFIX}updatePeriod must be an int >= 1, got {period!r}")
    tracking = popart.get(PREFIX + "gradientTensorTrackingMethod", 0)
    if tracking not in TRACKING:
        raise Error(f"{PREFIX}gradientTensorTrackingMethod {tracking!r} is not supported: use 0 "
                    "(AllNonViewChangingGradientTensors) or 1 (ConvAndMatmulGradients); tracking user-specified "
                    "tensors (2) needs PopART's tensor names")
    if popart.get(PREFIX + "toTrackTensors") is not None:
        raise Error(f"{PREFIX}toTrackTensors names PopART tensors, which this compiler does not have: use "
                    "gradientTensorTrackingMethod 0 or 1")
    return Settings(proportion("binEdgeLocation", 0.125), proportion("thresholdUpperCountProportion", 1e-7),
                    int(period), int(tracking))


class LossScaling:
    """The device side of the loss scale of one training executable (all replicas): the scale
    tensors, and with `settings` (automatic loss scaling) the statistics and the update program."""

    def __init__(self, settings: Settings | None, initial: float):
        self.settings = settings
        self.initial = float(initial)            # the optimiser's loss_scaling when compiled
        self._scales: dict[int, ip.Tensor] = {}  # replica -> its loss-scale tensor (float32 scalar)
        self.stats: dict[tuple[int, int], ip.Tensor] = {}   # (replica, IPU) -> float32 [2]
        self.windows: dict[int, ip.Tensor] = {}  # IPU -> window flag (update period > 1)
        self.factor: ip.Tensor | None = None
        self.counter: ip.Tensor | None = None
        self.program = -1                        # engine program run after a group's weight update
        self.tracked = 0

    @property
    def automatic(self) -> bool:
        """Whether the scale changes itself (automatic loss scaling)."""
        return self.settings is not None

    # ---- lowering hooks -------------------------------------------------------------------------
    @property
    def scales(self) -> list[ip.Tensor]:
        """Every replica's loss-scale tensor, replica 0's first."""
        return [self._scales[r] for r in sorted(self._scales)]

    def scale(self, lowering, graph: ip.Graph) -> ip.Tensor:
        """The replica's loss-scale tensor (made on the IPU of its first use: the loss's)."""
        t = self._scales.get(lowering.replica)
        if t is None:
            t = self._scales[lowering.replica] = graph.addVariable(np.float32, (1,), f"{lowering.prefix}lossScaling",
                                                                   category="optimiser_state")
            graph.setTileMapping(t, 0)
        return t

    def tracks(self, node) -> bool:
        """Whether the statistics count this backward node's float16 results."""
        if not self.automatic or node.pass_ == "fwd" or node.op in VIEW_OPS:
            return False
        if self.settings.tracking == 1:
            return node.op in CONV_AND_MATMUL
        return not any(v.kind in ("param", "buffer") for v in node.inputs)

    def track(self, lowering, ctx, node, outs) -> None:
        """Count the float16 gradients a backward node made into its IPU's statistics."""
        if not self.tracks(node):
            return
        for t in outs:
            if t is None or t.dtype != np.float16 or not t.numel:
                continue
            g = ctx.graph
            key = (lowering.replica, g.ipu)
            stats = self.stats.get(key)
            if stats is None:
                stats = self.stats[key] = g.addVariable(np.float32, (2,), f"{lowering.prefix}ipu{g.ipu}/"
                                                        "autoLossScaleStats", category="accumulators")
                g.setTileMapping(stats, 0)
            level = als.bin_edge(t.dtype, self.settings.bin_edge_location)
            name = f"{ctx.name}/gradient_statistics"
            if self.settings.update_period == 1:
                als.gradient_statistics(g, t, stats, level, ctx.prog, name)
            else:
                inside = ip.Sequence(name=name)
                als.gradient_statistics(g, t, stats, level, inside, name)
                ctx.prog.add(ip.If(self._window(g), inside))
            self.tracked += 1

    def _window(self, g: ip.Graph) -> ip.Tensor:
        if g.ipu not in self.windows:
            flag = self.windows[g.ipu] = g.addVariable(np.bool_, (1,), f"ipu{g.ipu}/autoLossScaleWindow",
                                                       category="optimiser_state")
            g.setTileMapping(flag, 0)
        return self.windows[g.ipu]

    # ---- the update program ---------------------------------------------------------------------
    def build(self, lowerings: list, configs: list) -> None:
        """The program run after the weight update closing each group (see the module docstring)."""
        if not self.tracked:
            raise Error("[AutomaticLossScale transform] No tracked gradient tensors of type fp16 were found. "
                        "Automatic loss scaling counts float16 gradients: train in float16 (model.half()), or "
                        "turn it off with Options.Training.setAutomaticLossScaling(False).")
        first = lowerings[0]
        device = first.device
        home = self.scales[0].ipu
        g = device.graph(home)
        seq = ip.Sequence(name="automatic loss scaling")
        self.factor = g.addVariable(np.float32, (1,), "lossScaleUpdateFactor", category="optimiser_state")
        self.counter = g.addVariable(np.float32, (1,), "lossScaleUpdateCounter", category="optimiser_state")
        stats = list(self.stats.values())
        gathered = g.addVariable(np.float32, (len(stats), 2), "autoLossScaleStats/gathered", category="temporaries",
                                 always_live=False)
        for t in (self.factor, self.counter, gathered):
            g.setTileMapping(t, 0)
        for i, s in enumerate(stats):
            seq.add(ip.Copy(s, gathered[i]) if s.ipu == home else ip.InterIpuCopy(s, gathered[i]))
        change = als.loss_scale_update(g, gathered, self.counter, self.factor, seq, self.settings.threshold,
                                       self.settings.update_period)
        for s in stats:
            ew.unary(device.graph(s.ipu), "fill", s, seq, f"{s.name}/clear", out=s, scale=0.0)
        targets: dict[int, list[ip.Tensor]] = {}
        for t in self.scales:
            targets.setdefault(t.ipu, []).append(t)
        for _, cfg in configs:
            for gr in device.graphs:
                h = cfg.hyper_on(gr)
                if h is not None:
                    targets.setdefault(gr.ipu, []).append(h.tensor[:, h.names.index("loss_scaling")])
        for ipu, tensors in sorted(targets.items()):
            gi = device.graph(ipu)
            local = change
            if ipu != home:
                local = gi.addVariable(np.float32, (1,), "lossScaleChange", category="temporaries", always_live=False)
                gi.setTileMapping(local, 0)
                seq.add(ip.InterIpuCopy(change, local))
            for t in tensors:
                ew.binary(gi, "mul", t, local.broadcast((t.numel,)).reshape(t.shape), seq, f"{t.name}/rescale",
                          out=t)
        if self.windows:
            zero = g.addConstant(np.float32, (1,), 0.0, "autoLossScaleWindow/zero")
            g.setTileMapping(zero, 0)
            window = ew.binary(g, "eq", self.counter, zero, seq, "autoLossScaleWindow/next")
            for ipu, flag in self.windows.items():
                seq.add(ip.Copy(window, flag) if ipu == home else ip.InterIpuCopy(window, flag))
        self.program = first.add_program(seq)

    # ---- host side ------------------------------------------------------------------------------
    def initialise(self, engine: ip.Engine) -> None:
        """Factor 1, loss scale = the optimiser's, no statistics, first update in a window."""
        if self.automatic:
            engine.writeTensor(self.factor, [1.0])
            engine.writeTensor(self.counter, [0.0])
        for t in self.scales:
            engine.writeTensor(t, [self.initial])
        for s in self.stats.values():
            engine.writeTensor(s, [0.0, 0.0])
        for flag in self.windows.values():
            engine.writeTensor(flag, [True])

    def update_factor(self, engine: ip.Engine) -> float:
        """The product of automatic loss scaling's changes so far (1 without it)."""
        if not self.automatic:
            return 1.0
        return float(engine.readTensor(self.factor).reshape(-1)[0])

    def loss_scale(self, engine: ip.Engine) -> float:
        """The loss scale the next gradients are computed with (replica 0's)."""
        return float(engine.readTensor(self.scales[0]).reshape(-1)[0])

    def new_optimizer(self, engine: ip.Engine, configs: list, initial: float) -> None:
        """After the host wrote a new optimiser's hyperparameters: the loss scale is the new
        loss_scaling times the factor, and so is every optimiser's loss-scaling column (its
        configuration's value, the loss scaling with the reduction's divisor, times the factor)."""
        factor = self.update_factor(engine)
        self.initial = float(initial)
        for t in self.scales:
            engine.writeTensor(t, [self.initial * factor])
        if not self.automatic:
            return
        for _, cfg in configs:
            for g in engine.device.graphs:
                h = cfg.hyper_on(g)
                if h is not None:
                    values = engine.readTensor(h.tensor)
                    values[:, h.names.index("loss_scaling")] = np.float32(cfg.loss_scaling * factor)
                    engine.writeTensor(h.tensor, values)

    def set_update_factor(self, engine: ip.Engine, factor: float, configs: list, initial: float) -> None:
        """Restore the product of automatic loss scaling's changes (from a state dict): the loss
        scale and the optimisers' loss-scaling columns follow it."""
        if not factor > 0:
            raise ValueError(f"lossScaleUpdateFactor must be > 0, got {factor}")
        engine.writeTensor(self.factor, [float(factor)])
        self.new_optimizer(engine, configs, initial)

    def ipu_state(self, engine: ip.Engine) -> dict:
        """What PopTorch's `optimizer.state_dict()["ipu_state"]` holds of it."""
        import torch  # (the compiler layer may use torch)
        return {"lossScaleUpdateFactor": torch.tensor(self.update_factor(engine))}


def group_ends(schedule) -> set[int]:
    """The steps after which the update program runs: the last step with a weight update of every
    group."""
    last: dict[int, int] = {}
    for t, step in enumerate(schedule.steps):
        if any(op.kind == "U" for op in step.ops):
            last[step.group] = t
    return set(last.values())
