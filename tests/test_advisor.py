"""Balance advice: the block-table model, the search (exhaustive and local), memory limits,
errors, and on a real model: the heavy stage is found and the advised split runs faster."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.report import advisor as adv
from ipusim.schedules import pipelined_schedule

TARGET = ip.Target.test(num_tiles=8, bytes_per_tile=64 * 1024)
TRAINING = adv.Pipeline(training=True, gradient_accumulation=8, device_iterations=1)


def chain(forward, backward=None, activation=4096, tile=1000, split=None, update=100):
    """A sequential model: each block feeds the next; every block's backward needs its input."""
    n = len(forward)
    backward = backward if backward is not None else [2 * f for f in forward]
    flows = []
    for b in range(n - 1):
        flows += [adv.Flow(100 + b, activation, ("fwd", b), ("fwd", b + 1)),
                  adv.Flow(100 + b, activation, ("fwd", b), ("bwd", b + 1)),
                  adv.Flow(200 + b, activation, ("bwd", b + 1), ("bwd", b))]
    tiles = np.full((n, TARGET.num_tiles), tile, dtype=np.int64) if np.isscalar(tile) else np.asarray(tile)
    return adv.BlockTable([f"B{i}" for i in range(n)], list(forward), list(backward), [update] * n, tiles, flows,
                          split, "test")


def brute_force(table, n, pipeline=TRAINING):
    model = adv._Model(table, TARGET, pipeline)
    return min((model.evaluate(s) for s in adv._compositions(table.num_blocks, n)), key=adv._key)


def test_imbalanced_split_gets_a_strictly_better_proposal():
    table = chain([5000, 5000, 5000, 5000, 1000, 1000, 1000, 1000], split=[4, 2, 2])
    advice = adv.advise(table, TARGET, TRAINING)
    assert advice.current.bottleneck_stage == 0          # the heavy stage is the first
    assert advice.exhaustive and advice.candidates == math.comb(7, 2)
    assert advice.best.cycles < advice.current.cycles
    assert advice.speedup > 1.3
    assert advice.best.split == brute_force(table, 3).split
    assert "speedup" in advice.text() and "IPU0: B0" in advice.text()


def test_balanced_split_is_kept():
    table = chain([3000] * 4, split=[1, 1, 1, 1])
    advice = adv.advise(table, TARGET, TRAINING)
    assert advice.best.split == (1, 1, 1, 1) and advice.speedup == 1.0
    assert "already the best" in advice.text()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(100, 20000), min_size=3, max_size=7), st.data())
def test_advice_is_optimal_and_never_worse_than_current(costs, data):
    n_ipus = data.draw(st.integers(1, min(3, len(costs))))
    cuts = sorted(data.draw(st.lists(st.integers(1, len(costs) - 1), min_size=n_ipus - 1, max_size=n_ipus - 1,
                                     unique=True)))
    bounds = [0] + cuts + [len(costs)]
    split = [bounds[i + 1] - bounds[i] for i in range(n_ipus)]
    table = chain(costs, split=split)
    advice = adv.advise(table, TARGET, adv.Pipeline(True, 2 * n_ipus - 1 + 2, 1))
    assert advice.best.cycles <= advice.current.cycles
    assert advice.best.cycles == brute_force(table, n_ipus, adv.Pipeline(True, 2 * n_ipus - 1 + 2, 1)).cycles


def test_memory_limit_rules_out_the_fastest_split():
    # (2, 2) is the fastest split, but B0 and B1 together need 80 KiB on tile 0 (64 KiB fit).
    tiles = np.full((4, TARGET.num_tiles), 1000, dtype=np.int64)
    tiles[0, 0] = tiles[1, 0] = 40 * 1024
    table = chain([1000, 9000, 9000, 1000], tile=tiles, split=[1, 3])
    model = adv._Model(table, TARGET, TRAINING)
    fastest = min((model.evaluate(s) for s in adv._compositions(4, 2)), key=lambda p: p.cycles)
    assert fastest.split == (2, 2) and not fastest.fits
    advice = adv.advise(table, TARGET, TRAINING)
    assert advice.best.split == (1, 3) and advice.best.fits
    assert all(p <= TARGET.bytes_per_tile for p in advice.best.max_tile_bytes)
    unfittable = chain([1000] * 2, tile=np.full((2, TARGET.num_tiles), 70 * 1024), split=[1, 1])
    none = adv.advise(unfittable, TARGET, TRAINING)
    assert none.best is None and "bytes on a tile" in none.text()


def test_channel_buffers_follow_the_schedule():
    """Each channel's buffers hold as many micro-batches as the schedule keeps in flight on it
    (the stash of stage s in the grouped schedule: 2(N-s)-1); the model charges them on the
    consumer's IPU."""
    schedule = pipelined_schedule(4, training=True, gradient_accumulation=8)
    assert [adv.in_flight(schedule, ("fwd", s), ("bwd", s)) for s in range(4)] == [7, 5, 3, 1]
    per_tile = 256                                    # 2048 B spread over 8 tiles, 64 elements each
    table = chain([1000] * 4, activation=per_tile * TARGET.num_tiles, tile=0, split=[1, 1, 1, 1])
    p = adv._Model(table, TARGET, TRAINING).evaluate((1, 1, 1, 1))
    for k in range(4):
        slots = 0
        if k > 0:    # the activation from stage k-1, for the forward and (stashed) for the backward
            slots += adv.in_flight(schedule, ("fwd", k - 1), ("fwd", k)) + \
                adv.in_flight(schedule, ("fwd", k - 1), ("bwd", k))
        if k < 3:    # the gradient from stage k+1
            slots += adv.in_flight(schedule, ("bwd", k + 1), ("bwd", k))
        assert p.max_tile_bytes[k] == per_tile * slots


def test_local_search_when_there_are_too_many_splits(monkeypatch):
    table = chain([1000 + 300 * (i % 5) for i in range(12)], split=[3, 3, 3, 3])
    exhaustive = adv.advise(table, TARGET, TRAINING, 4)
    monkeypatch.setattr(adv, "EXHAUSTIVE_LIMIT", 10)
    searched = adv.advise(table, TARGET, TRAINING, 4)
    assert not searched.exhaustive and searched.candidates < math.comb(11, 3)
    assert searched.best.cycles <= searched.current.cycles
    assert searched.best.cycles <= 1.05 * exhaustive.best.cycles


def test_other_ipu_counts_and_errors():
    table = chain([2000] * 6, split=[3, 3])
    four = adv.advise(table, TARGET, TRAINING, 4)
    assert len(four.best.split) == 4 and four.speedup > 1.2
    with pytest.raises(ValueError, match="at least 7 blocks|cannot fill 7"):
        adv.advise(table, TARGET, TRAINING, 7)
    with pytest.raises(ValueError, match="gradient_accumulation >= 11"):
        adv.advise(table, TARGET, TRAINING, 6)
    with pytest.raises(ValueError, match="num_ipus"):
        adv.advise(chain([1000, 1000]), TARGET, TRAINING)
    with pytest.raises(ValueError, match="does not cover"):
        chain([1000, 1000], split=[1, 2])


def test_inference_and_sharded():
    table = chain([4000, 1000, 1000, 1000], backward=[0] * 4, split=[2, 2])
    table.flows = [f for f in table.flows if f.src[0] == "fwd" and f.dst[0] == "fwd"]
    infer = adv.advise(table, TARGET, adv.Pipeline(False, 1, 8))
    assert infer.best.split == (1, 3) and infer.best.cycles < infer.current.cycles
    assert all(b == 0 for b in infer.best.backward)
    sharded = adv.advise(chain([1000] * 4, split=[2, 2]), TARGET, adv.Pipeline(True, 4, 1, "sharded"))
    assert sharded.best.cycles <= sharded.current.cycles


def test_block_table_round_trips_through_json():
    table = chain([1000, 2000, 3000], split=[1, 2])
    again = adv.BlockTable.from_dict(table.to_dict())
    assert again.names == table.names and again.flows == table.flows
    assert np.array_equal(again.tile_bytes, table.tile_bytes) and again.current_split == [1, 2]


def test_linear_spread_matches_map_linearly():
    for numel in (1, 63, 64, 65, 1000, 8 * 64 * 5 + 3):
        g = ip.Graph(TARGET)
        t = g.addVariable("float32", (numel,), "x")
        g.map_linearly(t, grain=4, min_elements_per_tile=64)
        expected = t.var.mapping.counts(TARGET.num_tiles) * 4
        assert np.array_equal(adv.linear_tile_bytes(numel * 4, TARGET.num_tiles), expected), numel


def test_in_flight_matches_the_lowering():
    from poptorch_lite.compiler.lowering import channel_slots
    for n, g in ((2, 3), (3, 5), (4, 8)):
        s = pipelined_schedule(n, training=True, gradient_accumulation=g)
        keys = [(("fwd", a), ("fwd", a + 1)) for a in range(n - 1)] + \
               [(("fwd", a), ("bwd", b)) for a in range(n) for b in range(a, n)] + \
               [(("bwd", a + 1), ("bwd", a)) for a in range(n - 1)]
        slots = channel_slots(s, keys)
        assert all(adv.in_flight(s, src, dst) == slots[(src, dst)] for src, dst in keys)



# --------------------------------------------------------------------------- a real model

class FineGrained(torch.nn.Module):
    """Six blocks; the first four are wide (heavy), the last two narrow."""

    WIDTHS = [128, 256, 256, 256, 256, 32, 32]

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(self.WIDTHS, self.WIDTHS[1:]))
        self.head = torch.nn.Linear(32, 10)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with poptorch.Block(f"L{i}"):
                x = torch.relu(layer(x))
        with poptorch.Block("L5"):
            out = self.head(x)
            return out, self.loss(out, y)


@pytest.mark.slow
def test_heavy_stage_is_longest_and_the_advised_split_runs_faster(tmp_path):
    from ipusim.report import profile as prof
    from poptorch_lite.runtime.profiling import advise, what_if
    torch.manual_seed(0)
    strategy = poptorch.PipelinedExecution(poptorch.Stage("L0", "L1", "L2", "L3").ipu(0), poptorch.Stage("L4").ipu(1),
                                           poptorch.Stage("L5").ipu(2))
    opts = poptorch.Options().setExecutionStrategy(strategy).enableProfiling(str(tmp_path))
    opts.Emulator.setTarget(ip.Target.test(num_tiles=32, bytes_per_tile=256 * 1024))
    opts.Training.gradientAccumulation(6)
    model = poptorch.trainingModel(FineGrained(), opts)
    x, y = torch.randn(6 * 4, 128), torch.randint(0, 10, (6 * 4,))
    model(x, y)
    measured = model.last_run.cycles
    printed = []
    model._profiler.session.echo = printed.append
    doc = prof.load(str(tmp_path / "training"))
    assert doc["execution"]["longest_stage"]["stage"] == 0
    assert doc["execution"]["longest_stage"]["blocks"] == ["L0", "L1", "L2", "L3"]
    assert doc["blocks"]["source"] == "model lowered with one block per stage without recomputation"
    assert doc["blocks"]["current_split"] == [4, 1, 1]
    advice = advise(model)
    assert advice.current.split == (4, 1, 1) and advice.measured_cycles == measured
    assert advice.best.cycles < advice.current.cycles and advice.speedup > 1.2
    assert abs(advice.current.cycles - measured) / measured < 0.15           # the model is close to the run
    better = what_if(model, split=advice.best.stages)                         # the advice, lowered and timed
    assert better["execution"]["cycles"] < 0.9 * measured
    assert better["execution"]["longest_stage"]["share_of_work"] < doc["execution"]["longest_stage"]["share_of_work"]
    two = advise(model, num_ipus=2)
    assert len(two.best.split) == 2
    model.destroy()
    (text,) = printed
    assert "Longest stage: stage 0 on IPU 0 (blocks L0, L1, L2, L3)" in text and "speedup x" in text


def test_advice_under_the_literature_kinds():
    """GPipe and 1F1B profiles are advised with their own schedule; the split kinds are refused
    with where to compare them."""
    from ipusim import schedules
    from ipusim.report import profile as prof
    table = chain([5000, 5000, 1000, 1000], split=[2, 1, 1])
    for make in (schedules.gpipe_schedule, schedules.one_f_one_b_schedule):
        pipeline = adv.Pipeline.of_schedule(prof.schedule_summary(make(3, gradient_accumulation=6)))
        assert pipeline.strategy == make(1, gradient_accumulation=1).strategy
        assert pipeline.schedule(3).steps == make(3, gradient_accumulation=6).steps
        advice = adv.advise(table, TARGET, pipeline)
        assert advice.best.cycles <= advice.current.cycles
    zb = adv.Pipeline.of_schedule(prof.schedule_summary(schedules.zb_h1_schedule(3, gradient_accumulation=6)))
    with pytest.raises(ValueError, match=r"does not cover ZB-H1 .*--schedules"):
        adv.advise(table, TARGET, zb)
