"""Reverse-mode differentiation of the IR: one VJP rule per op.

`differentiate` walks the forward nodes backwards from the loss and appends backward nodes to
the same graph, each placed on the block/stage/IPU of the forward node it differentiates
(`pass_="bwd"`), so the backward of a stage runs where its forward ran, as in PopTorch.
Gradients of values used several times are summed.
"""
from __future__ import annotations

import numpy as np

from .ir import IRGraph, Node, Value, prune

NON_DIFFERENTIABLE_OPS = frozenset({"cast_int"})


class Grad:
    """Emits backward nodes placed like one forward node."""

    def __init__(self, ir: IRGraph, fwd: Node):
        self.ir = ir
        self.fwd = fwd
        self.like = Node("", [], [], block=fwd.block, stage=fwd.stage, ipu=fwd.ipu, phase=fwd.phase,
                         pass_="bwd", source=fwd.source)

    def op(self, op: str, inputs, shape, dtype, /, **attrs) -> Value:
        return self.ir.add(op, list(inputs), [(shape, dtype)], like=self.like, **attrs)[0]

    def const(self, value, dtype) -> Value:
        arr = np.asarray(value, dtype=dtype)
        return Value(arr.shape, arr.dtype, "const", kind="const", data=arr)

    def binary(self, fn: str, a: Value, b: Value | float) -> Value:
        if not isinstance(b, Value):
            b = self.const(b, a.dtype)
        return self.op("binary", [a, b], tuple(np.broadcast_shapes(a.shape, b.shape)), a.dtype, fn=fn)

    def unary(self, fn: str, x: Value, **attrs) -> Value:
        return self.op("unary", [x], x.shape, x.dtype, fn=fn, **attrs)

    def reshape(self, x: Value, shape) -> Value:
        shape = tuple(shape)
        return x if x.shape == shape else self.op("reshape", [x], shape, x.dtype, shape=shape)

    def transpose(self, x: Value, perm) -> Value:
        return self.op("transpose", [x], tuple(x.shape[p] for p in perm), x.dtype, perm=tuple(perm))

    def expand(self, x: Value, shape) -> Value:
        return x if x.shape == tuple(shape) else self.op("expand", [x], tuple(shape), x.dtype, shape=tuple(shape))

    def sum_to(self, g: Value, shape) -> Value:
        """Undo broadcasting: sum g over the axes that broadcasting added or stretched."""
        shape = tuple(shape)
        if g.shape == shape:
            return g
        lead = len(g.shape) - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
        red = self.op("reduce", [g], tuple(s for i, s in enumerate(g.shape) if i not in axes), g.dtype,
                      fn="sum", axes=axes, keepdims=False)
        return self.reshape(red, shape)


def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def vjp(b: Grad, n: Node, gouts: list[Value | None]) -> list[Value | None]:
    """Gradients of n's inputs given gradients of its outputs (None: no gradient)."""
    g = gouts[0]
    x = n.inputs[0] if n.inputs else None
    y = n.outputs[0]
    a = n.attrs
    op = n.op
    if op == "reshape":
        return [b.reshape(g, x.shape)]
    if op == "transpose":
        return [b.transpose(g, _inverse(a["perm"]))]
    if op == "expand":
        return [b.sum_to(g, x.shape)]
    if op == "slice":
        return [b.op("slice_backward", [g], x.shape, g.dtype, key=a["key"])]
    if op == "cast":
        return [b.op("cast", [g], x.shape, x.dtype)]
    if op == "unary":
        fn = a["fn"]
        rules = {
            "relu": lambda: b.binary("relu_grad", x, g),
            "gelu": lambda: b.binary("gelu_grad", x, g),
            "tanh": lambda: b.binary("tanh_grad", y, g),
            "sigmoid": lambda: b.binary("sigmoid_grad", y, g),
            "exp": lambda: b.binary("mul", g, y),
            "log": lambda: b.binary("div", g, x),
            "sqrt": lambda: b.binary("div", b.binary("mul", g, 0.5), y),
            "rsqrt": lambda: b.binary("mul", g, b.binary("mul", b.binary("mul", y, b.unary("square", y)), -0.5)),
            "neg": lambda: b.unary("neg", g),
            "abs": lambda: b.binary("abs_grad", x, g),
            "square": lambda: b.binary("mul", g, b.binary("mul", x, 2.0)),
            "reciprocal": lambda: b.unary("neg", b.binary("mul", g, b.unary("square", y))),
            "scale": lambda: b.unary("scale", g, scale=a.get("scale", 1.0), bias=0.0),
        }
        if fn not in rules:
            raise NotImplementedError(f"no gradient rule for {fn} (at {n.source})")
        return [rules[fn]()]
    if op == "binary":
        fn = a["fn"]
        lhs, rhs = n.inputs
        if fn == "add":
            ga, gb = g, g
        elif fn == "sub":
            ga, gb = g, b.unary("neg", g)
        elif fn == "mul":
            ga, gb = b.binary("mul", g, rhs), b.binary("mul", g, lhs)
        elif fn == "div":
            ga = b.binary("div", g, rhs)
            gb = b.unary("neg", b.binary("div", b.binary("mul", ga, lhs), rhs))
        elif fn == "pow" and rhs.kind == "const":
            e = float(rhs.data)
            ga, gb = b.binary("mul", g, b.binary("mul", b.binary("pow", lhs, e - 1.0), e)), None
        else:
            raise NotImplementedError(f"no gradient rule for binary {fn} (at {n.source})")
        return [b.sum_to(ga, lhs.shape) if lhs.kind != "const" else None,
                b.sum_to(gb, rhs.shape) if gb is not None and rhs.kind != "const" else None]
    if op == "matmul":
        lhs, rhs = n.inputs
        if len(lhs.shape) == 2:
            ga = b.op("matmul", [g, b.transpose(rhs, (1, 0))], lhs.shape, g.dtype)
            gb = b.op("matmul", [b.transpose(lhs, (1, 0)), g], rhs.shape, g.dtype)
        else:
            ga = b.op("matmul", [g, b.transpose(rhs, (0, 2, 1))], lhs.shape, g.dtype)
            gb = b.op("matmul", [b.transpose(lhs, (0, 2, 1)), g], rhs.shape, g.dtype)
        return [ga, gb]
    if op == "reduce":
        fn = a["fn"]
        if fn not in ("sum", "mean"):
            raise NotImplementedError(f"no gradient rule for reduce {fn} (at {n.source})")
        kept = tuple(1 if i in a["axes"] else s for i, s in enumerate(x.shape))
        gx = b.expand(b.reshape(g, kept), x.shape)
        if fn == "mean":
            count = int(np.prod([x.shape[i] for i in a["axes"]]))
            gx = b.binary("mul", gx, 1.0 / count)
        return [gx]
    if op == "conv2d":
        w = n.inputs[1]
        conv = {k: a[k] for k in ("stride", "padding", "dilation", "groups")}
        gx = b.op("conv2d_backward_input", [g, w], x.shape, g.dtype, **conv)
        gw = b.op("conv2d_backward_weights", [g, x], w.shape, g.dtype, **conv)
        return [gx, gw]
    if op == "max_pool2d":
        return [b.op("max_pool2d_backward", [x, y, g], x.shape, g.dtype, **a)]
    if op == "avg_pool2d":
        return [b.op("avg_pool2d_backward", [g], x.shape, g.dtype, **a)]
    if op == "adaptive_avg_pool2d":
        return [b.op("adaptive_avg_pool2d_backward", [g], x.shape, g.dtype, **a)]
    if op == "softmax":
        return [b.op("softmax_backward", [y, g], x.shape, g.dtype, **a)]
    if op == "log_softmax":
        return [b.op("log_softmax_backward", [y, g], x.shape, g.dtype, **a)]
    if op == "dropout":
        return [b.op("dropout_backward", [g, n.outputs[1]], x.shape, g.dtype, **a)]
    if op in ("nll_loss", "cross_entropy", "mse_loss", "l1_loss"):
        target = n.inputs[1]
        gx = b.op(f"{op}_backward", [x, target, g], x.shape, x.dtype, **a)
        # mse and l1 depend on input - target only: the target's gradient is the negation
        return [gx, b.unary("neg", gx) if op in ("mse_loss", "l1_loss") else None]
    if op == "ctc_loss":
        gx = b.op("ctc_loss_backward", [x, *n.inputs[1:], g], x.shape, x.dtype, **a)
        return [gx, None, None, None]
    if op == "identity_loss":
        if a["reduction"] == "none":
            return [g]
        gx = b.expand(b.reshape(g, (1,) * len(x.shape)), x.shape)
        return [b.binary("mul", gx, 1.0 / x.numel) if a["reduction"] == "mean" else gx]
    if op == "layer_norm":
        mean, inv_std = n.outputs[1], n.outputs[2]
        params = n.inputs[1:]
        grads = b.ir.add("layer_norm_backward", [g, x, mean, inv_std, *params],
                         [(x.shape, x.dtype)] + [(v.shape, v.dtype) for v in params], like=b.like, **a)
        return grads
    if op == "batch_norm":
        if not a["training"]:
            raise NotImplementedError(f"batch norm with running statistics has no gradient rule (at {n.source}); "
                                      "train the model in training mode")
        w, bias = n.inputs[1], n.inputs[2]
        mean, inv_std = n.outputs[1], n.outputs[3]
        grads = b.ir.add("batch_norm_backward", [g, x, mean, inv_std, w],
                         [(x.shape, x.dtype), (w.shape, w.dtype), (bias.shape, bias.dtype)], like=b.like, **a)
        return grads + [None, None]
    if op == "embedding":
        idx, w = n.inputs
        return [None, b.op("embedding_backward", [idx, g], w.shape, g.dtype, **a)]
    raise NotImplementedError(f"no gradient rule for op {op} (at {n.source})")


def differentiate(ir: IRGraph, loss: Value, seed: float = 1.0, wrt=None) -> dict[str, Value]:
    """Append the backward pass of `loss` (its gradient seeded with `seed`, the loss scaling);
    return parameter name -> gradient value for the parameters named in `wrt` (default: all).

    Only what those gradients need is kept: a rule builds every input's gradient, and the ones
    nobody consumes (the data's, a frozen weight's) are dropped again, as PopART's autodiff
    never creates them."""
    params = {name: v for name, v in ir.params.items() if wrt is None or name in wrt}
    needs: set[int] = {v.id for v in params.values()}
    for n in ir.nodes:  # values that depend on a parameter
        if any(v.id in needs for v in n.inputs):
            needs.update(v.id for v in n.outputs)
    if loss.id not in needs:
        raise RuntimeError("the loss does not depend on any trainable parameter")
    grads: dict[int, Value] = {}
    seed_node = loss.producer
    b = Grad(ir, seed_node)
    grads[loss.id] = b.const(np.full(loss.shape, seed, dtype=loss.dtype), loss.dtype)
    forward = list(ir.nodes)
    for n in reversed(forward):
        gouts = [grads.get(v.id) for v in n.outputs]
        if all(g is None for g in gouts) or not any(v.id in needs for v in n.inputs):
            continue
        if gouts[0] is None:
            continue  # only secondary outputs (masks, statistics) got a gradient
        for inp, gin in zip(n.inputs, vjp(Grad(ir, n), n, gouts)):
            if gin is None or inp.id not in needs:
                continue
            if gin.shape != inp.shape:
                raise AssertionError(f"gradient of {inp} has shape {gin.shape} (op {n.op} at {n.source})")
            prev = grads.get(inp.id)
            grads[inp.id] = gin if prev is None else Grad(ir, n).binary("add", prev, gin)
    result = {name: grads[v.id] for name, v in params.items() if v.id in grads}
    prune(ir, list(result.values()), start=len(forward))
    return result
