"""poptorch.MultiConv: convolutions planned together; the Parallel plan runs them side by side on
shares of the tiles (fewer cycles), the Serial plan one after the other; values unchanged."""
import json

import numpy as np
import pytest
import torch
from torch import nn

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops import conv
from ipusim.ops.multiconv import ConvSpec, MultiConv, tile_shares

TARGET = ip.Target.test(num_tiles=64, bytes_per_tile=256 * 1024)


class Pair(nn.Module):
    """PopTorch's multiconv test harness: two small convolutions of one input and its square."""

    def __init__(self, multiconv=None, second=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(1, second, 5)
        self.multiconv = multiconv

    def forward(self, x):
        y = torch.pow(x, 2)
        if self.multiconv is None:
            u, v = self.conv1(x), self.conv2(y)
        else:
            with self.multiconv:
                u = self.conv1(x)
                v = self.conv2(y)
        return poptorch.identity_loss((u - v[:, :10]) ** 2, "mean"), u, v


def run(multiconv, mode="fast", training=False, second=10):
    torch.manual_seed(0)
    model = Pair(multiconv, second)
    opts = poptorch.Options()
    opts.Emulator.setTarget(TARGET)
    opts.Emulator.setMode(mode)
    x = torch.randn(2, 1, 28, 28)
    if training:
        compiled = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        out = compiled(x)
        return compiled, out, [p.detach().clone() for p in model.parameters()]
    compiled = poptorch.inferenceModel(model, opts)
    return compiled, compiled(x), None


def conv_cycles(model) -> int:
    """Cycles of the forward convolutions' programs (one OpProgram each, or one for a MultiConv)."""
    engine = model._executable.engine
    ops = [p for prog in engine.programs for p in ip.device.program.walk(prog) if isinstance(p, ip.OpProgram)
           and (p.name.endswith("/conv") or "/multiconv" in p.name)]
    return sum(engine.cost(p).total for p in ops)


def multiconvs(model) -> list:
    return [op for op in json.loads(model._debugGetPopartIR())["maingraph"] if op["type"] == "MultiConv"]


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_parallel_plan_is_faster_with_the_same_values(mode):
    separate, ref, _ = run(None, mode)
    parallel, par, _ = run(poptorch.MultiConv(), mode)
    serial, ser, _ = run(poptorch.MultiConv().planType(poptorch.MultiConvPlanType.Serial), mode)
    for got in (par, ser):
        for a, b in zip(got[1:], ref[1:]):      # the convolutions' outputs: bit-identical
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(got[0], ref[0])   # a sum over them, reduced from other tiles
    assert [len(multiconvs(m)) for m in (separate, parallel, serial)] == [0, 1, 1]
    assert serial.last_run.cycles == separate.last_run.cycles
    # the two convolutions compute side by side on 32 tiles each (5,190 cycles to 3,641)
    assert conv_cycles(parallel) < 0.75 * conv_cycles(separate)
    assert parallel.last_run.cycles < separate.last_run.cycles


def test_training_through_a_multiconv_matches_separate_convolutions():
    _, out, weights = run(None, training=True)
    _, out_mc, weights_mc = run(poptorch.MultiConv(), training=True)
    torch.testing.assert_close(out_mc[0], out[0])
    for a, b in zip(weights_mc, weights):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def conv_tiles(model) -> list[set]:
    """Tiles of the forward convolution vertices, per convolution of the multi-convolution."""
    graph = model._executable.engine.device.graphs[0]
    return [set(np.unique(np.concatenate([t.tiles for t in cs.tables])).tolist())
            for cs in graph.compute_sets if "/multiconv" in cs.name and cs.name.endswith("/conv")]


def test_the_parallel_plan_shares_the_tiles_by_work_and_reserved_tiles():
    parallel, _, _ = run(poptorch.MultiConv())
    first, second = conv_tiles(parallel)
    assert not first & second and max(first) < min(second)          # side by side, disjoint
    # conv2 of 30 channels does 3x conv1's multiply-accumulates: with 4 reserved tiles each it gets
    # 4 + 3/4 of the other 56; with 50 (PopLibs' default; at most 32 of 64 here) an equal split
    macs = [ConvSpec((2, 1, 28, 28), (10, 1, 5, 5)).macs, ConvSpec((2, 1, 28, 28), (30, 1, 5, 5)).macs]
    assert tile_shares(64, macs, 50) == [range(0, 32), range(32, 64)]
    assert tile_shares(64, macs, 4) == [range(0, 18), range(18, 64)]
    reserved, _, _ = run(poptorch.MultiConv().perConvReservedTiles(4), second=30)
    a, b = conv_tiles(reserved)
    assert max(a) < 18 <= min(b)


def test_available_memory_proportions_reach_each_planner():
    graph = ip.Graph(TARGET)
    specs = [ConvSpec((4, 16, 32, 32), (32, 16, 3, 3), available_memory_proportion=p) for p in (0.9, 0.001)]
    plans = MultiConv(graph, specs, "serial").plans
    assert plans[0].fits and not plans[1].fits or plans[0].splits != plans[1].splits


def test_poptorch_errors():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x):
            with poptorch.MultiConv():
                with poptorch.MultiConv():
                    return self.conv(x)

    class Empty(nn.Module):
        def forward(self, x):
            with poptorch.MultiConv():
                return torch.pow(x, 2)

    class Chained(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(1, 1, 3), nn.Conv2d(1, 1, 3)

        def forward(self, x):
            with poptorch.MultiConv():
                return self.b(self.a(x))

    x = torch.zeros(1, 1, 8, 8)
    with pytest.raises(poptorch.Error, match="Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(Nested())(x)
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv"):
        poptorch.inferenceModel(Empty())(x)
    with pytest.raises(poptorch.Error, match="must be independent"):
        poptorch.inferenceModel(Chained())(x)
    with pytest.raises(poptorch.Error, match="3 values given for 2 convolutions"):  # noqa
        run(poptorch.MultiConv().availableMemoryProportions((0.5, 0.6, 0.7)))
    with pytest.raises(poptorch.Error, match="accumulate their partials in float32"):
        run(poptorch.MultiConv().partialsTypes(torch.half))


def test_option_checks_as_poptorch():
    mc = poptorch.MultiConv()
    with pytest.raises(ValueError, match="Invalid partials types"):
        mc.partialsTypes("half")
    with pytest.raises(AssertionError, match="Invalid plan type"):
        mc.planType("parallel")
    with pytest.raises(AssertionError, match="Invalid available memory proportion"):
        mc.availableMemoryProportions([0.5, 1])
    with pytest.raises(ValueError, match="value must be bool"):
        mc.enableConvDithering([True, 1])


def test_parallel_programs_may_share_an_ipu_only_on_disjoint_tiles():
    g = ip.Graph(ip.Target.test(8))
    a, b, c = (g.addVariable("float32", (16,), name) for name in "abc")
    g.map_linearly(a, tiles=range(0, 4))
    g.map_linearly(b, tiles=range(4, 8))
    g.map_linearly(c, tiles=range(2, 6))
    x, y, z = (g.clone(t, f"{t.name}2") for t in (a, b, c))
    ip.Parallel(ip.Copy(a, x), ip.Copy(b, y))                       # tiles 0-3 and 4-7: side by side
    with pytest.raises(ValueError, match="share IPUs"):
        ip.Parallel(ip.Copy(a, x), ip.Copy(c, z))                    # both use tiles 2 and 3


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_device_multiconv_equals_separate_convolutions(mode):
    rng = np.random.default_rng(0)
    specs = [ConvSpec((2, 4, 12, 12), (6, 2, 3, 3), groups=2), ConvSpec((2, 4, 12, 12), (5, 4, 1, 1), stride=2)]
    outs = {}
    for kind in ("separate", "parallel"):
        g = ip.Graph(ip.Target.test(16))
        xs = [g.addVariable("float32", s.x_shape, f"x{i}") for i, s in enumerate(specs)]
        ws = [g.addVariable("float32", s.w_shape, f"w{i}") for i, s in enumerate(specs)]
        for t in xs + ws:
            g.map_linearly(t)
        prog = ip.Sequence()
        if kind == "separate":
            ys = [conv.conv(g, x, w, prog, stride=s.stride, groups=s.groups, name=f"c{i}")
                  for i, (x, w, s) in enumerate(zip(xs, ws, specs))]
        else:
            ys = MultiConv(g, specs).build(xs, ws, prog)
        engine = ip.Engine(g, prog, mode=mode).load()
        for t in xs + ws:
            engine.writeTensor(t, np.random.default_rng(hash(t.name) % 100).standard_normal(t.shape))
        engine.run()
        outs[kind] = [engine.readTensor(y) for y in ys]
    for a, b in zip(outs["parallel"], outs["separate"]):
        np.testing.assert_array_equal(a, b)
    del rng
