"""Replica groups: inputReplicaGrouping gives each group of replicas the same input; a per-replica
variable (W.replicaGrouping) holds one value per group and sums its gradients within the group."""
import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device.program import walk
from poptorch_lite.api.replica_groups import group_of, groups

CGT = poptorch.enums.CommGroupType
MODE = poptorch.enums.VariableRetrievalMode


def test_groups_as_poptorch_arranges_them():
    assert groups(8, 2, CGT.Consecutive) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(8, 2, CGT.Orthogonal) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(4, 0, CGT.NoGrouping) == [[0], [1], [2], [3]]
    assert groups(4, 4, CGT.All) == [[0, 1, 2, 3]]
    assert [group_of(r, 8, 4, CGT.Orthogonal) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


@pytest.mark.parametrize("kind, expected", [(CGT.Consecutive, [0, 0, 1, 1]), (CGT.Orthogonal, [0, 1, 0, 1])])
def test_replicas_of_an_input_group_receive_the_same_input(kind, expected):
    opts = poptorch.Options().replicationFactor(4).deviceIterations(3)
    opts.inputReplicaGrouping(2, kind)
    model = poptorch.inferenceModel(Scale(), opts)
    x = torch.arange(3 * 2 * 5, dtype=torch.float32).reshape(6, 5)   # 3 iterations x 2 input groups
    out = model(x)
    assert out.shape == (12, 5)                                      # a result per replica
    per_replica = out.reshape(3, 4, 5)
    for i in range(3):
        for r in range(4):
            torch.testing.assert_close(per_replica[i, r], 2 * x[2 * i + expected[r]])


def test_input_groups_set_the_batch_a_call_consumes():
    opts = poptorch.Options().replicationFactor(4)
    opts.inputReplicaGrouping(4, CGT.Consecutive)
    model = poptorch.inferenceModel(Scale(), opts)
    assert model(torch.ones(1, 3)).shape == (4, 3)     # one input for all four replicas
    pairs = poptorch.Options().replicationFactor(4)
    pairs.inputReplicaGrouping(2, CGT.Consecutive)
    with pytest.raises(ValueError, match=r"replicationFactor \(4\) / inputReplicaGrouping's group size \(2\)"):
        poptorch.inferenceModel(Scale(), pairs)(torch.ones(3, 3))


def test_input_grouping_is_checked_as_poptorch():
    opts = poptorch.Options().replicationFactor(4)
    with pytest.raises(ValueError, match="cannot be All"):
        opts.inputReplicaGrouping(2, CGT.All)
    with pytest.raises(ValueError, match="cannot be larger than replication_factor"):
        opts.inputReplicaGrouping(8, CGT.Consecutive)
    with pytest.raises(ValueError, match="must be a factor of replication_factor"):
        opts.inputReplicaGrouping(3, CGT.Consecutive)
    assert opts.inputReplicaGrouping(5, CGT.NoGrouping).input_group_size == 1


class MatLoss(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.W = torch.nn.Parameter(w)

    def forward(self, x):
        z = x @ self.W
        return z, poptorch.identity_loss(z ** 2, reduction="mean")


@pytest.mark.parametrize("orthogonal_input", [True, False])
def test_per_replica_variables_split_a_weight_and_train_like_the_whole(orthogonal_input):
    """A [40, 56] weight split into 4 column shards over 8 replicas, the data into 2 shards:
    each replica computes one block of X @ W; the training matches the whole on the CPU."""
    rng = np.random.RandomState(100)
    x = torch.tensor(rng.normal(size=(24, 40)).astype(np.float32))
    w0 = rng.normal(size=(40, 56)).astype(np.float32) * 40 ** -0.5
    w = torch.nn.Parameter(torch.tensor(w0))
    sgd = torch.optim.SGD([w], lr=0.01)
    cpu = []
    for _ in range(3):
        sgd.zero_grad()
        loss = torch.mean((x @ w) ** 2)
        loss.backward()
        sgd.step()
        cpu.append(float(loss.detach()))
    model = MatLoss(torch.tensor(w0.reshape(40, 4, 14).transpose(1, 0, 2)).contiguous())
    inputs, weights = (CGT.Orthogonal, CGT.Consecutive) if orthogonal_input else (CGT.Consecutive, CGT.Orthogonal)
    opts = poptorch.Options().replicationFactor(8).outputMode(poptorch.OutputMode.All)
    opts.inputReplicaGrouping(4, inputs)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    training.W.replicaGrouping(weights, 2, MODE.OnePerGroup)
    ipu = []
    for _ in range(3):
        _, loss = training(x.reshape(2, 12, 40))
        ipu.append(float(loss.sum()) / 8)
    np.testing.assert_allclose(ipu, cpu, atol=1e-6)
    trained = model.W.detach().numpy().transpose(1, 0, 2).reshape(40, 56)
    np.testing.assert_allclose(trained, w.detach().numpy(), atol=1e-6)
    # the weight's gradients are summed within pairs of replicas only
    engine = training._executable.engine
    names = [p.name for i in training._executable.updates.programs[0] for p in walk(engine.programs[i])
             if isinstance(p, ip.OpProgram) and p.name.startswith("all_reduce/")]
    assert len(names) == 4


def test_all_replicas_retrieval_and_checks():
    model = MatLoss(torch.randn(4, 3, 2))
    opts = poptorch.Options().replicationFactor(4)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.raises(poptorch.Error, match="first dimension must be 2"):
        training.W.replicaGrouping(CGT.Consecutive, 2, MODE.OnePerGroup)
    training.W.replicaGrouping(CGT.NoGrouping, 1, MODE.AllReplicas)
    before = model.W.detach().clone()
    training(torch.randn(4, 3))
    torch.testing.assert_close(model.W.detach(), before)      # lr 0: every replica's own value comes back
    with pytest.raises(poptorch.Error, match="already compiled"):
        training.W.replicaGrouping(CGT.Consecutive, 2, MODE.OnePerGroup)
