"""Multi-convolutions: several independent 2-D convolutions planned together, as PopLibs'
poplin::multiconv plans them (PopTorch's `MultiConv`).

Plan types:
- "parallel": the IPU's tiles are divided among the convolutions and each is planned on its share
  (`conv.plan_conv` for a target of that many tiles), so the convolutions compute side by side on
  disjoint tiles: their operand exchanges run one after the other (they may read the same
  tensors' tiles), then their compute sets (and any reduction of partials, which stays on the
  share) run as one `Parallel` program whose cycles are the slowest convolution's, not the sum.
  A convolution's share is `reserved_tiles` (at most the tiles / the number of convolutions) plus
  a part of the rest proportional to its multiply-accumulates.
- "serial": each convolution planned on all the tiles and run after the previous one, as separate
  convolutions are.
Each convolution keeps its own temporary-memory budget (`available_memory_proportion`). Values
are those of the separate convolutions, whatever the plan (the same vertices, on other tiles).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..device.graph import Graph
from ..device.program import OpProgram, Parallel, Sequence
from ..device.tensor import Tensor
from . import conv
from .matmul import AVAILABLE_MEMORY_PROPORTION, output_dtype

PLAN_TYPES = ("parallel", "serial")


@dataclass(frozen=True)
class ConvSpec:
    """One convolution of a multi-convolution: y = conv(x, w) like torch (no bias; 1 to 3 spatial
    dimensions)."""
    x_shape: tuple
    w_shape: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    dtype: str = "float32"
    available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION

    @property
    def macs(self) -> int:
        shape = conv.conv_output_shape(self.x_shape, self.w_shape, self.stride, self.padding, self.dilation,
                                       self.groups, "multiconv")
        return int(np.prod(shape)) * int(np.prod(self.w_shape[1:]))


def tile_shares(num_tiles: int, macs: list[int], reserved_tiles: int) -> list[range]:
    """Consecutive tile ranges, one per convolution: `reserved_tiles` each (at most an equal share)
    and the rest in proportion to their multiply-accumulates (at least one tile each)."""
    k = len(macs)
    if k > num_tiles:
        raise ValueError(f"multiconv: {k} convolutions cannot run side by side on {num_tiles} tiles")
    reserved = max(1, min(int(reserved_tiles), num_tiles // k))
    extra = num_tiles - reserved * k
    total = max(sum(macs), 1)
    shares = [reserved + extra * m // total for m in macs]
    for i in np.argsort([-m for m in macs], kind="stable")[:num_tiles - sum(shares)]:
        shares[i] += 1
    starts = np.concatenate(([0], np.cumsum(shares)))
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


class MultiConv:
    """A planned multi-convolution on one IPU graph: `outputs` are allocated at once (mapped as
    their plans say); `build` adds the program that computes them."""

    def __init__(self, graph: Graph, specs: list[ConvSpec], plan_type: str = "parallel", reserved_tiles: int = 50,
                 name: str = "multiconv"):
        if plan_type not in PLAN_TYPES:
            raise ValueError(f"{name}: plan_type must be one of {PLAN_TYPES}, got {plan_type!r}")
        if not specs:
            raise ValueError(f"{name}: a multi-convolution needs at least one convolution")
        self.graph, self.specs, self.plan_type, self.name = graph, list(specs), plan_type, name
        target = graph.target
        if plan_type == "parallel":
            self.ranges = tile_shares(target.num_tiles, [s.macs for s in specs], reserved_tiles)
        else:
            self.ranges = [range(target.num_tiles)] * len(specs)
        self.plans, self.outputs, self.args = [], [], []
        for i, (spec, tiles) in enumerate(zip(self.specs, self.ranges)):
            dtype = np.dtype(spec.dtype)
            s, p, d = spec.stride, spec.padding, spec.dilation
            shape = conv.conv_output_shape(spec.x_shape, spec.w_shape, s, p, d, spec.groups, name)
            geom = conv.forward_geometry(spec.x_shape, spec.w_shape, s, p, d, spec.groups)
            plan = conv.plan_conv(replace(target, num_tiles=len(tiles)), geom, dtype, output_dtype(None, dtype, name),
                                  spec.available_memory_proportion)
            self.plans.append(plan)
            self.outputs.append(conv._output(graph, plan, dtype, shape, f"{name}/conv{i}", "activations", tiles))
            self.args.append((s, p, d))

    @property
    def cycles(self) -> int:
        """The planners' estimate: the slowest convolution (parallel) or their sum (serial)."""
        est = [p.cycles for p in self.plans]
        return max(est) if self.plan_type == "parallel" else sum(est)

    def build(self, xs: list[Tensor], ws: list[Tensor], prog: Sequence) -> list[Tensor]:
        """Compute every convolution's output from its input and weights (one program)."""
        body = Sequence(name=self.name)
        computes = []
        for i, (x, w, spec, plan, out, tiles) in enumerate(zip(xs, ws, self.specs, self.plans, self.outputs,
                                                               self.ranges)):
            if tuple(x.shape) != tuple(spec.x_shape) or tuple(w.shape) != tuple(spec.w_shape):
                raise ValueError(f"{self.name}: convolution {i} was planned for {spec.x_shape} * {spec.w_shape}, "
                                 f"given {x.shape} * {w.shape}")
            g = spec.groups
            compute = Sequence(name=f"{self.name}/conv{i}") if self.plan_type == "parallel" else body
            conv._build(self.graph, body, f"{self.name}/conv{i}", plan,
                        conv.general_view(x, g, 1, (1, 0, 2)), conv.general_view(w, g, 0, (0, 1, 2)), out,
                        conv.general_view(out, g, 1, (1, 0, 2)), compute, tiles)
            computes.append(compute)
        if self.plan_type == "parallel":
            body.add(Parallel(*computes, name=f"{self.name}/side by side"))
        args, specs, outs = self.args, self.specs, self.outputs

        def fast(io):
            for x, w, spec, (s, p, d), out in zip(xs, ws, specs, args, outs):
                io.write(out, conv.conv_numpy(io.read(x), io.read(w), s, p, d, spec.groups))

        prog.add(OpProgram(self.name, body, fast, (*xs, *ws), tuple(outs)))
        return outs
