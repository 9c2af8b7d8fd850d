"""Options.Emulator.setPipelineSchedule: the tutorial network trained under GPipe, 1F1B,
interleaved 1F1B, ZB-H1 and ZB-H2 ends with the parameters PopTorch's schedule gives; the
zero-bubble kinds run each stage's backward as an input-gradient program (B) and a
weight-gradient program (W) in the schedule's order; placements a kind cannot run are refused
with what to do."""
import numpy as np
import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.compiler import lowering
from poptorch_lite.compiler.backward_split import WEIGHT_GRADIENT
from poptorch_lite.compiler.recompute import RECOMPUTE
from tutorial_model import Network, TrainingModelWithLoss

MICRO_BATCH, ACCUMULATION, CALLS = 4, 8, 2


def tutorial_model():
    torch.manual_seed(0)
    net = Network()
    net.layer3_dropout.p = 0.0
    return TrainingModelWithLoss(net)


def train(kind, ipus, strategy_cls=poptorch.PipelinedExecution):
    """Parameters after CALLS calls; blocks B1..B4 are stages 0..3, stage s on IPU ipus[s]."""
    training, model = trained(kind, ipus, strategy_cls)
    strategy = training._executable.schedule.strategy
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    training.destroy()
    return strategy, params


def trained(kind, ipus, strategy_cls=poptorch.PipelinedExecution):
    """The training model (not destroyed) and the user's module after CALLS calls."""
    model = tutorial_model()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.setExecutionStrategy(strategy_cls(*[poptorch.Stage(f"B{s + 1}").ipu(i) for s, i in enumerate(ipus)]))
    opts.Emulator.setPipelineSchedule(kind)
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05))
    torch.manual_seed(1)
    for _ in range(CALLS):
        x = torch.randn(MICRO_BATCH * ACCUMULATION, 1, 28, 28)
        y = torch.randint(0, 10, (MICRO_BATCH * ACCUMULATION,))
        training(x, y)
    return training, model


@pytest.fixture(scope="module")
def poptorch_params():
    return train("PopTorch", [0, 1, 2, 3])[1]


def assert_same(params, reference):
    for name, ref in reference.items():
        rel = float((params[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert rel <= 1e-6, (name, rel)


@pytest.mark.parametrize("kind,ipus", [("GPipe", [0, 1, 2, 3]), ("1F1B", [0, 1, 2, 3]),
                                       ("Interleaved1F1B", [0, 1, 0, 1]), ("ZB-H1", [0, 1, 2, 3]),
                                       ("ZB-H2", [0, 1, 2, 3])])
def test_training_under_each_kind_matches_poptorchs_schedule(kind, ipus, poptorch_params):
    strategy, params = train(kind, ipus)
    assert strategy == kind
    assert_same(params, poptorch_params)


def test_option_validates_and_defaults_to_poptorch():
    opts = poptorch.Options()
    assert opts.Emulator.pipeline_schedule == "PopTorch"
    with pytest.raises(ValueError, match=r"unknown schedule '1f1b'; use one of 'PopTorch', 'GPipe', '1F1B'"):
        opts.Emulator.setPipelineSchedule("1f1b")


@pytest.mark.parametrize("kind,ipus,message", [
    ("ZB-H1", [0, 1, 1, 0], r"runs stage s on IPU s; this model places its stages on IPUs \[0, 1, 0\]"),
    ("1F1B", [0, 1, 0, 1], r"runs stage s on IPU s; this model places its stages on IPUs \[0, 1, 0, 1\]"),
    # B2 and B3 on IPU 1 merge into one stage: 3 stages on 2 IPUs
    ("Interleaved1F1B", [0, 1, 1, 0], r"needs stage s on IPU s mod 2 \(3 stages on 2 IPUs, each IPU the same number "
                                      r"of stages\); this model places its stages on IPUs \[0, 1, 0\]"),
])
def test_kinds_the_runtime_cannot_run_are_refused(kind, ipus, message):
    with pytest.raises(ValueError, match=message):
        train(kind, ipus)


@pytest.fixture(scope="module")
def zb_h1():
    training, _ = trained("ZB-H1", [0, 1, 2, 3])
    yield training
    training.destroy()


def test_zero_bubble_runs_w_after_b_and_sends_b_without_waiting_for_w(zb_h1):
    """The run record follows the schedule: each stage's W of micro-batch k computes in a step
    after its B of k; B's input gradient is sent in B's own step and the stage before runs its B
    of k before this stage's W of k whenever the schedule defers that W."""
    exe = zb_h1._executable
    schedule, record = exe.schedule, zb_h1.last_run
    assert [s.ops for s in record.steps] == [list(s.ops) for s in schedule.steps]
    computed, sent = {}, {}
    for step in record.steps:
        for e in step.events:
            if e.op.kind in "BW" and e.part in ("compute", "send"):
                (computed if e.part == "compute" else sent).setdefault(
                    (e.op.kind, e.op.stage, e.op.global_micro_batch), []).append(step.index)
    stages, micro_batches = schedule.num_stages, schedule.num_micro_batches
    for s in range(stages):
        for k in range(micro_batches):
            assert len(computed[("W", s, k)]) == 1
            if s > 0:   # stage 0 sends no input gradient: its backward is all weight gradient
                assert computed[("B", s, k)][0] < computed[("W", s, k)][0]
                assert set(sent[("B", s, k)]) == set(computed[("B", s, k)])
    deferred = [(s, k) for s in range(2, stages) for k in range(micro_batches)
                if computed[("B", s - 1, k)][0] < computed[("W", s, k)][0]]
    assert len(deferred) >= micro_batches // 2, deferred


def test_zero_bubble_partition_of_the_backward(zb_h1):
    """B is what the gradients sent to the stage before need; W the rest of the stage's
    backward: its results feed only W or are parameter gradients. Every stage of the tutorial
    has a weight-gradient program, and only stage 0 has no input-gradient program."""
    exe = zb_h1._executable
    low = exe.lowering
    keys = set(low.stage_programs)
    assert {k for k in keys if k[0] == WEIGHT_GRADIENT} == {(WEIGHT_GRADIENT, s) for s in range(4)}
    assert {k for k in keys if k[0] == "bwd"} == {("bwd", s) for s in range(1, 4)}
    grads = {v.id for v in exe.ir.grads.values()}
    for n in exe.ir.nodes:
        if n.pass_ != WEIGHT_GRADIENT:
            continue
        for v in n.outputs:
            users = [m for m in exe.ir.nodes if v in m.inputs]
            assert all(m.pass_ == WEIGHT_GRADIENT and m.stage == n.stage for m in users), (n, users)
            assert users or v.id in grads, n
    for ch in low.channels:   # only B's input gradients go from a backward to another stage
        if ch.src[0] == "bwd" and ch.dst[1] != ch.src[1]:
            assert ch.dst == ("bwd", ch.src[1] - 1) or ch.dst == (WEIGHT_GRADIENT, ch.src[1] - 1)
        assert ch.src[0] != WEIGHT_GRADIENT


def test_zero_bubble_stash_is_accounted(zb_h1):
    """What W needs from its B is kept on the stage's IPU in as many slots as the schedule keeps
    micro-batches between B and W, counted as stashed activations."""
    exe = zb_h1._executable
    low = exe.lowering
    reports = {r.ipu: r for r in exe.engine.memory}
    b_to_w = [ch for ch in low.channels if ch.src[0] == "bwd" and ch.dst == (WEIGHT_GRADIENT, ch.src[1])]
    assert {ch.src[1] for ch in b_to_w} == {1, 2, 3}
    for ch in b_to_w:
        t_b = {op.global_micro_batch: t for t, st in enumerate(exe.schedule.steps) for op in st.ops
               if op.kind == "B" and op.stage == ch.src[1]}
        t_w = {op.global_micro_batch: t for t, st in enumerate(exe.schedule.steps) for op in st.ops
               if op.kind == "W" and op.stage == ch.src[1]}
        in_flight = max(sum(t_b[k] <= t <= t_w[k] for k in t_b) for t in range(exe.schedule.num_steps))
        assert ch.slots == in_flight > 1
        report = reports[low.stage_programs[ch.dst].ipu]
        for buffers in ch.buffers:
            assert len(buffers) == ch.slots
            for t in buffers:
                assert t.var.category == "stashed_activations" and t.var.always_live
                assert report.tensors[t.name].sum() == t.numel * np.dtype(t.dtype).itemsize


class Residual(torch.nn.Module):
    """Three stages with a fused norm backward (input and weight gradients from one op, so in B)
    and a skip connection from stage 0 to stage 2 (stage 2's B sends gradients to two stages)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 5)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        with poptorch.Block("S0"):
            h = torch.relu(self.inp(x))
        with poptorch.Block("S1"):
            g = self.mid(self.norm(h)).tanh()
        with poptorch.Block("S2"):
            logits = self.out(g + h)
            loss = self.loss(logits, y)
        return logits, loss


def train_residual(kind, replicas=1, configure=lambda opts: None):
    torch.manual_seed(0)
    model = Residual()
    opts = poptorch.Options().replicationFactor(replicas)
    opts.Training.gradientAccumulation(6)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*[poptorch.Stage(f"S{s}").ipu(s) for s in range(3)]))
    opts.Emulator.setPipelineSchedule(kind)
    configure(opts)
    training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(1)
    for _ in range(2):
        training(torch.randn(12 * replicas, 12), torch.randint(0, 5, (12 * replicas,)))
    low = training._executable.lowering
    programs = {key: [n.op for n in sp.nodes] for key, sp in low.stage_programs.items()}
    programs["off chip"] = [(ch.src, ch.dst) for ch in low.channels if ch.off_chip]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    training.destroy()
    return programs, params


@pytest.mark.parametrize("kind", ["ZB-H1", "ZB-H2"])
def test_zero_bubble_with_a_fused_norm_backward_and_a_skip_connection(kind):
    reference = train_residual("PopTorch")[1]
    programs, params = train_residual(kind)
    assert_same(params, reference)
    assert "layer_norm_backward" in programs[("bwd", 1)]
    assert all(op != "layer_norm_backward" for op in programs[(WEIGHT_GRADIENT, 1)])
    assert {key[1] for key in programs if key[0] == WEIGHT_GRADIENT} == {0, 1, 2}


def test_zero_bubble_in_strict_mode_with_replicas_and_the_stash_off_chip():
    """Strict mode moves every byte (a B-to-W channel that read the wrong tensor would give wrong
    numbers); with two replicas and the activation stash in Streaming Memory, B-to-W stashes
    included, ZB-H1 still trains to the parameters of PopTorch's schedule."""
    def configure(opts):
        opts.Emulator.setMode("strict")
        opts.TensorLocations.setActivationLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))

    reference = train_residual("PopTorch", 2, configure)[1]
    programs, params = train_residual("ZB-H1", 2, configure)
    assert_same(params, reference)
    assert {(src[0], dst[0]) for src, dst in programs["off chip"]} == {
        ("fwd", "bwd"), ("fwd", WEIGHT_GRADIENT), ("bwd", WEIGHT_GRADIENT),   # and with PopTorch's recomputation:
        ("fwd", RECOMPUTE), (RECOMPUTE, WEIGHT_GRADIENT)}                    # the stage's input, what stage 0's W reads


@pytest.mark.parametrize("kind", ["PopTorch", "ZB-H1"])
def test_views_of_weights_are_taken_again_not_stashed(kind, zb_h1):
    """A weight does not change between a micro-batch's forward and its backward, so a view of it
    the backward reads (the linear layers' transposed weights) is taken again from the weight on
    the stage's IPU, never copied into a stash slot per micro-batch."""
    training = zb_h1 if kind == "ZB-H1" else trained(kind, [0, 1, 2, 3])[0]
    exe = training._executable
    low = exe.lowering
    weight_ids = {v.id for v in exe.ir.params.values()}
    producer = {v.id: n for n in exe.ir.nodes for v in n.outputs}
    for ch in low.channels:
        for v in ch.values:
            assert lowering.weight_view(v, producer, weight_ids) is None, (ch.src, ch.dst, v)
    taken_again = [(sp.key, n.op) for sp in low.stage_programs.values() for chain in sp.weight_views.values()
                   for n in chain]
    assert ("bwd", 2) in {key for key, _ in taken_again} or (WEIGHT_GRADIENT, 2) in {key for key, _ in taken_again}
    assert {op for key, op in taken_again if key[0] != RECOMPUTE} == {"transpose"}
    assert {op for key, op in taken_again if key[0] == RECOMPUTE} <= {"transpose", "reshape"}   # as the forward
