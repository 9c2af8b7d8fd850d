"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) as device loops over time steps: inference outputs and
final states, training losses and weights against PyTorch (pipelined over two IPUs too), every
option of the modules, strict and fast modes, compile time independent of the sequence length."""
import copy
import time

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device.program import walk
from poptorch_lite.compiler import recurrent

KINDS = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}


def flat(out):
    """A recurrent module's (output, h_n) or (output, (h_n, c_n)) as a list of tensors."""
    y, state = out
    return [y, *(state if isinstance(state, tuple) else (state,))]


def repeats(pm) -> list:
    return [p for prog in pm._executable.engine.programs for p in walk(prog) if isinstance(p, ip.Repeat)]


CONFIGS = [
    ("lstm", {}), ("gru", {}), ("rnn", {}), ("rnn", {"nonlinearity": "relu"}),
    ("lstm", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    ("lstm", {"proj_size": 3, "bidirectional": True}), ("lstm", {"bias": False}),
    ("gru", {"num_layers": 2, "bidirectional": True, "bias": False}), ("gru", {"batch_first": True}),
    ("rnn", {"num_layers": 3, "nonlinearity": "relu", "bidirectional": True, "batch_first": True}),
]


@pytest.mark.parametrize("kind,options", CONFIGS)
def test_inference_outputs_and_states_match_pytorch(kind, options):
    torch.manual_seed(0)
    m = KINDS[kind](4, 6, **options).eval()
    x = torch.randn(2, 5, 4) if options.get("batch_first") else torch.randn(5, 2, 4)
    with torch.no_grad():
        expected = flat(m(x))
    for got, want in zip(flat(poptorch.inferenceModel(m)(x)), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_initial_states_and_unbatched_sequences(kind):
    torch.manual_seed(1)
    m = KINDS[kind](3, 5, num_layers=2).eval()
    x = torch.randn(4, 2, 3)
    h0 = torch.randn(2, 2, 5)
    state = (h0, torch.randn(2, 2, 5)) if kind == "lstm" else h0

    class WithState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, *state):
            return self.m(x, state if kind == "lstm" else state[0])

    args = (x, *state) if kind == "lstm" else (x, state)
    with torch.no_grad():
        expected = flat(m(x, state))
    for got, want in zip(flat(poptorch.inferenceModel(WithState())(*args)), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    unbatched = torch.randn(4, 3)
    with torch.no_grad():
        expected = flat(m(unbatched))
    for got, want in zip(flat(poptorch.inferenceModel(m)(unbatched)), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class Classifier(torch.nn.Module):
    def __init__(self, kind, **options):
        super().__init__()
        self.rnn = KINDS[kind](4, 6, **options)
        width = options.get("proj_size") or 6
        self.head = torch.nn.Linear(width * (2 if options.get("bidirectional") else 1), 3)
        self.batch_first = options.get("batch_first", False)

    def forward(self, x, y):
        out = self.rnn(x if self.batch_first else x.transpose(0, 1))[0]
        logits = self.head(out[:, -1] if self.batch_first else out[-1])
        return logits, torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("kind,options", CONFIGS)
def test_training_matches_pytorch(kind, options):
    torch.manual_seed(2)
    net = Classifier(kind, **options)
    ref = copy.deepcopy(net)
    x, y = torch.randn(2, 5, 4), torch.tensor([0, 2])
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    before = copy.deepcopy(net.state_dict())
    for _ in range(3):
        _, loss = model(x, y)
        opt.zero_grad()
        _, expected = ref(x, y)
        expected.backward()
        opt.step()
        assert abs(float(loss) - expected.item()) < 1e-6
    for (name, p), q in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        # (a reversed direction's recurrent weights get no gradient when only its first step, from a zero
        # state, is read: then neither model changes them)
        assert torch.equal(p, before[name]) == torch.equal(q, before[name]), name
    assert not all(torch.equal(p, before[name]) for name, p in net.state_dict().items())


class Sequence(torch.nn.Module):
    """Embedding and a first recurrent layer (or two) on IPU 0, a second one and the head on IPU 1."""

    def __init__(self, kind, layers, bidirectional, batch_first, vocab=11, width=6, hidden=8):
        super().__init__()
        cls = KINDS[kind]
        self.batch_first = batch_first
        self.emb = torch.nn.Embedding(vocab, width)
        self.first = cls(width, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        self.second = cls(hidden * (2 if bidirectional else 1), hidden, batch_first=batch_first)
        self.head = torch.nn.Linear(hidden, 3)
        poptorch.BeginBlock(self.emb, "embedding", ipu_id=0)
        poptorch.BeginBlock(self.second, "second", ipu_id=1)

    def forward(self, tokens, labels):   # tokens [B, T]: PopTorch cuts micro-batches along dim 0
        h = self.first(self.emb(tokens if self.batch_first else tokens.t()))[0]
        h = self.second(h)[0]
        logits = self.head(h[:, -1] if self.batch_first else h[-1])
        return logits, torch.nn.functional.cross_entropy(logits, labels)


PIPELINED = [("lstm", 1, False, False), ("lstm", 2, True, True), ("gru", 1, True, False), ("gru", 2, False, True),
             ("rnn", 2, True, False), ("rnn", 1, False, True)]


@pytest.mark.parametrize("kind,layers,bidirectional,batch_first", PIPELINED)
def test_pipelined_training_over_two_ipus_matches_pytorch(kind, layers, bidirectional, batch_first):
    torch.manual_seed(3)
    net = Sequence(kind, layers, bidirectional, batch_first)
    ref = copy.deepcopy(net)
    accumulation, micro, steps = 4, 2, 7
    opts = poptorch.Options().outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(accumulation)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.Stage("embedding").ipu(0),
                                                          poptorch.Stage("second").ipu(1)))
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.3))
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    device, host = [], []
    for call in range(2):
        gen = torch.Generator().manual_seed(call)
        tokens = torch.randint(0, 11, (accumulation * micro, steps), generator=gen)
        labels = torch.randint(0, 3, (accumulation * micro,), generator=gen)
        device += model(tokens, labels)[1].tolist()
        opt.zero_grad()
        for k in range(accumulation):
            part = slice(k * micro, (k + 1) * micro)
            _, loss = ref(tokens[part], labels[part])
            (loss / accumulation).backward()
            host.append(loss.item())
        opt.step()
    np.testing.assert_allclose(device, host, rtol=1e-5, atol=1e-6)
    ipus = {r.body.ipus().pop() for r in repeats(model)}
    assert ipus == {0, 1}   # each layer's loops (forward and backward) run on its own IPU
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_strict_and_fast_modes_agree(kind):
    torch.manual_seed(4)
    net = Classifier(kind, bidirectional=True)
    x, y = torch.randn(2, 5, 4), torch.tensor([1, 2])
    results = {}
    for mode in ("fast", "strict"):
        model = copy.deepcopy(net)
        opts = poptorch.Options()
        opts.Emulator.setMode(mode)
        trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
        losses = [float(trained(x, y)[1]) for _ in range(2)]
        results[mode] = (losses, [p.detach().clone() for p in model.parameters()], trained.last_run.cycles)
    np.testing.assert_allclose(results["fast"][0], results["strict"][0], rtol=1e-6)
    for a, b in zip(results["fast"][1], results["strict"][1]):   # float32 within 1e-6 relative
        assert float((a - b).norm()) <= 1e-6 * float(b.norm())
    assert results["fast"][2] == results["strict"][2]


def test_a_layer_is_a_loop_over_one_time_step_costing_its_steps():
    torch.manual_seed(5)
    net = Classifier("lstm")
    x, y = torch.randn(2, 9, 4), torch.tensor([0, 1])
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    forward, backward = sorted(repeats(model), key=lambda r: len(list(walk(r.body))))
    assert forward.count == backward.count == 9
    engine = model._executable.engine
    for r in (forward, backward):
        assert engine.cost(r).total == 9 * engine.cost(r.body).total
    # in inference nothing is saved for a backward: the loop carries the step, h, c and the outputs
    inference = poptorch.inferenceModel(Classifier("lstm"))
    inference(x, y)
    (loop,) = [n for n in inference._executable.ir.nodes if n.op == "loop"]
    assert len(loop.attrs["carried"]) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_128_time_steps_compile_in_about_the_time_of_8(kind):
    def compile_seconds(steps):
        torch.manual_seed(6)
        net = Classifier(kind)
        model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        start = time.perf_counter()
        model.compile(torch.randn(4, steps, 4), torch.zeros(4, dtype=torch.long))
        return time.perf_counter() - start, model

    compile_seconds(8)   # warm: kernels, decompositions
    short, short_model = compile_seconds(8)
    long, long_model = compile_seconds(128)
    assert long < 4 * short + 1.0, (short, long)
    assert [r.count for r in repeats(long_model)] == [128, 128]
    # one body of the same ops (its programs differ only where the tile plan of a longer sequence
    # moves an operand the shorter one had in place)
    ir_body = lambda m: sorted(len(n.attrs["body"]) for n in m._executable.ir.nodes if n.op == "loop")  # noqa: E731
    assert ir_body(short_model) == ir_body(long_model)
    body = lambda m: sorted(len(list(walk(r.body))) for r in repeats(m))  # noqa: E731
    for short_body, long_body in zip(body(short_model), body(long_model)):
        assert long_body <= 1.2 * short_body


def test_dropout_between_layers_is_the_ipus():
    torch.manual_seed(7)
    net = Classifier("gru", num_layers=3, dropout=0.5)
    x, y = torch.randn(4, 5, 4), torch.tensor([0, 1, 2, 0])
    trained = copy.deepcopy(net)
    model = poptorch.trainingModel(trained, optimizer=torch.optim.SGD(trained.parameters(), lr=0.0))
    model(x, y)
    ir_ops = [n.op for n in model._executable.ir.nodes]
    assert ir_ops.count("dropout") == 2     # between the three layers, not after the last
    net.eval()
    with torch.no_grad():
        expected = net(x, y)[0]
    torch.testing.assert_close(poptorch.inferenceModel(net)(x, y)[0], expected, rtol=1e-5, atol=1e-6)


def test_packed_sequences_are_refused_at_compile_time():
    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(3, 4)

        def forward(self, x):
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, [3, 2], enforce_sorted=True)
            return self.rnn(packed)[1][0]

    class Given(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(3, 4)

        def forward(self, packed):
            return self.rnn(packed)[1]

    with pytest.raises(poptorch.Error, match="PackedSequence.*pad_sequence"):
        poptorch.inferenceModel(Packed())(torch.randn(3, 2, 3))
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 3), [3, 2])
    with pytest.raises(poptorch.Error, match="PackedSequence.*pad_sequence"):
        poptorch.inferenceModel(Given())(packed)


@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_cells_decompose_into_core_ops(cell):
    torch.manual_seed(8)

    class Steps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell(3, 4)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x, y):
            state = None
            for t in range(x.shape[1]):
                state = self.cell(x[:, t], state)
            h = state[0] if isinstance(state, tuple) else state
            logits = self.head(h)
            return logits, torch.nn.functional.cross_entropy(logits, y)

    net = Steps()
    ref = copy.deepcopy(net)
    x, y = torch.randn(2, 3, 3), torch.tensor([0, 1])
    _, loss = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5))(x, y)
    assert abs(float(loss) - float(ref(x, y)[1])) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_ops_run_on_the_cpu_with_pytorchs_gradients(kind):
    """The captured ops' own CPU kernels (the reference the device loops are checked against)."""
    torch.manual_seed(9)
    m = KINDS[kind](3, 4)
    x = torch.randn(5, 2, 3, requires_grad=True)
    h0 = torch.randn(2, 4, requires_grad=True)
    w = [p for p in m.parameters()]
    if kind == "lstm":
        c0 = torch.randn(2, 4, requires_grad=True)
        out = recurrent.lstm_layer(x, h0, c0, *w, None, True)
        states = (h0.unsqueeze(0), c0.unsqueeze(0))
        ref = m(x.flip(0), states)
        expected = [ref[0].flip(0), ref[1][0][0], ref[1][1][0]]
        got = list(out[:3])
    elif kind == "gru":
        out = recurrent.gru_layer(x, h0, *w, True)
        ref = m(x.flip(0), h0.unsqueeze(0))
        expected, got = [ref[0].flip(0), ref[1][0]], list(out[:2])
    else:
        out = recurrent.rnn_layer(x, h0, *w, "tanh", True)
        ref = m(x.flip(0), h0.unsqueeze(0))
        expected, got = [ref[0].flip(0), ref[1][0]], list(out)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(sum(g.sum() for g in got), [x, h0] + w)
    expected_grads = torch.autograd.grad(sum(e.sum() for e in expected), [x, h0] + w)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
