"""fps (farthest point sampling) and nearest (nearest cluster) with torch_cluster's semantics, as
device ops and as ops of a model."""
import math

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops import cluster


def fps_reference(src, ptr, ratio, starts=None):
    """torch_cluster's CPU algorithm, in torch."""
    out = []
    for b in range(len(ptr) - 1):
        seg = src[ptr[b]:ptr[b + 1]]
        n = seg.shape[0]
        k = math.ceil(float(np.float32(n) * np.float32(ratio)))
        start = 0 if starts is None else starts[b]
        picked = [start]
        dist = ((seg - seg[start]) ** 2).sum(1)
        for _ in range(1, k):
            nxt = int(torch.argmax(dist))
            picked.append(nxt)
            dist = torch.minimum(dist, ((seg - seg[nxt]) ** 2).sum(1))
        out += [p + ptr[b] for p in picked]
    return torch.tensor(out)


def nearest_reference(x, y, bx, by):
    d = torch.cdist(x.double(), y.double()) ** 2
    d[bx[:, None] != by[None, :]] = math.inf
    return d.argmin(1)


class Fps(torch.nn.Module):
    def forward(self, x, ptr, ratio, random_start):
        return poptorch.fps(x, ptr, ratio, random_start)


@pytest.mark.parametrize("shape", [(1, 2), (2, 19), (3, 10), (19, 3)])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 1.0])
def test_fps_single_segment(shape, ratio):
    torch.manual_seed(sum(shape))
    src = torch.rand(shape)
    got = poptorch.inferenceModel(Fps())(src, [0, shape[0]], ratio, False)
    assert got.tolist() == fps_reference(src, [0, shape[0]], ratio).tolist()


@pytest.mark.parametrize("ptr", [[0, 13, 19], [0, 2, 3, 4, 9, 11, 19], [0, 1, 3, 4, 9, 18, 19]])
@pytest.mark.parametrize("ratio", [0.4, 0.6, 1.0])
def test_fps_segments(ptr, ratio):
    torch.manual_seed(len(ptr))
    src = torch.rand(19, 3)
    assert poptorch.inferenceModel(Fps())(src, ptr, ratio, False).tolist() == fps_reference(src, ptr, ratio).tolist()
    assert poptorch.fps(src, ptr, ratio).tolist() == fps_reference(src, ptr, ratio).tolist()   # on the CPU


def test_fps_random_start_picks_a_point_of_each_segment_first():
    torch.manual_seed(0)
    src, ptr = torch.rand(29, 3), [0, 2, 6, 11, 28, 29]
    opts = poptorch.Options().randomSeed(5)
    got = poptorch.inferenceModel(Fps(), opts)(src, ptr, 1.0, True)
    firsts = []
    for b in range(len(ptr) - 1):
        part = got[ptr[b]:ptr[b + 1]].tolist()
        assert sorted(part) == list(range(ptr[b], ptr[b + 1]))        # every point, once
        firsts.append(part[0] - ptr[b])
    assert got.tolist() == fps_reference(src, ptr, 1.0, firsts).tolist()
    assert any(firsts)      # not all segments started at their first point


def test_fps_feeds_a_trained_layer():
    class Train(torch.nn.Module):
        def __init__(self, out):
            super().__init__()
            self.linear = torch.nn.Linear(out, out)

        def forward(self, x, ptr, ratio):
            res = poptorch.fps(x, ptr, ratio, False).float()
            result = self.linear(res)
            return result, torch.nn.functional.mse_loss(result, torch.ones_like(result))

    torch.manual_seed(0)
    src, ptr = torch.rand(29, 3), [0, 2, 6, 11, 28, 29]
    out = sum(math.ceil(float(np.float32(b - a) * np.float32(0.7))) for a, b in zip(ptr, ptr[1:]))
    model = Train(out)
    ref = Train(out)
    ref.load_state_dict(model.state_dict())
    result, loss = poptorch.trainingModel(model)(src, ptr, 0.7)
    want = ref.linear(fps_reference(src, ptr, 0.7).float())
    torch.testing.assert_close(result, want)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(want, torch.ones_like(want)))


X = torch.tensor([[-1, -1], [-1, +1], [+1, +1], [+1, -1], [-2, -2], [-2, +2], [+2, +2], [+2, -2]])
Y = torch.tensor([[-1, 0], [+1, 0], [-2, 0], [+2, 0]])


class Nearest(torch.nn.Module):
    def forward(self, *args):
        return poptorch.nearest(*args)


@pytest.mark.parametrize("dtype", [torch.half, torch.float, torch.double])
def test_nearest_as_torch_cluster(dtype):
    x, y = X.to(dtype), Y.to(dtype)
    bx, by = [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1]
    expected = nearest_reference(x, y, torch.tensor(bx), torch.tensor(by))
    assert expected.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    model = poptorch.inferenceModel(Nearest())
    assert model(x, y, bx, by).tolist() == expected.tolist()
    assert poptorch.inferenceModel(Nearest())(x, y, torch.tensor(bx), torch.tensor(by)).tolist() == expected.tolist()
    single = nearest_reference(x, y, torch.zeros(8), torch.zeros(4)).tolist()
    assert poptorch.inferenceModel(Nearest())(x, y).tolist() == single
    assert poptorch.nearest(x, y, bx, by).tolist() == expected.tolist()       # on the CPU


@pytest.mark.parametrize("bx, by, message", [
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0], "do not occur in 'batch_y'"),
    ([0, 0, 0, 0, 1, 1, 1, 1], None, "do not occur in 'batch_y'"),
    ([0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 3, 3], "do not occur in 'batch_y'"),
    ([0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 1], "'batch_x' is not sorted"),
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 0], "'batch_y' is not sorted"),
])
def test_nearest_checks_batches_as_poptorch(bx, by, message):
    with pytest.raises(ValueError, match=message):
        poptorch.inferenceModel(Nearest())(X.float(), Y.float(), bx, by)


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_device_ops_in_both_modes(mode):
    rng = np.random.default_rng(7)
    g = ip.Graph(ip.Target.test(8))
    src = g.addVariable("float32", (40, 3), "src")
    x, y = g.addVariable("float32", (50, 4), "x"), g.addVariable("float32", (12, 4), "y")
    bx, by = g.addVariable("int32", (50,), "bx"), g.addVariable("int32", (12,), "by")
    for t in (src, x, y, bx, by):
        g.map_linearly(t)
    prog = ip.Sequence()
    ptr = [0, 7, 25, 40]
    picked = cluster.fps(g, src, ptr, 0.5, prog)
    near = cluster.nearest(g, x, y, bx, by, prog)
    engine = ip.Engine(g, prog, mode=mode).load()
    values = {src: rng.random((40, 3)), x: rng.random((50, 4)), y: rng.random((12, 4)),
              bx: np.repeat([0, 1, 2], [20, 20, 10]), by: np.repeat([0, 1, 2, 3], 3)}
    for t, v in values.items():
        engine.writeTensor(t, v)
    engine.run()
    np.testing.assert_array_equal(engine.readTensor(picked), cluster.fps_host(values[src], ptr, 0.5))
    want = nearest_reference(*(torch.from_numpy(np.asarray(values[t])) for t in (x, y, bx, by)))
    np.testing.assert_array_equal(engine.readTensor(near), want.numpy())
    assert len(np.unique(near.tiles())) > 1       # rows of x spread over tiles


def test_fps_cost_grows_with_the_points_picked():
    costs = []
    for ratio in (0.1, 1.0):
        g = ip.Graph(ip.Target.test(4))
        src = g.addVariable("float32", (64, 3), "src")
        g.map_linearly(src)
        prog = ip.Sequence()
        cluster.fps(g, src, [0, 64], ratio, prog)
        costs.append(ip.Engine(g, prog).costs[0].total)
    assert costs[1] > 5 * costs[0]
