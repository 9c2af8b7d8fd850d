"""Calling a model as its forward is called: keywords, defaults, *args / **kwargs, nested and custom
inputs, calls without tensors, tensors made inside forward; and a later call that differs from
the compiled one is an Error naming what changed."""
import collections
import copy

import pytest
import torch

import poptorch_lite as poptorch


class KeywordsAndDefaults(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, *more, scale=2.0, bias=None, **named):
        y = self.lin(x) * scale
        for i, m in enumerate(more):
            y = y + (i + 1) * m
        if bias is not None:
            y = y + bias
        return y - named["shift"]


def test_keywords_defaults_varargs_and_kwargs():
    torch.manual_seed(0)
    net = KeywordsAndDefaults()
    x, a, b, bias, shift = (torch.randn(4, 3) for _ in range(5))
    model = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(2))
    for _ in range(2):
        torch.testing.assert_close(model(x, a, b, bias=bias, shift=shift),
                                   net(x, a, b, bias=bias, shift=shift), rtol=1e-5, atol=1e-5)


def test_forward_args_kwargs_wrapper():
    class Wrapper(KeywordsAndDefaults):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    net = Wrapper()
    x, shift = torch.randn(2, 3), torch.randn(2, 3)
    model = poptorch.inferenceModel(net)
    torch.testing.assert_close(model(x, scale=3.0, shift=shift), net(x, scale=3.0, shift=shift),
                               rtol=1e-5, atol=1e-5)


def test_nested_inputs_and_dict_order():
    class Nested(torch.nn.Module):
        def forward(self, pair, table):
            a, (b, c) = pair
            return a + b * c - table["x"] / table["y"]

    net = Nested()
    t = [torch.randn(2, 2) for _ in range(5)]
    model = poptorch.inferenceModel(net)
    out = model((t[0], [t[1], t[2]]), {"x": t[3], "y": t[4] + 3})
    torch.testing.assert_close(out, net((t[0], [t[1], t[2]]), {"x": t[3], "y": t[4] + 3}))
    reordered = collections.OrderedDict(y=t[4] + 3, x=t[3])
    torch.testing.assert_close(model((t[0], [t[1], t[2]]), reordered), out)


def test_a_call_that_differs_from_the_compiled_one_is_an_error():
    torch.manual_seed(0)
    model = poptorch.inferenceModel(KeywordsAndDefaults())
    x, a, shift = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    model(x, a, scale=3.0, shift=shift)
    with pytest.raises(poptorch.Error, match="Value mismatch for scale: expected 3.0 but got 2.0"):
        model(x, a, shift=shift)
    with pytest.raises(poptorch.Error, match="Type mismatch for bias: expected None but got torch.Tensor"):
        model(x, a, scale=3.0, bias=x, shift=shift)
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch: expected 2 arguments but got 3"):
        model(x, a, a, scale=3.0, shift=shift)
    with pytest.raises(poptorch.Error, match="Missing arguments: shift"):
        model(x, a, scale=3.0)
    with pytest.raises(poptorch.Error, match="Unexpected arguments: other"):
        model(x, a, scale=3.0, shift=shift, other=x)
    with pytest.raises(poptorch.Error, match=r"Type mismatch for x: expected torch.float32 but got torch.float16"):
        model(x.half(), a, scale=3.0, shift=shift)
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for more\[0\]: expected torch.Size\(\[2, 3\]\) "
                                             r"but got torch.Size\(\[2, 1\]\)"):
        model(x, a[:, :1], scale=3.0, shift=shift)
    model.destroy()  # compiles again for the new call
    torch.testing.assert_close(model(x, shift=shift), KeywordsAndDefaults.forward(model.model, x, shift=shift))


def test_a_missing_argument_is_an_error_naming_it():
    model = poptorch.inferenceModel(KeywordsAndDefaults())
    with pytest.raises(poptorch.Error, match="Mandatory parameter x missing"):
        model(shift=torch.ones(1, 3))


class Batch:
    def __init__(self, data, label):
        self.data, self.label = data, label


class BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.data
        yield struct.label

    def reconstruct(self, original_structure, tensor_iterator):
        return Batch(*tensor_iterator)


def test_custom_argument_types_are_split_into_micro_batches():
    class Model(torch.nn.Module):
        def forward(self, batch):
            assert isinstance(batch, Batch)
            return batch.data * 2 + batch.label

    poptorch.registerCustomArgParser(Batch, BatchParser())
    try:
        model = poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(3))
        data, label = torch.randn(6, 2), torch.randn(6, 2)
        torch.testing.assert_close(model(Batch(data, label)), data * 2 + label)
    finally:
        poptorch.registerCustomArgParser(Batch, None)
    with pytest.raises(poptorch.Error, match="must be an instance of a subclass of poptorch.ICustomArgParser"):
        poptorch.registerCustomArgParser(Batch, object())


def test_outputs_of_custom_argument_types_are_rebuilt_by_their_parser(tmp_path):
    class Model(torch.nn.Module):
        def forward(self, x):
            return [Batch(x * 2, x + 1)], x.sum(1)

    poptorch.registerCustomArgParser(Batch, BatchParser())
    try:
        x = torch.randn(6, 2)
        for run in range(2):  # compiled, then loaded from the executable cache
            opts = poptorch.Options().deviceIterations(3).enableExecutableCaching(str(tmp_path))
            model = poptorch.inferenceModel(Model(), opts)
            [batch], total = model(x)
            assert type(batch) is Batch  # with the device's results, every micro-batch
            torch.testing.assert_close(batch.data, x * 2)
            torch.testing.assert_close(batch.label, x + 1)
            torch.testing.assert_close(total, x.sum(1))
        entries = [p for p in tmp_path.iterdir() if p.suffix != ".lock"]
        assert len(entries) == 1  # the second model's key is the first's
    finally:
        poptorch.registerCustomArgParser(Batch, None)


def test_a_call_without_tensor_inputs():
    class Constant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

        def forward(self, repeat=2):
            return self.w * repeat

    model = poptorch.inferenceModel(Constant(), poptorch.Options().deviceIterations(3))
    torch.testing.assert_close(model(), torch.tensor([2.0, 4.0] * 3))


def test_tensors_made_inside_forward():
    class Offsets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            offset = torch.tensor([1.0, -1.0])
            return self.lin(x) + offset * torch.tensor(3.0), x * torch.tensor([0.5, 2.0])

    torch.manual_seed(0)
    net = Offsets()
    attributes = set(vars(net))
    x = torch.randn(4, 2)
    model = poptorch.inferenceModel(net)
    for actual, expected in zip(model(x), net(x)):
        torch.testing.assert_close(actual, expected)
    assert set(vars(net)) == attributes  # the model gained no attributes from the capture


class Target(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        error = self.lin(x) - torch.tensor([1.0, -1.0])
        return poptorch.identity_loss(error * error, reduction="mean")


def test_training_with_a_tensor_made_inside_forward():
    torch.manual_seed(0)
    net = Target()
    reference = Target()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(4, 2)
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    loss = training(x)
    torch.testing.assert_close(loss, reference(x))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).backward()
    sgd.step()
    torch.testing.assert_close(net.lin.weight, reference.lin.weight, rtol=1e-5, atol=1e-6)


def test_attributes_of_the_wrapped_model():
    torch.manual_seed(0)
    net = Target()
    net.threshold = 0.5
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert model.lin is net.lin and model.threshold == 0.5
    before = net.lin.weight.detach().clone()
    model(torch.randn(2, 2))
    assert not torch.equal(model.lin.weight.detach(), before)  # the trained weight, copied back
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        model.missing  # pylint: disable=pointless-statement


def test_repr_shows_block_annotations():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(2, 2)
            self.second = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.second(self.first(x))

    net = Two()
    assert poptorch.module_repr(net) == repr(net)
    poptorch.BeginBlock(net.second, "late", ipu_id=1)
    text = repr(poptorch.inferenceModel(net))
    assert "(second): BeginBlock(user_id='late', ipu_id=1) Linear(in_features=2, out_features=2, bias=True)" in text
    assert "(first): Linear(" in text


class HalfThenFloat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4, dtype=torch.float16)
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.last = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.first(x).reshape(-1, 1, 2, 2)
        return self.last(self.conv(h).reshape(-1, 2, 4)).sum(dim=1)


def test_a_float16_input_runs_float32_layers_in_float16():
    torch.manual_seed(0)
    net = HalfThenFloat()
    x = torch.randn(3, 4).half()
    out = poptorch.inferenceModel(net)(x)
    assert out.dtype == torch.float16
    with torch.no_grad():  # the float32 layers with their weights cast to float16 for the op
        h = net.first(x).reshape(-1, 1, 2, 2).float()
        h = torch.nn.functional.conv2d(h, net.conv.weight.half().float(), net.conv.bias.half().float(), padding=1)
        h = h.half().float().reshape(-1, 2, 4)
        expected = torch.nn.functional.linear(h, net.last.weight.half().float(), net.last.bias.half().float()).sum(1)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    assert net.conv.weight.dtype == torch.float32


def test_training_a_float32_layer_on_float16_inputs_updates_float32_weights():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            y = self.lin(x).float()
            return poptorch.identity_loss(y * y, reduction="mean")

    torch.manual_seed(0)
    net = Model()
    before = net.lin.weight.detach().clone()
    loss = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))(torch.randn(2, 4).half())
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert net.lin.weight.dtype == torch.float32 and not torch.equal(net.lin.weight.detach(), before)


def test_outputs_keep_their_containers_and_constants_are_returned():
    Pair = collections.namedtuple("Pair", "total constant")

    class Outputs(collections.OrderedDict):
        pass

    class Model(torch.nn.Module):
        def forward(self, x):
            c = torch.tensor([1.0, 2.0])
            out = Outputs()
            out["pair"] = Pair(x + c, c)
            out["list"] = [x * 2]
            return out

    x = torch.randn(6, 2)
    out = poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(3))(x)
    assert type(out) is Outputs and list(out) == ["pair", "list"]
    assert type(out["pair"]) is Pair and type(out["list"]) is list
    torch.testing.assert_close(out["pair"].total, x + torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(out["pair"].constant, torch.tensor([1.0, 2.0] * 3))
    torch.testing.assert_close(out["list"][0], x * 2)


class Mixed(torch.nn.Module):
    def forward(self, x, y):
        z = y * 1.0
        z += x  # in place: the float32 operand is updated, as in PyTorch
        return x + y, z


def test_an_op_mixing_float16_and_float32_follows_pytorchs_promotion(caplog):
    x, y = torch.randn(2, 3).half(), torch.randn(2, 3)
    out, updated = poptorch.inferenceModel(Mixed())(x, y)
    assert out.dtype == torch.float32 and updated.dtype == torch.float32
    torch.testing.assert_close(out, x.float() + y)
    torch.testing.assert_close(updated, y + x.float())
    opts = poptorch.Options()  # PopTorch 3's deprecated setting changes nothing, and says so
    opts.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.FloatDowncastToHalf)
    assert "halfFloatCasting() has no effect" in caplog.text
    out, _ = poptorch.inferenceModel(Mixed(), opts)(x, y)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("conv", [False, True])
def test_matmuls_and_convolutions_run_in_their_activations_dtype(conv):
    """PyTorch refuses a layer whose weights' dtype differs from its input's; PopTorch runs it in
    the input's dtype, and float32 weights given float16 activations still train (in float32)."""
    torch.manual_seed(0)
    layer = torch.nn.Conv1d(4, 5, 2) if conv else torch.nn.Linear(4, 5)
    x = torch.randn(3, 4, 6) if conv else torch.randn(3, 4)
    assert poptorch.inferenceModel(layer)(x.half()).dtype == torch.float16
    half_layer = copy.deepcopy(layer).half()
    out = poptorch.inferenceModel(half_layer)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, copy.deepcopy(half_layer).float()(x))

    class Train(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            y = self.layer(x)
            return y, poptorch.identity_loss((y.float() ** 2).mean(), reduction="none")

    before = layer.weight.detach().clone()
    y, _ = poptorch.trainingModel(Train(), optimizer=torch.optim.SGD(layer.parameters(), lr=0.1))(x.half())
    assert y.dtype == torch.float16 and layer.weight.dtype == torch.float32
    assert not torch.equal(layer.weight.detach(), before)


def test_batch_norm_on_float16_activations_keeps_float32_running_statistics():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.bn = torch.nn.BatchNorm1d(3)

        def forward(self, x):
            y = self.bn(self.lin(x))
            return y, poptorch.identity_loss((y.float() ** 2).mean(), reduction="none")

    torch.manual_seed(0)
    net = Model()
    x = torch.randn(8, 3).half()
    with torch.no_grad():  # the layer's float16 result, as the device computes it
        h = torch.nn.functional.linear(x.float(), net.lin.weight.half().float(), net.lin.bias.half().float()).half()
    before = net.lin.weight.detach().clone()
    y, loss = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))(x)
    assert y.dtype == torch.float16 and loss.dtype == torch.float32
    assert net.bn.running_mean.dtype == torch.float32 and net.bn.weight.dtype == torch.float32
    torch.testing.assert_close(net.bn.running_mean, 0.1 * h.float().mean(0), rtol=1e-2, atol=1e-3)
    assert not torch.equal(net.lin.weight.detach(), before)


def test_keyword_arguments_of_a_kwargs_wrapper_are_named_by_their_keys():
    class Wrapper(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args[0] * kwargs["scale"] + kwargs["shift"]

    model = poptorch.inferenceModel(Wrapper())
    x = torch.ones(2)
    model(x, scale=2, shift=x)
    with pytest.raises(poptorch.Error, match="Value mismatch for scale: expected 2 but got 3"):
        model(x, scale=3, shift=x)
    with pytest.raises(poptorch.Error, match=r"^Missing arguments: shift\. The model"):
        model(x, scale=2)


def test_each_input_is_cut_along_its_own_batch_dimension():
    class Model(torch.nn.Module):
        def forward(self, images, table):
            return images.sum(dim=1), table * 2

    images, table = torch.randn(6, 4), torch.randn(9, 2)
    model = poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(3))
    summed, doubled = model(images, table)  # micro-batches of 2 images and of 3 table rows
    torch.testing.assert_close(summed, images.sum(dim=1))
    torch.testing.assert_close(doubled, table * 2)
    with pytest.raises(poptorch.Error, match=r"Invalid batch dimension 4 for table .*multiple of 3"):
        poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(3))(images, torch.randn(4, 2))


def test_forward_knows_when_it_runs_for_the_ipu():
    class Branches(torch.nn.Module):
        def forward(self, x, y):
            return x + y if poptorch.isRunningOnIpu() else x * y

    net = Branches()
    x, y = torch.tensor([50.0]), torch.tensor([2.0])
    assert poptorch.inferenceModel(net)(x, y).item() == 52.0
    assert net(x, y).item() == 100.0 and not poptorch.isRunningOnIpu()


def test_each_model_holds_its_own_options_with_the_output_mode_resolved():
    opts = poptorch.Options()
    training = poptorch.trainingModel(Target(), opts)
    inference = poptorch.inferenceModel(Target(), opts)
    assert opts.defaultOutputMode()
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All
    for frozen in (opts, training.options):
        with pytest.raises(AttributeError, match="frozen"):
            frozen.randomSeed(42)


def test_compiling_pauses_the_garbage_collector_and_leaves_it_as_it_was(monkeypatch):
    import gc

    from poptorch_lite.runtime import executor

    seen, real = [], executor.compile_model

    def compile_model(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(executor, "compile_model", compile_model)
    assert gc.isenabled()
    poptorch.inferenceModel(torch.nn.Linear(3, 2))(torch.randn(2, 3))
    assert seen == [False] and gc.isenabled()

    def failing(*args, **kwargs):
        raise RuntimeError("compiler failed")

    monkeypatch.setattr(executor, "compile_model", failing)
    with pytest.raises(RuntimeError, match="compiler failed"):
        poptorch.inferenceModel(torch.nn.Linear(3, 2))(torch.randn(2, 3))
    assert gc.isenabled()
    gc.disable()  # a program that turned the collector off keeps it off
    try:
        with executor.collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_zero_sized_input_or_weight_is_an_error_naming_its_shape():
    class Scale(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.w.sum()

    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[0, 2, 5\]\)"):
        poptorch.inferenceModel(Scale(2))(torch.ones(0, 2, 5))
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[0\]\)"):
        poptorch.inferenceModel(Scale(0))(torch.ones(1, 2))
