"""From a captured torch.fx graph to our IR: one converter per module type, function and method.

Shapes come from the fx graph's `tensor_meta` (the model run once on one micro-batch); ops that
a module decomposes into (Linear = matmul + add) compute their own shapes. An op without a
converter is a compile-time error naming the op and the user's source line. int64 tensors
become int32 on the device, as PopTorch does.
"""
from __future__ import annotations

import operator

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from ..api import ops
from .capture import OP_KINDS, describe_op
from .aten import UnsupportedOpError
from .ir import LOSS_OPS, IRGraph, Node, Value, flatten_values
from ..api.strategies import Placement


def np_dtype(dtype: torch.dtype) -> np.dtype:
    table = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int32,
             torch.int32: np.int32, torch.bool: np.bool_, torch.float64: np.float32}
    if dtype not in table:
        raise UnsupportedOpError(f"tensors of dtype {dtype} are not supported on the IPU")
    return np.dtype(table[dtype])


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def broadcast_shape(*shapes) -> tuple:
    return tuple(np.broadcast_shapes(*shapes))


class Converter:
    """Walks an fx graph and emits IR nodes placed on the stage/IPU of each fx node's block."""

    def __init__(self, gm: torch.fx.GraphModule, placement: Placement, training: bool):
        self.gm = gm
        self.placement = placement
        self.training = training
        self.ir = IRGraph()
        self.env: dict[str, object] = {}
        self.fx_node: torch.fx.Node | None = None
        self.template = Node("", [], [])
        self.modules = dict(gm.named_modules())
        self.param_names = {id(p): n for n, p in gm.named_parameters()}
        self.buffer_names = {id(b): n for n, b in gm.named_buffers()}

    # ---- emitting ---------------------------------------------------------------------------
    def emit(self, op: str, inputs: list[Value], out_specs: list[tuple], /, **attrs) -> list[Value]:
        return self.ir.add(op, inputs, out_specs, like=self.template, **attrs)

    def one(self, op, inputs, shape, dtype, /, **attrs) -> Value:
        return self.emit(op, inputs, [(shape, dtype)], **attrs)[0]

    def const(self, value, dtype) -> Value:
        arr = np.asarray(value, dtype=dtype)
        return Value(arr.shape, arr.dtype, f"const{float(arr.reshape(-1)[0]) if arr.size == 1 else ''}",
                     kind="const", data=arr)

    def as_value(self, x, like: Value) -> Value:
        return x if isinstance(x, Value) else self.const(x, like.dtype)

    def error(self, what: str) -> UnsupportedOpError:
        n = self.fx_node
        where = f" at {n.meta.get('source', '?')}" if n is not None else ""
        return UnsupportedOpError(f"{describe_op(n, self.gm) if n is not None else 'op'}{where}: {what}")

    def param(self, tensor: torch.Tensor, module_path: str, attr: str) -> Value:
        full = f"{module_path}.{attr}" if module_path else attr
        table, kind = (self.ir.params, "param") if isinstance(tensor, nn.Parameter) else (self.ir.buffers, "buffer")
        if full not in table:
            table[full] = Value(tuple(tensor.shape), np_dtype(tensor.dtype), full, kind=kind)
        return table[full]

    # ---- view helpers -------------------------------------------------------------------------
    def reshape(self, x: Value, shape) -> Value:
        shape = list(shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = x.numel // max(known, 1)
        if int(np.prod(shape)) != x.numel:
            raise self.error(f"cannot reshape {list(x.shape)} to {shape}")
        return x if tuple(shape) == x.shape else self.one("reshape", [x], tuple(shape), x.dtype, shape=tuple(shape))

    def transpose(self, x: Value, perm) -> Value:
        perm = tuple(int(p) for p in perm)
        return self.one("transpose", [x], tuple(x.shape[p] for p in perm), x.dtype, perm=perm)

    def unary(self, op: str, x: Value, **attrs) -> Value:
        return self.one("unary", [x], x.shape, x.dtype, fn=op, **attrs)

    def binary(self, op: str, a, b) -> Value:
        if not isinstance(a, Value) and not isinstance(b, Value):
            raise self.error("an arithmetic op on two Python numbers should not reach the graph")
        a = self.as_value(a, b if isinstance(b, Value) else a)
        b = self.as_value(b, a)
        if a.dtype != b.dtype:
            raise self.error(f"operands have different dtypes {a.dtype} and {b.dtype}; cast one of them")
        shape = broadcast_shape(a.shape, b.shape)
        dtype = np.bool_ if op in ("eq", "gt", "lt", "ge", "le", "ne") else a.dtype
        return self.one("binary", [a, b], shape, dtype, fn=op)

    def reduce(self, op: str, x: Value, dims, keepdim: bool) -> Value:
        dims = tuple(range(len(x.shape))) if dims is None else tuple(
            sorted(_norm_axis(d, len(x.shape)) for d in ((dims,) if isinstance(dims, int) else dims)))
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape)) if keepdim else \
            tuple(s for i, s in enumerate(x.shape) if i not in dims)
        return self.one("reduce", [x], shape, x.dtype, fn=op, axes=dims, keepdims=bool(keepdim))

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> IRGraph:
        for n in self.gm.graph.nodes:
            self.fx_node = n
            block = n.meta.get("block")
            if n.op in OP_KINDS and block is not None:
                placed = self.placement[block]
                self.template = Node("", [], [], block=placed.block.user_id, stage=placed.stage,
                                     ipu=placed.ipu, phase=placed.phase, source=n.meta.get("source", ""))
            if n.op == "placeholder":
                meta = n.meta.get("tensor_meta")
                if meta is None:
                    self.env[n.name] = None
                    continue
                v = Value(tuple(meta.shape), np_dtype(meta.dtype), n.name, kind="input")
                self.ir.inputs.append(v)
                self.env[n.name] = v
            elif n.op == "get_attr":
                self.env[n.name] = self.get_attr(n)
            elif n.op == "output":
                self.ir.outputs = self.load(n.args[0])
            else:
                args = self.load(n.args)
                kwargs = self.load(n.kwargs)
                if n.op == "call_module":
                    out = self.call_module(self.modules[n.target], n.target, args, kwargs)
                elif n.op == "call_function":
                    out = self.call_function(n.target, args, kwargs)
                else:
                    out = self.call_method(n.target, args, kwargs)
                self.env[n.name] = out
                self.check_shape(n, out)
        return self.ir

    def check_shape(self, n: torch.fx.Node, out) -> None:
        meta = n.meta.get("tensor_meta")
        if isinstance(out, Value) and meta is not None and hasattr(meta, "shape"):
            if tuple(meta.shape) != tuple(out.shape):
                raise self.error(f"internal shape mismatch: torch gives {list(meta.shape)}, "
                                 f"the compiler {list(out.shape)}")

    def load(self, a):
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (tuple, list)):
            return type(a)(self.load(x) for x in a)
        if isinstance(a, dict):
            return {k: self.load(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.load(a.start), self.load(a.stop), self.load(a.step))
        return a

    def get_attr(self, n: torch.fx.Node) -> Value:
        obj = self.gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise self.error(f"attribute {n.target} is not a tensor")
        path, _, attr = str(n.target).rpartition(".")
        if id(obj) in self.param_names or id(obj) in self.buffer_names:
            return self.param(obj, path, attr)
        return self.const(obj.detach().cpu().numpy(), np_dtype(obj.dtype))

    # ---- modules ----------------------------------------------------------------------------
    def call_module(self, m: nn.Module, path: str, args, kwargs):
        for cls, fn in MODULES.items():
            if type(m) is cls:
                return fn(self, m, path, *args, **kwargs)
        raise self.error(f"module type {type(m).__name__} is not supported by the IPU compiler; "
                         f"supported modules: {', '.join(sorted(c.__name__ for c in MODULES))}")

    def call_function(self, fn, args, kwargs):
        handler = FUNCTIONS.get(fn)
        if handler is None:
            name = getattr(fn, "__qualname__", getattr(fn, "__name__", str(fn)))
            raise self.error(f"function {name} is not supported by the IPU compiler")
        return handler(self, *args, **kwargs)

    def call_method(self, name: str, args, kwargs):
        handler = METHODS.get(name)
        if handler is None:
            raise self.error(f"tensor method .{name}() is not supported by the IPU compiler")
        return handler(self, *args, **kwargs)


# =========================================================================================
# Converters. Each takes the converter, then the torch call's arguments (Values for tensors).
# =========================================================================================
def linear(c: Converter, x: Value, w: Value, b: Value | None = None) -> Value:
    lead = x.shape[:-1]
    x2 = c.reshape(x, (-1, x.shape[-1])) if len(x.shape) != 2 else x
    y = c.one("matmul", [x2, c.transpose(w, (1, 0))], (x2.shape[0], w.shape[0]), x.dtype)
    if b is not None:
        y = c.binary("add", y, b)
    return c.reshape(y, lead + (w.shape[0],)) if len(x.shape) != 2 else y


def conv2d(c: Converter, x, w, b=None, stride=1, padding=0, dilation=1, groups=1) -> Value:
    stride, dilation = _pair(stride), _pair(dilation)
    kh, kw = w.shape[2:]
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise c.error("padding='same' needs stride 1 (as in torch)")
            total = [dilation[i] * (k - 1) for i, k in enumerate((kh, kw))]
            if any(t % 2 for t in total):
                raise c.error("padding='same' with an even effective kernel needs asymmetric padding, "
                              "which the IPU compiler does not support; pad explicitly")
            padding = (total[0] // 2, total[1] // 2)
        else:
            raise c.error(f"unknown padding {padding!r}")
    padding = _pair(padding)
    n, _, h, wd = x.shape
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = c.one("conv2d", [x, w], (n, w.shape[0], oh, ow), x.dtype, stride=stride, padding=padding,
              dilation=dilation, groups=int(groups))
    if b is not None:
        y = c.binary("add", y, c.reshape(b, (1, -1, 1, 1)))
    return y


def pool_out(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def max_pool2d(c, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    if _pair(dilation) != (1, 1) or ceil_mode or return_indices:
        raise c.error("max pooling with dilation, ceil_mode or return_indices is not supported")
    k = _pair(kernel_size)
    s = _pair(stride if stride not in (None, []) else kernel_size)
    p = _pair(padding)
    shape = x.shape[:2] + (pool_out(x.shape[2], k[0], s[0], p[0]), pool_out(x.shape[3], k[1], s[1], p[1]))
    return c.one("max_pool2d", [x], shape, x.dtype, kernel=k, stride=s, padding=p)


def avg_pool2d(c, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    if ceil_mode or divisor_override is not None:
        raise c.error("average pooling with ceil_mode or divisor_override is not supported")
    k = _pair(kernel_size)
    s = _pair(stride if stride not in (None, []) else kernel_size)
    p = _pair(padding)
    shape = x.shape[:2] + (pool_out(x.shape[2], k[0], s[0], p[0]), pool_out(x.shape[3], k[1], s[1], p[1]))
    return c.one("avg_pool2d", [x], shape, x.dtype, kernel=k, stride=s, padding=p,
                 count_include_pad=bool(count_include_pad))


def adaptive_avg_pool2d(c, x, output_size):
    out = list(_pair(output_size) if not isinstance(output_size, (tuple, list)) else output_size)
    out = [x.shape[2 + i] if o is None else int(o) for i, o in enumerate(out)]
    return c.one("adaptive_avg_pool2d", [x], x.shape[:2] + tuple(out), x.dtype, output_size=tuple(out))


def softmax_like(op):
    def convert(c, x, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            raise c.error(f"{op} needs an explicit dim")
        if dtype is not None:
            x = cast(c, x, dtype)
        return c.one(op, [x], x.shape, x.dtype, axis=_norm_axis(int(dim), len(x.shape)))
    return convert


def dropout(c, x, p=0.5, training=True, inplace=False):
    if not training or not c.training or p == 0:
        return x
    if not 0 <= p < 1:
        raise c.error(f"dropout probability must be in [0, 1), got {p}")
    y, _ = c.emit("dropout", [x], [(x.shape, x.dtype), (x.shape, np.bool_)], p=float(p))
    return y


def flatten(c, x, start_dim=0, end_dim=-1):
    r = len(x.shape)
    s, e = _norm_axis(start_dim, r), _norm_axis(end_dim, r)
    return c.reshape(x, x.shape[:s] + (int(np.prod(x.shape[s:e + 1])),) + x.shape[e + 1:])


def layer_norm(c, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    nd = len(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else 1
    ins = [x] + [v for v in (weight, bias) if v is not None]
    stats = x.shape[:len(x.shape) - nd] + (1,) * nd
    y, _, _ = c.emit("layer_norm", ins, [(x.shape, x.dtype), (stats, np.float32), (stats, np.float32)],
                     normalized_ndim=nd, eps=float(eps), affine=weight is not None, has_bias=bias is not None)
    return y


def batch_norm(c, x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Training: normalise with the batch statistics and update the running ones in place (the
    outputs keep mean, biased var and 1/std for the backward); inference: the running statistics."""
    if len(x.shape) != 4:
        raise c.error("only 2-D batch norm (NCHW input) is supported")
    if weight is None or bias is None or running_mean is None or running_var is None:
        raise c.error("batch norm without affine parameters or running statistics is not supported")
    if momentum is None:
        raise c.error("batch norm with momentum=None (cumulative average) is not supported")
    ins = [x, weight, bias, running_mean, running_var]
    if not (training and c.training):
        return c.one("batch_norm", ins, x.shape, x.dtype, training=False, eps=float(eps))
    ch = (x.shape[1],)
    y, *_ = c.emit("batch_norm", ins, [(x.shape, x.dtype), (ch, np.float32), (ch, np.float32), (ch, np.float32)],
                   training=True, momentum=float(momentum), eps=float(eps))
    return y


def embedding(c, idx, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise c.error("embedding with max_norm, scale_grad_by_freq or sparse gradients is not supported")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return c.one("embedding", [idx, weight], idx.shape + (weight.shape[1],), weight.dtype,
                 padding_idx=-1 if padding_idx is None else int(padding_idx))


def loss_reduction(c, reduction, size_average=None, reduce=None):
    if size_average is not None or reduce is not None:
        raise c.error("the deprecated size_average/reduce arguments are not supported; use reduction=")
    if reduction not in ("mean", "sum", "none"):
        raise c.error(f"unknown reduction {reduction!r}")
    return reduction


def _loss_shape(x: Value, reduction: str) -> tuple:
    return x.shape[:1] if reduction == "none" else ()


def nll_loss(c, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    if weight is not None:
        raise c.error("class weights in NLL loss are not supported")
    r = loss_reduction(c, reduction, size_average, reduce)
    return c.one("nll_loss", [x, target], _loss_shape(x, r), x.dtype, reduction=r, ignore_index=int(ignore_index))


def cross_entropy(c, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    if weight is not None or label_smoothing:
        raise c.error("cross entropy with class weights or label smoothing is not supported")
    if len(x.shape) != 2 or target.dtype == np.float32:
        raise c.error("cross entropy needs [N, C] logits and [N] class indices")
    r = loss_reduction(c, reduction, size_average, reduce)
    return c.one("cross_entropy", [x, target], _loss_shape(x, r), x.dtype, reduction=r,
                 ignore_index=int(ignore_index))


def pointwise_loss(op):
    def convert(c, x, target, size_average=None, reduce=None, reduction="mean", weight=None):
        if weight is not None:
            raise c.error(f"{op} with weights is not supported")
        r = loss_reduction(c, reduction, size_average, reduce)
        if x.shape != target.shape:
            raise c.error(f"{op} needs input and target of the same shape, got {list(x.shape)} and "
                          f"{list(target.shape)} (broadcasting in losses is not supported)")
        return c.one(op, [x, target], x.shape if r == "none" else (), x.dtype, reduction=r)
    return convert


def ctc_loss(c, log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    r = loss_reduction(c, reduction)
    if r == "none":
        raise c.error("CTC loss supports reduction 'sum' or 'mean' on the IPU, as in PopTorch")
    if len(targets.shape) != 2:
        raise c.error("CTC loss needs 2-D padded targets [N, S], as in PopTorch")
    return c.one("ctc_loss", [log_probs, targets, input_lengths, target_lengths], (), log_probs.dtype,
                 blank=int(blank), reduction=r, zero_infinity=bool(zero_infinity))


def identity_loss(c, x, reduction):
    r = {"sum": "sum", "mean": "mean", "none": "none", 0: "sum", 1: "mean", 2: "none"}.get(reduction)
    if r is None:
        raise c.error(f"identity_loss reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    return c.one("identity_loss", [x], x.shape if r == "none" else (), x.dtype, reduction=r)


def matmul(c, a, b):
    if len(a.shape) == 2 and len(b.shape) == 2:
        return c.one("matmul", [a, b], (a.shape[0], b.shape[1]), a.dtype)
    if len(a.shape) == 3 and len(b.shape) == 3 and a.shape[0] == b.shape[0]:
        return c.one("matmul", [a, b], (a.shape[0], a.shape[1], b.shape[2]), a.dtype)
    if len(b.shape) == 2 and len(a.shape) > 2:
        y = c.one("matmul", [c.reshape(a, (-1, a.shape[-1])), b], (int(np.prod(a.shape[:-1])), b.shape[1]), a.dtype)
        return c.reshape(y, a.shape[:-1] + (b.shape[1],))
    raise c.error(f"matmul of shapes {list(a.shape)} and {list(b.shape)} is not supported "
                  "(2-D @ 2-D, N-D @ 2-D and batched 3-D @ 3-D are)")


def cast(c, x, dtype):
    dt = np_dtype(dtype) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    return x if dt == x.dtype else c.one("cast", [x], x.shape, dt)


def permute(c, x, *dims):
    dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
    return c.transpose(x, [_norm_axis(d, len(x.shape)) for d in dims])


def transpose_dims(c, x, d0, d1):
    perm = list(range(len(x.shape)))
    d0, d1 = _norm_axis(d0, len(perm)), _norm_axis(d1, len(perm))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return c.transpose(x, perm)


def view(c, x, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    return c.reshape(x, [int(s) for s in shape])


def unsqueeze(c, x, dim):
    d = _norm_axis(dim, len(x.shape) + 1)
    return c.reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def squeeze(c, x, dim=None):
    if dim is None:
        return c.reshape(x, tuple(s for s in x.shape if s != 1))
    d = _norm_axis(dim, len(x.shape))
    return c.reshape(x, x.shape[:d] + x.shape[d + 1:]) if x.shape[d] == 1 else x


def getitem(c, x, key):
    if not isinstance(x, Value):
        return x[key]
    key = key if isinstance(key, tuple) else (key,)
    if not all(isinstance(k, (slice, int)) for k in key):
        raise c.error("tensor indexing supports integers and slices only")
    index = np.arange(x.numel).reshape(x.shape)[key]
    return c.one("slice", [x], index.shape, x.dtype, key=key)


def get_attribute(c, x, name):
    if not isinstance(x, Value):
        return getattr(x, name)
    if name == "T":
        return c.transpose(x, tuple(reversed(range(len(x.shape)))))
    if name == "shape":
        return tuple(x.shape)
    if name == "ndim":
        return len(x.shape)
    raise c.error(f"tensor attribute .{name} is not supported by the IPU compiler")


def size(c, x, dim=None):
    return tuple(x.shape) if dim is None else x.shape[dim]


def reduce_fn(op):
    def convert(c, x, dim=None, keepdim=False, dtype=None):
        if dtype is not None:
            x = cast(c, x, dtype)
        if isinstance(dim, (list, tuple)) and not dim:
            dim = None
        return c.reduce(op, x, dim, keepdim)
    return convert


def unary_fn(op):
    return lambda c, x, *a, **k: c.unary(op, x)


def gelu(c, x, approximate="none"):
    if approximate != "none":
        raise c.error("GELU with approximate='tanh' is not supported; use approximate='none'")
    return c.unary("gelu", x)


def binary_fn(op, reverse=False):
    def convert(c, a, b, alpha=1):
        if alpha != 1:
            b = c.binary("mul", b, alpha) if isinstance(b, Value) else b * alpha
        return c.binary(op, b, a) if reverse else c.binary(op, a, b)
    return convert


def rsub(c, a, b, alpha=1):
    return c.binary("sub", b, a)


def neg(c, x):
    return c.unary("neg", x)


def pow_(c, x, exponent):
    if exponent == 2:
        return c.unary("square", x)
    return c.binary("pow", x, exponent)


def contiguous(c, x, *a, **k):
    return x


def to(c, x, *args, **kwargs):
    dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    return cast(c, x, dtype) if dtype is not None else x


def conv2d_module(c: Converter, m: nn.Conv2d, path: str, x: Value) -> Value:
    if m.padding_mode != "zeros":
        raise c.error(f"Conv2d padding_mode={m.padding_mode!r} is not supported; only 'zeros' is")
    return conv2d(c, x, c.param(m.weight, path, "weight"),
                  c.param(m.bias, path, "bias") if m.bias is not None else None,
                  m.stride, m.padding, m.dilation, m.groups)


MODULES = {
    nn.Linear: lambda c, m, p, x: linear(c, x, c.param(m.weight, p, "weight"),
                                         c.param(m.bias, p, "bias") if m.bias is not None else None),
    nn.Conv2d: lambda c, m, p, x: conv2d_module(c, m, p, x),
    nn.MaxPool2d: lambda c, m, p, x: max_pool2d(c, x, m.kernel_size, m.stride, m.padding, m.dilation,
                                                m.ceil_mode, m.return_indices),
    nn.AvgPool2d: lambda c, m, p, x: avg_pool2d(c, x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                m.count_include_pad, m.divisor_override),
    nn.AdaptiveAvgPool2d: lambda c, m, p, x: adaptive_avg_pool2d(c, x, m.output_size),
    nn.ReLU: lambda c, m, p, x: c.unary("relu", x),
    nn.GELU: lambda c, m, p, x: gelu(c, x, m.approximate),
    nn.Tanh: lambda c, m, p, x: c.unary("tanh", x),
    nn.Sigmoid: lambda c, m, p, x: c.unary("sigmoid", x),
    nn.Softmax: lambda c, m, p, x: softmax_like("softmax")(c, x, m.dim),
    nn.LogSoftmax: lambda c, m, p, x: softmax_like("log_softmax")(c, x, m.dim),
    nn.Dropout: lambda c, m, p, x: dropout(c, x, m.p, m.training),
    nn.Flatten: lambda c, m, p, x: flatten(c, x, m.start_dim, m.end_dim),
    nn.Identity: lambda c, m, p, x: x,
    nn.LayerNorm: lambda c, m, p, x: layer_norm(c, x, m.normalized_shape,
                                                c.param(m.weight, p, "weight") if m.elementwise_affine else None,
                                                c.param(m.bias, p, "bias") if m.bias is not None else None, m.eps),
    nn.BatchNorm2d: lambda c, m, p, x: batch_norm(c, x, c.param(m.running_mean, p, "running_mean"),
                                                  c.param(m.running_var, p, "running_var"),
                                                  c.param(m.weight, p, "weight"), c.param(m.bias, p, "bias"),
                                                  m.training, m.momentum, m.eps),
    nn.Embedding: lambda c, m, p, x: embedding(c, x, c.param(m.weight, p, "weight"), m.padding_idx, m.max_norm),
    nn.CrossEntropyLoss: lambda c, m, p, x, t: cross_entropy(c, x, t, ignore_index=m.ignore_index,
                                                             reduction=m.reduction, label_smoothing=m.label_smoothing),
    nn.NLLLoss: lambda c, m, p, x, t: nll_loss(c, x, t, ignore_index=m.ignore_index, reduction=m.reduction),
    nn.MSELoss: lambda c, m, p, x, t: pointwise_loss("mse_loss")(c, x, t, reduction=m.reduction),
    nn.L1Loss: lambda c, m, p, x, t: pointwise_loss("l1_loss")(c, x, t, reduction=m.reduction),
    nn.CTCLoss: lambda c, m, p, *a: ctc_loss(c, *a, blank=m.blank, reduction=m.reduction,
                                             zero_infinity=m.zero_infinity),
}

FUNCTIONS = {
    ops.identity_loss: identity_loss,
    F.linear: linear, F.conv2d: conv2d, F.max_pool2d: max_pool2d, F.avg_pool2d: avg_pool2d,
    F.adaptive_avg_pool2d: adaptive_avg_pool2d, F.relu: unary_fn("relu"), torch.relu: unary_fn("relu"),
    F.gelu: gelu, torch.tanh: unary_fn("tanh"), F.tanh: unary_fn("tanh"), torch.sigmoid: unary_fn("sigmoid"),
    F.sigmoid: unary_fn("sigmoid"), torch.exp: unary_fn("exp"), torch.log: unary_fn("log"),
    torch.sqrt: unary_fn("sqrt"), torch.rsqrt: unary_fn("rsqrt"), torch.abs: unary_fn("abs"),
    torch.neg: neg, operator.neg: neg,
    F.softmax: softmax_like("softmax"), torch.softmax: softmax_like("softmax"),
    F.log_softmax: softmax_like("log_softmax"), torch.log_softmax: softmax_like("log_softmax"),
    F.dropout: dropout, torch.flatten: flatten, torch.reshape: view,
    F.layer_norm: layer_norm, F.batch_norm: batch_norm, F.embedding: embedding,
    operator.add: binary_fn("add"), torch.add: binary_fn("add"), operator.sub: binary_fn("sub"),
    torch.sub: binary_fn("sub"), operator.mul: binary_fn("mul"), torch.mul: binary_fn("mul"),
    operator.truediv: binary_fn("div"), torch.div: binary_fn("div"), torch.rsub: rsub,
    torch.maximum: binary_fn("max"), torch.minimum: binary_fn("min"), operator.pow: pow_, torch.pow: pow_,
    operator.matmul: matmul, torch.matmul: matmul, torch.mm: matmul, torch.bmm: matmul,
    torch.mean: reduce_fn("mean"), torch.sum: reduce_fn("sum"),
    F.nll_loss: nll_loss, F.cross_entropy: cross_entropy, F.mse_loss: pointwise_loss("mse_loss"),
    F.l1_loss: pointwise_loss("l1_loss"), F.ctc_loss: ctc_loss,
    operator.getitem: getitem, getattr: get_attribute, torch.transpose: transpose_dims, torch.permute: permute,
    torch.unsqueeze: unsqueeze, torch.squeeze: squeeze,
}

METHODS = {
    "view": view, "reshape": view, "flatten": flatten, "permute": permute, "transpose": transpose_dims,
    "t": lambda c, x: c.transpose(x, (1, 0)), "mean": reduce_fn("mean"), "sum": reduce_fn("sum"),
    "relu": unary_fn("relu"), "tanh": unary_fn("tanh"), "sigmoid": unary_fn("sigmoid"), "exp": unary_fn("exp"),
    "log": unary_fn("log"), "sqrt": unary_fn("sqrt"), "abs": unary_fn("abs"), "neg": neg,
    "softmax": softmax_like("softmax"), "log_softmax": softmax_like("log_softmax"),
    "size": size, "contiguous": contiguous, "float": lambda c, x: cast(c, x, torch.float32),
    "half": lambda c, x: cast(c, x, torch.float16), "to": to, "type": to, "unsqueeze": unsqueeze,
    "squeeze": squeeze, "add": binary_fn("add"), "sub": binary_fn("sub"), "mul": binary_fn("mul"),
    "div": binary_fn("div"), "pow": pow_, "matmul": matmul, "__getitem__": getitem,
}


def to_ir(gm: torch.fx.GraphModule, placement: Placement, training: bool) -> IRGraph:
    """Convert a captured, placed fx graph to IR; in training, find the one final loss."""
    ir = Converter(gm, placement, training).run()
    if training:
        ir.loss = find_final_loss(ir)
    return ir


def find_final_loss(ir: IRGraph) -> Value:
    """PopTorch's rule: exactly one loss among the outputs, not feeding another loss."""
    outputs = {v.id for v in flatten_values(ir.outputs)}
    ancestors_of_outputs: set[int] = set(outputs)
    for n in reversed(ir.nodes):
        if any(v.id in ancestors_of_outputs for v in n.outputs):
            ancestors_of_outputs.update(v.id for v in n.inputs)
    loss_nodes = [n for n in ir.nodes if n.op in LOSS_OPS and n.outputs[0].id in ancestors_of_outputs]
    feeding_other = set()
    for n in loss_nodes:
        frontier = {n.outputs[0].id}
        for m in ir.nodes[ir.nodes.index(n) + 1:]:
            if any(v.id in frontier for v in m.inputs):
                frontier.update(v.id for v in m.outputs)
                if m.op in LOSS_OPS:
                    feeding_other.add(n)
    finals = [n for n in loss_nodes if n not in feeding_other]
    if not finals:
        raise RuntimeError("Couldn't find a loss in the graph: a training model must return a loss computed "
                           "by a torch loss (e.g. torch.nn.NLLLoss) or wrapped in poptorch.identity_loss(x, "
                           "reduction=...)")
    if len(finals) > 1:
        where = ", ".join(f"{n.op} at {n.source}" for n in finals)
        raise RuntimeError(f"Multiple independent losses found in the graph ({where}). The graph must have one "
                           "final loss: combine them and wrap the result in poptorch.identity_loss(total, "
                           "reduction='none')")
    loss = finals[0].outputs[0]
    if loss.numel != 1:
        raise RuntimeError(f"the final loss {finals[0].op} at {finals[0].source} has shape {list(loss.shape)}; "
                           "training needs a scalar loss: use reduction='mean' or 'sum'")
    return loss

