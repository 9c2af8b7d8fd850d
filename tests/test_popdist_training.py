"""Training across processes: popdist.poptorch.Options, and the gradient all-reduce between
real processes (launched by poprun, or by hand with the OpenMPI rank variables) checked against
a single process that trains on the combined batch.

Run as a script, this file is the worker the end-to-end tests launch:
`python test_popdist_training.py OUT_DIR --options popdist|plain ...`.
"""
import argparse
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import popdist
import popdist.poptorch
import poptorch_lite as poptorch
from popdist import core
from poptorch_lite.runtime import distributed

HERE = Path(__file__).resolve()
MICRO_BATCH, ACCUMULATION, SAMPLES, FEATURES, CLASSES = 2, 4, 64, 8, 4


class TwoStageNet(torch.nn.Module):
    """A small classifier pipelined over two IPUs."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, hidden)
        self.fc2 = torch.nn.Linear(hidden, CLASSES)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        with poptorch.Block("B0", ipu_id=0):
            h = torch.relu(self.fc1(x))
        with poptorch.Block("B1", ipu_id=1):
            out = self.fc2(h)
            return out, self.loss(out, y)


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, FEATURES, generator=gen),
                                          torch.randint(0, CLASSES, (SAMPLES,), generator=gen))


def make_optimizer(model, reduction: str):
    lr = 0.1 if reduction == "mean" else 0.02
    return poptorch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def set_reduction(opts, reduction: str):
    kind = {"mean": poptorch.ReductionType.Mean, "sum": poptorch.ReductionType.Sum}[reduction]
    opts.Training.accumulationAndReplicationReductionType(kind)


def weights_of(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def checksum(weights: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- the worker


def worker(argv: list[str]) -> None:
    """Train one epoch of `dataset()` as one process of a data-parallel run; save the weights."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--options", choices=["popdist", "plain"], required=True)
    parser.add_argument("--reduction", choices=["mean", "sum"], default="mean")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--accumulators-off-chip", action="store_true")
    parser.add_argument("--read-only", action="store_true",
                        help="only record which samples two shuffled epochs read")
    args = parser.parse_args(argv)
    if args.options == "popdist":
        opts = popdist.poptorch.Options(ipus_per_replica=2)
    else:  # process id and count from OMPI_COMM_WORLD_RANK / _SIZE, as PopTorch reads them
        opts = poptorch.Options()
    rank = opts.Distributed.processId
    opts.Training.gradientAccumulation(ACCUMULATION)
    if args.read_only:
        opts.randomSeed(3)
        indices = torch.utils.data.TensorDataset(torch.arange(SAMPLES))
        loader = poptorch.DataLoader(opts, indices, batch_size=MICRO_BATCH, shuffle=True)
        epochs = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]
        (args.out / f"indices.{rank}.json").write_text(json.dumps(epochs))
        return
    opts.Emulator.setHostThreads(args.threads)
    if args.accumulators_off_chip:
        opts.TensorLocations.setAccumulatorLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    set_reduction(opts, args.reduction)
    torch.manual_seed(100 + rank)  # every process starts from different weights: process 0's win
    model = TwoStageNet(args.hidden)
    training = poptorch.trainingModel(model, opts, make_optimizer(model, args.reduction))
    loader = poptorch.DataLoader(opts, dataset(), batch_size=MICRO_BATCH)
    steps = 0
    for x, y in loader:
        training(x, y)
        steps += 1
    weights = weights_of(model)
    np.savez(args.out / f"weights.{rank}.npz", **weights)
    report = {
        "rank": rank, "processes": opts.Distributed.numProcesses, "steps": steps,
        "replicas": opts.replication_factor, "checksum": checksum(weights),
        "totals": {ipu: vars(t) for ipu, t in training._collective.totals.items()},
        "off_chip": sorted({slot.off_chip for buckets in training._collective.buckets.values()
                            for bucket in buckets for slot in bucket.slots}),
    }
    (args.out / f"report.{rank}.json").write_text(json.dumps(report))


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Seconds a launched run may take before it counts as hung: many times what the slowest takes on a
# 2-core machine running other work (about 45 s), as CPU-bound neighbours can make it.
HUNG = 1200


def launch_by_hand(tmp_path: Path, per_process_args: list[list[str]],
                   timeout: float = HUNG) -> list[subprocess.CompletedProcess]:
    """Start one worker per entry of `per_process_args` as a launcher like mpirun would:
    OpenMPI rank variables plus a torch.distributed rendezvous, no PopDist variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in core.POPDIST_VARIABLES and k not in ("RANK", "WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMPI_COMM_WORLD_SIZE=str(len(per_process_args)))
    started = [subprocess.Popen(
        [sys.executable, str(HERE), str(tmp_path), "--options", "plain", *args],
        env={**env, "OMPI_COMM_WORLD_RANK": str(rank)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        for rank, args in enumerate(per_process_args)]
    results = []
    try:
        for process in started:
            out, err = process.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def poprun(tmp_path: Path, instances: int, replicas: int, *worker_args: str,
           timeout: float = HUNG) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in core.POPDIST_VARIABLES}
    return subprocess.run(
        [sys.executable, "-m", "popdist.poprun", "--num-instances", str(instances),
         "--num-replicas", str(replicas), "--ipus-per-replica", "2",
         sys.executable, str(HERE), str(tmp_path), "--options", "popdist", *worker_args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL)


def reports(tmp_path: Path, processes: int) -> list[dict]:
    return [json.loads((tmp_path / f"report.{r}.json").read_text()) for r in range(processes)]


def saved_weights(tmp_path: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(tmp_path / f"weights.{rank}.npz") as saved:
        return dict(saved)


def single_process_weights(instances: int, local_replicas: int, reduction: str) -> dict:
    """One process with every replica of the run (`instances * local_replicas`), trained on
    the combined batch: step k feeds what all instances fed at step k (instance p reads the
    p-th contiguous share of the dataset), with gradient accumulation scaled up when the
    replicas themselves cannot be (one replica per process: accumulation x instances)."""
    data = dataset()
    per_step = MICRO_BATCH * ACCUMULATION * local_replicas
    share = per_step * (SAMPLES // (per_step * instances))
    steps = share // per_step
    opts = poptorch.Options()
    replicas = instances * local_replicas
    if local_replicas == 1:
        opts.Training.gradientAccumulation(ACCUMULATION * instances)
    else:
        opts.replicationFactor(replicas).Training.gradientAccumulation(ACCUMULATION)
    set_reduction(opts, reduction)
    torch.manual_seed(100)  # process 0's initial weights
    model = TwoStageNet()
    training = poptorch.trainingModel(model, opts, make_optimizer(model, reduction))
    for step in range(steps):
        rows = torch.cat([torch.arange(p * share + step * per_step, p * share + (step + 1) * per_step)
                          for p in range(instances)])
        training(data.tensors[0][rows], data.tensors[1][rows])
    return weights_of(model)


def assert_close(weights: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert weights.keys() == expected.keys()
    for name in expected:
        scale = np.abs(expected[name]).max()
        error = np.abs(weights[name] - expected[name]).max()
        assert error <= rtol * scale, f"{name}: max error {error} against scale {scale}"


def assert_trained_together(tmp_path: Path, processes: int, local_replicas: int) -> list[dict]:
    """Every process stepped the same number of times, reduced every step, and ends with
    bit-identical weights."""
    found = reports(tmp_path, processes)
    assert [r["rank"] for r in found] == list(range(processes))
    assert {r["processes"] for r in found} == {processes}
    assert {r["replicas"] for r in found} == {local_replicas}
    steps = SAMPLES // (MICRO_BATCH * ACCUMULATION * local_replicas * processes)
    assert {r["steps"] for r in found} == {steps}
    assert len({r["checksum"] for r in found}) == 1, "the processes' weights differ"
    for r in found:
        totals = r["totals"]
        assert sorted(totals) == ["0", "1"]  # both IPUs hold weights
        assert {t["count"] for t in totals.values()} == {steps}
        # fc1 (8x16 + 16) on IPU 0, fc2 (16x4 + 4) on IPU 1, float32, every local replica's,
        # once per step
        fc1, fc2 = 4 * (8 * 16 + 16) * local_replicas, 4 * (16 * 4 + 4) * local_replicas
        assert totals["0"]["nbytes"] == steps * fc1
        assert totals["1"]["nbytes"] == steps * fc2
        assert totals["0"]["network_bytes"] == distributed.ring_bytes(fc1, processes) * steps
    return found


# --------------------------------------------------------------------------- popdist.poptorch.Options


@pytest.fixture
def popdist_env(monkeypatch):
    """Set the PopDist variables of one instance (as poprun would); none are set otherwise."""
    for name in core.POPDIST_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def instance(index: int, instances: int, local_replicas: int, ipus_per_replica: int = 1):
        values = {
            core.NUM_TOTAL_REPLICAS: instances * local_replicas,
            core.NUM_IPUS_PER_REPLICA: ipus_per_replica,
            core.NUM_LOCAL_REPLICAS: local_replicas,
            core.UNIFORM_REPLICAS_PER_INSTANCE: 1,
            core.REPLICA_INDEX_OFFSET: index * local_replicas,
            core.LOCAL_INSTANCE_INDEX: index,
        }
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return instance


def test_options_take_replicas_process_and_device_from_poprun(popdist_env):
    popdist_env(index=1, instances=2, local_replicas=2, ipus_per_replica=2)
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    assert opts.replication_factor == 2
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    assert (opts.process_id, opts.num_processes) == (1, 2)
    assert opts.ipus_per_replica == 2
    assert opts.ipu_id == popdist.getDeviceId(2) == 6  # the 4-IPU device of this instance
    assert isinstance(opts, poptorch.Options)


def test_options_default_to_poprun_ipus_per_replica(popdist_env):
    popdist_env(index=0, instances=4, local_replicas=1, ipus_per_replica=4)
    opts = popdist.poptorch.Options()
    assert opts.ipus_per_replica == 4
    assert opts.replication_factor == 1
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 4)


def test_options_outside_poprun_describe_one_process(popdist_env):
    opts = popdist.poptorch.Options()
    assert opts.replication_factor == 1
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert opts.ipus_per_replica == 1 and opts.ipu_id == 0


def test_options_ignore_openmpi_variables_that_contradict_popdist(popdist_env, monkeypatch):
    popdist_env(index=0, instances=2, local_replicas=1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    opts = popdist.poptorch.Options()
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 2)


@pytest.mark.parametrize("call, name", [
    (lambda o: o.replicationFactor(1), "replicationFactor"),
    (lambda o: o.useIpuId(1), "useIpuId"),
    (lambda o: o.Distributed.disable(), "Distributed.disable"),
    (lambda o: o.Distributed.setEnvVarNames("A", "B"), "Distributed.setEnvVarNames"),
    (lambda o: o.Distributed.configureProcessId(0, 1), "Distributed.configureProcessId"),
    (lambda o: o.Distributed.configureProcessId(1), "Distributed.configureProcessId"),  # refused, not a TypeError
])
def test_options_refuse_what_poprun_decides(popdist_env, call, name):
    popdist_env(index=0, instances=2, local_replicas=2, ipus_per_replica=2)
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    for candidate in (opts, opts.clone()):
        with pytest.raises(RuntimeError, match=rf"Cannot call `{name}` with popdist\.poptorch\."
                                               r"Options: poprun decides .* poptorch\.Options"):
            call(candidate)
        assert candidate.replication_factor == 2
        assert candidate.Distributed.numProcesses == 2


def test_options_keep_every_other_setter(popdist_env):
    popdist_env(index=0, instances=2, local_replicas=1)
    opts = popdist.poptorch.Options()
    opts.deviceIterations(4).Training.gradientAccumulation(8)
    opts.randomSeed(7)
    assert (opts.device_iterations, opts.gradient_accumulation, opts.random_seed) == (4, 8, 7)
    opts._freeze()
    with pytest.raises(poptorch.options.FrozenOptionsError):
        opts.deviceIterations(2)


def test_options_check_ipus_per_replica_against_poprun(popdist_env):
    popdist_env(index=0, instances=2, local_replicas=1, ipus_per_replica=2)
    with pytest.raises(ValueError, match=r"ipus_per_replica=4\) disagrees with poprun, which gave "
                                         r"each replica 2 IPUs"):
        popdist.poptorch.Options(ipus_per_replica=4)
    with pytest.raises(ValueError, match="ipus_per_replica must be a positive integer, got 0"):
        popdist.poptorch.Options(ipus_per_replica=0)


def test_options_need_a_device_poplar_can_hold(popdist_env):
    popdist_env(index=0, instances=1, local_replicas=3, ipus_per_replica=1)
    with pytest.raises(ValueError, match="needs 3 IPUs .* power of two"):
        popdist.poptorch.Options()


def test_dataloader_shards_by_instance(popdist_env):
    """The DataLoader reads this instance's share: combined batch x steps from offset index x
    share."""
    popdist_env(index=1, instances=2, local_replicas=1)
    opts = popdist.poptorch.Options()
    opts.Training.gradientAccumulation(ACCUMULATION)
    loader = poptorch.DataLoader(opts, dataset(), batch_size=MICRO_BATCH)
    combined = MICRO_BATCH * ACCUMULATION
    assert len(loader) == SAMPLES // (2 * combined)
    first, _ = next(iter(loader))
    assert torch.equal(first, dataset().tensors[0][SAMPLES // 2:SAMPLES // 2 + combined])


# --------------------------------------------------------------------------- pure parts


def test_ring_all_reduce_bytes():
    assert distributed.ring_bytes(1000, 1) == 0
    assert distributed.ring_bytes(1000, 2) == 1000
    assert distributed.ring_bytes(1000, 4) == 1500
    assert distributed.ring_bytes(1001, 3) == 1335  # ceil(2 * 2 * 1001 / 3)


def test_first_difference_of_model_signatures():
    ours = (("weights", (("a", (2,), "f32"), ("b", (3,), "f32"))), ("local replicas", (2,)))
    theirs = (("weights", (("a", (2,), "f32"), ("b", (4,), "f32"))), ("local replicas", (1,)))
    assert distributed.first_difference(theirs, ours) == \
        "weights: ('b', (4,), 'f32') against ('b', (3,), 'f32')"
    shorter = (("weights", (("a", (2,), "f32"),)), ("local replicas", (2,)))
    assert distributed.first_difference(shorter, ours) == \
        "weights: nothing against ('b', (3,), 'f32')"


def test_joining_needs_a_rendezvous(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="process 0 of 2, but MASTER_ADDR and MASTER_PORT are "
                                           "not set.*poprun"):
        distributed.join_process_group(2, 0)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="RANK=1 in the environment, but Options.Distributed "
                                           "says process 0 of 2"):
        distributed.join_process_group(2, 0)
    assert not torch.distributed.is_initialized()


def test_the_process_group_is_destroyed_before_the_interpreter_exits(tmp_path):
    """A group left alive into interpreter finalisation can abort the process (gloo's threads
    still hold Python objects), so the group the run opens is destroyed by an exit handler.
    The checking handler is registered first, so it runs after the project's."""
    script = tmp_path / "leave_group_open.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "from poptorch_lite.runtime import distributed\n"
        "atexit.register(lambda: print('still initialised:', dist.is_initialized()))\n"
        f"distributed.open_process_group('127.0.0.1', '{free_port()}', 0, 1, 60)\n"
        "group = dist.new_group(backend='gloo')\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t, group=group)\n"
        "print('reduced:', t.tolist())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=HUNG, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["reduced: [1.0, 1.0, 1.0, 1.0]",
                                        "still initialised: False"]


# --------------------------------------------------------------------------- across processes


@pytest.mark.slow
def test_poprun_instances_share_every_shuffled_epoch(tmp_path):
    """2 instances x 2 local replicas: in each epoch the instances read disjoint shares that
    together hold every sample exactly once, in a new order each epoch."""
    done = poprun(tmp_path, 2, 4, "--read-only")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"indices.{r}.json").read_text()) for r in range(2)]
    combined = MICRO_BATCH * 2 * ACCUMULATION
    for epoch in range(2):
        shares = [seen[r][epoch] for r in range(2)]
        assert [len(s) for s in shares] == [SAMPLES // 2] * 2
        assert all(len(s) % combined == 0 for s in shares)
        assert sorted(shares[0] + shares[1]) == list(range(SAMPLES))
    assert seen[0][0] != seen[0][1]
    assert seen[0][0] != sorted(seen[0][0])


@pytest.mark.slow
def test_two_poprun_instances_train_as_one_process_with_the_combined_batch(tmp_path):
    """poprun --num-instances 2 --num-replicas 2: each instance starts from its own random
    weights, reads half the data, and all-reduces gradients (Mean): both end bit-identical, and
    equal to one process accumulating both instances' micro-batches."""
    done = poprun(tmp_path, 2, 2, "--reduction", "mean")
    assert done.returncode == 0, done.stderr[-3000:]
    found = assert_trained_together(tmp_path, processes=2, local_replicas=1)
    assert {tuple(r["off_chip"]) for r in found} == {(False,)}
    weights = saved_weights(tmp_path, 0)
    assert checksum(saved_weights(tmp_path, 1)) == checksum(weights) == found[0]["checksum"]
    assert_close(weights, single_process_weights(instances=2, local_replicas=1, reduction="mean"))


@pytest.mark.slow
def test_processes_of_any_launcher_reduce_sums_on_host_threads_from_streaming_memory(tmp_path):
    """Processes started by hand (OpenMPI rank variables and MASTER_ADDR/PORT, plain Options),
    Sum reduction, each IPU on its own host thread so both IPUs' all-reduces run concurrently,
    accumulators kept in Streaming Memory."""
    worker_args = ["--reduction", "sum", "--threads", "2", "--accumulators-off-chip"]
    results = launch_by_hand(tmp_path, [worker_args] * 2)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    found = assert_trained_together(tmp_path, processes=2, local_replicas=1)
    assert {tuple(r["off_chip"]) for r in found} == {(True,)}
    assert_close(saved_weights(tmp_path, 1),
                 single_process_weights(instances=2, local_replicas=1, reduction="sum"))


@pytest.mark.slow
def test_processes_with_different_models_fail_clearly(tmp_path):
    """Process 1 builds a narrower model: both processes stop at compile time with the same
    error naming the first difference, instead of hanging or mixing unrelated gradients."""
    results = launch_by_hand(tmp_path, [["--hidden", "16"], ["--hidden", "12"]])
    for rank, result in enumerate(results):
        assert result.returncode != 0
        assert "processes [1] compiled a different training model than process 0" in result.stderr
        assert f"(this is process {rank})" in result.stderr
        assert ("First difference, process 1 against process 0: weights: ('fc1.bias', (12,), "
                "'torch.float32') against ('fc1.bias', (16,), 'torch.float32')") in result.stderr
    assert not list(tmp_path.glob("report.*.json"))


@pytest.mark.slow
def test_two_instances_of_two_replicas_match_one_instance_of_four(tmp_path):
    """poprun --num-instances 2 --num-replicas 4 against one process with replicationFactor(4)."""
    done = poprun(tmp_path, 2, 4, "--reduction", "mean")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trained_together(tmp_path, processes=2, local_replicas=2)
    assert_close(saved_weights(tmp_path, 0),
                 single_process_weights(instances=2, local_replicas=2, reduction="mean"))


TUTORIAL = HERE.parents[1] / "tutorials" / "pytorch" / "popdist" / "train.py"
INSTANCE_LINE = re.compile(r"^\[1,(\d)\]<stdout>:instance (\d)/2: epoch 1 on its (\d+) images: "
                           r"loss ([\d.]+), accuracy ([\d.]+)%$", re.M)
TOTAL_LINE = re.compile(r"^\[1,0\]<stdout>:epoch 1, all 2 instances \((\d+) images\): "
                        r"loss ([\d.]+), accuracy ([\d.]+)%$", re.M)


@pytest.mark.slow
def test_tutorial_saves_on_instance_zero_and_averages_metrics(tmp_path):
    """The popdist tutorial's command (2 instances x 2 replicas) on a few images: one checkpoint,
    written by instance 0; the metrics instance 0 prints are the image-weighted averages of both
    instances' own."""
    env = {k: v for k, v in os.environ.items() if k not in core.POPDIST_VARIABLES}
    done = subprocess.run(
        [sys.executable, "-m", "popdist.poprun", "--num-instances", "2", "--num-replicas", "4",
         "--mpi-global-args=--tag-output", sys.executable, str(TUTORIAL), "--dataset",
         "synthetic", "--train-samples", "256", "--test-samples", "128", "--batch-size", "4",
         "--device-iterations", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2 * HUNG,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[1,0]<stdout>:2 instance(s) x 2 replica(s) x 1 IPU(s) per replica" in out
    assert "DATASET: procedural digits (256 training / 128 test images)" in out
    saves = re.findall(r"^\[1,(\d)\]<stdout>:instance (\d)/2: saved checkpoint (\S+)$", out, re.M)
    assert saves == [("0", "0", "checkpoints/epoch1.pt")]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch1.pt"]
    checkpoint = torch.load(tmp_path / "checkpoints" / "epoch1.pt", weights_only=False)
    assert checkpoint["saved_by_instance"] == 0 and checkpoint["epoch"] == 1
    assert set(checkpoint["model_state_dict"]) >= {"features.0.weight", "classifier.3.bias"}
    locals_ = {int(i): (int(n), float(loss), float(acc))
               for tag, i, n, loss, acc in INSTANCE_LINE.findall(out) if tag == i}
    assert sorted(locals_) == [0, 1]
    (images, loss, accuracy), = [(int(n), float(a), float(b)) for n, a, b in TOTAL_LINE.findall(out)]
    assert images == sum(n for n, _, _ in locals_.values()) == 256
    assert loss == pytest.approx(sum(n * l for n, l, _ in locals_.values()) / images, abs=1e-4)
    assert accuracy == pytest.approx(sum(n * a for n, _, a in locals_.values()) / images, abs=0.01)
    assert checkpoint["loss"] == pytest.approx(loss, abs=1e-4)
    assert re.search(r"^\[1,0\]<stdout>:test accuracy over 128 images \(all instances\): ", out,
                     re.M)


if __name__ == "__main__":
    worker(sys.argv[1:])
