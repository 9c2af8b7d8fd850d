"""PyTorch 2 capture (compiler/export.py) and ATen lowering (compiler/aten.py): blocks on forward and
backward nodes, placement on stages, loss rules, what users write in forward, unsupported ops, and
a table of ops computed through the whole compiler against PyTorch eager (forward and gradients)."""
import collections
import pathlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch_lite as poptorch
import poptorch_lite.api.blocks as blocks
from poptorch_lite.api.blocks import Block, BlockError, BlockRef
from poptorch_lite.api.ops import identity_loss
from poptorch_lite.api.strategies import AutoStage, PipelinedExecution, StrategyError
from poptorch_lite.compiler.aten import UnsupportedOpError, decompositions, ops_markdown, ops_table, to_ir
from poptorch_lite.compiler.export import annotation_of, capture_joint, pass_of

from test_compiled_ops import run_op
import tutorial_model
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss


def lower(model, *args, training=True, strategy=TUTORIAL_STRATEGY, trainable=None, **kwargs):
    model.train(training)
    joint = capture_joint(model, args, kwargs, training=training, decompositions=decompositions(),
                          trainable=trainable)
    return to_ir(joint, strategy)[0]


def tutorial_ir(training=True, batch=4, trainable=None):
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    args = (x, y) if training else (x,)
    return lower(TrainingModelWithLoss(Network()), *args, training=training, trainable=trainable)


# ---- blocks and placement ------------------------------------------------------------------------
def test_tutorial_model_lands_on_four_stages():
    ir = tutorial_ir()
    fwd = {}
    for n in ir.nodes:
        assert n.ipu == n.stage
        if n.pass_ == "fwd":
            fwd.setdefault(n.stage, []).append(n.op)
    assert fwd[0] == ["conv", "reshape", "binary", "max_pool", "unary"]
    assert fwd[1] == ["conv", "reshape", "binary", "max_pool", "unary"]
    assert fwd[2] == ["reshape", "transpose", "matmul", "binary", "unary", "dropout"]
    assert fwd[3] == ["transpose", "matmul", "binary", "log_softmax", "nll_loss"]
    assert ir.loss.producer.op == "nll_loss" and ir.loss.shape == ()
    assert sorted(ir.params) == sorted(n for n, _ in TrainingModelWithLoss(Network()).named_parameters())
    assert [v.shape for v in ir.inputs] == [(4, 1, 28, 28), (4,)]
    assert ir.inputs[1].dtype == np.int32  # int64 labels become int32 on the device


def test_backward_nodes_run_on_their_forward_nodes_ipu():
    """PopTorch puts an op's gradient on its forward op's IPU: every backward node made from a
    forward call carries that call's block, and every parameter's gradient is made on the stage
    of the parameter's forward op."""
    ir = tutorial_ir()
    stage_of_block = {f"B{i}": i - 1 for i in range(1, 5)}
    backward = [n for n in ir.nodes if n.pass_ == "bwd"]
    assert {n.op for n in backward} >= {"conv_backward_weights", "max_pool_backward", "log_softmax_backward",
                                        "nll_loss_backward", "dropout_backward", "matmul"}
    for n in backward:
        assert n.stage == stage_of_block[n.block] and n.ipu == n.stage
    assert {n.stage for n in backward if n.op == "conv_backward_weights"} == {0, 1}
    assert [n.stage for n in backward if n.op == "dropout_backward"] == [2]
    for name, g in ir.grads.items():
        users = {n.stage for n in ir.nodes if n.pass_ == "fwd" and ir.params[name] in n.inputs}
        assert g.producer.pass_ == "bwd" and {g.producer.stage} == users, name


def test_joint_graph_nodes_carry_block_source_and_module():
    model = TrainingModelWithLoss(Network()).train()
    joint = capture_joint(model, (torch.randn(2, 1, 28, 28), torch.randint(0, 10, (2,))), {}, training=True,
                          decompositions=decompositions())
    nodes = {n.name: n for n in joint.graph_module.graph.nodes}
    conv = annotation_of(nodes["convolution"])
    assert conv.block == BlockRef("B1") and conv.module == "model.layer1.conv (Conv2d)"
    assert conv.source.startswith(tutorial_model.__file__ + ":")
    grad = annotation_of(nodes["convolution_backward"])
    assert pass_of(nodes["convolution_backward"]) == "bwd" and grad.block == BlockRef("B2")
    assert annotation_of(nodes["nll_loss_forward"]).module == "loss (NLLLoss)"


def test_inference_drops_dropout_and_loss():
    ir = tutorial_ir(training=False)
    assert "dropout" not in [n.op for n in ir.nodes] and ir.loss is None and not ir.grads
    assert ir.outputs.shape == (4, 10)


def test_only_the_gradients_of_trainable_weights_are_built():
    """The data's gradient (layer1's input) and a frozen weight's are never computed."""
    frozen = {"model.layer4.weight", "model.layer4.bias"}
    names = [n for n, _ in TrainingModelWithLoss(Network()).named_parameters()]
    ir = tutorial_ir(trainable=set(names) - frozen)
    assert sorted(ir.grads) == sorted(set(names) - frozen)
    backward = [n for n in ir.nodes if n.pass_ == "bwd"]
    assert [n.stage for n in backward if n.op == "conv_backward_input"] == [1]
    # layer4 (stage 3) only passes the gradient on to layer3: one matmul, no weight gradient
    assert [n.outputs[0].shape for n in backward if n.op == "matmul" and n.stage == 3] == [(4, 256)]


def test_op_after_a_block_closed_is_an_error_naming_the_op_line_and_block():
    class Unplaced(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 4)

        def forward(self, x):
            with Block("A", ipu_id=0):
                x = self.l1(x)
            return x + 1  # OUTSIDE LINE

    line = next(i + 1 for i, t in enumerate(pathlib.Path(__file__).read_text().splitlines()) if "# OUTSIDE LINE" in t)
    with pytest.raises(BlockError, match=rf"^No active Block: .*add\(\) at {__file__}:{line} is outside any Block.*'A'"):
        lower(Unplaced(), torch.randn(2, 4), training=False, strategy=PipelinedExecution())


def test_pipeline_order_is_checked_on_the_captured_graph():
    class Back(nn.Module):
        def forward(self, x):
            Block.useAutoId()
            with Block(ipu_id=0):
                x = x * 2
            with Block(ipu_id=1):
                x = x * 3
            with Block(ipu_id=0):
                x = x * 4
            return x

    with pytest.raises(StrategyError, match=r"uses the result of .*stage 1.*AutoIncrement"):
        lower(Back(), torch.randn(2, 4), training=False, strategy=PipelinedExecution())
    ir = lower(Back(), torch.randn(2, 4), training=False, strategy=PipelinedExecution(AutoStage.AutoIncrement))
    assert [(n.stage, n.ipu) for n in ir.nodes] == [(0, 0), (1, 1), (2, 0)]


def test_begin_block_and_block_function_survive_capture():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 4)
            self.l2 = blocks.BeginBlock(nn.Linear(4, 4), "second", ipu_id=1)

        @blocks.BlockFunction("third", ipu_id=2)
        def tail(self, x, y):
            return F.mse_loss(torch.relu(x), y)

        def forward(self, x, y):
            return self.tail(self.l2(self.l1(x)), y)

    ir = lower(Model(), torch.randn(2, 4), torch.randn(2, 4), strategy=PipelinedExecution())
    fwd = [(n.op, n.block, n.ipu) for n in ir.nodes if n.pass_ == "fwd"][:6]
    assert fwd[:3] == [("transpose", None, 0), ("matmul", None, 0), ("binary", None, 0)]
    assert fwd[3:5] == [("transpose", "second", 1), ("matmul", "second", 1)]
    relu = next(n for n in ir.nodes if n.op == "unary" and n.attrs["fn"] == "relu")
    assert (relu.block, relu.ipu) == ("third", 2)
    relu_grad = next(n for n in ir.nodes if n.op == "binary" and n.attrs["fn"] == "relu_grad")
    assert (relu_grad.block, relu_grad.ipu, relu_grad.pass_) == ("third", 2, "bwd")


# ---- losses --------------------------------------------------------------------------------------
class TwoLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return F.mse_loss(out, y), F.l1_loss(out, y)


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum()


class SummedLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return identity_loss(F.mse_loss(out, y) + F.l1_loss(out, y), reduction="none")


def test_loss_rules_follow_poptorch():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(poptorch.Error, match=r"^Multiple independent losses found in graph\. Graph must have one "
                                             r"final loss\. Wrap final graph loss in poptorch\.identity_loss\."):
        lower(TwoLosses(), x, y, strategy=PipelinedExecution())
    with pytest.raises(poptorch.Error, match="^Couldn't find a loss in graph"):
        lower(NoLoss(), x, strategy=PipelinedExecution())
    ir = lower(SummedLosses(), x, y, strategy=PipelinedExecution())
    assert ir.loss is ir.outputs and set(ir.grads) == {"fc.weight", "fc.bias"}


# ---- what users write in forward -------------------------------------------------------------------
class Flexible(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *extra, scale=2.0, bias=None, **named):
        y = self.fc(x) * scale + torch.tensor([1.0, -1.0, 0.5])
        for e in extra:
            y = y + e
        if bias is not None:
            y = y - bias
        return {"y": y, "n": len(named), "z": named["z"] * 3} if named else y


@pytest.mark.parametrize("args,kwargs", [
    ((torch.randn(2, 4),), {}),
    ((torch.randn(2, 4), torch.randn(2, 3), torch.randn(2, 3)), {"scale": 0.5}),
    ((torch.randn(2, 4),), {"bias": torch.randn(2, 3), "z": torch.randn(2)}),
])
def test_varargs_keywords_defaults_and_constants_capture_like_eager(args, kwargs):
    model = Flexible().eval()
    joint = capture_joint(model, args, kwargs, training=False, decompositions=decompositions())
    flat = [p for p in model.parameters()] + [t for t in list(args) + list(kwargs.values())
                                              if isinstance(t, torch.Tensor)]
    outputs = joint.graph_module(*flat)
    expected = model(*args, **kwargs)
    leaves = outputs[:joint.num_outputs]
    if isinstance(expected, dict):
        assert joint.output_tree["n"] == expected["n"]
        torch.testing.assert_close(leaves[joint.output_tree["y"].index], expected["y"])
        torch.testing.assert_close(leaves[joint.output_tree["z"].index], expected["z"])
    else:
        torch.testing.assert_close(leaves[0], expected)
    ir = to_ir(joint, PipelinedExecution())[0]
    assert len(ir.inputs) == len(flat) - 2
    if isinstance(expected, dict):
        assert ir.outputs["n"] == expected["n"] and ir.outputs["y"].shape == (2, 3)


def test_named_tuple_outputs_keep_their_type():
    Pair = collections.namedtuple("Pair", "out loss")

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            return Pair(out, F.mse_loss(out, y))

    ir = lower(Named(), torch.randn(2, 4), torch.randn(2, 3), strategy=PipelinedExecution())
    assert type(ir.outputs) is Pair and ir.outputs.loss is ir.loss


def test_keyword_arguments_train_through_the_executor():
    class WithKeywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, target=None, weight=torch.tensor(2.0)):
            y = self.fc(x) * weight
            return y if target is None else (y, F.mse_loss(y, target))

    torch.manual_seed(0)
    model = WithKeywords()
    reference = WithKeywords()
    reference.load_state_dict(model.state_dict())
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, t = torch.randn(4, 4), torch.randn(4, 3)
    y, loss = training(x, target=t)
    ry, rloss = reference(x, target=t)
    torch.testing.assert_close(loss, rloss.detach(), rtol=1e-5, atol=1e-6)
    rloss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(model.fc.weight.detach(), reference.fc.weight.detach(), rtol=1e-5, atol=1e-6)


# ---- unsupported ops ---------------------------------------------------------------------------------
class Inner(nn.Module):
    def forward(self, x):
        return torch.nextafter(x.half(), x.half() + 1)  # NEXTAFTER LINE (float32 only on the IPU)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.fc(x))


def test_unsupported_op_names_the_aten_op_the_source_line_and_the_module():
    line = next(i + 1 for i, t in enumerate(pathlib.Path(__file__).read_text().splitlines()) if "# NEXTAFTER LINE" in t)
    with pytest.raises(UnsupportedOpError) as error:
        lower(Outer(), torch.randn(2, 4), training=False, strategy=PipelinedExecution())
    message = str(error.value)
    assert message.startswith("aten op aten.nextafter.default from function nextafter()")
    assert f"at {__file__}:{line}, module inner (Inner)" in message
    assert "not supported" in message


def test_unsupported_op_fails_when_the_model_is_compiled():
    model = poptorch.inferenceModel(Outer(), poptorch.Options())
    with pytest.raises(poptorch.UnsupportedOpError, match=r"aten\.nextafter.*module inner \(Inner\)"):
        model(torch.randn(2, 4))


def test_docs_ops_md_is_generated_from_the_lowering_table():
    docs = pathlib.Path(__file__).parent.parent / "docs" / "ops.md"
    assert docs.read_text() == ops_markdown(), "run: python -m poptorch_lite.compiler.aten > docs/ops.md"


def test_ops_table_lists_every_lowering():
    table = dict(ops_table())
    assert {"aten.convolution", "aten.addmm", "aten.where", "aten.cat", "aten.native_layer_norm",
            "aten.max_pool2d_with_indices_backward", "aten.nll_loss_forward"} <= set(table)
    assert all(how for how in table.values())


def test_the_decomposition_table_is_built_once_and_again_when_lowerings_change(monkeypatch):
    import poptorch_lite.compiler.aten as aten_module
    first, second = decompositions(), decompositions()
    assert first == second and first is not second  # each caller gets its own copy of one table
    assert aten_module._DECOMPOSITIONS[1] is not first
    built = aten_module._DECOMPOSITIONS
    assert decompositions() == first and aten_module._DECOMPOSITIONS is built
    # an op that gains a lowering leaves the table
    decomposed = torch.ops.aten.hardswish.default
    assert decomposed in first
    monkeypatch.setitem(aten_module.LOWERINGS, decomposed.overloadpacket, lambda c, x: x)
    assert decomposed not in decompositions()
    monkeypatch.delitem(aten_module.LOWERINGS, decomposed.overloadpacket)
    assert decompositions().keys() == first.keys()  # rebuilt: torch makes new partials for its entries


# ---- numbers: forward and gradients against PyTorch eager --------------------------------------------
OPS = {
    "cat": (lambda a, b: torch.cat([a, b * 2], 1), [(3, 4), (3, 2)]),
    "stack": (lambda a, b: torch.stack([a, b], 0), [(3, 4), (3, 4)]),
    "split": (lambda x: torch.split(x, 2, 1)[1] * 3, [(4, 5)]),
    "select": (lambda x: x[1] * x[:, 2:3].sum(), [(4, 5)]),
    "expand": (lambda x: x.expand(3, 4, 5) * 2, [(4, 5)]),
    "pad": (lambda x: F.pad(x, (1, 2)), [(4, 5)]),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.7), [(4, 5)]),
    "hardtanh": (F.hardtanh, [(4, 5)]),
    "where": (lambda x: torch.where(x > 0, x, 0.1 * x), [(4, 5)]),
    "leaky_relu": (F.leaky_relu, [(4, 5)]),
    "silu": (F.silu, [(4, 5)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), [(4, 5)]),
    "sign": (lambda x: torch.sign(x) * x, [(4, 5)]),
    "minimum": (torch.minimum, [(4, 5), (4, 5)]),
    "rsqrt": (lambda x: torch.rsqrt(x.abs() + 1), [(4, 5)]),
    "var": (lambda x: x.var(1), [(4, 5)]),
    "amax": (lambda x: x.amax(1), [(4, 5)]),
    "normalize": (lambda x: F.normalize(x, dim=1), [(4, 5)]),
    "softmax_by_hand": (lambda x: x.exp() / x.exp().sum(-1, keepdim=True), [(4, 5)]),
    "baddbmm": (torch.baddbmm, [(2, 3, 4), (2, 3, 5), (2, 5, 4)]),
    "matmul_3d_2d": (lambda a, b: a @ b, [(2, 3, 4), (4, 5)]),
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(2, 3, 4), (2, 3, 4), (2, 3, 4)]),
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), [(2, 3, 8), (4, 3, 3)]),
    "batch_norm_1d": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [(6, 3), (3,), (3,)]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [(2, 4, 3, 3), (4,), (4,)]),
    "layer_norm_3d": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [(2, 3, 4), (4,), (4,)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_pytorch_forward_and_gradients(name):
    fn, shapes = OPS[name]
    run_op(fn, *shapes, rtol=1e-4, atol=1e-5)


def test_random_ops_draw_from_the_ipus_generator():
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x), torch.randn_like(x) * 2 + 1, torch.empty_like(x).bernoulli_(0.3)

    model = poptorch.inferenceModel(Noisy(), poptorch.Options().randomSeed(3))
    uniform, normal, coins = model(torch.zeros(4, 5000))
    assert 0 <= uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    assert abs(normal.mean() - 1) < 0.05 and abs(normal.std() - 2) < 0.05
    assert set(coins.unique().tolist()) == {0.0, 1.0} and abs(coins.mean() - 0.3) < 0.01
    again = model(torch.zeros(4, 5000))[0]
    assert not torch.equal(again, uniform)   # a new draw every call


def test_data_dependent_shapes_are_unsupported_ops_named_at_their_source_line():
    """Fake tensors trace them with unbacked sizes; the lowering refuses the op."""
    class Masked(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()  # MASK LINE

    line = next(i + 1 for i, t in enumerate(pathlib.Path(__file__).read_text().splitlines()) if "# MASK LINE" in t)
    expected = rf"aten op aten\.index\.Tensor from function getitem\(\) at {__file__}:{line}"
    with pytest.raises(UnsupportedOpError, match=expected):
        lower(Masked(), torch.randn(2, 4), training=False, strategy=PipelinedExecution())


class Encoder(nn.Module):
    """Embedding, two torch.nn.TransformerEncoderLayers (multi-head attention, LayerNorm, GELU and
    ReLU feed-forwards) and a head, over two IPUs."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.l1 = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, activation="gelu")
        self.l2 = blocks.BeginBlock(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                    "second", ipu_id=1)
        self.head = nn.Linear(16, 50)

    def forward(self, ids, labels):
        logits = self.head(self.l2(self.l1(self.emb(ids))))
        return logits, F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1))


def test_transformer_encoder_pipelined_over_two_ipus_trains_like_pytorch():
    torch.manual_seed(0)
    model = Encoder()
    reference = Encoder()
    reference.load_state_dict(model.state_dict())
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, labels = torch.randint(0, 50, (6, 5)), torch.randint(0, 50, (6, 5))
    training(ids, labels)
    reference(ids, labels)[1].backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert {n.ipu for n in training._executable.ir.nodes} == {0, 1}


def test_bitwise_ops_of_integers_and_bools_match_torch():
    class Model(nn.Module):
        def forward(self, x, n):
            i, j = (x[0] * 100).int(), (x[1] * 100).int()
            return i & n.int(), i | 5, i ^ j, (x[0] > 0.5) ^ (x[1] > 0.5), (x[0] > 0.2) & (x[1] > 0.7)

    torch.manual_seed(0)
    args = (torch.rand(2, 10), torch.LongTensor([10]))
    for got, want in zip(poptorch.inferenceModel(Model())(*args), Model()(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("p", [2.0, 3.0, 1.0, 0.0, float("inf")])
def test_cdist_matches_torch_and_trains(p):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, y):
            d = torch.cdist(self.lin(x), y, p)
            return d, poptorch.identity_loss(d.sum(), reduction="mean")

    torch.manual_seed(0)
    x, y = torch.rand(2, 3, 4), torch.rand(2, 5, 4)
    model = Model()
    torch.testing.assert_close(poptorch.inferenceModel(model)(x, y)[0], model(x, y)[0], rtol=1e-4, atol=1e-5)
    if p in (2.0, 3.0):
        before = model.lin.weight.detach().clone()
        poptorch.trainingModel(model)(x, y)
        assert not torch.equal(model.lin.weight.detach(), before)


def test_one_hot_needs_its_number_of_classes():
    class OneHot(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.num_classes = num_classes

        def forward(self, x):
            return F.one_hot(x, num_classes=self.num_classes).float()

    x = torch.tensor([0, 2, 1])
    with pytest.raises(poptorch.Error, match=r"^OneHot num classes must be specified and must be constant\..*"
                                             r"num_classes="):
        lower(OneHot(-1), x, training=False, strategy=PipelinedExecution())
    model = poptorch.inferenceModel(OneHot(4))
    torch.testing.assert_close(model(x), F.one_hot(x, 4).float())
