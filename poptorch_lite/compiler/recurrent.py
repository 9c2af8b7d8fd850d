"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as device loops over time steps.

PyTorch runs them through fused kernels (``torch.lstm`` reaches ``mkldnn_rnn_layer`` on the CPU,
which has no decomposition); decomposed instead, a layer would unroll into one copy of its cell
per time step. Here each layer and direction is captured as one op of our own, with its gradient
another op (PyTorch's own autograd of the same computation when run on the CPU), and lowered to
a loop whose body is one time step:

- ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (what the modules call) are traced as the
  stack of layers and directions PyTorch composes: per layer and direction one
  ``poptorch_lite::lstm_layer`` (``gru_layer``, ``rnn_layer``) over the whole sequence, the
  directions' outputs concatenated, dropout between layers (the IPU's generator), ``batch_first``
  as views; the final states stacked. Every option of the modules: ``num_layers``,
  ``bidirectional``, ``batch_first``, ``bias``, ``dropout``, LSTM's ``proj_size``. A
  ``PackedSequence`` (variable lengths: shapes that depend on the data) is refused at compile
  time, as PopTorch does not support it either: pad the sequences instead.
- The forward (IR): the input projection of every time step as one matrix product before the loop
  (``x @ W_ih^T + b``); then a loop of T iterations whose body reads its step of the projection
  (``dynamic_slice`` at the step counter), adds the recurrent product ``h @ W_hh^T``, applies the
  gates and writes the step's output (and, for training, its gate pre-activations and cell
  state) with ``dynamic_update``. A reversed direction counts its steps down.
- The backward (IR): a loop over the time steps in the opposite order carrying the gradients of
  the states and accumulating the bias gradients; each step recomputes its gates from the saved
  pre-activations and writes the gradient of its pre-activations. The weight gradients then come
  from one product each over all steps (``dG^T x``, ``dG^T h_prev``), as does the input gradient
  (``dG W_ih``).
Outputs nobody reads (the saved gates in inference, gradients of frozen weights or of the data)
are not computed.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ..api.errors import Error
from .control_flow import loop
from .ir import Value

aten = torch.ops.aten

# =========================================================================================
# Capture: one op per layer and direction, its gradient another
# =========================================================================================


def _linear(x, w, b=None):
    y = x @ w.transpose(0, 1)
    return y if b is None else y + b


def _steps(T: int, reverse: bool):
    return range(T - 1, -1, -1) if reverse else range(T)


def lstm_reference(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse):
    """One LSTM layer and direction over [T, B, I]: (outputs, h_T, c_T, gate pre-activations, cells)."""
    gx = _linear(x, w_ih, b_ih)
    h, c = h0, c0
    ys, gates, cells = [None] * x.shape[0], [None] * x.shape[0], [None] * x.shape[0]
    for t in _steps(x.shape[0], reverse):
        g = gx[t] + _linear(h, w_hh, b_hh)
        i, f, gg, o = g.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        h = torch.sigmoid(o) * torch.tanh(c)
        if w_hr is not None:
            h = _linear(h, w_hr)
        ys[t], gates[t], cells[t] = h, g, c
    return torch.stack(ys), h, c, torch.stack(gates), torch.stack(cells)


def gru_reference(x, h0, w_ih, w_hh, b_ih, b_hh, reverse):
    """One GRU layer and direction: (outputs, h_T, reset and update gates, new gates, h W_hn^T + b_hn)."""
    gx = _linear(x, w_ih, b_ih)
    h = h0
    H = h0.shape[-1]
    ys, rzs, ns, hns = ([None] * x.shape[0] for _ in range(4))
    for t in _steps(x.shape[0], reverse):
        gh = _linear(h, w_hh, b_hh)
        rz = torch.sigmoid(gx[t, :, :2 * H] + gh[:, :2 * H])
        r, z = rz[:, :H], rz[:, H:]
        n = torch.tanh(gx[t, :, 2 * H:] + r * gh[:, 2 * H:])
        h = n + z * (h - n)
        ys[t], rzs[t], ns[t], hns[t] = h, rz, n, gh[:, 2 * H:]
    return torch.stack(ys), h, torch.stack(rzs), torch.stack(ns), torch.stack(hns)


def rnn_reference(x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse):
    """One Elman RNN layer and direction (tanh or relu): (outputs, h_T)."""
    act = torch.tanh if nonlinearity == "tanh" else torch.relu
    gx = _linear(x, w_ih, b_ih)
    h = h0
    ys = [None] * x.shape[0]
    for t in _steps(x.shape[0], reverse):
        h = act(gx[t] + _linear(h, w_hh, b_hh))
        ys[t] = h
    return torch.stack(ys), h


def _grads(forward, inputs, wanted, outputs_grads):
    """PyTorch's autograd of `forward(*inputs)`'s first outputs w.r.t. the `wanted` inputs (by
    torch.func: an op's kernel runs below the autograd dispatch keys, where torch.autograd records nothing)."""
    at = [i for i, w in enumerate(wanted) if w]

    def f(*chosen):
        args = list(inputs)
        for i, t in zip(at, chosen):
            args[i] = t
        return tuple(forward(*args)[:len(outputs_grads)])

    _, vjp = torch.func.vjp(f, *(inputs[i] for i in at))
    it = iter(vjp(tuple(outputs_grads)))
    return [next(it) if w else None for w in wanted]


def _or_zeros(g, like):
    return torch.zeros_like(like) if g is None else g


# ---- LSTM ---------------------------------------------------------------------------------------------
@torch.library.custom_op("poptorch_lite::lstm_layer", mutates_args=())
def lstm_layer(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
               b_ih: torch.Tensor | None, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None,
               reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.clone() for t in lstm_reference(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse))


@lstm_layer.register_fake
def _lstm_fake(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse):
    T, B = x.shape[:2]
    return (x.new_empty(T, B, h0.shape[-1]), torch.empty_like(h0), torch.empty_like(c0),
            x.new_empty(T, B, w_ih.shape[0]), x.new_empty(T, B, c0.shape[-1]))


@torch.library.custom_op("poptorch_lite::lstm_layer_backward", mutates_args=())
def lstm_layer_backward(dy: torch.Tensor, dh: torch.Tensor, dc: torch.Tensor, x: torch.Tensor, h0: torch.Tensor,
                        c0: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None,
                        b_hh: torch.Tensor | None, w_hr: torch.Tensor | None, y: torch.Tensor, gates: torch.Tensor,
                        cells: torch.Tensor, reverse: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    """The gradients (of x, h0, c0, W_ih, W_hh, the biases, W_hr): on the CPU PyTorch's autograd of
    the layer; on the device a loop over the steps in reverse from the saved gates and cells."""
    H4 = w_ih.shape[0]
    has_bias = b_ih is not None
    inputs = [x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse]
    wanted = [True, True, True, True, True, has_bias, has_bias, w_hr is not None, False]
    g = _grads(lstm_reference, inputs, wanted, [dy, dh, dc])
    db = g[5] if has_bias else x.new_zeros(H4)
    dw_hr = g[7] if w_hr is not None else x.new_zeros(0)
    return (_or_zeros(g[0], x), _or_zeros(g[1], h0), _or_zeros(g[2], c0), _or_zeros(g[3], w_ih),
            _or_zeros(g[4], w_hh), db, dw_hr)


@lstm_layer_backward.register_fake
def _lstm_backward_fake(dy, dh, dc, x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, y, gates, cells, reverse):
    return (torch.empty_like(x), torch.empty_like(h0), torch.empty_like(c0), torch.empty_like(w_ih),
            torch.empty_like(w_hh), x.new_empty(w_ih.shape[0]),
            torch.empty_like(w_hr) if w_hr is not None else x.new_empty(0))


def _lstm_setup(ctx, inputs, output):
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse = inputs
    y, _, _, gates, cells = output
    ctx.save_for_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, y, gates, cells)
    ctx.has_bias, ctx.has_proj, ctx.reverse = b_ih is not None, w_hr is not None, reverse


def _lstm_backward(ctx, dy, dh, dc, _dgates, _dcells):
    dx, dh0, dc0, dw_ih, dw_hh, db, dw_hr = lstm_layer_backward(dy, dh, dc, *ctx.saved_tensors, ctx.reverse)
    bias = (db, db) if ctx.has_bias else (None, None)
    return dx, dh0, dc0, dw_ih, dw_hh, *bias, dw_hr if ctx.has_proj else None, None


lstm_layer.register_autograd(_lstm_backward, setup_context=_lstm_setup)


# ---- GRU ----------------------------------------------------------------------------------------------
@torch.library.custom_op("poptorch_lite::gru_layer", mutates_args=())
def gru_layer(x: torch.Tensor, h0: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None,
              b_hh: torch.Tensor | None, reverse: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.clone() for t in gru_reference(x, h0, w_ih, w_hh, b_ih, b_hh, reverse))


@gru_layer.register_fake
def _gru_fake(x, h0, w_ih, w_hh, b_ih, b_hh, reverse):
    T, B = x.shape[:2]
    H = h0.shape[-1]
    return (x.new_empty(T, B, H), torch.empty_like(h0), x.new_empty(T, B, 2 * H), x.new_empty(T, B, H),
            x.new_empty(T, B, H))


@torch.library.custom_op("poptorch_lite::gru_layer_backward", mutates_args=())
def gru_layer_backward(dy: torch.Tensor, dh: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, w_ih: torch.Tensor,
                       w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None, y: torch.Tensor,
                       rz: torch.Tensor, n: torch.Tensor, hn: torch.Tensor, reverse: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (of x, h0, W_ih, W_hh, b_ih, b_hh): on the CPU PyTorch's autograd of the layer;
    on the device a loop over the steps in reverse from the saved gates."""
    H3 = w_ih.shape[0]
    has_bias = b_ih is not None
    inputs = [x, h0, w_ih, w_hh, b_ih, b_hh, reverse]
    wanted = [True, True, True, True, has_bias, has_bias, False]
    g = _grads(gru_reference, inputs, wanted, [dy, dh])
    return (_or_zeros(g[0], x), _or_zeros(g[1], h0), _or_zeros(g[2], w_ih), _or_zeros(g[3], w_hh),
            g[4] if has_bias else x.new_zeros(H3), g[5] if has_bias else x.new_zeros(H3))


@gru_layer_backward.register_fake
def _gru_backward_fake(dy, dh, x, h0, w_ih, w_hh, b_ih, b_hh, y, rz, n, hn, reverse):
    return (torch.empty_like(x), torch.empty_like(h0), torch.empty_like(w_ih), torch.empty_like(w_hh),
            x.new_empty(w_ih.shape[0]), x.new_empty(w_ih.shape[0]))


def _gru_setup(ctx, inputs, output):
    x, h0, w_ih, w_hh, b_ih, b_hh, reverse = inputs
    y, _, rz, n, hn = output
    ctx.save_for_backward(x, h0, w_ih, w_hh, b_ih, b_hh, y, rz, n, hn)
    ctx.has_bias, ctx.reverse = b_ih is not None, reverse


def _gru_backward(ctx, dy, dh, _drz, _dn, _dhn):
    dx, dh0, dw_ih, dw_hh, db_ih, db_hh = gru_layer_backward(dy, dh, *ctx.saved_tensors, ctx.reverse)
    bias = (db_ih, db_hh) if ctx.has_bias else (None, None)
    return dx, dh0, dw_ih, dw_hh, *bias, None


gru_layer.register_autograd(_gru_backward, setup_context=_gru_setup)


# ---- Elman RNN ----------------------------------------------------------------------------------------
@torch.library.custom_op("poptorch_lite::rnn_layer", mutates_args=())
def rnn_layer(x: torch.Tensor, h0: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None,
              b_hh: torch.Tensor | None, nonlinearity: str, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.clone() for t in rnn_reference(x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse))


@rnn_layer.register_fake
def _rnn_fake(x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse):
    return x.new_empty(*x.shape[:2], h0.shape[-1]), torch.empty_like(h0)


@torch.library.custom_op("poptorch_lite::rnn_layer_backward", mutates_args=())
def rnn_layer_backward(dy: torch.Tensor, dh: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, w_ih: torch.Tensor,
                       w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None, y: torch.Tensor,
                       nonlinearity: str, reverse: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (of x, h0, W_ih, W_hh, the biases): on the CPU PyTorch's autograd of the layer;
    on the device a loop over the steps in reverse from the saved outputs."""
    H = w_ih.shape[0]
    has_bias = b_ih is not None
    inputs = [x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse]
    wanted = [True, True, True, True, has_bias, False, False, False]
    g = _grads(rnn_reference, inputs, wanted, [dy, dh])
    return (_or_zeros(g[0], x), _or_zeros(g[1], h0), _or_zeros(g[2], w_ih), _or_zeros(g[3], w_hh),
            g[4] if has_bias else x.new_zeros(H))


@rnn_layer_backward.register_fake
def _rnn_backward_fake(dy, dh, x, h0, w_ih, w_hh, b_ih, b_hh, y, nonlinearity, reverse):
    return (torch.empty_like(x), torch.empty_like(h0), torch.empty_like(w_ih), torch.empty_like(w_hh),
            x.new_empty(w_ih.shape[0]))


def _rnn_setup(ctx, inputs, output):
    x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse = inputs
    ctx.save_for_backward(x, h0, w_ih, w_hh, b_ih, b_hh, output[0])
    ctx.has_bias, ctx.nonlinearity, ctx.reverse = b_ih is not None, nonlinearity, reverse


def _rnn_backward(ctx, dy, dh):
    dx, dh0, dw_ih, dw_hh, db = rnn_layer_backward(dy, dh, *ctx.saved_tensors, ctx.nonlinearity, ctx.reverse)
    bias = (db, db) if ctx.has_bias else (None, None)
    return dx, dh0, dw_ih, dw_hh, *bias, None, None


rnn_layer.register_autograd(_rnn_backward, setup_context=_rnn_setup)


# ---- the modules' functions, traced as a stack of layers ---------------------------------------------
PACKED = ("variable-length (packed) sequences are not supported on the IPU, as in PopTorch (their shapes depend "
          "on the data). Pad the sequences to one length (torch.nn.utils.rnn.pad_sequence) and pass the padded "
          "tensor, masking the outputs past each sequence's length")


def _packed(name: str, packed: bool) -> None:
    """torch.lstm(data, batch_sizes, ...) and torch.gru(data, batch_sizes, hx, ...) are the forms
    for a PackedSequence (a tensor where the others take the states, or the weights)."""
    if packed:
        raise Error(f"nn.{name} was given a PackedSequence: {PACKED}")


def traced_pack(*args, **kwargs):
    """``pack_padded_sequence`` (and ``pack_sequence``) in a model: refused, naming PackedSequence."""
    raise Error(f"a PackedSequence is made in the model (torch.nn.utils.rnn.pack_padded_sequence): {PACKED}")


def _stack(cell, x, states, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """PyTorch's composition of layers and directions around `cell(x, states_k, weights_k, reverse)`,
    which returns (output, *final states); `states` are the initial states, each [layers * dirs, B, *]."""
    if batch_first:
        x = x.transpose(0, 1)
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    finals = [[] for _ in states]
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            y, *last = cell(x, [s[k] for s in states], params[k * per:(k + 1) * per], d == 1)
            outs.append(y)
            for f, s in zip(finals, last):
                f.append(s)
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = aten.native_dropout.default(x, float(dropout), True)[0]
    if batch_first:
        x = x.transpose(0, 1)
    return (x, *(torch.stack(f) for f in finals))


def traced_lstm(x, second, *args):
    """``torch.lstm`` (``nn.LSTM``) in the capture: one ``lstm_layer`` per layer and direction."""
    _packed("LSTM", isinstance(second, torch.Tensor))
    params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    h0, c0 = second

    def cell(x, states, w, reverse):
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        w_hr = w[-1] if len(w) in (3, 5) else None
        y, h, c, _, _ = lstm_layer(x, states[0], states[1], w_ih, w_hh, b_ih, b_hh, w_hr, reverse)
        return y, h, c

    return _stack(cell, x, [h0, c0], list(params), has_biases, num_layers, dropout, train, bidirectional,
                  batch_first)


def traced_gru(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first=False):
    """``torch.gru`` (``nn.GRU``) in the capture: one ``gru_layer`` per layer and direction."""
    _packed("GRU", isinstance(params, torch.Tensor))

    def cell(x, states, w, reverse):
        b = (w[2], w[3]) if has_biases else (None, None)
        y, h, *_ = gru_layer(x, states[0], w[0], w[1], *b, reverse)
        return y, h

    return _stack(cell, x, [hx], list(params), has_biases, num_layers, dropout, train, bidirectional,
                  batch_first)


def _traced_rnn(nonlinearity: str):
    def traced(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first=False):
        _packed("RNN", isinstance(params, torch.Tensor))

        def cell(x, states, w, reverse):
            b = (w[2], w[3]) if has_biases else (None, None)
            return rnn_layer(x, states[0], w[0], w[1], *b, nonlinearity, reverse)

        return _stack(cell, x, [hx], list(params), has_biases, num_layers, dropout, train, bidirectional,
                      batch_first)
    traced.__doc__ = f"``torch.rnn_{nonlinearity}`` (``nn.RNN``) in the capture: one ``rnn_layer`` per layer and " \
                     "direction."
    return traced


traced_rnn_tanh, traced_rnn_relu = _traced_rnn("tanh"), _traced_rnn("relu")

FUNCTIONS = {torch.lstm: traced_lstm, torch.gru: traced_gru, torch.rnn_tanh: traced_rnn_tanh,
             torch.rnn_relu: traced_rnn_relu, torch._pack_padded_sequence: traced_pack}
"""The torch functions the recurrent modules call, traced as their layers (export.FUNCTIONS)."""


# =========================================================================================
# IR: the layers as loops over time steps (registered in aten.LOWERINGS)
# =========================================================================================
ATEN: dict = {}
"""ATen op packet -> lowering to IR (raw: given the fx node, to skip outputs nobody reads)."""


def aten_lowering(packet, doc: str):
    def deco(fn):
        fn.doc, fn.raw = doc, True
        ATEN[packet] = fn
        return fn
    return deco


def used_outputs(n: torch.fx.Node) -> set[int]:
    """Which outputs of a multi-output node some other node reads."""
    return {u.args[1] for u in n.users if u.target is operator.getitem}


def _mm(c, a: Value, b: Value) -> Value:
    return c.one("matmul", [a, b], (a.shape[0], b.shape[1]), a.dtype)


def _t(c, w: Value) -> Value:
    return c.transpose(w, (1, 0))


def _cols(c, x: Value, lo: int, hi: int) -> Value:
    """Columns lo..hi of the last axis (a view)."""
    key = (slice(None),) * (len(x.shape) - 1) + (slice(lo, hi),)
    return c.one("slice", [x], x.shape[:-1] + (hi - lo,), x.dtype, key=key)


def _rows(c, x: Value, lo: int, hi: int) -> Value:
    """Rows lo..hi of the first axis (a view)."""
    return c.one("slice", [x], (hi - lo,) + x.shape[1:], x.dtype, key=(slice(lo, hi),))


def _cat(c, parts: list[Value], axis: int) -> Value:
    axis %= len(parts[0].shape)
    shape, keys, at = list(parts[0].shape), [], 0
    for p in parts:
        keys.append((slice(None),) * axis + (slice(at, at + p.shape[axis]),))
        at += p.shape[axis]
    shape[axis] = at
    return c.one("cat", parts, tuple(shape), parts[0].dtype, keys=tuple(keys))


def _ew(c, fn: str, a, b) -> Value:
    dtype = a.dtype if isinstance(a, Value) else b.dtype
    return c.binary(fn, a, b, dtype)


def _step_of(c, seq: Value, t: Value) -> Value:
    """Row t of a [T, ...] sequence, as [...] (a dynamic slice at the step counter)."""
    row = c.one("dynamic_slice", [seq, t], (1,) + seq.shape[1:], seq.dtype, dim=0, size=1)
    return c.reshape(row, seq.shape[1:])


def _write(c, seq: Value, value: Value, t: Value) -> Value:
    """`seq` with row t replaced by `value` (a dynamic update at the step counter)."""
    return c.one("dynamic_update", [seq, c.reshape(value, (1,) + value.shape), t], seq.shape, seq.dtype, dim=0)


def _counter(c, T: int, backwards: bool) -> Value:
    return c.const(np.array([T - 1 if backwards else 0]), np.int32)


def _advance(c, t: Value, backwards: bool) -> Value:
    return c.binary("add", t, -1 if backwards else 1, dtype=np.int32)


def _projection(c, x: Value, w: Value, biases) -> Value:
    """x [T, B, I] @ w^T + biases, for every time step at once: [T, B, G]."""
    T, B, I = x.shape
    y = _mm(c, c.reshape(x, (T * B, I)), _t(c, w))
    for b in biases:
        if b is not None:
            y = _ew(c, "add", y, b)
    return c.reshape(y, (T, B, w.shape[0]))


def _previous(c, seq: Value, first: Value, reverse: bool) -> Value:
    """The state each step starts from: [first, seq[0], ..., seq[T-2]] (reversed direction:
    [seq[1], ..., seq[T-1], first])."""
    T = seq.shape[0]
    first = c.reshape(first, (1,) + first.shape)
    if T == 1:
        return first
    return _cat(c, [_rows(c, seq, 1, T), first] if reverse else [first, _rows(c, seq, 0, T - 1)], 0)


def _bias_sum(c, acc: Value, dG: Value) -> Value:
    """A bias gradient accumulated over the steps: acc + the step's pre-activation gradients summed
    over the batch."""
    return _ew(c, "add", acc, c.reduce("sum", dG, (0,), False))


def _zeros(c, n: int, dtype) -> Value:
    return c.const(np.zeros(n), dtype)


def _weight_grads(c, dG: Value, inputs: Value, prev: Value, w_ih: Value, want_dx: bool, want: dict):
    """From the pre-activation gradients of every step [T, B, G]: dx = dG W_ih, dW_ih = dG^T x,
    dW_hh = dG^T h_prev, each one matrix product over all the steps."""
    T, B, G = dG.shape
    flat = c.reshape(dG, (T * B, G))
    out = {}
    if want_dx:
        out["dx"] = c.reshape(_mm(c, flat, w_ih), inputs.shape)
    if want.get("dw_ih"):
        out["dw_ih"] = _mm(c, _t(c, flat), c.reshape(inputs, (T * B, inputs.shape[2])))
    if want.get("dw_hh"):
        out["dw_hh"] = _mm(c, _t(c, flat), c.reshape(prev, (T * B, prev.shape[2])))
    return out


# ---- LSTM ---------------------------------------------------------------------------------------------
@aten_lowering(torch.ops.poptorch_lite.lstm_layer, doc="matmul (input projection of every step), loop over the "
               "time steps: dynamic_slice, matmul, gates (unary, binary), dynamic_update")
def _lstm(c, n):
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, reverse = (c.load(a) for a in n.args)
    used = used_outputs(n)
    T, B, _ = x.shape
    H = w_ih.shape[0] // 4
    P = h0.shape[-1]
    dtype = x.dtype
    gx = _projection(c, x, w_ih, (b_ih, b_hh))
    save = 3 in used or 4 in used

    def step(s):
        t, h, cell, ys = s[:4]
        g = _ew(c, "add", _step_of(c, gx, t), _mm(c, h, _t(c, w_hh)))
        sig = c.unary("sigmoid", g)
        i, f, o = _cols(c, sig, 0, H), _cols(c, sig, H, 2 * H), _cols(c, sig, 3 * H, 4 * H)
        cell2 = _ew(c, "add", _ew(c, "mul", f, cell), _ew(c, "mul", i, c.unary("tanh", _cols(c, g, 2 * H, 3 * H))))
        h2 = _ew(c, "mul", o, c.unary("tanh", cell2))
        if w_hr is not None:
            h2 = _mm(c, h2, _t(c, w_hr))
        out = [h2, cell2, _write(c, ys, h2, t)]
        if save:
            out += [_write(c, s[4], g, t), _write(c, s[5], cell2, t)]
        return [_advance(c, t, reverse)] + out   # the counter last: the writes read it

    inits = [_counter(c, T, reverse), h0, c0, ((T, B, P), dtype)]
    if save:
        inits += [((T, B, 4 * H), dtype), ((T, B, H), dtype)]
    res = loop(c, T, inits, step, "nn.LSTM")
    return (res[3], res[1], res[2]) + ((res[4], res[5]) if save else (None, None))


@aten_lowering(torch.ops.poptorch_lite.lstm_layer_backward, doc="loop over the time steps in reverse: "
               "dynamic_slice, gate gradients (unary, binary), cat, matmul, dynamic_update, bias gradients (reduce "
               "sum, add); then matmul for the weight and input gradients")
def _lstm_backward(c, n):
    dy, dh, dc, x, h0, c0, w_ih, w_hh, _, _, w_hr, y, gates, cells, reverse = (c.load(a) for a in n.args)
    used = used_outputs(n)
    T, B, _ = x.shape
    H, P = c0.shape[-1], h0.shape[-1]
    dtype = x.dtype
    prev_h = _previous(c, y, h0, reverse)
    prev_c = _previous(c, cells, c0, reverse)
    proj = w_hr is not None and 6 in used
    want_db = 5 in used

    def step(s):
        t, dh_, dc_, dG_all = s[:4]
        dh_t = _ew(c, "add", dh_, _step_of(c, dy, t))
        dm = _mm(c, dh_t, w_hr) if w_hr is not None else dh_t
        g = _step_of(c, gates, t)
        sig = c.unary("sigmoid", g)
        i, f, o = _cols(c, sig, 0, H), _cols(c, sig, H, 2 * H), _cols(c, sig, 3 * H, 4 * H)
        gg = c.unary("tanh", _cols(c, g, 2 * H, 3 * H))
        tc = c.unary("tanh", _step_of(c, cells, t))
        d_o = _ew(c, "mul", dm, tc)
        dc_t = _ew(c, "add", dc_, _ew(c, "tanh_grad", tc, _ew(c, "mul", dm, o)))
        da = [_ew(c, "sigmoid_grad", i, _ew(c, "mul", dc_t, gg)),
              _ew(c, "sigmoid_grad", f, _ew(c, "mul", dc_t, _step_of(c, prev_c, t))),
              _ew(c, "tanh_grad", gg, _ew(c, "mul", dc_t, i)),
              _ew(c, "sigmoid_grad", o, d_o)]
        dG = _cat(c, da, 1)
        out = [_mm(c, dG, w_hh), _ew(c, "mul", dc_t, f), _write(c, dG_all, dG, t)]
        if proj:
            out.append(_write(c, s[4], dh_t, t))
        if want_db:
            out.append(_bias_sum(c, s[-1], dG))
        return [_advance(c, t, not reverse)] + out

    inits = [_counter(c, T, not reverse), dh, dc, ((T, B, 4 * H), dtype)] + ([((T, B, P), dtype)] if proj else []) \
        + ([_zeros(c, 4 * H, dtype)] if want_db else [])
    res = loop(c, T, inits, step, "the backward of nn.LSTM")
    grads = _weight_grads(c, res[3], x, prev_h, w_ih, 0 in used, {"dw_ih": 3 in used, "dw_hh": 4 in used})
    dw_hr = None
    if proj:   # dW_hr = sum over steps of dh_t^T m_t, m_t = o_t * tanh(c_t) recomputed for every step at once
        m = _ew(c, "mul", c.unary("sigmoid", _cols(c, gates, 3 * H, 4 * H)), c.unary("tanh", cells))
        dw_hr = _mm(c, _t(c, c.reshape(res[4], (T * B, P))), c.reshape(m, (T * B, H)))
    return (grads.get("dx"), res[1], res[2], grads.get("dw_ih"), grads.get("dw_hh"), res[-1] if want_db else None,
            dw_hr)


# ---- GRU ----------------------------------------------------------------------------------------------
@aten_lowering(torch.ops.poptorch_lite.gru_layer, doc="matmul (input projection of every step), loop over the "
               "time steps: dynamic_slice, matmul, gates (unary, binary), dynamic_update")
def _gru(c, n):
    x, h0, w_ih, w_hh, b_ih, b_hh, reverse = (c.load(a) for a in n.args)
    used = used_outputs(n)
    T, B, _ = x.shape
    H = h0.shape[-1]
    dtype = x.dtype
    gx = _projection(c, x, w_ih, (b_ih,))
    save = bool(used & {2, 3, 4})

    def step(s):
        t, h, ys = s[:3]
        gxt = _step_of(c, gx, t)
        gh = _mm(c, h, _t(c, w_hh))
        if b_hh is not None:
            gh = _ew(c, "add", gh, b_hh)
        rz = c.unary("sigmoid", _ew(c, "add", _cols(c, gxt, 0, 2 * H), _cols(c, gh, 0, 2 * H)))
        hn = _cols(c, gh, 2 * H, 3 * H)
        new = c.unary("tanh", _ew(c, "add", _cols(c, gxt, 2 * H, 3 * H), _ew(c, "mul", _cols(c, rz, 0, H), hn)))
        h2 = _ew(c, "add", new, _ew(c, "mul", _cols(c, rz, H, 2 * H), _ew(c, "sub", h, new)))
        out = [h2, _write(c, ys, h2, t)]
        if save:
            out += [_write(c, s[3], rz, t), _write(c, s[4], new, t), _write(c, s[5], hn, t)]
        return [_advance(c, t, reverse)] + out

    inits = [_counter(c, T, reverse), h0, ((T, B, H), dtype)]
    if save:
        inits += [((T, B, 2 * H), dtype), ((T, B, H), dtype), ((T, B, H), dtype)]
    res = loop(c, T, inits, step, "nn.GRU")
    return (res[2], res[1]) + ((res[3], res[4], res[5]) if save else (None, None, None))


@aten_lowering(torch.ops.poptorch_lite.gru_layer_backward, doc="loop over the time steps in reverse: "
               "dynamic_slice, gate gradients (unary, binary), cat, matmul, dynamic_update, bias gradients (reduce "
               "sum, add); then matmul for the weight and input gradients")
def _gru_backward(c, n):
    dy, dh, x, h0, w_ih, w_hh, _, _, y, rzs, ns, hns, reverse = (c.load(a) for a in n.args)
    used = used_outputs(n)
    T, B, _ = x.shape
    H = h0.shape[-1]
    dtype = x.dtype
    prev_h = _previous(c, y, h0, reverse)
    sums = [k for k in (4, 5) if k in used]   # the bias gradients wanted: of b_ih (4), of b_hh (5)

    def step(s):
        t, dh_, dgx_all, dgh_all = s[:4]
        dh_t = _ew(c, "add", dh_, _step_of(c, dy, t))
        rz = _step_of(c, rzs, t)
        r, z = _cols(c, rz, 0, H), _cols(c, rz, H, 2 * H)
        new, hn = _step_of(c, ns, t), _step_of(c, hns, t)
        dan = _ew(c, "tanh_grad", new, _ew(c, "mul", dh_t, c.unary("scale", z, scale=-1.0, bias=1.0)))
        dar = _ew(c, "sigmoid_grad", r, _ew(c, "mul", dan, hn))
        daz = _ew(c, "sigmoid_grad", z, _ew(c, "mul", dh_t, _ew(c, "sub", _step_of(c, prev_h, t), new)))
        dgx = _cat(c, [dar, daz, dan], 1)
        dgh = _cat(c, [dar, daz, _ew(c, "mul", dan, r)], 1)
        dh_prev = _ew(c, "add", _ew(c, "mul", dh_t, z), _mm(c, dgh, w_hh))
        out = [dh_prev, _write(c, dgx_all, dgx, t), _write(c, dgh_all, dgh, t)]
        out += [_bias_sum(c, acc, dgx if k == 4 else dgh) for k, acc in zip(sums, s[4:])]
        return [_advance(c, t, not reverse)] + out

    inits = [_counter(c, T, not reverse), dh, ((T, B, 3 * H), dtype), ((T, B, 3 * H), dtype)]
    res = loop(c, T, inits + [_zeros(c, 3 * H, dtype) for _ in sums], step, "the backward of nn.GRU")
    _, dh0, dgx, dgh = res[:4]
    db = dict(zip(sums, res[4:]))
    gx = _weight_grads(c, dgx, x, prev_h, w_ih, 0 in used, {"dw_ih": 2 in used})
    gh = _weight_grads(c, dgh, x, prev_h, w_ih, False, {"dw_hh": 3 in used})
    return gx.get("dx"), dh0, gx.get("dw_ih"), gh.get("dw_hh"), db.get(4), db.get(5)


# ---- Elman RNN ----------------------------------------------------------------------------------------
@aten_lowering(torch.ops.poptorch_lite.rnn_layer, doc="matmul (input projection of every step), loop over the "
               "time steps: dynamic_slice, matmul, tanh or relu, dynamic_update")
def _rnn(c, n):
    x, h0, w_ih, w_hh, b_ih, b_hh, nonlinearity, reverse = (c.load(a) for a in n.args)
    T, B, _ = x.shape
    H = h0.shape[-1]
    gx = _projection(c, x, w_ih, (b_ih, b_hh))

    def step(s):
        t, h, ys = s
        h2 = c.unary(nonlinearity, _ew(c, "add", _step_of(c, gx, t), _mm(c, h, _t(c, w_hh))))
        out = [h2, _write(c, ys, h2, t)]
        return [_advance(c, t, reverse)] + out

    _, h, ys = loop(c, T, [_counter(c, T, reverse), h0, ((T, B, H), x.dtype)], step, "nn.RNN")
    return ys, h


@aten_lowering(torch.ops.poptorch_lite.rnn_layer_backward, doc="loop over the time steps in reverse: "
               "dynamic_slice, tanh or relu gradient, matmul, dynamic_update, bias gradient (reduce sum, add); "
               "then matmul for the weight and input gradients")
def _rnn_backward(c, n):
    dy, dh, x, h0, w_ih, w_hh, _, _, y, nonlinearity, reverse = (c.load(a) for a in n.args)
    used = used_outputs(n)
    T, B, _ = x.shape
    H = h0.shape[-1]
    grad_fn = "tanh_grad" if nonlinearity == "tanh" else "relu_grad"
    want_db = 4 in used

    def step(s):
        t, dh_, da_all = s[:3]
        da = _ew(c, grad_fn, _step_of(c, y, t), _ew(c, "add", dh_, _step_of(c, dy, t)))
        out = [_mm(c, da, w_hh), _write(c, da_all, da, t)] + ([_bias_sum(c, s[3], da)] if want_db else [])
        return [_advance(c, t, not reverse)] + out

    inits = [_counter(c, T, not reverse), dh, ((T, B, H), x.dtype)] + ([_zeros(c, H, x.dtype)] if want_db else [])
    res = loop(c, T, inits, step, "the backward of nn.RNN")
    g = _weight_grads(c, res[2], x, _previous(c, y, h0, reverse), w_ih, 0 in used,
                      {"dw_ih": 2 in used, "dw_hh": 3 in used})
    return g.get("dx"), res[1], g.get("dw_ih"), g.get("dw_hh"), res[3] if want_db else None
