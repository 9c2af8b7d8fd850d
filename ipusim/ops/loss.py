"""Losses with torch's definitions: NLL, cross-entropy, MSE and L1, forward and backward.

NLL (`torch.nn.functional.nll_loss`): log_probs [N, C] (or [C], or [N, C, d1, ...]) and int32 labels
of the shape without the class axis. loss_i = -log_probs[i, labels_i], 0 where labels_i == ignore_index;
"none" returns every loss_i, "sum" their sum, "mean" their sum divided by the number of labels
that are not ignore_index (NaN when all are ignored, as torch). Class weights are not supported.
Cross-entropy = log_softmax along the class axis + NLL; its gradient wrt the logits is
(softmax - onehot(label)) * g_i, with g_i the upstream gradient of loss_i (divided by the count of
valid labels for "mean"), and 0 for ignored labels.

Labels on the device. A vertex cannot raise, so a label outside [0, C) that is not ignore_index
matches no class: its loss is 0 but it counts as a valid label in a mean, its NLL gradient is 0,
and its cross-entropy gradient is softmax * g_i (no one-hot term). Labels are compared as float32,
so they must stay below 2**24 (always true for class indices). Check labels on the host with
`validate_labels` (torch's "Target ... is out of bounds" error) before streaming them.

Mapping and cost. NLL picks -log_probs[i, label] with a segment map over the class axis (each
tile compares the labels of the rows it holds with its columns; labels are exchanged once per
(tile, row)), then reduces (reduce.py); the gradients are one segment map each. MSE and L1 reduce
`input - target` with sum_squares / sum_abs. Their gradients are one elementwise vertex pass,
mapped like the input, with the loss-gradient vertex below:
    instructions = 6 + ceil(n / width) * per_vector, per_vector = 3 (MSE) or 4 (L1),
    width = 2 (float32) or 4 (float16) elements per 64-bit vector.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.mapping import TileMap
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from . import elementwise as ew
from .common import lookup, placed, region_work
from .reduce import composite, kernel_values, output_storage, reduce, segment_map, vector_width
from .softmax import log_softmax

F32 = np.float32
REDUCTIONS = ("mean", "sum", "none")


def validate_labels(labels, num_classes: int, ignore_index: int = -100) -> None:
    """Host-side check of class labels, as torch does: every label is in [0, num_classes) or
    equals ignore_index."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype.name}")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise IndexError(f"Target {int(labels[where])} is out of bounds: label at index {where} must be in "
                         f"[0, {num_classes}) or equal ignore_index={ignore_index}")


# ---- NLL and cross-entropy ---------------------------------------------------------------------
def _class_axis(log_probs: Tensor, labels: Tensor, reduction: str, name: str) -> int:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: unknown reduction {reduction!r}; use one of {REDUCTIONS}")
    if log_probs.dtype.kind != "f":
        raise TypeError(f"{name}: {log_probs.name!r} is {log_probs.dtype.name}; the loss input must be float")
    if labels.dtype != np.int32:
        raise TypeError(f"{name}: labels {labels.name!r} are {labels.dtype.name}; pass int32 class indices")
    if log_probs.rank == 0:
        raise ValueError(f"{name}: {log_probs.name!r} is a scalar; expected [N, C] class scores")
    axis = 1 if log_probs.rank >= 2 else 0
    expected = log_probs.shape[:axis] + log_probs.shape[axis + 1:]
    if labels.shape != expected:
        raise ValueError(f"{name}: labels {labels.name!r} have shape {labels.shape}; for input {log_probs.shape} "
                         f"they must have shape {expected} (one class index per sample)")
    return axis


def _valid_count(graph: Graph, labels: Tensor, ignore_index: int, body: Sequence, name: str) -> Tensor:
    """Number of labels that are not ignore_index, as a float32 scalar."""
    ignore = graph.addConstant(np.int32, (1,), ignore_index, f"{name}/ignore_index")
    graph.setTileMapping(ignore, int(labels.tiles().reshape(-1)[0]) if labels.numel else 0)
    valid = ew.binary(graph, "ne", labels, ignore.reshape(()), body, f"{name}/valid")
    return reduce(graph, valid, None, "sum", body, f"{name}/count", out_dtype=F32, category="temporaries")


def _labels_f32(graph: Graph, labels: Tensor, body: Sequence, name: str) -> Tensor:
    return ew.cast(graph, labels, F32, body, f"{name}/labels")


def _row_gradient(graph: Graph, grad: Tensor, labels: Tensor, reduction: str, ignore_index: int,
                  body: Sequence, name: str) -> Tensor:
    """The upstream gradient of each sample's loss: g (none), g (sum) or g / valid count (mean)."""
    if reduction == "none":
        if grad.shape != labels.shape:
            raise ValueError(f"{name}: with reduction='none' the gradient {grad.name!r} must have the per-sample "
                             f"shape {labels.shape}, got {grad.shape}")
    elif grad.numel != 1:
        raise ValueError(f"{name}: with reduction={reduction!r} the gradient {grad.name!r} must be a scalar, "
                         f"got shape {grad.shape}")
    if grad.dtype != F32:
        grad = ew.cast(graph, grad, F32, body, f"{name}/grad")
    if reduction == "mean":
        grad = ew.div(graph, grad.reshape(()), _valid_count(graph, labels, ignore_index, body, name), body,
                      f"{name}/grad_mean")
    return grad


def nll_loss(graph: Graph, log_probs: Tensor, labels: Tensor, prog: Sequence, reduction: str = "mean",
             ignore_index: int = -100, name: str = "nll_loss") -> Tensor:
    """torch.nn.functional.nll_loss (no class weights); the result has log_probs' dtype."""
    axis = _class_axis(log_probs, labels, reduction, name)
    body = Sequence(name=name)
    picked = segment_map(graph, "nll_pick", log_probs, (axis,), body, f"{name}/pick",
                         r=_labels_f32(graph, labels, body, name), param=float(ignore_index), out_dtype=F32,
                         category="temporaries")
    if reduction == "none":
        loss = reduce(graph, picked, (axis,), "sum", body, name, out_dtype=log_probs.dtype)
    elif reduction == "sum":
        loss = reduce(graph, picked, None, "sum", body, name, out_dtype=log_probs.dtype)
    else:
        total = reduce(graph, picked, None, "sum", body, f"{name}/total", out_dtype=F32, category="temporaries")
        loss = ew.div(graph, total, _valid_count(graph, labels, ignore_index, body, name), body, name)
        if log_probs.dtype != F32:
            loss = ew.cast(graph, loss, log_probs.dtype, body, f"{name}/cast")
    prog.add(composite(name, body, (log_probs, labels), (loss,)))
    return loss


def nll_loss_backward(graph: Graph, grad: Tensor, log_probs: Tensor, labels: Tensor, prog: Sequence,
                      reduction: str = "mean", ignore_index: int = -100, name: str = "nll_loss_backward") -> Tensor:
    """Gradient of nll_loss wrt log_probs given the loss's upstream gradient `grad` (a scalar, or
    per sample for reduction='none'); mapped like log_probs."""
    axis = _class_axis(log_probs, labels, reduction, name)
    body = Sequence(name=name)
    q = _row_gradient(graph, grad, labels, reduction, ignore_index, body, name)
    d = segment_map(graph, "nll_grad", log_probs, (axis,), body, name, r=_labels_f32(graph, labels, body, name),
                    q=q, param=float(ignore_index), out_dtype=log_probs.dtype)
    prog.add(composite(name, body, (grad, log_probs, labels), (d,)))
    return d


def cross_entropy(graph: Graph, logits: Tensor, labels: Tensor, prog: Sequence, reduction: str = "mean",
                  ignore_index: int = -100, name: str = "cross_entropy") -> tuple[Tensor, Tensor]:
    """torch.nn.functional.cross_entropy with class indices: returns (loss, log_probs); keep
    log_probs for the backward pass."""
    axis = _class_axis(logits, labels, reduction, name)
    body = Sequence(name=name)
    lp = log_softmax(graph, logits, axis, body, f"{name}/log_softmax")
    loss = nll_loss(graph, lp, labels, body, reduction, ignore_index, f"{name}/nll")
    prog.add(composite(name, body, (logits, labels), (loss, lp)))
    return loss, lp


def cross_entropy_backward(graph: Graph, grad: Tensor, logits: Tensor, labels: Tensor, prog: Sequence,
                           reduction: str = "mean", ignore_index: int = -100, log_probs: Tensor | None = None,
                           name: str = "cross_entropy_backward") -> Tensor:
    """Gradient of cross_entropy wrt the logits: (softmax(logits) - onehot) * g_i. Pass the
    forward's `log_probs` to reuse them; otherwise log_softmax is recomputed."""
    axis = _class_axis(logits, labels, reduction, name)
    body = Sequence(name=name)
    if log_probs is None:
        log_probs = log_softmax(graph, logits, axis, body, f"{name}/log_softmax")
    elif log_probs.shape != logits.shape:
        raise ValueError(f"{name}: log_probs {log_probs.shape} and logits {logits.shape} differ in shape")
    q = _row_gradient(graph, grad, labels, reduction, ignore_index, body, name)
    d = segment_map(graph, "softmax_xent_grad", log_probs, (axis,), body, name,
                    r=_labels_f32(graph, labels, body, name), q=q, param=float(ignore_index), out_dtype=logits.dtype)
    prog.add(composite(name, body, (grad, logits, labels, log_probs), (d,)))
    return d


# ---- MSE and L1 --------------------------------------------------------------------------------
MSE, L1 = 0, 1
PER_VECTOR = {MSE: 3, L1: 4}


@njit(**JIT)
def loss_grad_value(op, a, b, g, k):
    d = a - b
    if op == MSE:
        return 2.0 * d * g * k
    return (1.0 if d > 0 else (-1.0 if d < 0 else 0.0 * d)) * g * k


@njit(parallel=True, **JIT)
def loss_grad_codelet(a, a_addr, a_start, b, b_addr, b_start, g, g_addr, g_start, out, o_addr, o_start, params):
    """params: op (0 MSE, 1 L1), k (1/N for a mean, else 1)."""
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        for i in range(o_start[v + 1] - o_start[v]):
            value = loss_grad_value(op, ld(a, a_addr[a_start[v] + i]), ld(b, b_addr[b_start[v] + i]),
                                    ld(g, g_addr[g_start[v] + i]), params[v, 1])
            st(out, o_addr[o_start[v] + i], value)


@njit(parallel=True, **JIT)
def loss_grad_whole(op, a, b, g, g_step, out, k):
    """Whole-tensor form: g holds one gradient per element (g_step 1) or one for all (g_step 0);
    one loop per op and gradient form, so that each vectorises."""
    if g_step == 0:
        gv = np.float64(g[0])
        if op == MSE:
            for i in prange(out.size):
                out[i] = loss_grad_value(MSE, np.float64(a[i]), np.float64(b[i]), gv, k)
        else:
            for i in prange(out.size):
                out[i] = loss_grad_value(L1, np.float64(a[i]), np.float64(b[i]), gv, k)
    elif op == MSE:
        for i in prange(out.size):
            out[i] = loss_grad_value(MSE, np.float64(a[i]), np.float64(b[i]), np.float64(g[i]), k)
    else:
        for i in prange(out.size):
            out[i] = loss_grad_value(L1, np.float64(a[i]), np.float64(b[i]), np.float64(g[i]), k)


def loss_grad_instructions(n, width: int, op):
    """Ints, or arrays (one per vertex)."""
    return 6 + np.ceil(n / width) * lookup(PER_VECTOR, op)


LOSS_GRAD_VERTEX = VertexType(
    "popnn::LossGradient", ("a", "b", "g"), ("out",), loss_grad_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(
        loss_grad_instructions(sizes["out"], vector_width(dtype), params[:, 0])),
    num_params=2)


def _check_pointwise(input: Tensor, target: Tensor, reduction: str, name: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: unknown reduction {reduction!r}; use one of {REDUCTIONS}")
    if input.shape != target.shape:
        raise ValueError(f"{name}: input {input.name!r} {input.shape} and target {target.name!r} {target.shape} "
                         "must have the same shape")
    if input.dtype != target.dtype or input.dtype.kind != "f":
        raise TypeError(f"{name}: input ({input.dtype.name}) and target ({target.dtype.name}) must be the same "
                        "float dtype")


def _pointwise_loss(graph, input, target, prog, reduction, name, unary_op, reduce_op) -> Tensor:
    _check_pointwise(input, target, reduction, name)
    body = Sequence(name=name)
    d = ew.sub(graph, input, target, body, f"{name}/diff")
    if reduction == "none":
        loss = ew.unary(graph, unary_op, d, body, name)
    else:
        n = input.numel
        scale = 1.0 if reduction == "sum" else (1.0 / n if n else math.nan)
        loss = reduce(graph, d, None, reduce_op, body, name, out_dtype=input.dtype, scale=scale)
    prog.add(composite(name, body, (input, target), (loss,)))
    return loss


def mse_loss(graph: Graph, input: Tensor, target: Tensor, prog: Sequence, reduction: str = "mean",
             name: str = "mse_loss") -> Tensor:
    """torch.nn.functional.mse_loss: (input - target)**2, averaged, summed or elementwise."""
    return _pointwise_loss(graph, input, target, prog, reduction, name, "square", "sum_squares")


def l1_loss(graph: Graph, input: Tensor, target: Tensor, prog: Sequence, reduction: str = "mean",
            name: str = "l1_loss") -> Tensor:
    """torch.nn.functional.l1_loss: |input - target|, averaged, summed or elementwise."""
    return _pointwise_loss(graph, input, target, prog, reduction, name, "abs", "sum_abs")


def _pointwise_backward(graph, grad, input, target, prog, reduction, name, op) -> Tensor:
    _check_pointwise(input, target, reduction, name)
    shape = input.shape
    if reduction == "none" and grad.shape != shape:
        raise ValueError(f"{name}: with reduction='none' the gradient must have the input's shape {shape}, "
                         f"got {grad.shape}")
    if reduction != "none" and grad.numel != 1:
        raise ValueError(f"{name}: with reduction={reduction!r} the gradient must be a scalar, got {grad.shape}")
    if grad.dtype != input.dtype:
        raise TypeError(f"{name}: gradient ({grad.dtype.name}) and input ({input.dtype.name}) dtypes differ")
    k = 1.0 / input.numel if reduction == "mean" and input.numel else 1.0
    out = graph.addVariable(input.dtype, shape, name, category="activations", always_live=False)
    out.var.mapping = input.tile_map()
    gb = grad if reduction == "none" else grad.reshape(()).broadcast(shape)
    body = Sequence(name=name)
    tiles = out.tile_map()
    tl = placed(graph, body, target, tiles, f"{name}/target")
    gl = placed(graph, body, gb, tiles, f"{name}/grad")
    cs = graph.addComputeSet(name)
    work = region_work(tiles, graph.target.workers_per_tile, grain=4)
    fields = {f: work.field(t) for f, t in {"a": input, "b": tl, "g": gl, "out": out}.items()}
    graph.addVertices(cs, LOSS_GRAD_VERTEX, work.tiles, fields, np.array([op, k], np.float64))
    body.add(Execute(cs))

    def fast(io):
        res = output_storage(io, out)
        direct = res is not None
        if not direct:
            res = np.empty(out.numel, dtype=np.float32)
        g = kernel_values(io.read(grad))
        loss_grad_whole(op, kernel_values(io.read(input)), kernel_values(io.read(target)), g,
                        int(reduction == "none"), res, k)
        if not direct:
            io.write(out, res.reshape(shape))

    prog.add(OpProgram(name, body, fast, (grad, input, target), (out,)))
    return out


def mse_loss_backward(graph: Graph, grad: Tensor, input: Tensor, target: Tensor, prog: Sequence,
                      reduction: str = "mean", name: str = "mse_loss_backward") -> Tensor:
    """Gradient of mse_loss wrt input: 2 * (input - target) * g (/ N for a mean). The gradient
    wrt target is its negation."""
    return _pointwise_backward(graph, grad, input, target, prog, reduction, name, MSE)


def l1_loss_backward(graph: Graph, grad: Tensor, input: Tensor, target: Tensor, prog: Sequence,
                     reduction: str = "mean", name: str = "l1_loss_backward") -> Tensor:
    """Gradient of l1_loss wrt input: sign(input - target) * g (/ N for a mean; sign(0) = 0, as torch)."""
    return _pointwise_backward(graph, grad, input, target, prog, reduction, name, L1)
