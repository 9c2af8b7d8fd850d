"""IO tiles and overlapped host I/O: numIOTiles takes tiles from compute (compute cycles rise),
set_overlap_for_input/output stream through IO tiles while the neighbouring step computes."""
import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch

TARGET = ip.Target.test(num_tiles=64, bytes_per_tile=256 * 1024)
M = poptorch.OverlapMode


def test_a_target_with_io_tiles_plans_on_the_rest():
    t = TARGET.with_io_tiles(32)
    assert (t.num_tiles, t.io_tiles, t.total_tiles, t.bytes_per_ipu) == (32, 32, 64, TARGET.bytes_per_ipu)
    g = ip.Graph(t)
    x = g.addVariable("float32", (128,), "x")
    g.map_linearly(x, tiles=g.io_tiles)          # buffers may live on IO tiles...
    assert set(np.unique(x.tiles())) == set(range(32, 64))
    from ipusim.ops.custom import custom
    with pytest.raises(ValueError, match="an IO tile"):   # ...vertices may not run there
        custom(g, [x], [((128,), "float32")], lambda a: a, ip.Sequence())   # (placed where x lives)
    with pytest.raises(ValueError, match="no compute tiles"):
        TARGET.with_io_tiles(64)


class Wide(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0 + 1.0).sum(1)


def run(model, x, io=0, strategy=True, mode="fast"):
    opts = poptorch.Options()
    if strategy:
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.Emulator.setTarget(TARGET)
    opts.Emulator.setMode(mode)
    if io:
        opts.TensorLocations.numIOTiles(io)
    m = poptorch.inferenceModel(model, opts)
    return m, m(x)


def compute(record) -> int:
    return sum(c.compute for s in record.steps for c in s.busy.values())


def test_io_tiles_are_taken_from_compute():
    x = torch.randn(64, 1024)
    plain, out = run(Wide(), x)
    with_io, out_io = run(Wide(), x, io=32)
    assert plain._executable.engine.target.num_tiles == 64
    assert with_io._executable.engine.target.num_tiles == 32
    torch.testing.assert_close(out_io, out)
    # elementwise work on 65,536 elements spread over half the tiles: each tile does twice as much
    assert compute(with_io.last_run) > 1.6 * compute(plain.last_run)


class Overlapped(torch.nn.Module):
    def __init__(self, mode, out_mode=None):
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)
        self.mode, self.out_mode = mode, out_mode or mode

    def forward(self, x, y):
        x = poptorch.set_overlap_for_input(x, self.mode)
        h = torch.relu(self.lin(torch.relu(self.lin(x))))
        loss = torch.nn.functional.mse_loss(h, y)
        return poptorch.set_overlap_for_output(h, self.out_mode), loss


def train(mode, iterations=2, accumulation=4, strict=False):
    torch.manual_seed(0)
    model = Overlapped(mode)
    opts = poptorch.Options().deviceIterations(iterations).outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(accumulation)
    opts.TensorLocations.numIOTiles(32)
    opts.Emulator.setTarget(TARGET)
    if strict:
        opts.Emulator.setMode("strict")
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    gen = torch.Generator().manual_seed(1)
    n = 2 * iterations * accumulation
    h, loss = training(torch.randn(n, 256, generator=gen), torch.randn(n, 256, generator=gen))
    return model, training, h, loss


def hidden(record, part, kind="F"):
    return [(s.index, e.op.global_micro_batch) for s in record.steps for e in s.overlapped
            if e.part == part and e.op.kind == kind]


def test_overlapped_inputs_hide_behind_the_step_before_as_the_mode_says():
    _, base, h0, l0 = train(M.NoOverlap)
    model_a, acc, h1, l1 = train(M.OverlapAccumulationLoop)
    _, dev, h2, l2 = train(M.OverlapDeviceIterationLoop)
    for h, loss in ((h1, l1), (h2, l2)):
        torch.testing.assert_close(h, h0)
        torch.testing.assert_close(loss, l0)
    assert not hidden(base.last_run, "prefetch")
    # 2 device iterations x 4 micro-batches: the accumulation loop hides micro-batches 1-3 and 5-7,
    # the device-iteration loop every one but the first
    assert [k for _, k in hidden(acc.last_run, "prefetch")] == [1, 2, 3, 5, 6, 7]
    assert [k for _, k in hidden(dev.last_run, "prefetch")] == [1, 2, 3, 4, 5, 6, 7]
    # the backward reads the input again (the weight gradient needs it): its load hides behind the forward
    assert [k for _, k in hidden(acc.last_run, "prefetch", "B")] == list(range(8))
    # outputs drain while the next step (the same micro-batch's backward) computes
    assert len(hidden(acc.last_run, "drain")) == 8
    assert base.last_run.cycles > acc.last_run.cycles > dev.last_run.cycles
    # a hidden prefetch leaves its own step and runs during the step before, off the compute tiles
    step = acc.last_run.steps[hidden(acc.last_run, "prefetch")[0][0]]
    assert all(e.part != "prefetch" for s in acc.last_run.steps for e in s.events
               if e.op.kind == "F" and e.op.global_micro_batch in (1, 2, 3, 5, 6, 7))
    io = max(c.total for e in step.overlapped if e.part == "prefetch" for c in e.per_ipu.values())
    assert step.cycles >= max(max(c.total for c in step.busy.values()), io)


def test_strict_mode_gives_the_same_numbers_and_cycles():
    _, fast, h0, l0 = train(M.OverlapAccumulationLoop, iterations=1, accumulation=2)
    _, strict, h1, l1 = train(M.OverlapAccumulationLoop, iterations=1, accumulation=2, strict=True)
    torch.testing.assert_close(h1, h0, rtol=1e-6, atol=1e-6)
    assert strict.last_run.cycles == fast.last_run.cycles


def test_the_io_buffers_live_on_the_io_tiles():
    _, training, _, _ = train(M.OverlapAccumulationLoop, iterations=1, accumulation=2)
    report = training._executable.engine.memory[0]
    assert report.peak.size == 64
    io_bytes = sum(int(b[32:].sum()) for name, b in report.tensors.items() if name.endswith("/io_tiles"))
    # one micro-batch of 2 x 256 float32: the input of the forward, of the backward, and the output
    assert io_bytes == 3 * 2 * 256 * 4


def test_inference_has_no_accumulation_loop_to_overlap():
    class Net(torch.nn.Module):
        def forward(self, x):
            return poptorch.set_overlap_for_input(x, M.OverlapAccumulationLoop) * 2.0

    opts = poptorch.Options().deviceIterations(4).setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    opts.Emulator.setTarget(TARGET)
    m = poptorch.inferenceModel(Net(), opts)
    x = torch.randn(8, 3)
    torch.testing.assert_close(m(x), x * 2)
    assert not hidden(m.last_run, "prefetch")


class OnInput(torch.nn.Module):
    def forward(self, x):
        return poptorch.set_overlap_for_input(x, M.OverlapAccumulationLoop) + 1


@pytest.mark.parametrize("io, sharded, message", [
    (0, False, "Overlapped IO is not supported with poptorch.PipelinedExecution"),
    (0, True, "No IO tiles allocated. You must allocate at least 32 IO tiles"),
])
def test_poptorch_rules_for_overlap(io, sharded, message):
    with pytest.raises(poptorch.Error, match=message):
        run(OnInput(), torch.ones(2), io=io, strategy=sharded)


def test_marks_must_be_on_inputs_and_outputs():
    class Twice(torch.nn.Module):
        def forward(self, x):
            return x + 1, poptorch.set_overlap_for_input(x, M.OverlapAccumulationLoop)

    class NotOutput(torch.nn.Module):
        def forward(self, x):
            return poptorch.set_overlap_for_output(x + 1, M.OverlapAccumulationLoop) * 2

    class ReturnedTwice(torch.nn.Module):
        def forward(self, x):
            y = x + 1
            return y, poptorch.set_overlap_for_output(y, M.OverlapAccumulationLoop)

    with pytest.raises(poptorch.Error, match="must be the only op applied to an input.*input 0"):
        run(Twice(), torch.ones(2), io=32)
    with pytest.raises(poptorch.Error, match="not a tensor output to the model"):
        run(NotOutput(), torch.ones(2), io=32)
    with pytest.raises(poptorch.Error, match="returned twice"):
        run(ReturnedTwice(), torch.ones(2), io=32)
    with pytest.raises(poptorch.Error, match="mode must be a poptorch.OverlapMode"):
        poptorch.set_overlap_for_input(torch.ones(1), "overlap")


def test_marks_are_identities_on_the_cpu_and_keep_structures():
    x = {"a": torch.ones(2), "b": [torch.zeros(1)]}
    assert poptorch.set_overlap_for_input(x, M.OverlapDeviceIterationLoop)["b"][0] is x["b"][0]
