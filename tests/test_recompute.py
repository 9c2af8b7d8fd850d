"""Recomputation (PopART's autoRecomputation, poptorch.recomputationCheckpoint): a stage's
backward re-runs the stage's forward from what the forward stashed (its inputs, checkpoints and
random seed) instead of reading stashed activations. Stashed bytes fall, cycles rise, values stay
bit-identical, under every schedule kind, with replicas, an off-chip stash and phases;
PopTorch's default (Pipeline for pipelined training over several IPUs) holds; profiles, the
schedule comparison and the balance advice account for the R ops."""
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import poptorch_lite as poptorch
from poptorch_lite.compiler import recompute
from poptorch_lite.compiler.ir import IRGraph, Node, Value
from poptorch_lite.runtime.recompute_replay import RecomputeReplay
from test_profile import SMALL
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss

BATCH = (torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0)),
         torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1)))


# ---- the IR transform ---------------------------------------------------------------------------
@st.composite
def graphs(draw):
    """Forward nodes on stages in order (each reading values of its own or earlier stages, a
    weight or the input), a loss on the last stage, then backward nodes reading forward values
    of their stage and gradients."""
    ir = IRGraph()
    x = Value((2,), np.dtype(np.float32), "x", kind="input")
    w = Value((2,), np.dtype(np.float32), "w", kind="param")
    ir.inputs, ir.params = [x], {"w": w}
    stages = draw(st.integers(1, 4))
    forward = {s: [] for s in range(stages)}
    values = [x]
    for s in range(stages):
        for i in range(draw(st.integers(1, 5))):
            inputs = draw(st.lists(st.sampled_from(values + [w]), min_size=1, max_size=2, unique_by=id))
            op = draw(st.sampled_from(["binary", "binary", "checkpoint", "dropout"])) if inputs[0].kind != "param" \
                else "binary"
            out = Value((2,), np.dtype(np.float32), f"f{s}_{i}")
            node = Node(op, inputs[:1] if op == "checkpoint" else inputs, [out], stage=s)
            out.producer = node
            ir.nodes.append(node)
            forward[s].append(out)
            values.append(out)
    ir.loss = values[-1]
    grads = [ir.loss]
    for s in reversed(range(stages)):
        for i in range(draw(st.integers(1, 4))):
            reads = draw(st.lists(st.sampled_from(forward[s] + [x, w]), min_size=1, max_size=2, unique_by=id))
            out = Value((2,), np.dtype(np.float32), f"g{s}_{i}")
            node = Node("binary", [draw(st.sampled_from(grads))] + reads, [out], stage=s, pass_="bwd")
            out.producer = node
            ir.nodes.append(node)
            grads.append(out)
    return ir


@settings(max_examples=200, deadline=None)
@given(graphs(), st.sampled_from(["pipelined", "serial_phased"]), st.sampled_from([recompute.PIPELINE, 4]))
def test_backward_reads_recomputed_values_and_the_stash_only(ir, kind, mode):
    before = [(n, list(n.inputs)) for n in ir.nodes]
    stages = recompute.apply(ir, mode, kind)
    clones = [n for n in ir.nodes if n.pass_ == recompute.RECOMPUTE]
    assert sorted({n.stage for n in clones}) == list(stages)
    last = ir.loss.producer.stage
    for n in clones:
        original = n.attrs["recomputes"]
        assert original.pass_ == "fwd" and original.stage == n.stage and original.op == n.op != "checkpoint"
        for v in n.inputs:   # what R starts from: its own clones, or the stash of its stage's forward
            p = v.producer
            assert p is None or p.stage != n.stage or p.pass_ == recompute.RECOMPUTE or \
                p.op in ("checkpoint", recompute.SEED_SNAPSHOT) or (mode != recompute.PIPELINE and kind == "pipelined")
        if original.op == "dropout":   # draws with its forward's seed
            assert n.inputs[-1].producer.op == recompute.SEED_SNAPSHOT
    for n in ir.nodes:
        if n.pass_ == "bwd" and n.stage in stages:
            for v in n.inputs:
                p = v.producer
                assert p is None or p.pass_ != "fwd" or p.stage != n.stage or p.op == "checkpoint" or \
                    (kind == "pipelined" and n.stage == last) or (mode != recompute.PIPELINE and kind == "pipelined")
    if kind != "pipelined":   # phased: every stage whose backward reads computed forward values recomputes
        assert last in stages or not any(v.producer is not None and v.producer.op not in ("checkpoint",)
                                         for n in ir.nodes if n.pass_ == "bwd" and n.stage == last
                                         for v in n.inputs if v.producer is not None
                                         and v.producer.pass_ == "fwd" and v.producer.stage == last)
    elif not any(n.op == "checkpoint" and n.stage == last for n in ir.nodes):
        # PopART keeps the loss stage after its last checkpoints, here the values entering it
        for n in clones:
            if n.stage == last:
                assert not enters(n.attrs["recomputes"], last)
    recompute.undo(ir)
    assert [(n, list(n.inputs)) for n in ir.nodes] == before


def enters(node, stage):
    """Whether a value entering `stage` (from another stage, or a model input) is among the
    node's ancestors within the stage."""
    for v in node.inputs:
        p = v.producer
        if (p is None and v.kind == "input") or (p is not None and p.stage != stage) or \
                (p is not None and enters(p, stage)):
            return True
    return False


# ---- models -------------------------------------------------------------------------------------
def tutorial(mode=None, kind="PopTorch", strategy=TUTORIAL_STRATEGY, emulator="fast", replicas=1, off_chip=False):
    """The tutorial network trained for two calls (dropout on): its outputs, parameters, compiled
    executable figures."""
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().setExecutionStrategy(strategy).randomSeed(5)
    opts.Emulator.setTarget(SMALL).setMode(emulator).setPipelineSchedule(kind)
    opts.Training.gradientAccumulation(8)
    if replicas > 1:
        opts.replicationFactor(replicas)
    if off_chip:
        opts.TensorLocations.setActivationLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    if mode is not None:
        opts._Popart.set("autoRecomputation", mode)
    training = poptorch.trainingModel(model, opts)
    x, y = (torch.cat([t] * replicas) for t in BATCH)
    training(x, y)
    out = training(x, y)
    return run_figures(training, out, model)


def run_figures(training, out, model):
    exe = training._executable
    figures = {"out": out, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
               "buffers": {k: torch.from_numpy(v.detach().numpy().copy()) for k, v in model.named_buffers()},
               "schedule": exe.schedule, "cycles": training.last_run.cycles,
               "stash": [int(r.by_category.get("stashed_activations", np.zeros(1)).sum()) for r in exe.engine.memory],
               "off_chip": [r.off_chip_bytes for r in exe.engine.memory],
               "total": [r.total for r in exe.engine.memory]}
    training.destroy()
    return figures


def assert_same_values(a, b):
    for x, y in zip(torch.utils._pytree.tree_leaves(a["out"]), torch.utils._pytree.tree_leaves(b["out"])):
        assert torch.equal(x, y)
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for k in a["buffers"]:
        assert torch.equal(a["buffers"][k], b["buffers"][k]), k


@pytest.fixture(scope="module")
def tutorial_runs():
    return {"default": tutorial(), "off": tutorial(0)}


def test_pipelined_training_recomputes_by_default_as_poptorch(tutorial_runs):
    on, off = tutorial_runs["default"], tutorial_runs["off"]
    assert on["schedule"].recomputed_stages == (0, 1, 2)   # the loss stage keeps its activations
    assert off["schedule"].recomputed_stages == () and not any(op.kind == "R" for op in off["schedule"].ops)
    r = [op for op in on["schedule"].ops if op.kind == "R"]
    assert len(r) == 3 * on["schedule"].num_micro_batches


def test_recomputation_stashes_less_costs_cycles_and_changes_no_value(tutorial_runs):
    on, off = tutorial_runs["default"], tutorial_runs["off"]
    assert_same_values(on, off)   # dropout on B3 draws the same mask when recomputed
    for ipu in range(3):
        assert on["stash"][ipu] < off["stash"][ipu]
    assert on["stash"][3] == off["stash"][3]
    assert on["stash"][0] < off["stash"][0] / 5
    assert on["cycles"] > off["cycles"]
    assert sum(on["total"]) < sum(off["total"])


@pytest.mark.slow
@pytest.mark.parametrize("kind, ipus", [("GPipe", (0, 1, 2, 3)), ("1F1B", (0, 1, 2, 3)), ("ZB-H1", (0, 1, 2, 3)),
                                        ("ZB-H2", (0, 1, 2, 3)), ("Interleaved1F1B", (0, 1, 0, 1))])
def test_every_schedule_kind_recomputes_with_the_same_values(kind, ipus):
    strategy = poptorch.PipelinedExecution(*[poptorch.Stage(f"B{s + 1}").ipu(i) for s, i in enumerate(ipus)])
    on, off = tutorial(kind=kind, strategy=strategy), tutorial(0, kind=kind, strategy=strategy)
    assert on["schedule"].recomputed_stages == (0, 1, 2) and on["schedule"].order_errors() == []
    assert_same_values(on, off)
    assert sum(on["stash"]) < sum(off["stash"]) and on["cycles"] > off["cycles"]


@pytest.mark.slow
def test_strict_mode_recomputes_the_same_numbers_as_fast(tutorial_runs):
    strict = tutorial(emulator="strict")
    assert strict["cycles"] == tutorial_runs["default"]["cycles"] and strict["stash"] == tutorial_runs["default"]["stash"]
    assert_same_values(strict, tutorial(0, emulator="strict"))


def test_replicas_and_an_off_chip_stash_recompute_too(tutorial_runs):
    on, off = tutorial(replicas=2), tutorial(0, replicas=2)
    assert_same_values(on, off)
    assert on["stash"] == tutorial_runs["default"]["stash"] * 2 and off["stash"] == tutorial_runs["off"]["stash"] * 2
    on, off = tutorial(off_chip=True), tutorial(0, off_chip=True)
    assert_same_values(on, off)
    assert sum(on["off_chip"]) < sum(off["off_chip"]) and on["off_chip"][0] < off["off_chip"][0] / 5


PHASED = {"serial": lambda: poptorch.SerialPhasedExecution(
              *[poptorch.Phase(poptorch.Stage(f"B{i + 1}")).ipus(i % 2) for i in range(4)]),
          "parallel": lambda: poptorch.ParallelPhasedExecution(
              *[poptorch.Phase(poptorch.Stage(f"B{i + 1}")).ipus(i % 2) for i in range(4)])}


@pytest.mark.parametrize("kind", sorted(PHASED))
def test_phased_execution_recomputes_every_phase_when_asked(kind):
    default = tutorial(strategy=PHASED[kind]())
    assert default["schedule"].recomputed_stages == ()   # PopTorch turns it on for pipelines only
    on = tutorial(recompute.PIPELINE, strategy=PHASED[kind]())
    assert on["schedule"].recomputed_stages == (0, 1, 2, 3)   # PopART's streaming memory recomputes every phase
    assert_same_values(on, default)
    assert sum(on["stash"]) < sum(default["stash"]) and on["cycles"] > default["cycles"]


# ---- a transformer-like MLP with dropout and LayerNorm ------------------------------------------
class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Encoder(nn.Module):
    """`layers` residual layers, layer i in block "L{i}" on IPU i * ipus // layers; a checkpoint
    after the first layer of each block when `checkpoint`."""

    def __init__(self, layers=4, ipus=2, width=32, checkpoint=()):
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = nn.Linear(width, 10)
        self.ipus, self.checkpoint = ipus, checkpoint
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with poptorch.Block(f"L{i}", ipu_id=i * self.ipus // len(self.layers)):
                x = layer(x)
                if i in self.checkpoint:
                    x = poptorch.recomputationCheckpoint(x)
        with poptorch.Block("head", ipu_id=self.ipus - 1):
            out = self.head(x)
            return out, self.loss(out, y)


def encoder(mode=None, ipus=2, checkpoint=(), layers=4, emulator="fast"):
    torch.manual_seed(0)
    model = Encoder(layers, ipus, checkpoint=checkpoint)
    opts = poptorch.Options().randomSeed(11)
    opts.Emulator.setTarget(SMALL).setMode(emulator)
    opts.Training.gradientAccumulation(2 * ipus - 1)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    if mode is not None:
        opts._Popart.set("autoRecomputation", mode)
    training = poptorch.trainingModel(model, opts)
    x = torch.randn(4 * (2 * ipus - 1), 32, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (4 * (2 * ipus - 1),), generator=torch.Generator().manual_seed(3))
    training(x, y)
    return run_figures(training, training(x, y), model)


@pytest.mark.parametrize("ipus", [2, 3, 4])
def test_dropout_and_layer_norm_recompute_bit_identically(ipus):
    on, off = encoder(ipus=ipus, layers=ipus if ipus != 2 else 4), encoder(0, ipus=ipus, layers=ipus if ipus != 2 else 4)
    assert on["schedule"].recomputed_stages == tuple(range(ipus - 1))
    assert_same_values(on, off)
    for ipu in range(ipus - 1):
        assert on["stash"][ipu] < off["stash"][ipu]
    assert on["cycles"] > off["cycles"]


def test_a_checkpoint_is_stashed_and_recomputation_restarts_from_it():
    plain, marked = encoder(), encoder(checkpoint=(0,))
    assert_same_values(plain, marked)
    assert marked["stash"][0] > plain["stash"][0]   # the checkpoint is stashed beside the stage's input...
    assert marked["cycles"] < plain["cycles"]       # ...and layer 0 is not recomputed
    assert_same_values(marked, encoder(0, checkpoint=(0,)))


def test_a_checkpoint_in_the_loss_stage_recomputes_what_comes_before_it():
    plain, marked = encoder(), encoder(checkpoint=(2,))
    assert plain["schedule"].recomputed_stages == (0,)
    assert marked["schedule"].recomputed_stages == (0, 1)   # layer 2 recomputed before the loss stage's backward
    assert_same_values(plain, marked)
    assert marked["stash"][1] < plain["stash"][1]


def test_batch_norm_statistics_are_updated_once():
    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 26 * 26, 10)

        def forward(self, x, y):
            with poptorch.Block("a", ipu_id=0):
                x = torch.relu(self.bn(self.conv(x)))
            with poptorch.Block("b", ipu_id=1):
                out = self.fc(x.flatten(1))
                return out, nn.functional.cross_entropy(out, y)

    runs = {}
    for mode in (None, 0):
        torch.manual_seed(0)
        model = Convs()
        opts = poptorch.Options()
        opts.Emulator.setTarget(SMALL)
        opts.Training.gradientAccumulation(3)
        if mode is not None:
            opts._Popart.set("autoRecomputation", mode)
        training = poptorch.trainingModel(model, opts)
        out = training(BATCH[0][:6], BATCH[1][:6])
        runs[mode] = run_figures(training, out, model)
    assert runs[None]["schedule"].recomputed_stages == (0,)
    assert_same_values(runs[None], runs[0])
    assert runs[None]["buffers"]["bn.num_batches_tracked"] == 3


# ---- PopTorch's default and the settings --------------------------------------------------------
def compiled(options, model=None, inference=False):
    torch.manual_seed(0)
    model = model or Encoder(4, 2)
    options.Emulator.setTarget(SMALL)
    x, y = torch.randn(12, 32), torch.randint(0, 10, (12,))
    if inference:
        m = poptorch.inferenceModel(model, options)
    else:
        m = poptorch.trainingModel(model, options)
    m.compile(x, y)
    return m._executable.schedule


def pipelined(accumulation=3, recomputation=None, strategy=poptorch.PipelinedExecution):
    options = poptorch.Options().setExecutionStrategy(strategy(poptorch.AutoStage.SameAsIpu))
    options.Training.gradientAccumulation(accumulation)
    if recomputation is not None:
        options._Popart.set("autoRecomputation", recomputation)
    return options


def test_default_is_off_for_one_ipu_inference_and_when_set_to_zero():
    assert compiled(pipelined()).recomputed_stages == (0,)
    assert compiled(pipelined(1), Encoder(4, 1)).recomputed_stages == ()
    assert compiled(pipelined(recomputation=0)).recomputed_stages == ()
    inference = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    assert compiled(inference.deviceIterations(2), inference=True).recomputed_stages == ()
    assert compiled(pipelined(strategy=poptorch.ShardedExecution)).recomputed_stages == ()


@pytest.mark.parametrize("strategy, value, message", [
    (poptorch.ShardedExecution, 3, "ShardedExecution: PopART recomputes pipeline stages only"),
    (poptorch.PipelinedExecution, 7, r"Value 7 for RecomputationType out of range"),   # PopTorch's errors
    (poptorch.PipelinedExecution, "3", r"autoRecomputation takes a uint64 value"),
])
def test_settings_it_cannot_run_are_errors(strategy, value, message):
    with pytest.raises(poptorch.Error, match=message):
        compiled(pipelined(recomputation=value, strategy=strategy))
    with pytest.raises(poptorch.Error, match="pipeline of one IPU"):
        compiled(pipelined(1, recomputation=3), Encoder(4, 1))


def test_pipeline_recomputation_on_the_other_modes_also_stashes_what_a_stage_sends(tutorial_runs):
    full, off = tutorial_runs["default"], tutorial_runs["off"]
    implicit = tutorial(4)   # B1 ends in a ReLU whose backward reads what it sends to B2: stashed, not recomputed
    assert implicit["schedule"].recomputed_stages == full["schedule"].recomputed_stages
    assert_same_values(implicit, full)
    assert full["stash"][0] < implicit["stash"][0] < off["stash"][0]


def test_recomputation_checkpoint_outside_a_model():
    x, y = torch.randn(3), torch.randn(2)
    assert poptorch.recomputationCheckpoint(x) is x
    assert poptorch.recomputationCheckpoint(x, y) == (x, y)
    assert poptorch.recomputationCheckpoint([x, y]) == [x, y]
    assert poptorch.recomputationCheckpoint((x,)) == (x,)
    with pytest.raises(ValueError, match="must be tensors"):
        poptorch.recomputationCheckpoint(x, 3)


# ---- the profile, the pricing and the advice ----------------------------------------------------
def test_profiles_show_r_and_the_stash(tmp_path):
    torch.manual_seed(0)
    opts = poptorch.Options().setExecutionStrategy(TUTORIAL_STRATEGY).enableProfiling(str(tmp_path))
    opts.Emulator.setTarget(SMALL)
    opts.Training.gradientAccumulation(8)
    training = poptorch.trainingModel(TrainingModelWithLoss(Network()), opts)
    training(*BATCH)
    summary = training._profiler.finish()
    from ipusim.report import advisor, pricing, profile
    doc = profile.load(str(tmp_path / "training" / "profile.json"))
    ex = doc["execution"]
    assert ex["schedule"]["recomputed_stages"] == [0, 1, 2]
    assert any(o["kind"] == "R" for s in ex["steps"] for o in s["ops"])
    assert [st["recompute"] is not None for st in ex["stages"]] == [True, True, True, False]
    assert "Recomputation: stage 0 (IPU 0)" in summary and "stashed activations per IPU" in summary
    with open(tmp_path / "training" / "trace.json") as f:
        trace = json.load(f)
    lanes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("args", {}).get("kind") == "R"]
    assert lanes and all(e["name"].startswith("R") for e in lanes)
    comparison = pricing.compare(doc)
    for row in comparison.rows:
        if row.price is not None:
            assert row.schedule.recomputed_stages
    assert "recompute their forward before each backward" in " ".join(comparison.header)
    assert "without recomputation" in doc["blocks"]["source"]
    pipeline = advisor.Pipeline.of_schedule(ex["schedule"])
    assert pipeline.recompute
    table = advisor.BlockTable.from_dict(doc["blocks"])
    on = advisor.advise(table, advisor.target_of(doc), pipeline).current
    off = advisor.advise(table, advisor.target_of(doc), advisor.Pipeline(**{**pipeline.__dict__, "recompute": False})).current
    assert on.backward[0] > off.backward[0] and on.backward[3] == off.backward[3]
    assert on.cycles > off.cycles and on.max_tile_bytes[0] <= off.max_tile_bytes[0]


# ---- recomputation copied on the host (runtime/recompute_replay.py) ----------------------------
def tutorial_calls(monkeypatch, budget_mb=None, calls=3, emulator="fast"):
    """The tutorial trained for `calls` calls with the copies' budget set: its figures and the
    replay's state after the last call."""
    if budget_mb is not None:
        monkeypatch.setenv(recompute.COPY_BUDGET_ENV, str(budget_mb))
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().setExecutionStrategy(TUTORIAL_STRATEGY).randomSeed(5)
    opts.Emulator.setTarget(SMALL).setMode(emulator)
    opts.Training.gradientAccumulation(8)
    training = poptorch.trainingModel(model, opts)
    written = []
    write = RecomputeReplay.write
    monkeypatch.setattr(RecomputeReplay, "write",
                        lambda self, op: (written.append((op.stage, op.global_micro_batch)), write(self, op)))
    for _ in range(calls - 1):
        training(*BATCH)
    out = training(*BATCH)
    replay = training._replay
    replay_lowering[:] = [training._executable.lowering]
    return run_figures(training, out, model), replay, written


replay_lowering = []   # the lowering of the last tutorial_calls


def test_calls_after_the_first_copy_the_recomputation_and_change_nothing(monkeypatch):
    copied, replay, written = tutorial_calls(monkeypatch)
    assert replay.enabled == {0, 1, 2} and not replay.failed and not replay.copies
    assert sorted(set(written)) == [(s, k) for s in range(3) for k in range(8)]   # calls 2 and 3
    assert len(written) == 2 * 3 * 8
    computed, off, _ = tutorial_calls(monkeypatch, budget_mb=0)
    assert not off.enabled
    assert_same_values(copied, computed)
    assert copied["cycles"] == computed["cycles"] and copied["stash"] == computed["stash"]


def test_a_stage_whose_copies_differ_from_its_recomputation_keeps_recomputing(monkeypatch):
    after_forward = RecomputeReplay.after_forward

    def perturbed(self, op):
        after_forward(self, op)
        if op.stage == 1 and 1 in self.checking:   # the first call: one bit of one copy of stage 1 off
            value = self.copies[(1, op.global_micro_batch)][0][0].reshape(-1)
            value[0] = np.nextafter(value[0], np.float32(np.inf))
    monkeypatch.setattr(RecomputeReplay, "after_forward", perturbed)
    copied, replay, written = tutorial_calls(monkeypatch)
    assert replay.failed == {1} and replay.enabled == {0, 2}
    assert {s for s, _ in written} == {0, 2}
    computed, _, _ = tutorial_calls(monkeypatch, budget_mb=0)
    assert_same_values(copied, computed)


def test_the_copies_fit_their_budget_the_smallest_stages_first(monkeypatch):
    _, replay, _ = tutorial_calls(monkeypatch, calls=1)
    low = replay_lowering[0]
    need = {key[1]: low._copies_bytes(key) for key, pairs in low.recomputed_from.items()}
    assert set(need) == {0, 1, 2} and all(need.values())
    for pairs in low.recomputed_from.values():
        assert all(f.var.host_access and r.var.host_access for f, r in pairs)
    smallest = min(need, key=need.get)
    _, tight, _ = tutorial_calls(monkeypatch, budget_mb=need[smallest] / 2**20, calls=1)
    assert tight.enabled == {smallest}
    low = replay_lowering[0]
    assert {key[1] for key, pairs in low.recomputed_from.items() if pairs} == {smallest}


@pytest.mark.parametrize("raw, message", [("lots", "megabytes"), ("-1", "negative")])
def test_a_bad_budget_is_an_error_naming_the_variable(monkeypatch, raw, message):
    monkeypatch.setenv(recompute.COPY_BUDGET_ENV, raw)
    with pytest.raises(ValueError, match=f"{recompute.COPY_BUDGET_ENV}.*{message}"):
        recompute.copy_budget_bytes()


def test_strict_mode_always_runs_the_recomputation(monkeypatch):
    _, replay, written = tutorial_calls(monkeypatch, calls=2, emulator="strict")
    assert not replay.enabled and not written


def test_in_flight_counts_micro_batches_between_forward_and_recompute():
    from ipusim.schedules.poptorch import pipelined_schedule
    s = pipelined_schedule(3, training=True, gradient_accumulation=6).with_recomputation((0, 1))
    # PopTorch's pipeline keeps 2 * (stages - s) - 1 micro-batches of stage s in flight
    assert [recompute.in_flight(s, stage) for stage in range(2)] == [5, 3]
