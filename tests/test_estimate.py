"""Estimate mode: the programs, plans, tile mappings and schedules of a run, its memory and cycles,
without values or tensor storage. Every figure must be the run's own: cycles per step, bytes per
tile, the profile."""
import json

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops import matmul as mm

import model_zoo
import tutorial_model


def test_engine_estimate_mode_charges_a_runs_cycles_without_storage():
    def build(mode):
        g = ip.Graph(ip.GC200)
        a = g.addVariable("float16", (64, 256), "a")
        b = g.addVariable("float16", (256, 96), "b")
        g.map_linearly(a)
        g.map_linearly(b)
        prog = ip.Sequence()
        c = mm.matmul(g, a, b, prog)
        return ip.Engine(g, prog, mode=mode).load(), c

    fast, _ = build("fast")
    est, c = build("estimate")
    assert est.mem is None
    assert est.run() == fast.run() > 0
    np.testing.assert_array_equal(est.memory[0].peak, fast.memory[0].peak)
    with pytest.raises(ip.EstimateModeError, match="estimate mode computes no values"):
        est.readTensor(c)
    with pytest.raises(ip.EstimateModeError, match="writeTensor"):
        est.writeTensor(c, np.zeros(c.shape, np.float16))


def test_engine_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="'fast', 'strict' or 'estimate'"):
        ip.Engine(ip.Graph(ip.Target.test()), ip.Sequence(), mode="quick")


def _tutorial(mode):
    torch.manual_seed(0)
    model = tutorial_model.TrainingModelWithLoss(tutorial_model.Network())
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(8)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*[poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4)]))
    opts.Emulator.setMode(mode)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01))
    return training, (torch.randn(2 * 8 * 2, 1, 28, 28), torch.randint(0, 10, (32,)))


def _zoo(name, mode, micro_batch=1, **kw):
    zoo = model_zoo.MODELS[name](**kw)
    model = model_zoo.with_blocks(zoo)
    opts = model_zoo.options(zoo, "pipelined", 8)
    opts.Emulator.setMode(mode)
    x, labels = zoo.inputs(1, 8, micro_batch)
    return (poptorch.trainingModel(model, opts, poptorch.optim.AdamW(model.parameters(), lr=1e-3)),
            (x[0].flatten(0, 1), labels[0].flatten(0, 1)))


def _same_accounting(make):
    """The model priced in estimate mode and run in fast mode: the same cycles in every step and
    event, the same bytes on every tile."""
    runs = {}
    for mode in ("fast", "estimate"):
        model, inputs = make(mode)
        out = model(*inputs)
        runs[mode] = model, out
    (fast, fast_out), (est, est_out) = runs["fast"], runs["estimate"]
    assert est._executable.engine.mode == "estimate" and est._executable.engine.mem is None
    assert [s.cycles for s in est.last_run.steps] == [s.cycles for s in fast.last_run.steps]
    assert [[(e.part, e.program, e.per_ipu) for e in s.events] for s in est.last_run.steps] == \
        [[(e.part, e.program, e.per_ipu) for e in s.events] for s in fast.last_run.steps]
    for a, b in zip(est._executable.engine.memory, fast._executable.engine.memory):
        np.testing.assert_array_equal(a.peak, b.peak)
        assert a.off_chip_bytes == b.off_chip_bytes
    for a, b in zip(est_out, fast_out):
        assert a.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype


def test_tutorial_estimate_equals_a_run():
    _same_accounting(_tutorial)


def test_bert_style_encoder_estimate_equals_a_run():
    _same_accounting(lambda mode: _zoo("bert_style", mode))


@pytest.mark.slow
def test_resnet18_estimate_equals_a_run():
    _same_accounting(lambda mode: _zoo("resnet18", mode, micro_batch=2, image=32))


class _TwoIpus(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 10)
        self.loss = torch.nn.CrossEntropyLoss()
        poptorch.BeginBlock(self.a, "A", ipu_id=0)
        poptorch.BeginBlock(self.b, "B", ipu_id=1)

    def forward(self, x, y):
        out = self.b(torch.relu(self.a(x)))
        return out, self.loss(out, y)


@pytest.mark.parametrize("sharded", [False, True])
def test_replicas_priced_once_cost_what_the_emulated_replicas_cost(sharded):
    """Two replicas emulated (their ring all-reduce, the sharded update's gathers) against one
    replica standing for both: the same cycles in every step, the same bytes on replica 0's
    tiles, and only one replica's IPUs built."""
    def make(mode):
        torch.manual_seed(0)
        model = _TwoIpus()
        opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
        opts.Training.gradientAccumulation(4)
        if sharded:
            opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useReplicatedTensorSharding(True))
        opts.Emulator.setMode(mode)
        return (poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters(), lr=0.1)),
                (torch.randn(32, 32), torch.randint(0, 10, (32,))))

    (fast, inputs), (est, _) = make("fast"), make("estimate")
    expected = fast(*inputs)
    out = est(*inputs)
    assert [o.shape for o in out] == [o.shape for o in expected]
    engine = est._executable.engine
    assert engine.device.num_ipus == 2 and engine.device.replicas == 2 and engine.device.sync_ipus == 4
    assert [s.cycles for s in est.last_run.steps] == [s.cycles for s in fast.last_run.steps]
    for a, b in zip(engine.memory, fast._executable.engine.memory):
        np.testing.assert_array_equal(a.peak, b.peak)


def test_offline_target_compiles_and_a_call_is_an_error_unless_estimating():
    model = _TwoIpus()
    opts = poptorch.Options().useOfflineIpuTarget()
    opts.Training.gradientAccumulation(4)
    training = poptorch.trainingModel(model, opts)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    training.compile(x, y)
    assert training._executable.engine.mode == "estimate" and training._executable.engine.mem is None
    with pytest.raises(RuntimeError, match="setMode\\('estimate'\\)"):
        training(x, y)
    opts = poptorch.Options().useOfflineIpuTarget()
    opts.Training.gradientAccumulation(4)
    opts.Emulator.setMode("estimate")
    with torch.device("meta"):
        model = _TwoIpus()
    training = poptorch.trainingModel(model, opts)
    out, loss = training(torch.empty(16, 32, device="meta"), torch.empty(16, dtype=torch.long, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 10) and loss.shape == ()
    assert training.last_run.cycles > 0


def test_estimate_mode_reports_what_does_not_fit_instead_of_failing():
    model = _TwoIpus()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Emulator.setTarget(ip.Target.test(num_tiles=4, bytes_per_tile=2048)).setMode("estimate")
    training = poptorch.trainingModel(model, opts)
    training.compile(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    oom = training._executable.out_of_memory
    assert isinstance(oom, ip.OutOfMemoryError) and "Out of memory compiling the model" in str(oom)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Emulator.setTarget(ip.Target.test(num_tiles=4, bytes_per_tile=2048))
    with pytest.raises(ip.OutOfMemoryError):
        poptorch.trainingModel(_TwoIpus(), opts).compile(torch.randn(4, 32), torch.randint(0, 10, (4,)))


@pytest.mark.parametrize("shape, tile", [((64, 32), 3), ((7, 5, 3), 0), ((1000,), 15), ((3, 4), 5)])
def test_a_broadcast_scalars_exchange_costs_what_the_general_walk_says(shape, tile):
    """A scalar broadcast to a tensor (an optimiser's running-mean share times a weight's gradient)
    is priced in work per run of the destination's map; the general walk over the same elements
    named one by one gives the same cycles and bytes."""
    from ipusim.device import cost
    target = ip.Target.test(num_tiles=16)
    g = ip.Graph(target)
    s = g.addVariable("float16", (2,), "s")
    g.setTileMapping(s, tile)
    d = g.addVariable("float16", shape, "d")
    g.map_linearly(d, grain=4)
    broadcast = s[:1].reshape((1,) * len(shape)).broadcast(shape)
    listed = ip.Tensor.of_runs(s.var, np.zeros(int(np.prod(shape)), np.int64), np.ones(int(np.prod(shape)), np.int64),
                               shape)
    assert broadcast.strided and not any(broadcast.strides) and not listed.strided
    assert cost._exchange_cycles(broadcast, d, target) == cost._exchange_cycles(listed, d, target)


def test_a_profiled_estimate_writes_the_profile_of_a_run(tmp_path):
    """Profiling an estimate: the replayed layers' programs have their costs like every other node,
    the files are written and the report tool reads them with the balance advice."""
    import subprocess
    import sys
    runs = {}
    for mode in ("fast", "estimate"):
        zoo = model_zoo.MODELS["bert_style"]()
        model = model_zoo.with_blocks(zoo)
        opts = model_zoo.options(zoo, "pipelined", 8)
        opts.Emulator.setMode(mode)
        opts.enableProfiling(str(tmp_path / mode))
        x, labels = zoo.inputs(1, 8, 1)
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
        training(x[0].flatten(0, 1), labels[0].flatten(0, 1))
        training.destroy()
        runs[mode] = json.loads((tmp_path / mode / "training" / "profile.json").read_text())
    for key in ("memory", "programs", "execution", "blocks", "operations"):
        assert json.dumps(runs["estimate"][key]) == json.dumps(runs["fast"][key]), key
    out = subprocess.run([sys.executable, "-m", "ipusim.report", str(tmp_path / "estimate" / "training")],
                         capture_output=True, text=True, check=True).stdout
    assert "Balance advice" in out or "balance" in out.lower()
