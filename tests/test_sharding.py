"""Replicated tensor sharding of optimiser state: each replica holds 1/R of the state, the update
pays a reduce-scatter and an all-gather instead of an all-reduce, the values are unchanged."""
import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops import collectives

TARGET = ip.Target.test(num_tiles=16, bytes_per_tile=512 * 1024)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(64, 48)
        self.small = torch.nn.Linear(48, 3)

    def forward(self, x, y):
        out = self.small(torch.relu(self.big(x)))
        return out, torch.nn.functional.cross_entropy(out, y)


def train(replicas, shard, min_elements=0, steps=2):
    torch.manual_seed(0)
    model = Net()
    opts = poptorch.Options().replicationFactor(replicas)
    opts.Training.gradientAccumulation(2)
    opts.Emulator.setTarget(TARGET)
    location = poptorch.TensorLocationSettings().useReplicatedTensorSharding(shard)
    if min_elements:
        location.minElementsForReplicatedTensorSharding(min_elements)
    opts.TensorLocations.setOptimizerLocation(location)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=1e-2)
    training = poptorch.trainingModel(model, opts, optimizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        training(torch.randn(4 * replicas, 64, generator=gen), torch.randint(0, 3, (4 * replicas,), generator=gen))
    return model, training, optimizer


def state_bytes(exe, weight: str) -> list[int]:
    """Bytes of the weight's optimiser state tensors (Adam's moments and step counters) per IPU."""
    out = []
    for report in exe.engine.memory:
        out.append(sum(int(b.sum()) for name, b in report.tensors.items()
                       if name.split("/")[-2:-1] and weight in name and "/exp_avg" in name))
    return out


def update_step(training):
    return next(s for s in training.last_run.steps if any(op.kind == "U" for op in s.ops))


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_replica_holds_one_share_of_the_state_and_values_are_unchanged(replicas):
    full_model, full, full_opt = train(replicas, False)
    shard_model, sharded, shard_opt = train(replicas, True)
    for p, q in zip(full_model.parameters(), shard_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)     # bit-identical
    for (k, a), (_, b) in zip(full_opt.state_dict()["state"].items(), shard_opt.state_dict()["state"].items()):
        for slot in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a[slot], b[slot], rtol=0, atol=0)
    for weight in ("big.weight", "small.weight"):
        whole = state_bytes(full._executable, weight)
        share = state_bytes(sharded._executable, weight)
        numel = dict(full_model.named_parameters())[weight].numel()
        assert whole == [2 * 4 * numel] * replicas                  # exp_avg + exp_avg_sq, float32
        assert share == [2 * 4 * numel // replicas] * replicas      # 1/R of it on every replica
    # a tensor of fewer elements than replicas stays whole (small.bias has 3)
    expected = {"big.weight", "big.bias", "small.weight"} | ({"small.bias"} if replicas <= 3 else set())
    assert sharded._executable.updates.sharded == expected


def test_min_elements_keeps_small_tensors_whole():
    _, sharded, _ = train(2, True, min_elements=100)
    assert sharded._executable.updates.sharded == {"big.weight", "small.weight"}   # biases of 48 and 3 stay whole


def test_the_update_pays_a_reduce_scatter_and_an_all_gather():
    replicas = 2
    _, full, _ = train(replicas, False, steps=1)
    _, sharded, _ = train(replicas, True, steps=1)
    a, b = update_step(full), update_step(sharded)
    links = lambda step: sum(c.inter_ipu for c in step.busy.values())   # noqa: E731
    compute = lambda step: sum(c.compute for c in step.busy.values())  # noqa: E731
    # the ring's two halves move what the all-reduce moves (chunks of the gradient, then of the weight)
    assert links(a) == links(b)
    # each replica updates half of every weight: the optimiser's compute falls
    assert compute(b) < compute(a)
    # the programs are the collectives': one reduce-scatter and one all-gather per weight
    names = [p.name for i in sharded._executable.updates.programs[0] for p in
             ip.device.program.walk(sharded._executable.engine.programs[i]) if isinstance(p, ip.OpProgram)]
    assert sum(n.startswith("reduce_scatter/") for n in names) == 4
    assert sum(n.startswith("all_gather_shards/") for n in names) == 4
    assert not any(n.startswith("all_reduce/") for n in names)


@pytest.mark.parametrize("mode", ["fast", "strict"])
@pytest.mark.parametrize("replicas, n", [(2, 10), (3, 7), (4, 3)])
def test_reduce_scatter_then_all_gather_equals_all_reduce(mode, replicas, n):
    device = ip.Device(ip.Target.test(4), replicas)
    xs, ys = [], []
    for r in range(replicas):
        g = device.graph(r)
        for store in (xs, ys):
            t = g.addVariable("float32", (n,), f"t{len(store)}")
            g.map_linearly(t)
            store.append(t)
    prog = ip.Sequence()
    shards = collectives.reduce_scatter(device, xs, prog)
    for r, (lo, hi) in enumerate(shards):   # "update" each shard: copy it into the other tensor
        prog.add(ip.Copy(xs[r].flatten()[lo:hi], ys[r].flatten()[lo:hi]))
    collectives.all_gather_shards(device, ys, prog)
    engine = ip.Engine(device, prog, mode=mode).load()
    values = np.random.default_rng(0).standard_normal((replicas, n)).astype(np.float32)
    for r in range(replicas):
        engine.writeTensor(xs[r], values[r])
    engine.run()
    expected = values[0].copy()
    for r in range(1, replicas):
        expected += values[r]
    for r in range(replicas):
        np.testing.assert_allclose(engine.readTensor(ys[r]), expected, rtol=1e-6)
    assert [hi - lo for lo, hi in shards] == [hi - lo for lo, hi in collectives.chunk_bounds(n, replicas)][1:] + \
        [collectives.chunk_bounds(n, replicas)[0][1]]
