"""Replication, tensor locations (Streaming Memory), phased execution and offline compilation."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipusim as ip
import poptorch_lite as poptorch
from test_training import SHARDED, tutorial_model

SMALL = ip.Target.test(num_tiles=16, bytes_per_tile=256 * 1024)


class TwoStageNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x, labels):
        with poptorch.Block("A", ipu_id=0):
            h = torch.relu(self.fc1(x))
        with poptorch.Block("B", ipu_id=1):
            out = torch.log_softmax(self.fc2(h), 1)
            loss = F.nll_loss(out, labels)
        return out, loss


def replica_options(replicas, accumulation=4, iterations=10, reduction=poptorch.ReductionType.Mean):
    opts = poptorch.Options().deviceIterations(iterations).replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation).accumulationAndReplicationReductionType(reduction)
    opts.Emulator.setTarget(SMALL)
    return opts


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean, poptorch.ReductionType.Sum])
def test_replicas_train_like_pytorch_on_the_combined_batch(replicas, reduction):
    torch.manual_seed(0)
    model = TwoStageNet()
    ref = copy.deepcopy(model)
    micro, acc, its, calls = 2, 4, 10, 2          # 20 optimiser steps
    opts = replica_options(replicas, acc, its, reduction)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5))
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    gen = torch.Generator().manual_seed(3)
    per_step = micro * acc * replicas
    for _ in range(calls):
        x = torch.randn(per_step * its, 12, generator=gen)
        y = torch.randint(0, 5, (per_step * its,), generator=gen)
        training(x, y)
        for step in range(its):
            ropt.zero_grad()
            for j in range(acc * replicas):
                lo = step * per_step + j * micro
                _, loss = ref(x[lo:lo + micro], y[lo:lo + micro])
                (loss / (acc * replicas) if reduction == poptorch.ReductionType.Mean else loss).backward()
            ropt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        rel = float((p.detach() - q.detach()).abs().max() / q.detach().abs().max())
        assert rel < 1e-4, (name, rel)
    exe = training._executable
    for name in exe.lowering.weights:
        values = [exe.engine.readTensor(low.weights[name]) for low in exe.lowerings]
        for v in values[1:]:
            np.testing.assert_array_equal(v, values[0])   # replicas stay bit-identical


def test_replicated_outputs_and_all_reduce_cost():
    torch.manual_seed(0)
    model = TwoStageNet()
    opts = replica_options(2, accumulation=4, iterations=1)
    opts.outputMode(poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, opts)
    out, loss = training(torch.randn(16, 12), torch.randint(0, 5, (16,)))
    assert out.shape == (16, 5) and loss.shape == (8,)
    exe = training._executable
    assert exe.engine.device.num_ipus == 4
    w_step = [s for s in training.last_run.steps if any(op.kind == "U" for op in s.ops)][0]
    assert sum(c.inter_ipu for c in w_step.busy.values()) > 0      # the ring all-reduce uses the links


def test_replication_needs_divisible_batches():
    opts = replica_options(2, accumulation=4, iterations=1)
    with pytest.raises(ValueError, match=r"replicationFactor \(2\)"):
        poptorch.trainingModel(TwoStageNet(), opts)(torch.randn(12, 12), torch.randint(0, 5, (12,)))


def offload_options(offload: bool):
    opts = poptorch.Options().setExecutionStrategy(SHARDED)
    opts.Emulator.setTarget(ip.Target.test(num_tiles=64, bytes_per_tile=512 * 1024))
    if offload:
        opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    return opts


def test_optimiser_offload_frees_tile_memory_and_costs_streaming_time():
    models, runs = [], []
    x, y = torch.randn(2, 1, 28, 28), torch.randint(0, 10, (2,))
    for offload in (False, True):
        model = tutorial_model()
        training = poptorch.trainingModel(model, offload_options(offload),
                                          poptorch.optim.AdamW(model.parameters(), lr=1e-3))
        training(x, y)
        models.append(model)
        runs.append(training)
    on, off = (r._executable for r in runs)
    state_bytes = {}
    for low_on in (on.lowering,):
        for name, w in low_on.weights.items():
            if name in low_on.accumulators:
                state_bytes[w.ipu] = state_bytes.get(w.ipu, 0) + 2 * 4 * w.numel   # exp_avg, exp_avg_sq
    for r_on, r_off in zip(on.engine.memory, off.engine.memory):
        saved = int(r_on.always_live.sum() - r_off.always_live.sum())
        assert saved >= state_bytes[r_on.ipu], (r_on.ipu, saved)
        assert r_off.by_category["optimiser_state"].sum() == r_on.by_category["optimiser_state"].sum()
        assert r_off.off_chip_bytes >= state_bytes[r_on.ipu]
        assert r_off.total < r_on.total
    # the weight updates take longer by the Streaming Memory time of loading and storing the state
    w_on = sum(on.engine.cost(on.engine.programs[i]).total for ids in on.updates.programs.values() for i in ids)
    w_off = sum(off.engine.cost(off.engine.programs[i]).total for ids in off.updates.programs.values() for i in ids)
    target = off.engine.target
    assert w_off - w_on >= sum(2 * target.streaming_memory_cycles(b // 2) for b in state_bytes.values())
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)   # same numbers either way
    state = runs[1]._optimizer.state_dict()["state"]
    assert int(next(iter(state.values()))["step"]) == 1


def test_replicated_tensor_sharding_splits_optimiser_state():
    sizes = []
    for shard in (False, True):
        torch.manual_seed(0)
        model = TwoStageNet()
        opts = replica_options(2, accumulation=4, iterations=1)
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(shard))
        training = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters(), lr=1e-2))
        gen = torch.Generator().manual_seed(1)
        training(torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen))
        exe = training._executable
        sizes.append(sum(r.by_category["optimiser_state"].sum() for r in exe.engine.memory))
        for name in exe.lowering.weights:
            values = [exe.engine.readTensor(low.weights[name]) for low in exe.lowerings]
            np.testing.assert_array_equal(values[0], values[1])
        if shard:
            sharded_weights = [p.detach().clone() for p in model.parameters()]
        else:
            full_weights = [p.detach().clone() for p in model.parameters()]
    assert sizes[1] < 0.6 * sizes[0]
    for a, b in zip(full_weights, sharded_weights):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


PHASED = {
    "serial": lambda: poptorch.SerialPhasedExecution(*[poptorch.Phase(poptorch.Stage(f"B{i + 1}")).ipus(i % 2)
                                                       for i in range(4)]),
    "parallel": lambda: poptorch.ParallelPhasedExecution(*[poptorch.Phase(poptorch.Stage(f"B{i + 1}")).ipus(i % 2)
                                                           for i in range(4)]),
}


@pytest.mark.parametrize("kind", ["serial", "parallel"])
def test_phased_execution_trains_like_sharded(kind):
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    results = {}
    for name, strategy in (("sharded", SHARDED), (kind, PHASED[kind]())):
        model = tutorial_model()
        opts = poptorch.Options().deviceIterations(2).setExecutionStrategy(strategy)
        opts.Training.gradientAccumulation(2)
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05))
        training(x, y)
        results[name] = (model, training)
    (m_sharded, t_sharded), (m_phased, t_phased) = results["sharded"], results[kind]
    for p, q in zip(m_phased.parameters(), m_sharded.parameters()):
        assert float((p - q).detach().abs().max() / q.detach().abs().max()) < 1e-5
    assert t_phased._executable.engine.device.num_ipus == 2
    mem_sharded = [r.total for r in t_sharded._executable.engine.memory]
    mem_phased = [r.total for r in t_phased._executable.engine.memory]
    assert len(mem_phased) == 2 and len(mem_sharded) == 4
    assert t_phased.last_run.cycles != t_sharded.last_run.cycles


def test_off_chip_liveness_moves_the_stash_to_streaming_memory():
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    reports = {}
    for liveness in (poptorch.Liveness.AlwaysLive, poptorch.Liveness.OffChipAfterFwd):
        strategy = PHASED["serial"]().setTensorsLiveness(liveness)
        opts = poptorch.Options().setExecutionStrategy(strategy)
        model = tutorial_model()
        training = poptorch.trainingModel(model, opts)
        training(x[:1], y[:1])
        reports[liveness] = training._executable.engine.memory
    on_chip = sum(r.by_category.get("stashed_activations", np.zeros(1)).sum() for r in reports[poptorch.Liveness.AlwaysLive])
    off_chip = sum(r.off_chip_bytes for r in reports[poptorch.Liveness.OffChipAfterFwd])
    assert on_chip > 0 and off_chip > 0
    assert sum(r.always_live.sum() for r in reports[poptorch.Liveness.OffChipAfterFwd]) < \
        sum(r.always_live.sum() for r in reports[poptorch.Liveness.AlwaysLive])


def test_offline_target_compiles_but_refuses_to_run():
    opts = poptorch.Options().useOfflineIpuTarget(2).setExecutionStrategy(SHARDED)
    model = poptorch.trainingModel(tutorial_model(), opts)
    x, y = torch.randn(1, 1, 28, 28), torch.randint(0, 10, (1,))
    model.compile(x, y)
    assert model.isCompiled()
    with pytest.raises(RuntimeError, match=r"offline.*model\.compile"):
        model(x, y)


class CountsInputs(torch.nn.Module):
    """Changes a buffer itself (not BatchNorm's running statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.bn = torch.nn.BatchNorm1d(2)
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x):
        with torch.no_grad():
            self.count += x.sum(0)
        return self.bn(self.lin(x)) + self.count


def test_a_buffer_the_model_changes_cannot_be_broadcast_to_replicas():
    x = torch.arange(8.0).reshape(4, 2)
    model = poptorch.inferenceModel(CountsInputs(), poptorch.Options().replicationFactor(2))
    with pytest.raises(poptorch.Error, match=r"^PopTorch does not support broadcasting buffers\..*"
                                             r"broadcastBuffers\(False\)\. Buffer 'count' \(changed from method "
                                             r"\.add_\(\)"):
        model(x)
    # each replica keeps its own buffer: replica r's count is the sum of its own micro-batch
    net = CountsInputs().eval()
    out = poptorch.inferenceModel(net, poptorch.Options().replicationFactor(2).broadcastBuffers(False))(x)
    torch.testing.assert_close(out, torch.cat([_fresh(net)(x[:2]), _fresh(net)(x[2:])]))


def _fresh(net: CountsInputs) -> CountsInputs:
    copy_of_net = CountsInputs().eval()
    copy_of_net.load_state_dict(net.state_dict())
    return copy_of_net


def test_batch_norm_statistics_still_train_on_replicas():
    class Normalised(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.bn = torch.nn.BatchNorm1d(2)

        def forward(self, x):
            return poptorch.identity_loss(self.bn(self.lin(x)).sum(), reduction="sum")

    model = poptorch.trainingModel(Normalised(), poptorch.Options().replicationFactor(2))
    model(torch.randn(4, 2))
