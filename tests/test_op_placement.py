"""op_placement: every op of a captured model with its block, stage, IPU and phase, under each
execution strategy, for every way of opening blocks."""

import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch_lite
from poptorch_lite.api.blocks import BeginBlock, Block, BlockError, BlockFunction, BlockRef, removeBlocks
from poptorch_lite.api.errors import Error
from poptorch_lite.api.strategies import (
    ParallelPhasedExecution,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    StrategyError,
)
from poptorch_lite.compiler.aten import decompositions
from poptorch_lite.compiler.export import annotation_of, capture_joint
from poptorch_lite.compiler.placement import op_placement

import tutorial_model
from tutorial_model import Network, TrainingModelWithLoss  # the model of Graphcore's MNIST pipelining tutorial


class LossOutsideBlocks(TrainingModelWithLoss):
    def forward(self, args, loss_inputs=None):
        output = self.model(args)
        loss = self.loss(output, loss_inputs)  # LOSS LINE
        return output, loss


def tutorial_strategy(kind=PipelinedExecution):
    return kind(Stage("B1").ipu(0), Stage("B2").ipu(1), Stage("B3").ipu(2), Stage("B4").ipu(3))


IMAGES = torch.randn(8, 1, 28, 28)
LABELS = torch.randint(0, 10, (8,))
TUTORIAL_CALLS = [
    ("module model.layer1.conv (Conv2d)", "B1"),
    ("module model.layer1.pool (MaxPool2d)", "B1"),
    ("module model.layer1.relu (ReLU)", "B1"),
    ("module model.layer2.conv (Conv2d)", "B2"),
    ("module model.layer2.pool (MaxPool2d)", "B2"),
    ("module model.layer2.relu (ReLU)", "B2"),
    ("method .view()", "B3"),
    ("module model.layer3 (Linear)", "B3"),
    ("module model.layer3_act (ReLU)", "B3"),
    ("module model.layer3_dropout (Dropout)", "B3"),
    ("module model.layer4 (Linear)", "B4"),
    ("module model.softmax (LogSoftmax)", "B4"),
]


def expected_tutorial_calls(with_loss):
    listed = TUTORIAL_CALLS + ([("module loss (NLLLoss)", "B4")] if with_loss else [])
    return [(origin, block, int(block[1]) - 1, int(block[1]) - 1, None) for origin, block in listed]


@pytest.mark.parametrize("kind", [PipelinedExecution, ShardedExecution])
def test_tutorial_training_model_placement(kind):
    table = op_placement(TrainingModelWithLoss(Network()), tutorial_strategy(kind), IMAGES, LABELS)
    assert table.by_origin() == expected_tutorial_calls(with_loss=True)
    assert table.placement.schedule_kind == kind.schedule_kind
    assert table.placement.schedule_arguments() == {"num_stages": 4, "stage_ipus": (0, 1, 2, 3)}
    ops = {r.op for r in table if r.origin == "module model.layer1.conv (Conv2d)"}
    assert ops == {"aten.convolution"}  # the ATen ops the compiler lowers


def test_tutorial_inference_model_has_no_loss():
    model = TrainingModelWithLoss(Network())
    table = op_placement(model, tutorial_strategy(), IMAGES)  # labels=None: the branch without a loss
    assert table.by_origin() == expected_tutorial_calls(with_loss=False)
    network_alone = op_placement(model.model, tutorial_strategy(), IMAGES)
    assert [r[1:] for r in network_alone.by_origin()] == [r[1:] for r in table.by_origin()]
    model.eval()  # dropout is no op in inference
    assert "module model.layer3_dropout (Dropout)" not in [r[0] for r in op_placement(model, tutorial_strategy(), IMAGES).by_origin()]


def test_tutorial_table_prints_every_op():
    table = op_placement(TrainingModelWithLoss(Network()), tutorial_strategy(), IMAGES, LABELS)
    lines = str(table).splitlines()
    assert lines[0] == repr(tutorial_strategy())
    assert lines[1].split() == ["node", "op", "from", "block", "stage", "ipu"]
    assert lines[-2].split()[1:] == ["aten.nll_loss_forward", "module", "loss", "(NLLLoss)", "B4", "3", "3"]
    assert len(lines) == 2 + len(table)
    assert all(r.source.startswith(tutorial_model.__file__ + ":") for r in table if r.origin != "module loss (NLLLoss)")


def test_loss_outside_a_block_is_an_error_naming_the_op_line_and_block():
    source = pathlib.Path(__file__).read_text().splitlines()
    line = next(i + 1 for i, text in enumerate(source) if "# LOSS LINE" in text)
    with pytest.raises(BlockError) as error:
        op_placement(LossOutsideBlocks(Network()), tutorial_strategy(), IMAGES, LABELS)
    message = str(error.value)
    assert "module loss (NLLLoss)" in message
    assert f"{__file__}:{line}" in message
    assert "with Block('B4')" in message


def test_top_level_name_is_this_function():
    assert poptorch_lite.op_placement is op_placement


# Block styles


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 2)
        self.loss = nn.MSELoss()

    def forward(self, x, target=None):
        x = self.l3(self.l2(self.l1(x)))
        if target is None:
            return x
        return x, self.loss(x, target)


X = torch.randn(3, 4)
TARGET = torch.randn(3, 2)


def blocks_of(model, *inputs, strategy=None):
    """(call, block, stage, ipu) per call of the model's code."""
    return [row[:4] for row in op_placement(model, strategy, *inputs).by_origin()]


def test_begin_block_on_leaf_modules_lasts_until_next_block():
    model = Chain()
    BeginBlock(model.l2, "second", ipu_id=1)
    BeginBlock(model.l3, ipu_id=2)
    assert blocks_of(model, X, TARGET) == [
        ("module l1 (Linear)", None, 0, 0),
        ("module l2 (Linear)", "second", 1, 1),
        ("module l3 (Linear)", "0", 2, 2),
        ("module loss (MSELoss)", "0", 2, 2),
    ]


def test_begin_block_on_non_leaf_and_root_modules():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.ReLU()
            self.chain = Chain()

        def forward(self, x):
            return self.chain(self.pre(x)) * 2

    model = BeginBlock(Outer(), "root", ipu_id=0)
    BeginBlock(model.chain, "chain", ipu_id=1)
    assert blocks_of(model, X) == [
        ("module pre (ReLU)", "root", 0, 0),
        ("module chain.l1 (Linear)", "chain", 1, 1),
        ("module chain.l2 (Linear)", "chain", 1, 1),
        ("module chain.l3 (Linear)", "chain", 1, 1),
        ("method .mul()", "chain", 1, 1),
    ]


def test_begin_block_module_called_twice_is_one_block():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = BeginBlock(nn.Linear(4, 4), ipu_id=1)
            self.other = BeginBlock(nn.Linear(4, 4), "other", ipu_id=0)

        def forward(self, x):
            return self.shared(self.other(self.shared(x)))

    joint = capture_joint(Twice(), (X,), {}, training=False, decompositions=decompositions())
    addmms = [annotation_of(n).block for n in joint.graph_module.graph.nodes if n.name.startswith("addmm")]
    assert addmms == [BlockRef("0", 1), BlockRef("other", 0), BlockRef("0", 1)]
    # Starting "0" again after "other" sends data back to an earlier stage.
    with pytest.raises(StrategyError, match="module shared .*uses the result of module other"):
        op_placement(Twice(), ShardedExecution(), X)


def test_remove_blocks_returns_ops_to_the_default_region():
    model = Chain()
    BeginBlock(model.l2, "second", ipu_id=1)
    removeBlocks(model)
    assert {r[1] for r in blocks_of(model, X)} == {None}


def test_block_start_keeps_the_loss_in_the_last_block():
    class Started(Chain):
        def forward(self, x, target):
            Block.start("A", ipu_id=0)
            x = self.l2(self.l1(x))
            Block.start("B", ipu_id=1)
            x = self.l3(x)
            return x, self.loss(x, target)

    assert [r[1:] for r in blocks_of(Started(), X, TARGET)] == [
        ("A", 0, 0),
        ("A", 0, 0),
        ("B", 1, 1),
        ("B", 1, 1),
    ]


def test_block_function_and_auto_ids():
    class Decorated(Chain):
        @BlockFunction(ipu_id=1)
        def tail(self, x):
            return self.l3(x)

        def forward(self, x):
            x = self.l1(x)
            Block.useAutoId()
            with Block(ipu_id=0):
                x = self.l2(x)
            with Block("named", ipu_id=1):
                x = torch.relu(x)
            return self.tail(x)

    assert blocks_of(Decorated(), X) == [
        ("module l1 (Linear)", None, 0, 0),
        ("module l2 (Linear)", "0", 0, 0),
        ("function relu()", "named", 1, 1),
        ("module l3 (Linear)", "1", 1, 1),
    ]


def test_op_after_block_closed_is_an_error():
    class Unplaced(Chain):
        def forward(self, x):
            with Block("A", ipu_id=0):
                x = self.l1(x)
            return x + 1

    with pytest.raises(BlockError, match=r"method .add\(\) at .* outside any Block.*'A'"):
        op_placement(Unplaced(), None, X)


def test_unpacking_a_multi_output_op_needs_no_block_but_slicing_does():
    class Unpack(nn.Module):
        def forward(self, x):
            with Block("A", ipu_id=0):
                parts = torch.split(x, 2)
            first = parts[0]
            with Block("B", ipu_id=1):
                return first * 2

    assert blocks_of(Unpack(), X) == [("function split()", "A", 0, 0), ("method .mul()", "B", 1, 1)]

    class Slice(nn.Module):
        def forward(self, x):
            with Block("A", ipu_id=0):
                y = x * 2
            first = y[0]
            with Block("B", ipu_id=1):
                return first * 2

    with pytest.raises(BlockError, match=r"function getitem\(\) at .*outside any Block.*'A'"):
        op_placement(Slice(), None, X)


def test_phases_must_follow_the_data():
    class TwoBlocks(nn.Module):
        def forward(self, x):
            with Block("A", ipu_id=0):
                x = x * 2
            with Block("B", ipu_id=0):
                return x * 3

    with pytest.raises(StrategyError, match="phase 1.*phase 0|phase 0.*phase 1"):
        op_placement(TwoBlocks(), SerialPhasedExecution("B", "A"), X)


def test_parallel_phased_model_from_poptorch_tests():
    """PopTorch's 2x2 parallel phased test: blocks spread over IPU pairs 0-2 / 1-3."""
    n, size = 3, 10

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList(
                [nn.Parameter(torch.rand(size, size)) for _ in range(n * 6)]
            )

        def forward(self, in0, target=None):
            phase = 0
            with Block("0", ipu_id=0):
                ins = torch.split(in0, size)
            weight = iter(self.weights)
            for step in range(n * 3):
                out = []
                for ipu in range(2):
                    x = ins[ipu]
                    ipu = (phase % 2) + ipu * 2
                    with Block(f"{phase}", ipu_id=ipu):
                        x = torch.matmul(next(weight), x)
                        out.append(F.relu(x))
                ins = out[1], out[0]
                if step % 3 != 1:
                    phase += 1
            with Block(f"{n * 2 - 1}", ipu_id=3):
                res = ins[0] + ins[1]
                if target is None:
                    return res
                return res, nn.L1Loss(reduction="mean")(res, target)

    strategy = ParallelPhasedExecution(*[f"{i}" for i in range(2 * n)])
    table = op_placement(Model(), strategy, torch.rand(size * 2, 1), torch.rand(size, 1))
    calls = table.by_origin()
    matmuls = [(ipu, phase) for origin, _, _, ipu, phase in calls if origin == "function matmul()"]
    assert matmuls == [
        (0, 0), (2, 0), (1, 1), (3, 1), (1, 1), (3, 1),
        (0, 2), (2, 2), (1, 3), (3, 3), (1, 3), (3, 3),
        (0, 4), (2, 4), (1, 5), (3, 5), (1, 5), (3, 5),
    ]  # fmt: skip
    assert [(origin, ipu, phase) for origin, _, _, ipu, phase in calls][-2:] == [
        ("method .add()", 3, 5), ("function l1_loss()", 3, 5)]
    assert table.placement.phase_ipus == ((0, 2), (1, 3)) * 3
    assert "phase" in str(table).splitlines()[1]


def test_capture_input_errors():
    with pytest.raises(Error, match="Mandatory parameter x missing"):
        op_placement(Chain())
    with pytest.raises(TypeError, match="ExecutionStrategy"):
        op_placement(Chain(), "pipelined", X)
