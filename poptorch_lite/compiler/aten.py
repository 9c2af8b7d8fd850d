"""From a captured joint ATen graph (:mod:`.export`) to our IR: one lowering per ATen op.

:data:`LOWERINGS` maps each ATen op (its overload packet, e.g. ``aten.add``) to a function that
emits IR nodes onto the ops ipusim has today; ``docs/ops.md`` is generated from it
(:func:`ops_table`). The graph is already decomposed to core ATen except the ops kept whole for a
fused ipusim kernel (:func:`decompositions`). An op without a lowering is an :class:`UnsupportedOpError`
at compile time naming the ATen op, the user's source line and the module path.

Placement: every node lands on the stage and IPU of its block (``export.Annotation``); forward
nodes are ``pass_="fwd"``, nodes traced inside ``torch.autograd.grad`` are ``"bwd"`` and carry
the block of the forward call they differentiate. A node without a block (functionalisation's
copies, the sum of two gradients of one value, the gradient seed) goes where its inputs are:
forward nodes with their latest input, backward nodes with their earliest (the backward runs
the stages in reverse), or, without placed inputs, with their first consumer.

int64 tensors become int32 on the device, as PopTorch does (an int64 constant beyond int32, or an
index op whose positions exceed int32, is an error); float64 becomes float32.
"""
from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._decomp.decompositions import native_batch_norm_decomposition

from ..api.blocks import DEFAULT_REGION
from ..api.cpu_ops import cpu_call
from ..api.custom_ops import call_spec, registered_custom_op
from ..api.errors import Error
from ..api.options import REPEATED
from ..api.printing import PrintFormat
from ..api.strategies import ExecutionStrategy, Placement, check_data_flow as check_flow
from . import control_flow, library, recurrent  # noqa: F401  (register the poptorch_lite ops lowered below)
from .export import JointGraph, Output, annotation_of, pass_of
from .multiconv import member_attrs
from .ir import VIEW_OPS, IRGraph, Node, Value, map_values

aten = torch.ops.aten
logger = logging.getLogger("poptorch_lite")


class UnsupportedOpError(Error, NotImplementedError):
    """The model uses an op the compiler cannot lower."""


INT32_MAX = 2**31 - 1   # the IPU's largest integer (it has no int64)


# 8- and 16-bit integer tensors cross to and from the device in their own dtype and are held there
# in 32-bit words; the compiler only moves, compares and converts them (SMALL_INT_MOVES, ...), so
# only a conversion into them needs their wrap-around (`_wrap_small_int`) and no arithmetic does.
SMALL_INTS = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16}


def np_dtype(dtype: torch.dtype) -> np.dtype:
    table = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int32,
             torch.int32: np.int32, torch.bool: np.bool_, torch.float64: np.float32,
             torch.int8: np.int32, torch.uint8: np.int32, torch.int16: np.int32}
    if dtype not in table:
        raise UnsupportedOpError(f"tensors of dtype {dtype} are not supported on the IPU")
    return np.dtype(table[dtype])


def host_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The host dtype of a tensor the device holds wider (SMALL_INTS), else None."""
    return np.dtype(SMALL_INTS[dtype]) if dtype in SMALL_INTS else None


@dataclass(frozen=True)
class Site:
    """Where a node runs."""
    block: str | None
    stage: int
    ipu: int
    phase: int | None
    pass_: str
    source: str
    scope: str = ""

    def template(self) -> Node:
        return Node("", [], [], block=self.block, stage=self.stage, ipu=self.ipu, phase=self.phase,
                    pass_=self.pass_, source=self.source, scope=self.scope)


@dataclass(frozen=True)
class Only:
    """An output only the matching backward op may read (max pooling's indices stand for the
    pooled values, NLL's total weight for nothing): any other use is unsupported."""
    what: str
    value: Value | None = None


# ---- placement ------------------------------------------------------------------------------------
def op_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def traced_blocks(joint: JointGraph) -> list:
    """The blocks holding forward ops, in order of their first op."""
    blocks = []
    for n in op_nodes(joint.graph_module.graph):
        a = annotation_of(n)
        if a is not None and a.block is not None and pass_of(n) == "fwd":
            blocks.append(a.block)
    return list(dict.fromkeys(blocks)) or [DEFAULT_REGION]


def place(joint: JointGraph, strategy: ExecutionStrategy) -> tuple[Placement, dict]:
    """Place the blocks under `strategy`; return the placement and every op node's Site. Data
    may only flow to the same or a later stage (pipelines) or phase (phased execution)."""
    placement = strategy.place(traced_blocks(joint))
    nodes = op_nodes(joint.graph_module.graph)
    passes = node_passes(nodes)
    sites: dict[torch.fx.Node, Site] = {}
    for n in nodes:
        a = annotation_of(n)
        if a is not None and a.block is not None:
            p = placement[a.block]
            sites[n] = Site(p.block.user_id, p.stage, p.ipu, p.phase, passes[n], a.source, a.scope)
    for n in nodes:  # by their inputs
        if n in sites:
            continue
        placed = [sites[i] for i in n.all_input_nodes if i in sites]
        if placed:
            pick = max if passes[n] == "fwd" else min
            s = pick(placed, key=lambda s: (s.stage, s.phase or 0))
            sites[n] = Site(s.block, s.stage, s.ipu, s.phase, passes[n], s.source, s.scope)
    for n in reversed(nodes):  # by their first consumer
        if n in sites:
            continue
        users = [sites[u] for u in n.users if u in sites]
        if users:
            u = users[0]
            sites[n] = Site(u.block, u.stage, u.ipu, u.phase, passes[n], u.source, u.scope)
        else:
            p = placement.blocks[0]
            sites[n] = Site(p.block.user_id, p.stage, p.ipu, p.phase, passes[n], "")
    check_data_flow(joint, placement, sites)
    return placement, sites


def node_passes(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, str]:
    """Each op's pass: the one it was traced in, except that an op reading a backward value is in the
    backward (functionalisation remakes a returned view of a gradient from its base after the
    gradient's trace has ended)."""
    passes: dict[torch.fx.Node, str] = {}
    for n in nodes:
        own = pass_of(n)
        passes[n] = "bwd" if own == "fwd" and any(passes.get(i) == "bwd" for i in n.all_input_nodes) else own
    return passes


def check_data_flow(joint: JointGraph, placement: Placement, sites: dict) -> None:
    """Every forward op uses results of its own or an earlier stage or phase only."""
    for n, here in sites.items():
        if here.pass_ != "fwd" or annotation_of(n) is None:
            continue
        for producer in n.all_input_nodes:
            there = sites.get(producer)
            if there is None or there.pass_ != "fwd" or annotation_of(producer) is None:
                continue
            a, b = annotation_of(n), annotation_of(producer)
            check_flow(placement.schedule_kind, a.describe(), a.source, here, b.describe(), there)


# ---- lowering -------------------------------------------------------------------------------------
class Lowerer:
    """Walks the joint graph and emits IR nodes placed at each node's Site."""

    def __init__(self, joint: JointGraph, sites: dict):
        self.joint = joint
        self.gm = joint.graph_module
        self.sites = sites
        self.ir = IRGraph()
        self.env: dict[torch.fx.Node, object] = {}
        self.node: torch.fx.Node | None = None
        self.template = Node("", [], [])

    # ---- emitting ---------------------------------------------------------------------------
    def emit(self, op: str, inputs: list[Value], out_specs: list[tuple], /, **attrs) -> list[Value]:
        return self.ir.add(op, inputs, out_specs, like=self.template, **attrs)

    def one(self, op, inputs, shape, dtype, /, **attrs) -> Value:
        return self.emit(op, inputs, [(shape, dtype)], **attrs)[0]

    def const(self, value, dtype) -> Value:
        arr = np.asarray(value, dtype=dtype)
        label = f"const{float(arr.reshape(-1)[0])}" if arr.size == 1 else "const"
        return Value(arr.shape, arr.dtype, label, kind="const", data=arr)

    def error(self, what: str) -> UnsupportedOpError:
        n = self.node
        a = annotation_of(n) if n is not None else None
        target = str(n.target) if n is not None else "op"
        where = " (added by the capture, no user source)" if a is None else f" {a.origin()}"
        return UnsupportedOpError(f"aten op {target}{where}: {what}")

    def unsupported(self) -> UnsupportedOpError:
        return self.error("not supported by the IPU compiler (see docs/ops.md for the supported ATen ops)")

    # ---- helpers ------------------------------------------------------------------------------
    def out_meta(self, i: int | None = None):
        """The node's (fake) result; of a multi-output op, output i (default the first)."""
        val = self.node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return val[i or 0]
        return val

    def out_dtype(self, i: int | None = None) -> np.dtype:
        return np_dtype(self.out_meta(i).dtype)

    def cast(self, x: Value, dtype) -> Value:
        dtype = np.dtype(dtype)
        return x if x.dtype == dtype else self.one("cast", [x], x.shape, dtype)

    def operand(self, x, dtype) -> Value:
        return self.cast(x, dtype) if isinstance(x, Value) else self.const(x, dtype)

    def reshape(self, x: Value, shape) -> Value:
        shape = list(int(s) for s in shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = x.numel // max(known, 1)
        if int(np.prod(shape)) != x.numel:
            raise self.error(f"cannot reshape {list(x.shape)} to {shape}")
        return x if tuple(shape) == x.shape else self.one("reshape", [x], tuple(shape), x.dtype, shape=tuple(shape))

    def transpose(self, x: Value, perm) -> Value:
        perm = tuple(int(p) % max(len(x.shape), 1) for p in perm)
        if perm == tuple(range(len(x.shape))):
            return x
        return self.one("transpose", [x], tuple(x.shape[p] for p in perm), x.dtype, perm=perm)

    def expand(self, x: Value, shape) -> Value:
        shape = tuple(int(s) for s in shape)
        lead = len(shape) - len(x.shape)
        shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
        if lead:
            x = self.reshape(x, (1,) * lead + x.shape)
        return x if x.shape == shape else self.one("expand", [x], shape, x.dtype, shape=shape)

    def unary(self, fn: str, x: Value, **attrs) -> Value:
        return self.one("unary", [x], x.shape, x.dtype, fn=fn, **attrs)

    def binary(self, fn: str, a, b, dtype=None) -> Value:
        """a fn b with both operands in `dtype` (the node's output dtype unless given)."""
        dtype = np.dtype(dtype if dtype is not None else self.out_dtype())
        a, b = self.operand(a, dtype), self.operand(b, dtype)
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        out = np.bool_ if fn in COMPARISONS else dtype
        return self.one("binary", [a, b], shape, out, fn=fn)

    def reduce(self, fn: str, x: Value, dims, keepdim: bool) -> Value:
        rank = len(x.shape)
        if rank == 0:   # a scalar's dimension 0 (or -1) is itself: nothing to reduce
            return x
        dims = tuple(range(rank)) if dims is None or (isinstance(dims, (list, tuple)) and not dims) else \
            tuple(sorted({int(d) % rank for d in ((dims,) if isinstance(dims, int) else dims)}))
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape)) if keepdim else \
            tuple(s for i, s in enumerate(x.shape) if i not in dims)
        return self.one("reduce", [x], shape, x.dtype, fn=fn, axes=dims, keepdims=bool(keepdim))

    def where(self, cond: Value, a, b, dtype=None) -> Value:
        """select(cond, a, b) in `dtype` (the node's output dtype unless given) from ops ipusim has:
        relu_grad(m, v) is v where m > 0 and exactly 0 elsewhere, so a where cond plus b where not
        cond is exact (the unused side's inf or nan never reaches the sum)."""
        dtype = np.dtype(dtype if dtype is not None else self.out_dtype())
        m = self.cast(cond, dtype)
        a, b = self.operand(a, dtype), self.operand(b, dtype)
        shape = tuple(np.broadcast_shapes(m.shape, a.shape, b.shape))
        m = self.expand(m, shape)
        not_m = self.unary("scale", m, scale=-1.0, bias=1.0)
        return self.binary("add", self.binary("relu_grad", m, a, dtype), self.binary("relu_grad", not_m, b, dtype),
                           dtype)

    # ---- driver ---------------------------------------------------------------------------------
    def run(self) -> IRGraph:
        j = self.joint
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        names = [("param", n) for n in j.params] + [("buffer", n) for n in j.buffers] + [("input", n) for n in j.inputs]
        for (kind, name), n in zip(names, placeholders):
            meta = n.meta["val"]
            v = Value(tuple(meta.shape), np_dtype(meta.dtype), name, kind=kind, host_dtype=host_dtype(meta.dtype))
            if kind == "param":
                self.ir.params[name] = v
            elif kind == "buffer":
                self.ir.buffers[name] = v
            else:
                self.ir.inputs.append(v)
            self.env[n] = v
        for n in self.gm.graph.nodes:
            self.node = n
            if n.op == "get_attr":
                t = getattr(self.gm, n.target)
                if t.dtype == torch.int64 and t.numel() and (t.max() > INT32_MAX or t.min() < -INT32_MAX - 1):
                    raise self.error(f"the int64 constant {n.target} holds values beyond int32, and the IPU has no "
                                     "int64: keep its values within +-2^31")
                self.env[n] = self.const(t.detach().cpu().numpy(), np_dtype(t.dtype))
            elif n.op == "call_function":
                self.template = self.sites[n].template()
                self.template.aten = str(n.target)
                self.template.module = getattr(annotation_of(n), "module", "")
                self.env[n] = self.call(n)
            elif n.op == "output":
                self.finish(list(n.args[0]))
        return self.ir

    def load(self, a):
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            if isinstance(v, Only):
                raise self.error(f"uses {v.what}, which only its backward op can read")
            return v
        if isinstance(a, (tuple, list)):
            return type(a)(self.load(x) for x in a)
        if isinstance(a, dict):
            return {k: self.load(v) for k, v in a.items()}
        return a

    def call(self, n: torch.fx.Node):
        if n.target is operator.getitem:
            return self.env[n.args[0]][n.args[1]]
        packet = getattr(n.target, "overloadpacket", None)
        lower = LOWERINGS.get(packet)
        if lower is None and packet in DATA_DEPENDENT_SHAPES:
            raise self.error(f"its output's shape depends on the input's values, which a compiled program cannot "
                             f"have (PopTorch refuses it too): {DATA_DEPENDENT_SHAPES[packet]}")
        if lower is None:
            raise self.unsupported()
        if getattr(lower, "raw", False):
            out = lower(self, n)
        else:
            self.check_small_ints(n, packet)
            out = lower(self, *self.load(n.args), **self.load(n.kwargs))
        val = n.meta.get("val")
        if isinstance(out, Value) and isinstance(val, torch.Tensor) and tuple(val.shape) != out.shape:
            raise self.error(f"internal shape mismatch: torch gives {list(val.shape)}, the compiler {list(out.shape)}")
        return out

    def check_small_ints(self, n: torch.fx.Node, packet) -> None:
        """An op on int8, uint8 or int16 tensors must only move or convert them (see SMALL_INTS)."""
        ins = [a.meta["val"].dtype for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        val = n.meta.get("val")
        out = val.dtype if isinstance(val, torch.Tensor) else None
        small = [d for d in ins + [out] if d in SMALL_INTS]
        if not small:
            return
        if packet in SMALL_INT_CONVERSIONS or packet in SMALL_INT_CONSTANTS or \
                (packet in SMALL_INT_COMPARISONS and out not in SMALL_INTS):
            return
        if packet not in SMALL_INT_MOVES or (out in SMALL_INTS and any(d != out for d in ins)):
            raise self.error(f"computes on or into {small[0]} tensors, which the IPU emulator only transfers, "
                             "reshapes and converts: cast them to a supported dtype first (x.int(), x.float())")

    def finish(self, outs: list) -> None:
        j = self.joint
        values = [self.env[o] if isinstance(o, torch.fx.Node) else o for o in outs]
        user = [self.in_host_dtype(o, self.copy_of_state(v)) for o, v in zip(outs, values[:j.num_outputs])]
        updated = len(j.input_updates)
        rest = values[j.num_outputs + updated:]
        self.ir.outputs = map_values(j.output_tree, lambda leaf: user[leaf.index], Output)
        self.ir.input_updates = [(i, self.input_update(i, v))
                                 for i, v in zip(j.input_updates, values[j.num_outputs:j.num_outputs + updated])]
        if j.loss is not None:
            self.ir.loss, rest = rest[0], rest[1:]
            self.ir.grads = {name: self.constant_gradient(name, g) for name, g in zip(j.grads, rest[:len(j.grads)])}
            rest = rest[len(j.grads):]
        for name, new in zip(j.buffers, rest):
            old = self.ir.buffers[name]
            if new is old:
                continue
            # the update runs where the buffer's new value is made, or where the buffer is read
            producer = new.producer if isinstance(new, Value) else None
            reader = producer or next((node for node in self.ir.nodes if any(v is old for v in node.inputs)), None)
            self.template = reader or self.template
            self.emit("assign", [old, self.cast(new, old.dtype)], [])

    def in_host_dtype(self, o, v):
        """Output `v` of fx node `o`, as a value of its own (a view) when its host dtype differs
        from the one `v` has (an int8 input returned both as it is and as int32)."""
        if not (isinstance(o, torch.fx.Node) and isinstance(v, Value) and isinstance(o.meta.get("val"), torch.Tensor)):
            return v
        want = host_dtype(o.meta["val"].dtype)
        if v.host_dtype == want:
            return v
        out = self.one("reshape", [v], v.shape, v.dtype, shape=v.shape)
        out.host_dtype = want
        return out

    def input_update(self, index: int, v):
        """The new value of input `index`, which the model changed in place, as the device sends it
        back: in the input's dtype."""
        if not isinstance(v, Value):
            raise self.error(f"input {self.joint.inputs[index]} is changed in place to a value that is not a tensor")
        return self.cast(v, self.ir.inputs[index].dtype)

    def constant_gradient(self, name: str, g):
        """A gradient that is a constant (zeros, of floor, round or sign) made in the backward
        pass on its weight's IPU (a copy), so that the weight is trained like the others: its
        gradient accumulates and its optimiser (momentum, weight decay) updates it."""
        if not (isinstance(g, Value) and g.kind == "const"):
            return g
        w = self.ir.params[name]
        reader = next((node for node in self.ir.nodes if any(x is w for x in node.inputs)), None)
        if reader is None:   # no op reads the weight's values (fill_, zero_, a matrix power 0): its first user's site
            placeholder = next(n for n, v in self.env.items() if v is w)
            site = next((self.sites[u] for u in placeholder.users if u in self.sites), None)
            if site is None:
                return g
            reader = site.template()
        self.template = Node("", [], [], block=reader.block, stage=reader.stage, ipu=reader.ipu, phase=reader.phase,
                             pass_="bwd", source=reader.source)
        return self.one("copy", [g], g.shape, g.dtype)

    def copy_of_state(self, v):
        """A parameter or buffer the model returns as it is, copied where its first reader runs
        (the IPU that holds it, in the forward): the output is its value as that micro-batch's
        forward saw it, as PopTorch returns it."""
        if not (isinstance(v, Value) and v.kind in ("param", "buffer")):
            return v
        reader = next((node for node in self.ir.nodes if any(x is v for x in node.inputs)), None)
        self.template = reader or (self.ir.nodes[0] if self.ir.nodes else self.template)
        return self.one("copy", [v], v.shape, v.dtype)


def to_ir(joint: JointGraph, strategy: ExecutionStrategy) -> tuple[IRGraph, Placement]:
    """Place the captured graph under `strategy` and lower it to IR (ops whose results nobody
    uses are dropped first)."""
    joint.graph_module.graph.eliminate_dead_code()
    placement, sites = place(joint, strategy)
    ir = Lowerer(joint, sites).run()
    control_flow.check_scopes(ir)
    return ir, placement


# =========================================================================================
# Lowerings: (lowerer, *ATen arguments with Values for tensors) -> Value, tuple, list or Only
# =========================================================================================
LOWERINGS: dict = {}
COMPARISONS = {"eq", "ne", "gt", "ge", "lt", "le", "logical_and", "logical_or", "logical_xor"}


# Ops whose output shape depends on the data, and what to use instead
DATA_DEPENDENT_SHAPES = {
    aten.nonzero: "use torch.nonzero_static(x, size=...) with a bound on the count, or a mask",
    aten.argwhere: "use torch.nonzero_static(x, size=...) with a bound on the count, or a mask",
    aten.masked_select: "use torch.where(mask, x, 0) or multiply by the mask",
    aten._unique2: "count with a fixed number of bins (torch.histc, scatter_add) instead",
    aten.unique_dim: "count with a fixed number of bins (torch.histc, scatter_add) instead",
    aten.unique_consecutive: "compare neighbours (x[1:] != x[:-1]) and keep a mask instead",
}


def lowers(*packets, doc: str = "", raw: bool = False):
    """Register a lowering; a `raw` one is given the fx node (to read a forward op's Only output)."""
    def deco(fn):
        for p in packets:
            LOWERINGS[p] = fn
        fn.doc, fn.raw = doc, raw
        return fn
    return deco


def _int_list(v, n: int = 2) -> tuple:
    return (int(v),) * n if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)


# ---- no computation ------------------------------------------------------------------------------
@lowers(aten.alias, aten.clone, aten.lift_fresh, aten.lift_fresh_copy, aten.detach, aten.alias_copy, aten.detach_copy,
        doc="no computation (values are never mutated after functionalisation)")
def _same(c, x, *args, **kwargs):
    return x


SMALL_INT_MOVES = {aten.alias, aten.clone, aten.lift_fresh, aten.lift_fresh_copy, aten.detach, aten.alias_copy,
                   aten.detach_copy, aten.view, aten.view_copy, aten._unsafe_view, aten.reshape, aten.permute,
                   aten.permute_copy, aten.unsqueeze, aten.unsqueeze_copy, aten.squeeze, aten.squeeze_copy,
                   aten.expand, aten.expand_copy, aten.t, aten.t_copy, aten.transpose, aten.transpose_copy,
                   aten.slice, aten.slice_copy, aten.select, aten.select_copy}
# conversions into a small int wrap as torch's do (`_wrap_small_int`); constants are made wrapped;
# comparisons are exact on the 32-bit words
SMALL_INT_CONVERSIONS = {aten._to_copy, aten.to, aten.copy}
SMALL_INT_CONSTANTS = {aten.arange, aten.full, aten.full_like, aten.zeros, aten.ones, aten.zeros_like, aten.ones_like,
                       aten.new_zeros, aten.new_ones, aten.empty, aten.empty_like, aten.scalar_tensor}
SMALL_INT_COMPARISONS = {aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge}


@lowers(aten.view, aten.view_copy, aten._unsafe_view, aten.reshape, doc="view")
def _view(c, x, shape):
    return c.reshape(x, shape)


@lowers(aten.permute, aten.permute_copy, doc="view")
def _permute(c, x, dims):
    return c.transpose(x, dims)


@lowers(aten.t, aten.t_copy, doc="view")
def _t(c, x):
    return c.transpose(x, (1, 0)) if len(x.shape) == 2 else x


@lowers(aten.transpose, aten.transpose_copy, doc="view")
def _transpose(c, x, d0, d1):
    perm = list(range(len(x.shape)))
    d0, d1 = d0 % len(perm), d1 % len(perm)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return c.transpose(x, perm)


@lowers(aten.expand, aten.expand_copy, doc="view (broadcast)")
def _expand(c, x, shape, implicit=False):
    return c.expand(x, shape)


@lowers(aten.unsqueeze, aten.unsqueeze_copy, doc="view")
def _unsqueeze(c, x, dim):
    d = dim % (len(x.shape) + 1)
    return c.reshape(x, x.shape[:d] + (1,) + x.shape[d:])


@lowers(aten.squeeze, aten.squeeze_copy, doc="view")
def _squeeze(c, x, dims=None):
    rank = len(x.shape)
    if dims is None:
        dims = range(rank)
    dims = {d % rank for d in ((dims,) if isinstance(dims, int) else dims)} if rank else set()
    return c.reshape(x, tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)))


def _slice_key(x: Value, dim: int, start, end, step) -> tuple:
    dim = dim % len(x.shape)
    size = x.shape[dim]
    start, end, _ = slice(start, end, step).indices(size) if start is not None or end is not None else (0, size, 1)
    return (slice(None),) * dim + (slice(start, end, int(step)),)


@lowers(aten.flip, doc="view (negative strides)")
def _flip(c, x, dims):
    rank = len(x.shape)
    flipped = {int(d) % rank for d in dims}
    key = tuple(slice(None, None, -1) if d in flipped and x.shape[d] > 1 else slice(None) for d in range(rank))
    return x if all(k == slice(None) for k in key) else c.one("slice", [x], x.shape, x.dtype, key=key)


@lowers(aten.slice, aten.slice_copy, doc="view")
def _slice(c, x, dim=0, start=None, end=None, step=1):
    key = _slice_key(x, dim, start, end, step)
    shape = np.empty(x.shape, dtype=np.bool_)[key].shape
    if shape == x.shape:
        return x
    return c.one("slice", [x], shape, x.dtype, key=key)


@lowers(aten.select, aten.select_copy, doc="view")
def _select(c, x, dim, index):
    dim = dim % len(x.shape)
    key = (slice(None),) * dim + (int(index) % x.shape[dim],)
    return c.one("slice", [x], x.shape[:dim] + x.shape[dim + 1:], x.dtype, key=key)


@lowers(aten.split_with_sizes, aten.split_with_sizes_copy, doc="views")
def _split_with_sizes(c, x, sizes, dim=0):
    out, start = [], 0
    for s in sizes:
        out.append(_slice(c, x, dim, start, start + s, 1))
        start += s
    return out


@lowers(aten.split, aten.split_copy, doc="views")
def _split(c, x, size, dim=0):
    n = x.shape[dim % len(x.shape)]
    return _split_with_sizes(c, x, [min(size, n - s) for s in range(0, n, size)], dim)


@lowers(aten.cat, doc="copies into one new tensor")
def _cat(c, tensors, dim=0):
    dtype = c.out_dtype()
    tensors = [c.cast(t, dtype) for t in tensors if t.numel > 0 or len(tensors) == 1]
    dim = dim % len(tensors[0].shape)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    keys, start = [], 0
    for t in tensors:
        keys.append((slice(None),) * dim + (slice(start, start + t.shape[dim]),))
        start += t.shape[dim]
    return c.one("cat", tensors, tuple(shape), dtype, keys=tuple(keys))


@lowers(aten.slice_scatter, doc="a copy of the base with the source copied into a slice")
def _slice_scatter(c, base, src, dim=0, start=None, end=None, step=1):
    key = _slice_key(base, dim, start, end, step)
    return c.one("scatter_slice", [base, c.cast(src, base.dtype)], base.shape, base.dtype, key=key)


@lowers(aten.select_scatter, doc="a copy of the base with the source copied into a slice")
def _select_scatter(c, base, src, dim, index):
    dim = dim % len(base.shape)
    key = (slice(None),) * dim + (int(index) % base.shape[dim],)
    return c.one("scatter_slice", [base, c.cast(src, base.dtype)], base.shape, base.dtype, key=key)


@lowers(aten.constant_pad_nd, doc="slices (negative padding), a filled tensor with the input copied into it")
def _pad(c, x, pad, value=0.0):
    pairs = [(len(x.shape) - 1 - i, int(pad[2 * i]), int(pad[2 * i + 1])) for i in range(len(pad) // 2)]
    for d, lo, hi in pairs:   # negative padding crops
        if lo < 0 or hi < 0:
            x = _slice(c, x, d, max(-lo, 0), x.shape[d] - max(-hi, 0), 1)
    shape, key = list(x.shape), [slice(None)] * len(x.shape)
    for d, lo, hi in pairs:
        lo, hi = max(lo, 0), max(hi, 0)
        shape[d] += lo + hi
        key[d] = slice(lo, lo + x.shape[d])
    if tuple(shape) == x.shape:
        return x
    base = c.const(np.full(shape, value), x.dtype)
    return c.one("scatter_slice", [base, x], tuple(shape), x.dtype, key=tuple(key))


@lowers(aten.repeat, doc="view (broadcast)")
def _repeat(c, x, repeats):
    repeats = [int(r) for r in repeats]
    x = c.reshape(x, (1,) * (len(repeats) - len(x.shape)) + x.shape)
    pairs = [v for r, s in zip(repeats, x.shape) for v in (r, s)]
    spread = c.expand(c.reshape(x, tuple(v for s in x.shape for v in (1, s))), pairs)
    return c.reshape(spread, tuple(r * s for r, s in zip(repeats, x.shape)))


# ---- gather, scatter, indexing ---------------------------------------------------------------------

def _indices(c, idx: Value) -> Value:
    if idx.dtype == np.bool_:
        raise c.error("indexing with a boolean mask has a shape that depends on the data; use torch.where or "
                      "multiply by the mask")
    if idx.dtype.kind == "f":
        raise c.error(f"indices must be integers, got {idx.dtype.name}")
    return c.cast(idx, np.int32)


def _check_int32(c, size: int, what: str) -> None:
    if size > INT32_MAX:
        raise c.error(f"{what} has {size} positions; the IPU has no int64 and int32 indices reach {INT32_MAX}: "
                      "index fewer elements at once")


def _gather_along(c, x: Value, idx: Value, axis: int) -> Value:
    return c.one("gather", [x, idx], idx.shape, x.dtype, axis=axis)


def _scatter_along(c, base: Value, idx: Value, src: Value, axis: int, accumulate: bool, reduce=None) -> Value:
    attrs = {"reduce": reduce} if reduce else {}
    return c.one("scatter", [base, idx, c.cast(src, base.dtype)], base.shape, base.dtype, axis=axis,
                 accumulate=bool(accumulate), **attrs)


def _crop(c, x: Value, shape, skip: int) -> Value:
    """x sliced to `shape` on every axis but `skip` (torch.gather's index may be smaller)."""
    for d, n in enumerate(shape):
        if d != skip and n < x.shape[d]:
            x = _slice(c, x, d, 0, n, 1)
    return x


@lowers(aten.replication_pad1d_backward, aten.replication_pad2d_backward, aten.replication_pad3d_backward,
        doc="per padded axis a scatter-add of the gradient onto the clamped source positions")
def _replication_pad_backward(c, grad, x, padding):
    g, rank = grad, len(x.shape)
    for k in range(len(padding) // 2):   # pairs from the last axis
        axis = rank - 1 - k
        size, out = x.shape[axis], g.shape[axis]
        source = np.clip(np.arange(out) - int(padding[2 * k]), 0, size - 1)
        idx = c.const(source.reshape((1,) * axis + (out,) + (1,) * (rank - axis - 1)), np.int32)
        base = c.const(np.zeros(g.shape[:axis] + (size,) + g.shape[axis + 1:]), g.dtype)
        g = _scatter_along(c, base, c.expand(idx, g.shape), g, axis, accumulate=True)
    return g


@lowers(aten.gather, doc="gather along an axis")
def _gather(c, x, dim, index, sparse_grad=False):
    if not len(x.shape):
        return c.reshape(_gather(c, c.reshape(x, (1,)), 0, c.reshape(index, (1,))), index.shape)
    dim = dim % len(x.shape)
    _check_int32(c, x.shape[dim], f"axis {dim}")
    idx = _indices(c, index)
    return _gather_along(c, _crop(c, x, idx.shape, dim), idx, dim)


SCATTER_REDUCTIONS = {"sum": "add", "add": "add", "amax": "max", "amin": "min", "prod": "mul", "multiply": "mul"}


def _identity(how: str, dtype) -> float:
    """The value a scatter's reduction starts from where include_self=False leaves out the base."""
    if how == "add":
        return 0
    if how == "mul":
        return 1
    if np.dtype(dtype).kind == "f":
        return -np.inf if how == "max" else np.inf
    info = np.iinfo(np.int32)
    return info.min if how == "max" else info.max


@lowers(aten.scatter, aten.scatter_add, aten.scatter_reduce,
        doc="scatter along an axis (writes; adds for scatter_add and reduce='sum'/'add'; keeps the larger or "
            "smaller for 'amax'/'amin', multiplies for 'prod'; 'mean': the sum over the count; include_self=False: "
            "a scatter of the reduction's identity first)")
def _scatter(c, x, dim, index, src, reduce=None, include_self=True):
    if not len(x.shape):   # a 0-d tensor as one element
        one = c.reshape(src, (1,)) if isinstance(src, Value) else src
        y = _scatter(c, c.reshape(x, (1,)), 0, c.reshape(index, (1,)), one, reduce, include_self)
        return c.reshape(y, ())
    dim = dim % len(x.shape)
    how = "add" if c.node.target.overloadpacket is aten.scatter_add else None
    if reduce == "mean":   # the sum over the count, both with the base unless include_self=False
        total = _scatter(c, x, dim, index, src, "sum", include_self)
        ones = c.const(np.ones(index.shape), x.dtype)
        count = _scatter(c, c.const(np.full(x.shape, 1 if include_self else 0), x.dtype), dim, index, ones, "sum")
        mean = c.binary("div", total, c.binary("max", count, 1.0))
        if c.out_dtype().kind != "f":
            mean = c.unary("floor", mean)
        return mean     # untouched positions: x over 1
    if reduce is not None:
        if reduce not in SCATTER_REDUCTIONS:
            raise c.error(f"scatter with reduce={reduce!r} is not supported (writes, and the reductions "
                          f"{sorted(SCATTER_REDUCTIONS)} are)")
        how = SCATTER_REDUCTIONS[reduce]
    _check_int32(c, x.shape[dim] if x.shape else 1, f"axis {dim}")
    idx = _indices(c, index)
    src = _crop(c, src, idx.shape, -1) if isinstance(src, Value) else c.const(np.full(idx.shape, src), x.dtype)
    part = _crop(c, x, idx.shape, dim)
    base = part
    if how is not None and not include_self:
        base = _scatter_along(c, part, idx, c.const(np.full(idx.shape, _identity(how, x.dtype)), x.dtype), dim, False)
    y = _scatter_along(c, base, idx, src, dim, how == "add", how if how in ("max", "min", "mul") else None)
    if part is x:
        return y
    key = tuple(slice(0, n) for n in part.shape)   # an index smaller than x on other axes: the rest is x
    return c.one("scatter_slice", [x, y], x.shape, x.dtype, key=key)


@lowers(aten.index_reduce, doc="scatter along an axis with the reduction (the index broadcast over the source), "
                                "as scatter_reduce")
def _index_reduce(c, x, dim, index, source, reduce, include_self=True):
    if not len(x.shape):
        return _scatter(c, x, 0, index, source, reduce, include_self)
    dim = dim % len(x.shape)
    idx = c.reshape(index, (1,) * dim + (-1,) + (1,) * (len(x.shape) - dim - 1))
    return _scatter(c, x, dim, c.expand(idx, source.shape), source, reduce, include_self)


@lowers(aten.bucketize, doc="binary search as torch's: per step a gather of the middle boundary, a comparison "
                             "(ge, or gt with right=True) and where on the bounds")
def _bucketize(c, x, boundaries, out_int32=False, right=False):
    if not isinstance(x, Value):
        x = c.const(np.asarray(x), np.float32 if isinstance(x, float) else np.int32)
    n = boundaries.shape[0] if boundaries.shape else 1
    return c.cast(binary_search(c, x, c.reshape(boundaries, (n,)), right), c.out_dtype())


def binary_search(c, x: Value, bounds: Value, right: bool) -> Value:
    """torch.bucketize's binary search (int32 positions) of each value of x in the boundaries:
    one row `bounds` [B] for every value, or a row per row of x (bounds [..., B] and x [..., M],
    torch.searchsorted's). The lower bound, or the upper bound with right=True, in the same steps
    for every value: ceil(log2(B + 1)) of them, a value whose bounds have met keeping them (so
    unsorted boundaries give torch's answer too)."""
    common = np.float32 if "f" in (x.dtype.kind, bounds.dtype.kind) else np.int32
    n = bounds.shape[-1]
    per_row = len(bounds.shape) > 1
    lo = c.const(np.zeros(x.shape), np.int32)
    hi = c.const(np.full(x.shape, n), np.int32)
    for _ in range(int(np.ceil(np.log2(n + 1)))):
        total = c.binary("add", lo, hi, dtype=np.int32)
        mid = c.binary("div", c.binary("sub", total, c.binary("remainder", total, 2, dtype=np.int32), dtype=np.int32),
                       2, dtype=np.int32)
        if per_row:
            value = _gather_along(c, bounds, c.binary("min", mid, n - 1, dtype=np.int32), len(x.shape) - 1)
        else:
            value = c.reshape(_gather_along(c, bounds, c.reshape(mid, (-1,)), 0), x.shape)
        active = c.binary("lt", lo, hi, dtype=np.int32)
        upper = c.binary("gt" if right else "ge", value, x, dtype=common)
        move_hi = c.binary("logical_and", active, upper, dtype=np.bool_)
        move_lo = c.binary("logical_and", active, c.unary("logical_not", upper), dtype=np.bool_)
        hi = c.where(move_hi, mid, hi, np.int32)
        lo = c.where(move_lo, c.binary("add", mid, 1, dtype=np.int32), lo, np.int32)
    return lo


@lowers(aten.index_select, doc="gather along an axis (the index broadcast)")
def _index_select(c, x, dim, index):
    if not len(x.shape):   # a 0-d tensor's one element (the index can only be 0)
        return c.reshape(x, tuple(c.out_meta().shape))
    dim = dim % max(len(x.shape), 1)
    idx = c.reshape(_indices(c, index), (-1,))
    shape = x.shape[:dim] + idx.shape + x.shape[dim + 1:]
    idx = c.expand(c.reshape(idx, (1,) * dim + idx.shape + (1,) * (len(x.shape) - dim - 1)), shape)
    return _gather_along(c, x, idx, dim)


def _advanced(c, x: Value, indices: list):
    """torch's advanced indexing x[indices] as a gather along axis 1 of x seen as [P, N, Q]: the
    indexed axes moved together (to the front when they are not adjacent, as torch does) and
    merged, the index tensors broadcast and made one linear index (each wrapped first). Returns
    x as [P, N, Q], the index as [P, L, Q], the result's shape and the permutation of x."""
    rank = len(x.shape)
    indices = list(indices) + [None] * (rank - len(indices))
    dims = [d for d, i in enumerate(indices) if i is not None]
    idx = {d: _indices(c, indices[d]) for d in dims}
    bshape = tuple(np.broadcast_shapes(*(idx[d].shape for d in dims)))
    p = dims[0] if dims == list(range(dims[0], dims[-1] + 1)) else 0
    rest = [d for d in range(rank) if d not in dims]
    perm = rest[:p] + dims + rest[p:]
    pre, post = [x.shape[d] for d in rest[:p]], [x.shape[d] for d in rest[p:]]
    N = int(np.prod([x.shape[d] for d in dims]))
    _check_int32(c, N, "the indexed axes")
    if len(dims) == 1:
        lin = idx[dims[0]]
    else:
        lin, stride = None, 1
        for d in reversed(dims):
            term = c.binary("remainder", idx[d], x.shape[d], dtype=np.int32)
            term = term if stride == 1 else c.binary("mul", term, stride, dtype=np.int32)
            lin = term if lin is None else c.binary("add", lin, term, dtype=np.int32)
            stride *= x.shape[d]
    P, L, Q = int(np.prod(pre)), int(np.prod(bshape)), int(np.prod(post))
    lin = c.expand(c.reshape(c.expand(lin, bshape), (1, L, 1)), (P, L, Q))
    x3 = c.reshape(c.transpose(x, perm), (P, N, Q))
    return x3, lin, tuple(pre) + bshape + tuple(post), perm


@lowers(aten.index, aten._unsafe_index, doc="gather along an axis (advanced indexing: the indexed axes merged)")
def _index(c, x, indices):
    x3, lin, shape, _ = _advanced(c, x, indices)
    return c.reshape(_gather_along(c, x3, lin, 1), shape)


def _masked_put(c, x, indices, values, accumulate):
    """x[mask] = values with one boolean mask whose values broadcast over the masked positions (a
    value per position would need their count, which depends on the data): where(mask, values, x),
    or x + where(mask, values, 0) when accumulating. None when the indices are not such a mask."""
    used = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(used) != 1 or used[0][1].dtype != np.bool_:
        return None
    start, mask = used[0]
    rest = x.shape[start + len(mask.shape):]
    if len(values.shape) > len(rest) and any(s != 1 for s in values.shape[:len(values.shape) - len(rest)]):
        raise c.error("assigning a value per masked position needs their count, which depends on the data; "
                      "assign one value (or one row) broadcast over the mask, or use torch.where")
    values = c.reshape(values, values.shape[len(values.shape) - len(rest):] if len(values.shape) > len(rest)
                       else values.shape)
    m = c.reshape(mask, (1,) * start + mask.shape + (1,) * len(rest))
    v = c.expand(c.cast(values, x.dtype), x.shape)
    if accumulate:
        return c.binary("add", x, c.where(c.expand(m, x.shape), v, 0.0))
    return c.where(c.expand(m, x.shape), v, x)


@lowers(aten.index_put, aten._unsafe_index_put, doc="scatter along an axis (advanced indexing: the indexed axes "
                                                    "merged; accumulate adds)")
def _index_put(c, x, indices, values, accumulate=False):
    masked = _masked_put(c, x, indices, values, accumulate)
    if masked is not None:
        return masked
    x3, lin, shape, perm = _advanced(c, x, indices)
    src = c.reshape(c.expand(c.cast(values, x.dtype), shape), lin.shape)
    y = _scatter_along(c, x3, lin, src, 1, accumulate)
    y = c.reshape(y, tuple(x.shape[d] for d in perm))
    return c.transpose(y, tuple(int(i) for i in np.argsort(perm)))


@lowers(aten.unfold, aten.unfold_copy, doc="gather along an axis (the windows' positions), the window axis moved last")
def _unfold(c, x, dim, size, step):
    if not len(x.shape):
        return c.reshape(x, (1,))
    dim = dim % len(x.shape)
    windows = (x.shape[dim] - size) // step + 1
    positions = np.arange(windows)[:, None] * step + np.arange(size)[None, :]
    y = _index(c, x, [None] * dim + [c.const(positions, np.int32)])     # [..., windows, size, ...]
    rank = len(y.shape)
    return c.transpose(y, tuple(d for d in range(rank) if d != dim + 1) + (dim + 1,))


@lowers(aten.upsample_nearest1d_backward, aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
        aten._upsample_nearest_exact1d_backward, aten._upsample_nearest_exact2d_backward,
        aten._upsample_nearest_exact3d_backward,
        doc="scatter along an axis (the nearest source positions, accumulated)")
def _upsample_nearest_backward(c, grad, output_size, input_size, *scales):
    """Each output position's gradient added to the input position it copied: the positions as the
    forward's decomposition computes them (float32 index times scale, truncated; nearest-exact:
    the index's centre, plus one half, times scale, floored)."""
    exact = "exact" in c.node.target.__name__
    nd = len(output_size)
    scales = (tuple(scales) + (None,) * nd)[:nd]
    taps = []
    for o, i, s in zip(output_size, input_size[2:], scales):
        scale = np.float32(i / (i * s) if s else i / o)
        at = np.arange(o, dtype=np.float32)
        src = np.floor((at + np.float32(0.5)) * scale) if exact else at * scale
        taps.append([(np.minimum(src.astype(np.int64), i - 1), np.ones(o, np.float32))])
    return _upsample_taps_backward(c, grad, input_size, taps)


def _linear_sources(out: int, size: int, align_corners: bool, scale) -> list:
    """[(first input position, its weight), (second, its weight)] of each output position of a
    linear interpolation, in float32 as PyTorch's CPU kernels compute them."""
    o = np.arange(out)
    if out == size:
        return [(o, np.ones(out, np.float32)), (o, np.zeros(out, np.float32))]
    f32 = np.float32
    if align_corners:
        src = (f32(size - 1) / f32(out - 1) if out > 1 else f32(0)) * o.astype(f32)
    else:
        ratio = f32(1.0 / scale) if scale is not None and scale > 0 else f32(size) / f32(out)
        src = np.maximum(ratio * (o.astype(f32) + f32(0.5)) - f32(0.5), f32(0))
    first = np.minimum(np.floor(src).astype(np.int64), size - 1)
    w1 = np.clip(src - first.astype(f32), f32(0), f32(1)).astype(f32)
    return [(first, f32(1) - w1), (first + (first < size - 1), w1)]


def _cubic_sources(out: int, size: int, align_corners: bool, scale) -> list:
    """[(input position, weight)] x 4 of each output position of a bicubic interpolation (Keys'
    kernel, A = -0.75; positions clamped to the input), in float32 as PyTorch's CPU kernels
    compute them."""
    f32 = np.float32
    o = np.arange(out).astype(f32)
    if align_corners:
        src = (f32(size - 1) / f32(out - 1) if out > 1 else f32(0)) * o
    else:
        ratio = f32(1.0 / scale) if scale is not None and scale > 0 else f32(size) / f32(out)
        src = ratio * (o + f32(0.5)) - f32(0.5)
    first = np.floor(src)
    t = (src - first).astype(f32)
    A = f32(-0.75)

    def near(x):   # |x| <= 1
        return ((A + f32(2)) * x - (A + f32(3))) * x * x + f32(1)

    def far(x):    # 1 < |x| < 2
        return ((A * x - f32(5) * A) * x + f32(8) * A) * x - f32(4) * A
    weights = [far(t + f32(1)), near(t), near(f32(1) - t), far(f32(2) - t)]
    first = first.astype(np.int64)
    return [(np.clip(first - 1 + k, 0, size - 1), w.astype(f32)) for k, w in enumerate(weights)]


def _upsample_taps_backward(c, grad, input_size, taps: list) -> Value:
    """Each output position's gradient added, times its weight, into the input positions it
    interpolated (one accumulating index_put over every combination of one tap per axis):
    `taps[d]` lists axis d's (input position, weight) per output position; a combination's weight
    is the product of its taps' weights in float32."""
    nd = len(taps)
    corners = list(itertools.product(*(range(len(t)) for t in taps)))
    indices, weight = [], np.ones((len(corners),) + (1,) * nd, np.float32)
    for d, tap in enumerate(taps):
        shape = [len(corners)] + [1] * nd
        shape[1 + d] = len(tap[0][0])
        indices.append(c.const(np.stack([tap[b[d]][0] for b in corners]).reshape(shape), np.int32))
        weight = weight * np.stack([tap[b[d]][1] for b in corners]).reshape(shape)
    if len(corners) == 1 and (weight == 1).all():
        spread = c.reshape(grad, grad.shape[:2] + (1,) + grad.shape[2:])
    else:
        spread = c.binary("mul", c.reshape(grad, grad.shape[:2] + (1,) + grad.shape[2:]),
                          c.const(weight, grad.dtype), grad.dtype)
    zeros = c.const(np.zeros(tuple(int(v) for v in input_size)), grad.dtype)
    return _index_put(c, zeros, [None, None] + indices, spread, True)


def _upsample_linear_backward(c, grad, output_size, input_size, align_corners, scales):
    """The backward of a (bi, tri)linear interpolation: the taps as PyTorch's CPU backward computes
    them."""
    taps = [_linear_sources(int(o), int(i), bool(align_corners), s)
            for o, i, s in zip(output_size, input_size[2:], scales)]
    return _upsample_taps_backward(c, grad, input_size, taps)


@lowers(aten.upsample_bilinear2d_backward, doc="mul, scatter along an axis (each gradient times its weight to the "
                                               "four source positions, accumulated)")
def _upsample_bilinear2d_backward(c, grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_linear_backward(c, grad, output_size, input_size, align_corners, (scales_h, scales_w))


@lowers(aten.upsample_linear1d_backward, doc="mul, scatter along an axis (each gradient times its weight to the "
                                             "two source positions, accumulated)")
def _upsample_linear1d_backward(c, grad, output_size, input_size, align_corners, scales=None):
    return _upsample_linear_backward(c, grad, output_size, input_size, align_corners, (scales,))


@lowers(aten.upsample_trilinear3d_backward, doc="mul, scatter along an axis (each gradient times its weight to the "
                                                "eight source positions, accumulated)")
def _upsample_trilinear3d_backward(c, grad, output_size, input_size, align_corners, scales_d=None, scales_h=None,
                                   scales_w=None):
    return _upsample_linear_backward(c, grad, output_size, input_size, align_corners, (scales_d, scales_h, scales_w))


@lowers(aten.upsample_bicubic2d_backward, doc="mul, scatter along an axis (each gradient times its weight to the "
                                              "sixteen source positions, clamped to the input, accumulated)")
def _upsample_bicubic2d_backward(c, grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    taps = [_cubic_sources(int(o), int(i), bool(align_corners), s)
            for o, i, s in zip(output_size, input_size[2:], (scales_h, scales_w))]
    return _upsample_taps_backward(c, grad, input_size, taps)


def _aa_weights(out: int, size: int, align_corners: bool, scale) -> np.ndarray:
    """The [out, size] matrix of antialiased linear interpolation along one axis (a triangle filter
    stretched over the scale when shrinking, its weights normalised per output), in float32 as
    PyTorch's CPU kernel computes them."""
    f32 = np.float32
    if align_corners:
        s = f32(size - 1) / f32(out - 1) if out > 1 else f32(0)
    else:
        s = f32(1.0 / scale) if scale is not None and scale > 0 else f32(size) / f32(out)
    support = f32(s) if s >= 1.0 else f32(1.0)
    widest = int(np.ceil(support)) * 2 + 1
    invscale = f32(1.0 / s) if s >= 1.0 else f32(1.0)
    weights = np.zeros((out, size), f32)
    for i in range(out):
        center = f32(s * (i + 0.5))
        lo = max(int(center - support + f32(0.5)), 0)
        n = min(max(min(int(center + support + f32(0.5)), size) - lo, 0), widest)
        x = np.abs(((np.arange(lo, lo + n).astype(f32) - center).astype(np.float64) + 0.5) * float(invscale))
        w = np.where(x < 1.0, 1.0 - x, 0.0).astype(f32)
        total = f32(w.sum(dtype=f32))
        weights[i, lo:lo + n] = w / total if total != 0 else w
    return weights


def _resample_2d(c, x: Value, wh: np.ndarray, ww: np.ndarray) -> Value:
    """wh @ x @ ww^T over the last two axes of x [N, C, H, W]: the width first, then the height."""
    N, C, H, W = x.shape
    oh, ow = wh.shape[0], ww.shape[0]
    rows = c.one("matmul", [c.reshape(x, (N * C * H, W)), c.const(ww.T, x.dtype)], (N * C * H, ow), x.dtype)
    cols = c.transpose(c.reshape(rows, (N * C, H, ow)), (0, 2, 1))
    y = c.one("matmul", [c.reshape(cols, (N * C * ow, H)), c.const(wh.T, x.dtype)], (N * C * ow, oh), x.dtype)
    return c.transpose(c.reshape(y, (N, C, ow, oh)), (0, 1, 3, 2))


@lowers(aten._upsample_bilinear2d_aa, doc="matmul by the antialiased weights along the width, then the height")
def _upsample_bilinear2d_aa(c, x, output_size, align_corners, *scales):
    if c.node.target == aten._upsample_bilinear2d_aa.vec:
        factors = scales[0]
        if output_size is None:
            output_size = [int(np.floor(s * f)) for s, f in zip(x.shape[2:], factors)]
        scales = tuple(factors) if factors is not None else (None, None)
    scales = (tuple(scales) + (None, None))[:2]
    (oh, ow), (H, W) = [int(v) for v in output_size], x.shape[2:]
    return _resample_2d(c, x, _aa_weights(oh, H, bool(align_corners), scales[0]),
                        _aa_weights(ow, W, bool(align_corners), scales[1]))


@lowers(aten._upsample_bilinear2d_aa_backward, doc="matmul by the transposed antialiased weights along the width, "
                                                   "then the height")
def _upsample_bilinear2d_aa_backward(c, grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    (oh, ow), (H, W) = [int(v) for v in output_size], [int(v) for v in input_size[2:]]
    return _resample_2d(c, grad, _aa_weights(oh, H, bool(align_corners), scales_h).T,
                        _aa_weights(ow, W, bool(align_corners), scales_w).T)


def _diagonal_indices(c, x, offset, dim1, dim2):
    rank = len(x.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    n = max(0, min(x.shape[dim1] - max(-offset, 0), x.shape[dim2] - max(offset, 0)))
    indices = [None] * rank
    indices[dim1] = c.const(np.arange(n) + max(-offset, 0), np.int32)
    indices[dim2] = c.const(np.arange(n) + max(offset, 0), np.int32)
    # the diagonal's axis lands where advanced indexing puts it; torch puts it last
    where = min(dim1, dim2) if abs(dim1 - dim2) == 1 else 0
    perm = [d for d in range(rank - 1) if d != where] + [where]
    return indices, perm


@lowers(aten.diagonal, aten.diagonal_copy, doc="gather along an axis (advanced indexing)")
def _diagonal(c, x, offset=0, dim1=0, dim2=1):
    indices, perm = _diagonal_indices(c, x, offset, dim1, dim2)
    return c.transpose(_index(c, x, indices), perm)


@lowers(aten.diagonal_scatter, doc="scatter along an axis (advanced indexing)")
def _diagonal_scatter(c, x, src, offset=0, dim1=0, dim2=1):
    indices, perm = _diagonal_indices(c, x, offset, dim1, dim2)
    return _index_put(c, x, indices, c.transpose(src, tuple(int(i) for i in np.argsort(perm))))


# ---- constants -------------------------------------------------------------------------------------
def _out_const(c, values: np.ndarray) -> Value:
    """A constant of the node's dtype; an 8- or 16-bit integer one wrapped as torch's would be."""
    small = SMALL_INTS.get(c.out_meta().dtype)
    if small is not None:
        values = np.asarray(values).astype(np.int64).astype(small)
    return c.const(values, c.out_dtype())


def _full(c, shape, value):
    return _out_const(c, np.full(tuple(int(s) for s in shape), value))


@lowers(aten.full, doc="constant")
def _full_op(c, size, fill_value, **kwargs):
    return _full(c, size, fill_value)


@lowers(aten.full_like, doc="constant")
def _full_like(c, x, fill_value, **kwargs):
    return _full(c, x.shape, fill_value)


@lowers(aten.zeros, aten.ones, aten.zeros_like, aten.ones_like, aten.new_zeros, aten.new_ones, aten._efficientzerotensor,
        doc="constant")
def _zeros_ones(c, *args, **kwargs):
    value = 1.0 if "ones" in c.node.target.__name__ else 0.0
    return _full(c, c.out_meta().shape, value)


@lowers(aten.empty, aten.empty_like, aten.empty_permuted, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        doc="constant (zeros)")
def _empty(c, *args, **kwargs):
    return _full(c, c.out_meta().shape, 0.0)


@lowers(aten.scalar_tensor, doc="constant")
def _scalar_tensor(c, value, **kwargs):
    return _full(c, (), value)


@lowers(aten.arange, doc="constant")
def _arange(c, *args, **kwargs):
    numbers = [a for a in args if isinstance(a, (int, float))]
    return _out_const(c, np.arange(*numbers))


@lowers(aten.triu_indices, aten.tril_indices, doc="constant")
def _triangle_indices(c, row, col, offset=0, **kwargs):
    upper = c.node.target.overloadpacket is aten.triu_indices
    rows, cols = (np.triu_indices if upper else np.tril_indices)(int(row), int(offset), int(col))
    return c.const(np.stack([rows, cols]), c.out_dtype())


@lowers(aten.copy_, doc="a buffer's in-place update (its new value is an output of the graph)", raw=True)
def _copy_(c, n):
    dst = c.env[n.args[0]]
    if not (isinstance(dst, Value) and dst.kind == "buffer"):
        raise c.error("in-place updates of model parameters are not supported (register the tensor as a buffer)")
    return None


# ---- elementwise -----------------------------------------------------------------------------------
def _unary(fn):
    def lower(c, x, *args, **kwargs):
        return c.unary(fn, c.cast(x, c.out_dtype()))
    lower.doc = f"unary {fn}"
    return lower


for _packet, _fn in [(aten.neg, "neg"), (aten.abs, "abs"), (aten.relu, "relu"), (aten.exp, "exp"),
                     (aten.log, "log"), (aten.sqrt, "sqrt"), (aten.rsqrt, "rsqrt"), (aten.reciprocal, "reciprocal"),
                     (aten.tanh, "tanh"), (aten.sigmoid, "sigmoid"), (aten.log1p, "log1p"), (aten.expm1, "expm1"),
                     (aten.sin, "sin"), (aten.cos, "cos"), (aten.tan, "tan"), (aten.asin, "asin"), (aten.acos, "acos"),
                     (aten.atan, "atan"), (aten.sinh, "sinh"), (aten.cosh, "cosh"), (aten.asinh, "asinh"),
                     (aten.acosh, "acosh"), (aten.atanh, "atanh"), (aten.erf, "erf"), (aten.erfinv, "erfinv"),
                     (aten.log2, "log2"), (aten.log10, "log10"), (aten.exp2, "exp2"), (aten.floor, "floor"),
                     (aten.ceil, "ceil"), (aten.round, "round"), (aten.trunc, "trunc"), (aten.lgamma, "lgamma"),
                     (aten.digamma, "digamma"), (aten.erfc, "erfc"), (aten.special_erfcx, "erfcx"),
                     (aten.special_ndtri, "ndtri"), (aten.i0, "i0"), (aten.special_modified_bessel_i0, "i0"),
                     (aten.special_i0e, "i0e"), (aten.special_i1, "i1"), (aten.special_modified_bessel_i1, "i1"),
                     (aten.special_i1e, "i1e"), (aten.special_modified_bessel_k0, "k0"),
                     (aten.special_scaled_modified_bessel_k0, "k0e"), (aten.special_modified_bessel_k1, "k1"),
                     (aten.special_scaled_modified_bessel_k1, "k1e"), (aten.special_bessel_j0, "j0"),
                     (aten.special_bessel_j1, "j1"), (aten.special_bessel_y0, "y0"), (aten.special_bessel_y1, "y1"),
                     (aten.special_spherical_bessel_j0, "spherical_j0"), (aten.special_airy_ai, "airy_ai"),
                     (aten.angle, "angle")]:
    LOWERINGS[_packet] = _unary(_fn)


@lowers(aten.round, doc="unary round (half to even); with decimals d: mul 10^d, round, div 10^d (10^-d and mul for "
                        "d < 0), in the input's dtype as torch")
def _round(c, x, decimals=0):
    x = c.cast(x, c.out_dtype())
    if not decimals:
        return c.unary("round", x)
    if decimals > 0:
        ten = float(10.0 ** decimals)
        return c.binary("div", c.unary("round", c.binary("mul", x, ten)), ten)
    ten = float(10.0 ** -decimals)
    return c.binary("mul", c.unary("round", c.binary("div", x, ten)), ten)


@lowers(aten.polygamma, doc="unary polygamma (order n): digamma for n = 0, else (-1)^(n+1) n! zeta(n + 1, x)")
def _polygamma(c, n, x):
    if int(n) < 0:
        raise c.error(f"polygamma of a negative order {n} is not defined")
    return c.unary("polygamma", c.cast(x, c.out_dtype()), scale=float(int(n)))


@lowers(aten.frexp, doc="unary frexp_mantissa and frexp_exponent (int32)")
def _frexp(c, x):
    mantissa = c.unary("frexp_mantissa", x)
    return mantissa, c.one("unary", [x], x.shape, np.int32, fn="frexp_exponent")


def _bool_test(fn):
    def lower(c, x):
        if x.dtype.kind != "f":   # integers and booleans are finite, and their sign is their value's
            return c.binary("lt", x, 0, dtype=x.dtype) if fn == "signbit" else c.binary("ne", x, x, dtype=x.dtype)
        return c.one("unary", [x], x.shape, np.bool_, fn=fn)
    lower.doc = f"unary {fn} (bool)"
    return lower


LOWERINGS.update({aten.isinf: _bool_test("isinf"), aten.signbit: _bool_test("signbit")})


@lowers(aten.isnan, doc="unary isnan (bool)")
def _isnan(c, x):
    return c.one("unary", [x], x.shape, np.bool_, fn="isnan")


@lowers(aten.elu, doc="where(x > 0, scale * x, scale * alpha * expm1(input_scale * x))")
def _elu(c, x, alpha=1.0, scale=1.0, input_scale=1.0):
    negative = c.binary("mul", c.unary("expm1", c.binary("mul", x, float(input_scale))), float(alpha) * float(scale))
    return c.where(c.binary("gt", x, 0.0, dtype=x.dtype), c.binary("mul", x, float(scale)), negative)


@lowers(aten.elu_backward, doc="where(positive, grad * scale, grad * input_scale * (y + alpha * scale) or "
                               "grad * input_scale * alpha * scale * exp(input_scale * x))")
def _elu_backward(c, grad, alpha, scale, input_scale, is_result, x_or_y):
    alpha, scale, input_scale = float(alpha), float(scale), float(input_scale)
    if is_result:   # x_or_y is the forward's result: alpha * scale * exp(..) = y + alpha * scale
        slope = c.binary("mul", c.binary("add", x_or_y, alpha * scale), input_scale)
    else:
        slope = c.binary("mul", c.unary("exp", c.binary("mul", x_or_y, input_scale)), input_scale * alpha * scale)
    positive = c.binary("gt", x_or_y, 0.0, dtype=x_or_y.dtype)
    return c.where(positive, c.binary("mul", grad, scale), c.binary("mul", grad, slope))


GELU_BETA, GELU_KAPPA = float(np.sqrt(2 / np.pi)), 0.044715


def _gelu_tanh_inner(c, x):
    """tanh(beta * (x + kappa * x^3)) of GELU's tanh form, and x^2."""
    x2 = c.unary("square", x)
    inner = c.binary("mul", c.binary("add", x, c.binary("mul", c.binary("mul", x2, x), GELU_KAPPA)), GELU_BETA)
    return c.unary("tanh", inner), x2


@lowers(aten.gelu, doc="unary gelu (erf form); tanh form: mul, add, tanh")
def _gelu(c, x, approximate="none"):
    if approximate == "none":
        return c.unary("gelu", x)
    t, _ = _gelu_tanh_inner(c, x)
    return c.binary("mul", c.binary("mul", x, 0.5), c.unary("scale", t, scale=1.0, bias=1.0))


@lowers(aten.logical_not, aten.bitwise_not, doc="unary logical_not (bool); logical_not of numbers: eq 0; "
                                                "bitwise_not of integers: -x - 1 (two's complement)")
def _not(c, x):
    if x.dtype == np.bool_:
        return c.one("unary", [x], x.shape, np.bool_, fn="logical_not")
    if c.node.target.overloadpacket is aten.logical_not:
        return c.binary("eq", x, 0, dtype=x.dtype)
    if x.dtype.kind != "i":
        raise c.error(f"bitwise not of {x.dtype.name} is not defined (integers and booleans have one)")
    return c.unary("scale", x, scale=-1.0, bias=-1.0)


@lowers(aten.sign, aten.sgn, doc="binary abs_grad(x, 1)")
def _sign(c, x):
    return c.binary("abs_grad", x, 1.0)


def _arith(fn):
    def lower(c, a, b, alpha=1, rounding_mode=None):
        if rounding_mode is not None:   # the quotient in float, rounded, in the result's dtype
            quotient = c.binary("div", a, b, dtype=np.float32 if c.out_dtype().kind != "f" else None)
            return c.cast(c.unary(rounding_mode, quotient), c.out_dtype())
        if alpha != 1:
            b = c.binary("mul", b, alpha) if isinstance(b, Value) else b * alpha
        return c.binary(fn, a, b)
    lower.doc = f"binary {fn}" + (" (rounding_mode: unary floor or trunc of the quotient)" if fn == "div" else "")
    return lower


LOWERINGS.update({aten.add: _arith("add"), aten.sub: _arith("sub"), aten.mul: _arith("mul"),
                  aten.div: _arith("div"), aten.maximum: _arith("max"), aten.minimum: _arith("min"),
                  aten.atan2: _arith("atan2"), aten.fmod: _arith("fmod"), aten.remainder: _arith("remainder"),
                  aten.hypot: _arith("hypot"), aten.copysign: _arith("copysign"), aten.fmax: _arith("fmax"),
                  aten.fmin: _arith("fmin"), aten.special_zeta: _arith("zeta"), aten.igamma: _arith("igamma"),
                  aten.igammac: _arith("igammac")})


@lowers(aten.nextafter, doc="binary nextafter (float32)")
def _nextafter(c, a, b):
    if c.out_dtype() != np.float32:
        raise c.error(f"nextafter of {c.out_dtype().name} tensors is not supported on the IPU: it steps between "
                      "float32 values (cast to float32 first)")
    return c.binary("nextafter", a, b)


def _polynomial(fn):
    def lower(c, x, n):
        return c.binary(fn, x, n)
    lower.doc = f"binary {fn} (x, n): torch.special's recurrence, the trigonometric form for high degrees"
    return lower


for _name in ("chebyshev_t", "chebyshev_u", "chebyshev_v", "chebyshev_w", "shifted_chebyshev_t",
              "shifted_chebyshev_u", "shifted_chebyshev_v", "shifted_chebyshev_w", "hermite_h", "hermite_he",
              "laguerre_l", "legendre_p"):
    _family, _letter = _name.rsplit("_", 1)
    LOWERINGS[getattr(aten, f"special_{_family}_polynomial_{_letter}")] = _polynomial(_name)


@lowers(aten.rsub, doc="binary sub")
def _rsub(c, a, b, alpha=1):
    return c.binary("sub", b, c.binary("mul", a, alpha) if alpha != 1 else a)


@lowers(aten.pow, doc="unary square / sqrt / reciprocal / rsqrt for those exponents, else binary pow")
def _pow(c, x, e):
    if isinstance(x, Value) and not isinstance(e, Value):
        x = c.cast(x, c.out_dtype())
        special = {2: "square", 0.5: "sqrt", -1: "reciprocal", -0.5: "rsqrt"}
        if e == 1:
            return x
        if e in special:
            return c.unary(special[e], x)
    return c.binary("pow", x, e)


def device_result_type(a, b) -> np.dtype:
    """The dtype an op on `a` and `b` (device Values and Python scalars) computes in: PyTorch's
    type promotion applied to the dtypes the tensors have on the IPU (float64 already float32,
    int64 int32), so an int32 tensor against a float16 one computes in float16, never float64."""
    torch_of = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}
    a, b = (torch.empty((1,) * len(v.shape), dtype=torch_of[v.dtype]) if isinstance(v, Value) else v
            for v in (a, b))   # a zero-dim tensor keeps its lower priority in the promotion
    return np_dtype(torch.result_type(a, b))


def _comparison(fn):
    def lower(c, a, b):
        return c.binary(fn, a, b, dtype=device_result_type(a, b))
    lower.doc = f"binary {fn} (bool)"
    return lower


for _packet, _fn in [(aten.eq, "eq"), (aten.ne, "ne"), (aten.gt, "gt"), (aten.ge, "ge"), (aten.lt, "lt"),
                     (aten.le, "le"), (aten.logical_and, "logical_and"), (aten.logical_or, "logical_or")]:
    LOWERINGS[_packet] = _comparison(_fn)


def _bitwise(fn, logical):
    def lower(c, a, b):
        dtype = c.out_dtype()
        if dtype == np.bool_:
            return c.binary(logical, a, b, dtype=np.bool_)
        if dtype.kind not in "iu":
            raise c.error(f"{fn} needs integer or bool operands, not {dtype.name}")
        return c.binary(fn, a, b, dtype=dtype)
    lower.doc = f"binary {logical} (bool), {fn} (integers)"
    return lower


LOWERINGS.update({aten.bitwise_and: _bitwise("bitwise_and", "logical_and"),
                  aten.bitwise_or: _bitwise("bitwise_or", "logical_or"),
                  aten.bitwise_xor: _bitwise("bitwise_xor", "ne")})
LOWERINGS[aten.logical_xor] = _comparison("logical_xor")


@lowers(aten.clamp, doc="binary max and min")
def _clamp(c, x, min=None, max=None):
    y = c.cast(x, c.out_dtype())
    if min is not None:
        y = c.binary("max", y, min)
    if max is not None:
        y = c.binary("min", y, max)
    return y


@lowers(aten.hardtanh, doc="binary max and min")
def _hardtanh(c, x, min_val=-1.0, max_val=1.0):
    return _clamp(c, x, min_val, max_val)


@lowers(aten.leaky_relu, doc="where(x > 0, x, x * slope)")
def _leaky_relu(c, x, negative_slope=0.01):
    return c.where(c.binary("gt", x, 0.0, dtype=x.dtype), x, c.binary("mul", x, negative_slope))


@lowers(aten.hardshrink_backward, aten.softshrink_backward, doc="where(|x| > lambda, grad, 0)")
def _shrink_backward(c, grad, x, lambd):
    return c.where(c.binary("gt", c.unary("abs", x), lambd, dtype=x.dtype), grad, 0.0)


@lowers(aten.rrelu_with_noise_functional, doc="where(x >= 0, x, x * slope): the mean slope in inference, in "
                                             "training a random uniform slope per element (the noise output)")
def _rrelu_with_noise(c, x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    if not training:
        return _leaky_relu(c, x, (float(lower) + float(upper)) / 2), noise
    slope = c.one("random", [], x.shape, x.dtype, kind="uniform", a=float(lower), b=float(upper))
    positive = c.binary("ge", x, 0.0, dtype=x.dtype)
    return c.where(positive, x, c.binary("mul", x, slope)), c.where(positive, 1.0, slope)


@lowers(aten.clamp_min, doc="binary max")
def _clamp_min(c, x, m):
    return c.binary("max", x, m)


@lowers(aten.clamp_max, doc="binary min")
def _clamp_max(c, x, m):
    return c.binary("min", x, m)


@lowers(aten.where, doc="relu_grad(mask, a) + relu_grad(1 - mask, b): exact, no select op yet")
def _where(c, cond, a, b):
    return c.where(cond, a, b)


WRAPS = {torch.uint8: (0xFF, 0), torch.int8: (0xFF, 0x80), torch.int16: (0xFFFF, 0x8000)}   # low bits, sign bit


def _wrap_small_int(c, x: Value, source: torch.dtype, target: torch.dtype) -> Value:
    """x converted to int8, uint8 or int16 as torch converts: to int32 (a float truncated; NaN, inf and
    floats beyond int32 to -2**31, as the IPU's and the CPU's conversions give), then its low 8 or 16
    bits as two's complement: (v & mask) for uint8, ((v & mask) ^ sign) - sign for the signed ones."""
    v = c.cast(x, np.int32)
    lo, hi = (np.iinfo(SMALL_INTS[source]).min, np.iinfo(SMALL_INTS[source]).max) if source in SMALL_INTS else \
        (0, 1) if source == torch.bool else (None, None)
    if lo is not None and np.iinfo(SMALL_INTS[target]).min <= lo and hi <= np.iinfo(SMALL_INTS[target]).max:
        return v    # every value of the source fits the target
    mask, sign = WRAPS[target]
    low = c.binary("bitwise_and", v, mask, dtype=np.int32)
    if not sign:
        return low
    return c.binary("sub", c.binary("bitwise_xor", low, sign, dtype=np.int32), sign, dtype=np.int32)


@lowers(aten._to_copy, aten.to, aten.copy, doc="cast; into int8, uint8 or int16: cast to int32, then the low bits "
                                               "as two's complement (bitwise and, xor, sub), as torch wraps")
def _to_copy(c, x, *args, **kwargs):
    if c.node.target.overloadpacket is aten.copy:
        src, dst = c.node.args[1].meta["val"].dtype, c.node.args[0].meta["val"].dtype
        value = _wrap_small_int(c, args[0], src, dst) if dst in SMALL_INTS and src != dst else c.cast(args[0], x.dtype)
        return c.expand(value, x.shape)
    src, dst = c.node.args[0].meta["val"].dtype, c.out_meta().dtype
    if dst in SMALL_INTS and src != dst:
        return _wrap_small_int(c, x, src, dst)
    return c.cast(x, c.out_dtype())


@lowers(aten.threshold_backward, doc="binary relu_grad; another threshold t: where(x > t, grad, 0)")
def _threshold_backward(c, grad, x, threshold):
    if threshold != 0:
        return c.where(c.binary("gt", x, threshold, dtype=x.dtype), grad, 0.0)
    return c.one("binary", [x, grad], grad.shape, grad.dtype, fn="relu_grad")


@lowers(aten.tanh_backward, doc="binary tanh_grad")
def _tanh_backward(c, grad, y):
    return c.one("binary", [y, grad], grad.shape, grad.dtype, fn="tanh_grad")


@lowers(aten.sigmoid_backward, doc="binary sigmoid_grad")
def _sigmoid_backward(c, grad, y):
    return c.one("binary", [y, grad], grad.shape, grad.dtype, fn="sigmoid_grad")


@lowers(aten.gelu_backward, doc="binary gelu_grad (erf form); tanh form: PyTorch's formula in mul, add, tanh")
def _gelu_backward(c, grad, x, approximate="none"):
    if approximate == "none":
        return c.one("binary", [x, grad], grad.shape, grad.dtype, fn="gelu_grad")
    t, x2 = _gelu_tanh_inner(c, x)
    left_derivative = c.unary("scale", t, scale=0.5, bias=0.5)                       # 0.5 * (1 + t)
    sech2 = c.unary("scale", c.unary("square", t), scale=-1.0, bias=1.0)              # 1 - t^2
    slope = c.unary("scale", x2, scale=3 * GELU_KAPPA * GELU_BETA, bias=GELU_BETA)    # beta * (1 + 3 kappa x^2)
    right_derivative = c.binary("mul", c.binary("mul", c.binary("mul", x, 0.5), sech2), slope)
    return c.binary("mul", grad, c.binary("add", left_derivative, right_derivative))


# ---- reductions ------------------------------------------------------------------------------------
def _reduction(fn):
    def lower(c, x, dims=None, keepdim=False, dtype=None):
        return c.reduce(fn, c.cast(x, c.out_dtype()), dims, keepdim)
    lower.doc = f"reduce {fn}"
    return lower


LOWERINGS.update({aten.sum: _reduction("sum"), aten.mean: _reduction("mean"), aten.amax: _reduction("max"),
                  aten.amin: _reduction("min")})


def _topk_along(c, x: Value, k: int, dim: int, largest: bool) -> tuple[Value, Value]:
    """The k largest (smallest) along `dim` in order, stable, and their int32 positions."""
    if not x.shape:
        x = c.reshape(x, (1,))
    dim = dim % len(x.shape)
    _check_int32(c, x.shape[dim], f"axis {dim}")
    shape = x.shape[:dim] + (int(k),) + x.shape[dim + 1:]
    values, positions = c.emit("topk", [x], [(shape, x.dtype), (shape, np.int32)], k=int(k), axis=dim,
                               largest=bool(largest))
    return values, positions


def _extreme(fn):
    def lower(c, x, dim=None, keepdim=False):
        if dim is None:   # max(x): the value only
            return c.reduce(fn, x, None, False)
        values, positions = _topk_along(c, x, 1, dim, fn == "max")
        shape = tuple(c.out_meta(0).shape)
        return c.reshape(values, shape), c.reshape(positions, shape)
    lower.doc = f"topk k=1 along the axis (values and first positions); without an axis reduce {fn}"
    return lower


LOWERINGS.update({aten.max: _extreme("max"), aten.min: _extreme("min")})


def _arg(fn):
    def lower(c, x, dim=None, keepdim=False):
        flat = c.reshape(x, (-1,)) if dim is None else x
        _, positions = _topk_along(c, flat, 1, 0 if dim is None else dim, fn == "max")
        return c.reshape(positions, tuple(c.out_meta().shape))
    lower.doc = f"topk k=1 along the axis (the first position of the {fn})"
    return lower


LOWERINGS.update({aten.argmax: _arg("max"), aten.argmin: _arg("min")})


@lowers(aten.sort, doc="topk k=n (stable; NaN as the largest)")
def _sort(c, x, *args, **kwargs):
    if c.node.target == aten.sort.stable:
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim, descending = (tuple(args) + (-1, False)[len(args):])[:2]
        dim, descending = kwargs.get("dim", dim), kwargs.get("descending", descending)
    n = x.shape[dim % len(x.shape)] if x.shape else 1
    return _topk_along(c, x, n, dim, descending)


def _kth_smallest(c, x, k: int, dim, keepdim):
    """The k-th smallest (1-based) along `dim` and its position: the last of topk's k smallest."""
    dim = dim % max(len(x.shape), 1)
    values, positions = _topk_along(c, x, k, dim, False)
    shape = tuple(c.out_meta(0).shape)
    return tuple(c.reshape(_select(c, v, dim, k - 1) if v.shape else v, shape) for v in (values, positions))


@lowers(aten.kthvalue, doc="topk k smallest, the last (stable)")
def _kthvalue(c, x, k, dim=-1, keepdim=False):
    return _kth_smallest(c, x, int(k), dim, keepdim)


@lowers(aten.median, doc="topk: the lower median along the axis (stable); without an axis of the flattened tensor")
def _median(c, x, dim=None, keepdim=False):
    if dim is None:
        flat = c.reshape(x, (-1,))
        return _kth_smallest(c, flat, (flat.shape[0] + 1) // 2, 0, False)[0]
    n = x.shape[dim % len(x.shape)] if x.shape else 1
    return _kth_smallest(c, x, (n + 1) // 2, dim, keepdim)


@lowers(aten.topk, doc="topk (stable: of equal values the first positions)")
def _topk(c, x, k, dim=-1, largest=True, sorted=True):
    return _topk_along(c, x, k, dim, largest)


def _any_all(fn):
    def lower(c, x, dims=None, keepdim=False):
        y = c.reduce(fn, c.cast(x, np.float32), dims, keepdim)
        return c.binary("ne", y, 0.0, dtype=np.float32)
    lower.doc = f"cast, reduce {fn}, ne 0"
    return lower


LOWERINGS.update({aten.any: _any_all("max"), aten.all: _any_all("min")})


@lowers(aten.var, doc="reduce mean, sub, square, reduce mean")
def _var(c, x, dims=None, correction=None, keepdim=False, **kwargs):
    return _var_mean(c, x, dims, correction=correction, keepdim=keepdim)[0]


@lowers(aten.var_mean, doc="reduce mean, sub, square, reduce mean")
def _var_mean(c, x, dims=None, correction=None, keepdim=False, **kwargs):
    correction = 1 if correction is None else correction
    rank = len(x.shape)
    axes = range(rank) if dims is None else [d % rank for d in dims]
    n = int(np.prod([x.shape[d] for d in axes]))
    mean = c.reduce("mean", x, dims, True)
    var = c.reduce("mean", c.unary("square", c.binary("sub", x, mean)), dims, keepdim)
    if correction:
        var = c.binary("mul", var, n / max(n - correction, 0))
    return var, mean if keepdim else c.reduce("mean", x, dims, False)


def _scan(fn):
    def lower(c, x, dim, dtype=None):
        x = c.cast(x, c.out_dtype())
        if not x.shape:
            return x
        return c.one("scan", [x], x.shape, x.dtype, fn=fn, axis=dim % len(x.shape))
    lower.doc = f"scan {fn} (cumulative, along an axis)"
    return lower


LOWERINGS.update({aten.cumsum: _scan("sum"), aten.cumprod: _scan("prod")})


@lowers(aten.logcumsumexp, doc="scan logsumexp (cumulative, along an axis: log1p(exp(min - max)) + max, no overflow)")
def _logcumsumexp(c, x, dim):
    return _scan("logsumexp")(c, x, dim)


def _cumulative_extreme(fn):
    def lower(c, x, dim):
        dtype = c.out_dtype(0)
        if not x.shape:
            return x, c.const(np.zeros(()), np.int32)
        x = c.cast(x, np.int32 if dtype == np.bool_ else dtype)
        values, positions = c.emit("scan", [x], [(x.shape, x.dtype), (x.shape, np.dtype(np.int32))], fn=fn,
                                   axis=dim % len(x.shape))
        return c.cast(values, dtype), positions
    lower.doc = f"scan {fn} with positions (cumulative, along an axis: of equal values the last position)"
    return lower


LOWERINGS.update({aten.cummax: _cumulative_extreme("max"), aten.cummin: _cumulative_extreme("min")})


@lowers(aten.prod, doc="scan prod along the axis, the last (of the flattened tensor without an axis)")
def _prod(c, x, dim=None, keepdim=False, dtype=None):
    x = c.cast(x, c.out_dtype())
    if dim is None:
        x, dim = c.reshape(x, (-1,)), 0
    if not x.shape:
        return x
    dim = dim % len(x.shape)
    products = c.one("scan", [x], x.shape, x.dtype, fn="prod", axis=dim)
    return c.reshape(_select(c, products, dim, -1), tuple(c.out_meta().shape))


# ---- matmul ----------------------------------------------------------------------------------------
@lowers(aten.mm, aten.bmm, doc="matmul")
def _mm(c, a, b):
    shape = a.shape[:-1] + (b.shape[-1],)
    return c.one("matmul", [a, b], shape, c.out_dtype())


def _scaled_sum(c, bias, product, beta, alpha, shape):
    """beta * bias + alpha * product() as eager PyTorch computes it: a zero beta ignores the bias and
    a zero alpha the product (their NaNs and infinities never reach the result)."""
    terms = []
    if alpha != 0:
        y = product()
        terms.append(y if alpha == 1 else c.binary("mul", y, alpha))
    if beta != 0:
        terms.append(bias if beta == 1 else c.binary("mul", bias, beta))
    if not terms:
        return _full(c, shape, 0)
    out = terms[0] if len(terms) == 1 else c.binary("add", terms[0], terms[1])
    out = c.cast(out, c.out_dtype())
    return out if out.shape == tuple(shape) else c.expand(out, shape)


@lowers(aten.addmm, doc="matmul, add (a zero alpha or beta drops its term)")
def _addmm(c, bias, a, b, beta=1, alpha=1):
    return _scaled_sum(c, bias, lambda: _mm(c, a, b), beta, alpha, a.shape[:-1] + (b.shape[-1],))


@lowers(aten.addmv, doc="matmul of the matrix by the vector as a column, add (a zero alpha or beta drops its term)")
def _addmv(c, bias, mat, vec, beta=1, alpha=1):
    n, k = mat.shape
    product = lambda: c.reshape(c.one("matmul", [mat, c.reshape(vec, (k, 1))], (n, 1), c.out_dtype()), (n,))
    return _scaled_sum(c, bias, product, beta, alpha, (n,))


# ---- convolution ------------------------------------------------------------------------------------
def _conv_attrs(c, stride, padding, dilation, transposed, output_padding, groups, nd):
    """The conv attributes (1 to 3 spatial dimensions). A transposed convolution is the input
    gradient of the convolution it transposes (its output_padding only lengthens the output, which
    the shape says)."""
    if not 1 <= nd <= 3:
        raise c.error(f"{nd}-D convolution is not supported (1-D, 2-D and 3-D are)")
    if transposed and any(o >= st for o, st in zip(_int_list(output_padding, nd), _int_list(stride, nd))):
        raise c.error(f"transposed convolution with output_padding {list(output_padding)} not below the stride "
                      f"{list(stride)} is not supported (the rows past the last window's reach)")
    return dict(stride=_int_list(stride, nd), padding=_int_list(padding, nd), dilation=_int_list(dilation, nd),
                groups=int(groups))


@lowers(aten.convolution, doc="conv (1-D to 3-D), add; transposed: conv_backward_input, add")
def _convolution(c, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    nd = len(x.shape) - 2
    attrs = _conv_attrs(c, stride, padding, dilation, transposed, output_padding, groups, nd)
    y = c.one("conv_backward_input" if transposed else "conv", [x, w], tuple(c.out_meta().shape), x.dtype, **attrs,
              **({} if transposed else member_attrs(c)))
    if b is not None:
        y = c.binary("add", y, c.reshape(b, (1, -1) + (1,) * nd))
    return y


@lowers(aten.convolution_backward, doc="conv_backward_input, conv_backward_weights, reduce sum; transposed: "
                                       "conv, conv_backward_weights, reduce sum")
def _convolution_backward(c, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    nd = len(x.shape) - 2
    attrs = _conv_attrs(c, stride, padding, dilation, transposed, output_padding, groups, nd)
    if transposed:   # x went through the input gradient of a conv of w: its gradient is that conv
        gx = c.one("conv", [grad, w], x.shape, grad.dtype, **attrs) if output_mask[0] else None
        gw = c.one("conv_backward_weights", [x, grad], w.shape, grad.dtype, **attrs) if output_mask[1] else None
    else:
        gx = c.one("conv_backward_input", [grad, w], x.shape, grad.dtype, **attrs) if output_mask[0] else None
        gw = c.one("conv_backward_weights", [grad, x], w.shape, grad.dtype, **attrs) if output_mask[1] else None
    gb = c.reduce("sum", grad, [0] + list(range(2, len(grad.shape))), False) if output_mask[2] else None
    return gx, gw, gb


# ---- pooling ----------------------------------------------------------------------------------------
def _pool_attrs(c, nd, kernel, stride, padding, dilation=1, ceil_mode=False):
    k = _int_list(kernel, nd)
    s = _int_list(stride, nd) if stride not in (None, []) else k
    return dict(kernel=k, stride=s, padding=_int_list(padding, nd), dilation=_int_list(dilation, nd),
                ceil_mode=bool(ceil_mode))


def _batched(c, nd, *xs):
    """The operands of an nd-D pooling as [N, C, *spatial] (an unbatched [C, *spatial] gets N = 1)."""
    return [x if x is None or len(x.shape) == nd + 2 else c.reshape(x, (1,) + x.shape) for x in xs]


def _pooled(c, op, nd, inputs, shape, dtype, **attrs) -> Value:
    """op of [N, C, *spatial] inputs, the result reshaped to `shape` (the node's, maybe unbatched)."""
    shape = tuple(shape)
    y = c.one(op, _batched(c, nd, *inputs), shape if len(shape) == nd + 2 else (1,) + shape, dtype, **attrs)
    return c.reshape(y, shape)


MAX_POOL_BACKWARDS = (aten.max_pool2d_with_indices_backward, aten.adaptive_max_pool2d_backward,
                      aten.max_pool3d_with_indices_backward, aten.adaptive_max_pool3d_backward)


def _indices_read(c) -> bool:
    """Whether anything but its backward reads the indices output of the max pooling being lowered."""
    for user in c.node.users:
        if user.target is not operator.getitem:
            return True
        if user.args[1] == 1 and any(getattr(u.target, "overloadpacket", None) not in MAX_POOL_BACKWARDS
                                     for u in user.users):
            return True
    return False


def _window_table(geom) -> tuple[np.ndarray, np.ndarray]:
    """Per output of a max pooling (row-major) and window position (row-major): the input position
    to gather (a padding position takes the window's first real one, which leaves the maximum and
    its first position as they are) and the flat position in the plane it stands for."""
    from ipusim.ops.pool import window_table
    flat = window_table(geom)
    real = flat >= 0
    first = flat[np.arange(flat.shape[0]), real.argmax(axis=1)]
    empty = ~real.any(axis=1)   # dilation can leave a window with padding only: torch points at its start
    if empty.any():
        outs = np.unravel_index(np.flatnonzero(empty), geom.out_shape)
        starts = []
        for o, d in zip(outs, geom.dims):
            s0 = o * d.stride - d.padding
            starts.append(np.where(s0 < 0, s0 + -(-(-s0) // d.dilation) * d.dilation, s0))
        strides = np.cumprod((1,) + geom.in_shape[:0:-1])[::-1]   # (torch's start may lie past the plane)
        first[empty] = sum(st * stride for st, stride in zip(starts, strides))
    table = np.where(real, flat, first[:, None])
    return np.where(real, flat, np.where(empty, 0, first)[:, None]), table


def _pool_indices(c, x: Value, geom) -> Value:
    """PyTorch's indices of a max pooling of x [N, C, *spatial]: per window the flat position in
    the plane of its first maximum in row-major window order (every window's values gathered,
    topk k=1 along the window, the position looked up in the window's table)."""
    n, ch = x.shape[:2]
    gather, table = _window_table(geom)
    P, (O, K) = n * ch, gather.shape
    taps = c.expand(c.const(gather.reshape(1, O * K), np.int32), (P, O * K))
    values = c.reshape(_gather_along(c, c.reshape(x, (P, -1)), taps, 1), (P, O, K))
    first = _topk_along(c, values, 1, 2, True)[1]
    where = _gather_along(c, c.expand(c.const(table.reshape(1, O, K), np.int32), (P, O, K)), first, 2)
    return c.reshape(where, (n, ch) + geom.out_shape)


def _max_pooled(c, op, nd, x, attrs, geom_of, what):
    """A max pooling's values, and its indices: computed when something other than the backward
    reads them, else an Only standing for the values."""
    out = tuple(c.out_meta(0).shape)
    y = _pooled(c, op, nd, [x], out, x.dtype, **attrs)
    if not _indices_read(c):
        return y, Only(what, y)
    xb = _batched(c, nd, x)[0]
    return y, c.reshape(_pool_indices(c, xb, geom_of(xb.shape)), out)


def _pooled_values(c, indices: torch.fx.Node) -> Value:
    """The pooled values a max pooling backward reads (its indices argument stands for them)."""
    v = c.env[indices]
    if isinstance(v, Only):
        return v.value
    if indices.target is operator.getitem:   # indices computed for another reader: the values are output 0
        return c.env[indices.args[0]][0]
    raise c.error("the indices of a max pooling backward must come from its max pooling")


def _spatial_rank(c) -> int:
    """2 or 3: the spatial dimensions of the pooling op being lowered (from its name)."""
    return 3 if "3d" in c.node.target.overloadpacket.__name__ else 2


@lowers(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices,
        doc="max_pool; indices read by other ops than the backward: a gather of every window, topk k=1 along it, "
            "a gather of the window's positions")
def _max_pool(c, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    from ipusim.ops.pool import pool_geometry
    nd = _spatial_rank(c)
    attrs = _pool_attrs(c, nd, kernel, stride, padding, dilation, ceil_mode)
    return _max_pooled(c, "max_pool", nd, x, attrs, lambda shape: pool_geometry(
        "max", shape, attrs["kernel"], attrs["stride"], attrs["padding"], attrs["dilation"], attrs["ceil_mode"]),
        "max pooling's indices")


@lowers(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward,
        doc="max_pool_backward (each window's gradient to its first maximum)", raw=True)
def _max_pool_backward(c, n):
    nd = _spatial_rank(c)
    grad, x = c.load(n.args[0]), c.load(n.args[1])
    attrs = _pool_attrs(c, nd, *[c.load(a) for a in n.args[2:7]])
    return _pooled(c, "max_pool_backward", nd, [x, _pooled_values(c, n.args[7]), grad], x.shape, grad.dtype, **attrs)


def _avg_attrs(c, nd, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return dict(_pool_attrs(c, nd, kernel, stride, padding, 1, ceil_mode), count_include_pad=bool(count_include_pad),
                divisor_override=None if divisor_override is None else int(divisor_override))


@lowers(aten.avg_pool2d, aten.avg_pool3d, doc="avg_pool")
def _avg_pool(c, x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    nd = _spatial_rank(c)
    return _pooled(c, "avg_pool", nd, [x], c.out_meta().shape, x.dtype,
                   **_avg_attrs(c, nd, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override))


@lowers(aten.avg_pool2d_backward, aten.avg_pool3d_backward, doc="avg_pool_backward")
def _avg_pool_backward(c, grad, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    nd = _spatial_rank(c)
    return _pooled(c, "avg_pool_backward", nd, [grad], x.shape, grad.dtype,
                   **_avg_attrs(c, nd, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override))


@lowers(aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d, doc="adaptive_avg_pool")
def _adaptive(c, x, output_size):
    nd = _spatial_rank(c)
    out = tuple(c.out_meta().shape)
    return _pooled(c, "adaptive_avg_pool", nd, [x], out, x.dtype, output_size=out[-nd:])


@lowers(aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward, doc="adaptive_avg_pool_backward")
def _adaptive_backward(c, grad, x):
    nd = _spatial_rank(c)
    return _pooled(c, "adaptive_avg_pool_backward", nd, [grad], x.shape, grad.dtype, output_size=grad.shape[-nd:])


@lowers(aten.adaptive_max_pool2d, aten.adaptive_max_pool3d,
        doc="adaptive_max_pool; indices read by other ops than the backward: as max_pool's")
def _adaptive_max(c, x, output_size):
    from ipusim.ops.pool import adaptive_geometry
    nd = _spatial_rank(c)
    out = tuple(c.out_meta(0).shape)[-nd:]
    return _max_pooled(c, "adaptive_max_pool", nd, x, dict(output_size=out),
                       lambda shape: adaptive_geometry(shape, out, kind="max"), "adaptive max pooling's indices")


@lowers(aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward,
        doc="adaptive_max_pool_backward (each window's gradient to its first maximum)", raw=True)
def _adaptive_max_backward(c, n):
    nd = _spatial_rank(c)
    grad, x = c.load(n.args[0]), c.load(n.args[1])
    return _pooled(c, "adaptive_max_pool_backward", nd, [x, _pooled_values(c, n.args[2]), grad], x.shape, grad.dtype,
                   output_size=grad.shape[-nd:])


@lowers(aten.fractional_max_pool2d, aten.fractional_max_pool3d,
        doc="the windows' starts from the random samples (mul, trunc, sub), gather of each window, topk k=1 (the "
            "largest value and its position), gather of its index")
def _fractional_max_pool(c, x, kernel, output_size, samples):
    """Fractional max pooling as PyTorch's CPU kernel: along each spatial axis (of input size n,
    window k, output size m) the window of output i starts at trunc((i + u) * a) - trunc(u * a),
    a = (n - k) / (m - 1), the last at n - k, u the sample of the axis (drawn per plane: W, H for
    2-D, T, H, W for 3-D); the output is each window's largest value (the first of equals) and its
    position in the plane."""
    nd = _spatial_rank(c)
    unbatched = len(x.shape) == nd + 1
    if unbatched:
        x = c.reshape(x, (1,) + x.shape)
    N, C, sizes = x.shape[0], x.shape[1], x.shape[2:]
    kernel, out = _int_list(kernel, nd), _int_list(output_size, nd)
    f32 = np.float32
    u = c.cast(samples, f32)
    order = (1, 0) if nd == 2 else (0, 1, 2)   # the sample of each spatial axis
    lin = None
    shape = (N, C) + tuple(out) + tuple(kernel)
    for d in range(nd):
        n, k, m = sizes[d], kernel[d], out[d]
        ud = c.reshape(c.one("slice", [u], (N, C, 1), f32, key=(slice(None), slice(None), slice(order[d], order[d] + 1))),
                       (N, C, 1))
        if m > 1:
            alpha = f32(n - k) / f32(m - 1)
            i = c.const(np.arange(m, dtype=f32), f32)
            starts = c.binary("sub", c.unary("trunc", c.binary("mul", c.binary("add", i, ud, f32), float(alpha), f32)),
                              c.unary("trunc", c.binary("mul", ud, float(alpha), f32)), f32)
            starts = c.where(c.const(np.arange(m) == m - 1, np.bool_), float(n - k), starts, f32)
        else:
            starts = c.const(np.full((1, 1, 1), n - k), f32)
        position = c.binary("add", c.reshape(c.expand(starts, (N, C, m)), (N, C, m, 1)),
                            c.const(np.arange(k).reshape(1, 1, 1, k), f32), f32)
        stride = int(np.prod(sizes[d + 1:]))
        position = c.cast(c.binary("mul", position, float(stride), f32), np.int32)
        view = [N, C] + [1] * (2 * nd)
        view[2 + d], view[2 + nd + d] = m, k
        term = c.expand(c.reshape(position, tuple(view)), shape)
        lin = term if lin is None else c.binary("add", lin, term, np.int32)
    M, K, P = int(np.prod(out)), int(np.prod(kernel)), int(np.prod(sizes))
    lin = c.reshape(lin, (N, C, M, K))
    values = c.reshape(_gather_along(c, c.reshape(x, (N, C, P)), c.reshape(lin, (N, C, M * K)), 2), (N, C, M, K))
    best, at = _topk_along(c, values, 1, 3, True)
    index = _gather_along(c, lin, at, 3)
    result = (N, C) + tuple(out) if not unbatched else (C,) + tuple(out)
    return c.reshape(best, result), c.reshape(index, result)


@lowers(aten.fractional_max_pool2d_backward, aten.fractional_max_pool3d_backward,
        doc="scatter along an axis (each gradient added at its window's largest position)")
def _fractional_max_pool_backward(c, grad, x, kernel, output_size, indices):
    nd = _spatial_rank(c)
    planes = x.shape[:-nd]
    P, M = int(np.prod(x.shape[-nd:])), int(np.prod(grad.shape[-nd:]))
    R = int(np.prod(planes))
    zeros = c.const(np.zeros((R, P)), grad.dtype)
    y = _scatter_along(c, zeros, c.reshape(_indices(c, indices), (R, M)), c.reshape(grad, (R, M)), 1, True)
    return c.reshape(y, x.shape)


# ---- softmax, norms, dropout, losses, embedding --------------------------------------------------------
def _softmax(op):
    def lower(c, x, dim, half_to_float=False):
        return c.one(op, [x], x.shape, x.dtype, axis=dim % len(x.shape))
    lower.doc = op
    return lower


def _softmax_backward(op):
    def lower(c, grad, y, dim, input_dtype=None):
        return c.one(op, [y, grad], y.shape, grad.dtype, axis=dim % len(y.shape))
    lower.doc = op
    return lower


LOWERINGS.update({aten._softmax: _softmax("softmax"), aten._log_softmax: _softmax("log_softmax"),
                  aten._softmax_backward_data: _softmax_backward("softmax_backward"),
                  aten._log_softmax_backward_data: _softmax_backward("log_softmax_backward")})


@lowers(aten.native_layer_norm, doc="layer_norm")
def _layer_norm(c, x, normalized_shape, w, b, eps):
    nd = len(normalized_shape)
    stats = x.shape[:len(x.shape) - nd] + (1,) * nd
    ins = [x] + [v for v in (w, b) if v is not None]
    return tuple(c.emit("layer_norm", ins, [(x.shape, x.dtype), (stats, np.float32), (stats, np.float32)],
                        normalized_ndim=nd, eps=float(eps), affine=w is not None, has_bias=b is not None))


@lowers(aten.native_layer_norm_backward, doc="layer_norm_backward")
def _layer_norm_backward(c, grad, x, normalized_shape, mean, rstd, w, b, output_mask):
    params = [v for v in (w, b) if v is not None]
    outs = c.emit("layer_norm_backward", [grad, x, mean, rstd, *params],
                  [(x.shape, x.dtype)] + [(v.shape, v.dtype) for v in params],
                  normalized_ndim=len(normalized_shape), affine=w is not None, has_bias=b is not None, eps=0.0)
    dx, rest = outs[0], outs[1:]
    dw = rest.pop(0) if w is not None else None
    db = rest.pop(0) if b is not None else None
    return (dx if output_mask[0] else None, dw if output_mask[1] else None, db if output_mask[2] else None)


@lowers(aten.native_group_norm, doc="reshape, reduce mean, sub, square, reduce mean, rsqrt, mul, add")
def _group_norm(c, x, w, b, n, channels, hw, groups, eps):
    g = c.reshape(x, (n, groups, -1))
    mean = c.reduce("mean", g, [2], True)
    centred = c.binary("sub", g, mean)
    var = c.reduce("mean", c.unary("square", centred), [2], True)
    rstd = c.unary("rsqrt", c.binary("add", var, float(eps)))
    y = c.reshape(c.binary("mul", centred, rstd), x.shape)
    per_channel = (1, channels) + (1,) * (len(x.shape) - 2)
    if w is not None:
        y = c.binary("mul", y, c.reshape(w, per_channel))
    if b is not None:
        y = c.binary("add", y, c.reshape(b, per_channel))
    return y, c.reshape(mean, (n, groups)), c.reshape(rstd, (n, groups))


def _nchw(c, x):
    if len(x.shape) == 4:
        return x
    if len(x.shape) in (2, 3):
        return c.reshape(x, x.shape + (1,) * (4 - len(x.shape)))
    if len(x.shape) > 4:   # statistics per channel over the batch and every spatial position: merged
        return c.reshape(x, x.shape[:2] + (int(np.prod(x.shape[2:-1])), x.shape[-1]))
    raise c.error(f"batch norm of a {len(x.shape)}-D input is not supported (2-D and more are)")


def _affine(c, x, w, b):
    """A batch norm's weight and bias, ones and zeros without affine parameters."""
    ch = (x.shape[1],)
    return (w if w is not None else c.const(np.ones(ch), x.dtype),
            b if b is not None else c.const(np.zeros(ch), x.dtype))


@lowers(aten._native_batch_norm_legit_functional, doc="batch_norm (running statistics updated in place)")
def _batch_norm(c, x, w, b, running_mean, running_var, training, momentum, eps):
    w, b = _affine(c, x, w, b)
    x4 = _nchw(c, x)
    ins = [x4, w, b, running_mean, running_var]
    ch = (x.shape[1],)
    if not training:
        return _batch_norm_inference(c, x, w, b, running_mean, running_var, momentum, eps)
    y, mean, _, inv_std = c.emit("batch_norm", ins, [(x4.shape, x.dtype), (ch, np.float32), (ch, np.float32),
                                                     (ch, np.float32)],
                                 training=True, momentum=float(momentum), eps=float(eps))
    # the lowering updates the running statistics in place: their new values are the buffers
    return c.reshape(y, x.shape), mean, inv_std, running_mean, running_var


@lowers(aten._native_batch_norm_legit_no_training, doc="batch_norm (running statistics)")
def _batch_norm_inference(c, x, w, b, running_mean, running_var, momentum, eps):
    w, b = _affine(c, x, w, b)
    x4 = _nchw(c, x)
    y = c.one("batch_norm", [x4, w, b, running_mean, running_var], x4.shape, x.dtype, training=False, eps=float(eps))
    return c.reshape(y, x.shape), Only("batch norm statistics"), Only("batch norm statistics")


@lowers(aten.native_batch_norm_backward, doc="batch_norm_backward")
def _batch_norm_backward(c, grad, x, w, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    if not train:
        raise c.error("batch norm with running statistics has no gradient here; train the model in training mode")
    # ipusim's kernels take the statistics in float32 (a float16 input's may have been cast)
    stats = [c.cast(save_mean, np.float32), c.cast(save_invstd, np.float32)]
    affine = w is not None   # instance norm's batch norm has no weight: a weight of ones, no gradient for it
    w = w if affine else c.const(np.ones(x.shape[1]), x.dtype)
    dx, dw, db = c.emit("batch_norm_backward", [_nchw(c, grad), _nchw(c, x), *stats, w],
                        [(_nchw(c, x).shape, x.dtype), (w.shape, w.dtype), (w.shape, w.dtype)])
    return c.reshape(dx, x.shape), dw if affine else None, db if affine else None


@lowers(aten.native_dropout, doc="dropout")
def _dropout(c, x, p, train):
    if not train or p == 0:
        return x, Only("an inactive dropout's mask")
    y, mask = c.emit("dropout", [x], [(x.shape, x.dtype), (x.shape, np.bool_)], p=float(p))
    return y, mask


@lowers(aten.native_dropout_backward, doc="dropout_backward (a scale no probability p gives, 1 / (1 - p): mul by "
                                            "the mask and the scale)")
def _dropout_backward(c, grad, mask, scale):
    scale = float(scale)
    p = 1.0 if scale == 0 else 1.0 - 1.0 / scale
    if 0 <= p <= 1 and (p == 1 or 1.0 / (1.0 - p) == scale):
        return c.one("dropout_backward", [grad, mask], grad.shape, grad.dtype, p=p)
    return c.binary("mul", c.binary("mul", grad, c.cast(mask, grad.dtype), grad.dtype), scale, grad.dtype)


def _draw(c, kind, a, b, shape=None, dtype=None):
    shape = tuple(c.out_meta().shape) if shape is None else tuple(shape)
    dtype = c.out_dtype() if dtype is None else np.dtype(dtype)
    if dtype.kind != "f" and kind not in ("bernoulli", "geometric", "integers"):
        raise c.error(f"random {kind} numbers of an integer dtype are not supported")
    return c.one("random", [], shape, dtype, kind=kind, a=float(a), b=float(b))


@lowers(aten.rand, aten.rand_like, doc="random uniform (the IPU's generator, not torch's)")
def _rand(c, *args, **kwargs):
    return _draw(c, "uniform", 0.0, 1.0)


@lowers(aten.randn, aten.randn_like, doc="random normal (the IPU's generator, not torch's)")
def _randn(c, *args, **kwargs):
    return _draw(c, "normal", 0.0, 1.0)


@lowers(aten.uniform, doc="random uniform (the IPU's generator, not torch's)")
def _uniform(c, x, low=0.0, high=1.0, generator=None):
    return _draw(c, "uniform", low, high)


@lowers(torch.ops.prims.uniform, doc="random uniform (the IPU's generator, not torch's)")
def _prims_uniform(c, shape, *, low, high, **kwargs):
    return _draw(c, "uniform", low, high)


@lowers(aten.normal, doc="random normal (the IPU's generator, not torch's); a tensor mean or std: a standard normal "
                         "draw, binary mul by std and add mean")
def _normal_of(c, mean, std=1.0, *size, **kwargs):
    if not isinstance(mean, Value) and not isinstance(std, Value):
        return _draw(c, "normal", mean, std)
    z = _draw(c, "normal", 0.0, 1.0)
    return c.binary("add", c.binary("mul", z, std), mean)


@lowers(aten.normal_functional, doc="random normal (the IPU's generator, not torch's)")
def _normal(c, x, mean=0.0, std=1.0, generator=None):
    return _draw(c, "normal", mean, std)


@lowers(aten.bernoulli, doc="random bernoulli (the IPU's generator): a constant probability, or per element "
                            "uniform < p")
def _bernoulli(c, x, p=None, generator=None):
    if p is not None and not isinstance(p, Value):
        return _draw(c, "bernoulli", p, 0.0)
    probs = x if p is None else p     # torch.bernoulli(probs), or x.bernoulli_(p) with a tensor p
    uniform = c.one("random", [], tuple(c.out_meta().shape), np.dtype(np.float32), kind="uniform", a=0.0, b=1.0)
    return c.cast(c.binary("lt", uniform, probs, dtype=np.float32), c.out_dtype())


@lowers(aten.exponential, doc="random exponential (the IPU's generator): -ln(v) / lambd, v uniform in (0, 1)")
def _exponential(c, x, lambd=1.0, generator=None):
    return _draw(c, "exponential", lambd, 0.0)


@lowers(aten.cauchy, doc="random Cauchy (the IPU's generator): median + sigma * tan(pi * (v - 1/2)), v uniform in "
                         "(0, 1)")
def _cauchy(c, x, median=0.0, sigma=1.0, generator=None):
    return _draw(c, "cauchy", median, sigma)


@lowers(aten.geometric, doc="random geometric (the IPU's generator): ceil(ln(v) / ln(1 - p)), v uniform in (0, 1)")
def _geometric(c, x, p, generator=None):
    return _draw(c, "geometric", p, 0.0)


@lowers(aten.log_normal, doc="random log-normal (the IPU's generator): exp of a normal draw")
def _log_normal(c, x, mean=1.0, std=2.0, generator=None):
    return _draw(c, "log_normal", mean, std)


@lowers(aten.randint, aten.randint_like, doc="random integers in [low, high) (the IPU's generator, PopLibs' "
                                             "uniform of an integer type)")
def _randint(c, *args, **kwargs):
    bounds = args[1:] if c.node.target.overloadpacket is aten.randint_like else args[:-1]
    if any(isinstance(b, Value) for b in bounds):
        raise c.error("randint_like with a tensor bound is not supported: give high (and low) as numbers")
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds[:2]
    if c.out_dtype().kind == "i" and not (-INT32_MAX - 1 <= low and high - 1 <= INT32_MAX):
        raise c.error(f"randint's range [{low}, {high}) is beyond int32, and the IPU has no int64")
    return _draw(c, "integers", low, high)


@lowers(aten.multinomial, doc="random categorical draws (the IPU's generator): without replacement topk of "
                              "probs / e (e exponential: the first k of exponential clocks), with replacement "
                              "per draw the argmax of probs / e")
def _multinomial(c, probs, num_samples, replacement=False, generator=None):
    k, n = int(num_samples), probs.shape[-1]
    dtype = probs.dtype
    if replacement:
        shape = probs.shape[:-1] + (k, n)
        keys = c.binary("div", c.reshape(probs, probs.shape[:-1] + (1, n)), _draw(c, "exponential", 1.0, 0.0, shape,
                                                                                   dtype), dtype=dtype)
        _, positions = _topk_along(c, keys, 1, -1, True)
    else:
        keys = c.binary("div", probs, _draw(c, "exponential", 1.0, 0.0, probs.shape, dtype), dtype=dtype)
        _, positions = _topk_along(c, keys, k, -1, True)
    return c.cast(c.reshape(positions, tuple(c.out_meta().shape)), c.out_dtype())


REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _per_sample_times(c, grad_output, d: Value, reduction: int, n: int) -> Value:
    """d ([N, ...], each sample's gradient of its loss) times the gradient of the reduced loss."""
    if REDUCTIONS[int(reduction)] == "none":
        go = c.reshape(grad_output, (n,) + (1,) * (len(d.shape) - 1))
    else:
        go = c.binary("div", grad_output, float(n)) if REDUCTIONS[int(reduction)] == "mean" else grad_output
    return c.binary("mul", d, go)


@lowers(aten.multi_margin_loss_backward, doc="the hinge's gradient composed: gather the target's score, compare, "
                                             "where, reduce sum for the target's column")
def _multi_margin_loss_backward(c, grad_output, x, target, p, margin, weight=None, reduction=1):
    dtype = x.dtype
    xs = c.reshape(x, (1, 1) if not x.shape else (1,) + x.shape if len(x.shape) == 1 else x.shape)
    n, classes = xs.shape
    t = c.reshape(_indices(c, target), (n, 1))
    z = c.binary("add", c.binary("sub", xs, _gather_along(c, xs, t, 1), dtype), float(margin), dtype)
    classes_row = c.const(np.arange(classes, dtype=np.int32).reshape(1, classes), np.int32)
    picked = c.cast(c.binary("eq", classes_row, t, np.int32), dtype)    # one-hot of the target
    active = c.binary("logical_and", c.binary("gt", z, 0.0, dtype), c.binary("ne", classes_row, t, np.int32), np.bool_)
    g = c.where(active, 1.0 if int(p) == 1 else c.binary("mul", z, 2.0, dtype), 0.0)
    if weight is not None:
        g = c.binary("mul", g, _gather_along(c, c.expand(c.reshape(weight, (1, classes)), (n, classes)), t, 1), dtype)
    g = c.binary("div", g, float(classes), dtype)
    d = c.binary("sub", g, c.binary("mul", picked, c.reduce("sum", g, (1,), True), dtype), dtype)
    return c.reshape(_per_sample_times(c, grad_output, d, reduction, n), x.shape)


@lowers(aten.multilabel_margin_loss_backward, doc="the hinge's gradient composed over (target, other class) pairs: "
                                                  "compare, mul by the target masks, reduce sums")
def _multilabel_margin_loss_backward(c, grad_output, x, target, reduction, is_target):
    dtype = x.dtype
    xs = c.reshape(x, (1, 1) if not x.shape else (1,) + x.shape if len(x.shape) == 1 else x.shape)
    n, classes = xs.shape
    tm = c.cast(c.reshape(is_target, (n, classes)), dtype)
    # z[n, j, k] = 1 - x[n, j] + x[n, k], active where j is a target, k is not and z > 0
    z = c.binary("add", c.binary("sub", c.reshape(xs, (n, 1, classes)), c.reshape(xs, (n, classes, 1)), dtype), 1.0,
                 dtype)
    pairs = c.binary("mul", c.reshape(tm, (n, classes, 1)),
                     c.reshape(c.unary("scale", tm, scale=-1.0, bias=1.0), (n, 1, classes)), dtype)
    active = c.binary("mul", c.cast(c.binary("gt", z, 0.0, dtype), dtype), pairs, dtype)
    d = c.binary("div", c.binary("sub", c.reduce("sum", active, (1,), False), c.reduce("sum", active, (2,), False),
                                 dtype), float(classes), dtype)
    return c.reshape(_per_sample_times(c, grad_output, d, reduction, n), x.shape)



@lowers(aten.nll_loss_forward, doc="nll_loss; with class weights: gather the picked log-probabilities and the "
                                    "weights, mul, reduce sum, div")
def _nll(c, x, target, weight, reduction, ignore_index):
    if len(x.shape) == 1:   # one sample's [C] log-probabilities: a batch of one
        y, total = _nll(c, c.reshape(x, (1,) + x.shape), c.reshape(target, (1,)), weight, reduction, ignore_index)
        return (c.reshape(y, ()) if REDUCTIONS[reduction] == "none" else y), total
    if len(x.shape) != 2:
        raise c.error("NLL loss needs [N, C] or [C] log-probabilities")
    r = REDUCTIONS[reduction]
    if weight is not None:
        return _weighted_nll(c, x, target, weight, r, int(ignore_index))
    y = c.one("nll_loss", [x, target], x.shape[:1] if r == "none" else (), x.dtype, reduction=r,
              ignore_index=int(ignore_index))
    return y, Only("NLL loss's total weight")


def _sample_weights(c, x, target, weight, ignore_index) -> tuple[Value, Value]:
    """The targets as [N, 1] indices and each sample's class weight, 0 where ignored."""
    target = _indices(c, target)
    w = c.binary("mul", _gather_along(c, c.cast(weight, x.dtype), target, 0),
                 c.cast(c.binary("ne", target, ignore_index, dtype=np.int32), x.dtype), x.dtype)
    return c.reshape(target, target.shape + (1,)), w


def _weighted_nll(c, x, target, weight, reduction, ignore_index):
    idx, w = _sample_weights(c, x, target, weight, ignore_index)
    picked = c.reshape(_gather_along(c, x, idx, 1), w.shape)
    losses = c.unary("neg", c.binary("mul", picked, w, x.dtype))
    total = c.reduce("sum", w, None, False)
    if reduction == "none":
        return losses, total
    summed = c.reduce("sum", losses, None, False)
    return (summed if reduction == "sum" else c.binary("div", summed, total, x.dtype)), total


@lowers(aten.nll_loss_backward, doc="nll_loss_backward; with class weights: gather the weights, mul, scatter "
                                    "into zeros", raw=True)
def _nll_backward(c, n):
    grad, x, target, weight, reduction, ignore_index = (c.load(a) for a in n.args[:6])
    return _nll_gradient(c, n, grad, x, target, weight, reduction, ignore_index)


def _nll_gradient(c, n, grad, x, target, weight, reduction, ignore_index):
    if len(x.shape) == 1:   # one sample's [C] log-probabilities: a batch of one
        one = (1,) if REDUCTIONS[reduction] == "none" else ()
        return c.reshape(_nll_gradient(c, n, c.reshape(grad, one), c.reshape(x, (1,) + x.shape),
                                       c.reshape(target, (1,)), weight, reduction, ignore_index), x.shape)
    if weight is not None:
        idx, w = _sample_weights(c, x, target, weight, int(ignore_index))
        r = REDUCTIONS[reduction]
        scale = c.binary("mul", w, c.reshape(grad, grad.shape if r == "none" else ()), x.dtype)
        if r == "mean":
            scale = c.binary("div", scale, c.load(n.args[6]), x.dtype)
        coefficient = c.reshape(c.unary("neg", scale), idx.shape)
        return _scatter_along(c, c.const(np.zeros(x.shape), x.dtype), idx, coefficient, 1, False)
    return c.one("nll_loss_backward", [x, target, grad], x.shape, x.dtype, reduction=REDUCTIONS[reduction],
                 ignore_index=int(ignore_index))


@lowers(torch.ops.poptorch_lite.ctc_loss, doc="ctc_loss (F.ctc_loss, captured whole: compiler/library.py)")
def _ctc(c, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return c.one("ctc_loss", [log_probs, targets, input_lengths, target_lengths], (), log_probs.dtype,
                 blank=int(blank), reduction=reduction, zero_infinity=bool(zero_infinity))


@lowers(torch.ops.poptorch_lite.ctc_loss_backward, doc="ctc_loss_backward")
def _ctc_backward(c, log_probs, targets, input_lengths, target_lengths, grad, blank, reduction, zero_infinity):
    return c.one("ctc_loss_backward", [log_probs, targets, input_lengths, target_lengths, grad], log_probs.shape,
                 log_probs.dtype, blank=int(blank), reduction=reduction, zero_infinity=bool(zero_infinity))


# ---- PopTorch's device ops ---------------------------------------------------------------------------
@lowers(torch.ops.poptorch_lite.print_tensor, doc="print_tensor (ipu_print_tensor: a stream to the host, which prints)")
def _print_tensor(c, x, title, print_gradient, *fmt):
    return c.one("print_tensor", [x], x.shape, x.dtype, title=title, format=PrintFormat(*fmt))


@lowers(torch.ops.poptorch_lite.recomputation_checkpoint,
        doc="checkpoint (recomputationCheckpoint: kept, not recomputed, when recomputation is on)")
def _recomputation_checkpoint(c, x):
    return c.one("checkpoint", [x], x.shape, x.dtype)


@lowers(torch.ops.poptorch_lite.serialized_matmul, doc="matmul in `factor` pieces (serializedMatMul)")
def _serialized_matmul(c, a, b, mode, factor, keep_precision):
    return c.one("matmul", [a, b], a.shape[:-1] + (b.shape[-1],), c.out_dtype(), serialization=str(mode),
                 factor=int(factor), keep_precision=bool(keep_precision))


@lowers(torch.ops.poptorch_lite.loss_scale, doc="loss_scale (the gradient seed times the device's loss scale: the "
                                                   "optimiser's loss_scaling, or automatic loss scaling's)")
def _loss_scale(c, x, initial):
    return c.one("loss_scale", [x], x.shape, x.dtype, initial=float(initial))


@lowers(torch.ops.poptorch_lite.ctc_beam_search_decoder, doc="ctc_beam_search_decoder (PopTorch's CTC decoder)")
def _ctc_decoder(c, probs, lengths, blank, beam_width, top_paths):
    T, N, _ = probs.shape
    return tuple(c.emit("ctc_beam_search_decoder", [probs, c.cast(lengths, np.int32)],
                        [((N, top_paths), np.float32), ((N, top_paths), np.int32), ((N, top_paths, T), np.int32)],
                        blank=int(blank), beam_width=int(beam_width), top_paths=int(top_paths)))


@lowers(torch.ops.poptorch_lite.fps, doc="fps (farthest point sampling, torch_cluster's)")
def _fps(c, src, ptr, ratio, random_start):
    from ipusim.ops.cluster import segment_sizes
    return c.one("fps", [c.cast(src, np.float32)], (sum(segment_sizes(ptr, ratio)),), np.int32, ptr=tuple(ptr),
                 ratio=float(ratio), random_start=bool(random_start))


@lowers(torch.ops.poptorch_lite.nearest, doc="nearest (nearest cluster, torch_cluster's)")
def _nearest(c, x, y, batch_x, batch_y):
    return c.one("nearest", [c.cast(x, np.float32), c.cast(y, np.float32), c.cast(batch_x, np.int32),
                             c.cast(batch_y, np.int32)], (x.shape[0],), np.int32)


def _overlap_mode(mode: str):
    from ..api.enums import OverlapMode
    return OverlapMode(mode)


@lowers(torch.ops.poptorch_lite.overlap_input, doc="none: marks a model input for overlapped host I/O "
                                                    "(set_overlap_for_input)", raw=True)
def _overlap_input(c, n):
    src = n.args[0]
    v = c.env.get(src) if isinstance(src, torch.fx.Node) else None
    if not (isinstance(v, Value) and v.kind == "input" and src.op == "placeholder"):
        raise Error("poptorch.set_overlap_for_input applied on a node which is not a tensor input to the model.")
    index = next(i for i, x in enumerate(c.ir.inputs) if x is v)
    if len(src.users) > 1:
        raise Error("poptorch.set_overlap_for_input must be the only op applied to an input. This is not the case "
                    f"for input {index} to the model.")
    c.ir.host_io[("input", index)] = _overlap_mode(n.args[1])
    return v


@lowers(torch.ops.poptorch_lite.overlap_output, doc="none: marks a returned tensor for overlapped host I/O "
                                                     "(set_overlap_for_output)", raw=True)
def _overlap_output(c, n):
    def source(node):   # what a returned node returns: through the capture's detaches
        while isinstance(node, torch.fx.Node) and node.target in (aten.detach.default, aten.detach_copy.default,
                                                                  aten.alias.default):
            node = node.args[0]
        return node

    returned = [source(o) for o in list(c.gm.graph.output_node().args[0])[:c.joint.num_outputs]]
    if n not in returned:
        raise Error("poptorch.set_overlap_for_output applied on a node which is not a tensor output to the model.")
    if returned.count(n) + returned.count(n.args[0]) > 1:
        raise Error("poptorch.set_overlap_for_output cannot be used with a tensor that is returned twice. Please "
                    "check all returned tensors including those nested in tuples/lists.")
    c.ir.host_io[("output", returned.index(n))] = _overlap_mode(n.args[1])
    return c.load(n.args[0])


def _custom_definition(c, key: str):
    call = call_spec(key)
    try:
        return call, registered_custom_op(call)
    except LookupError as error:
        raise c.error(str(error)) from None


@lowers(torch.ops.poptorch_lite.custom_op, doc="custom_op (poptorch.custom_op: the registered kernel as vertices)")
def _custom_op(c, inputs, key):
    call, definition = _custom_definition(c, key)
    specs = [(shape, np_dtype(dtype)) for shape, dtype in call.outputs]
    return c.emit("custom_op", list(inputs), specs, call=call, definition=definition)


@lowers(torch.ops.poptorch_lite.custom_op_backward, doc="custom_op_backward (the registered gradient kernel)")
def _custom_op_backward(c, grads, inputs, outputs, key):
    call, definition = _custom_definition(c, key)
    wanted = [i for i, v in enumerate(inputs) if np.issubdtype(v.dtype, np.floating)]
    specs = [(inputs[i].shape, inputs[i].dtype) for i in wanted]
    return c.emit("custom_op_backward", [*grads, *inputs, *outputs], specs, call=call, definition=definition,
                  counts=(len(grads), len(inputs), len(outputs)), wanted=tuple(wanted))


@lowers(torch.ops.poptorch_lite.cpu_op, doc="cpu_op (poptorch.CPU: streams to the host, the host's function, "
                                             "streams back)")
def _cpu_op(c, inputs, key):
    call = cpu_call(key)
    return c.emit("cpu_op", list(inputs), [(shape, np_dtype(dtype)) for shape, dtype in call.outputs], call=call)


PLANNED = frozenset({"matmul", "conv"})   # IR ops whose planner takes a temporary-memory budget


def planned_producers(v: Value) -> list[Node]:
    """The matmuls and convolutions whose result `v` is: through views, casts and the adds and
    multiplies that apply a bias or a scale to it (a Linear layer is a matmul and an add)."""
    node = v.producer
    if node is None:
        return []
    if node.op in PLANNED:
        return [node]
    if node.op in VIEW_OPS or node.op == "cast" or (node.op == "binary" and node.attrs["fn"] in ("add", "mul")):
        return [p for i in node.inputs for p in planned_producers(i)]
    return []


@lowers(torch.ops.poptorch_lite.available_memory,
        doc="none: the memory budget of the matmul or convolution that made the tensor (set_available_memory)")
def _available_memory(c, x, proportion):
    planned = planned_producers(x)
    if not planned:
        a = annotation_of(c.node)
        logger.warning("set_available_memory at %s: the tensor was not made by a matrix multiplication or a "
                       "convolution, so the hint has no effect", a.source if a is not None else "<unknown>",
                       extra=REPEATED)
    for node in planned:
        node.attrs["available_memory_proportion"] = float(proportion)
    return x


@lowers(aten.embedding, doc="embedding")
def _embedding(c, w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise c.error("embedding with scale_grad_by_freq or sparse gradients is not supported")
    return c.one("embedding", [idx, w], idx.shape + (w.shape[1],), w.dtype, padding_idx=int(padding_idx))


@lowers(aten.embedding_dense_backward, doc="embedding_backward")
def _embedding_backward(c, grad, idx, num_weights, padding_idx, scale_grad_by_freq):
    if scale_grad_by_freq:
        raise c.error("embedding with scale_grad_by_freq is not supported")
    return c.one("embedding_backward", [idx, grad], (int(num_weights), grad.shape[-1]), grad.dtype,
                 padding_idx=int(padding_idx))


_DECOMPOSITIONS: tuple | None = None  # (what the table was built from, the table)


def decompositions() -> dict:
    """What the capture decomposes: every op without a lowering of its own that PyTorch can
    decompose (the core ATen table, then torch._decomp's wider one; not the torch._refs entries
    of that table, which trace to prims ops), never an op lowered whole
    (convolution, pooling, softmax, norms, dropout, NLL, embedding keep their fused ipusim kernels
    and estimators). BatchNorm's ``native_batch_norm`` becomes ``_native_batch_norm_legit``, whose
    schema declares the running-statistics update, so that functionalisation turns it into new
    buffer values.

    Built once per process (the core table materialises every CompositeImplicitAutograd op torch
    knows, tens of milliseconds) and again when ops, decompositions or lowerings have been added
    since; each call gets its own copy."""
    global _DECOMPOSITIONS  # pylint: disable=global-statement
    built_from = (len(torch._C._dispatch_get_all_op_names()), len(decomposition_table), len(LOWERINGS))
    if _DECOMPOSITIONS is None or _DECOMPOSITIONS[0] != built_from:
        _DECOMPOSITIONS = (built_from, _decomposition_table())
    return dict(_DECOMPOSITIONS[1])


def _decomposition_table() -> dict:
    wider = {op: fn for op, fn in decomposition_table.items()
             if getattr(fn, "__module__", "").startswith("torch._decomp")}   # not torch._refs: prims
    table = {op: fn for op, fn in {**wider, **core_aten_decompositions()}.items()
             if isinstance(op, torch._ops.OpOverload) and op.overloadpacket not in LOWERINGS}
    table[aten.native_batch_norm.default] = native_batch_norm_decomposition
    table.update(_custom_op_decompositions())
    table.update(linalg.DECOMPOSITIONS)   # ops PyTorch's fake tensors refuse, in a form with static shapes
    return table


def _custom_op_decompositions() -> dict:
    """PyTorch's own ops written as Python over ATen ops (torch.library custom ops), traced through
    their implementation: F.linear_cross_entropy's batch-chunked forms (chunks that bound a GPU's
    memory become a loop of slices, matmuls and sums unrolled in the graph)."""
    try:
        from torch.nn.modules import linear_cross_entropy as lce
    except ImportError:   # a torch without them
        return {}
    ops = (lce._linear_cross_entropy_batch_chunked, lce._linear_cross_entropy_batch_chunked_no_reduction)
    return {op._opoverload: op._init_fn for op in ops}


for _packet, _lower in {**control_flow.ATEN, **recurrent.ATEN}.items():   # device loops and branches, dynamic
    lowers(_packet, doc=_lower.doc, raw=_lower.raw)(_lower)                 # slices, recurrent layers

from . import linalg  # noqa: E402,F401  (dense linear algebra: registers its lowerings, built on the helpers above)


from . import counting, indexing  # noqa: E402,F401  (register the lowering families kept in modules of their own)


def ops_table() -> list[tuple[str, str]]:
    """(ATen op, how it is lowered) for every supported op, sorted: docs/ops.md is made from it."""
    rows = {}
    for packet, fn in LOWERINGS.items():
        rows[str(packet)] = getattr(fn, "doc", "")
    return sorted(rows.items())


def ops_markdown() -> str:
    """docs/ops.md: the supported ATen ops, from the lowering table (`python -m
    poptorch_lite.compiler.aten > docs/ops.md` rewrites it; a test checks that it is current)."""
    lines = ["# Supported ops", "",
             "Generated from the lowering table of `poptorch_lite/compiler/aten.py` by",
             "`python -m poptorch_lite.compiler.aten > docs/ops.md`; do not edit by hand.", "",
             "A model is captured as one joint forward-backward graph of ATen ops (`compiler/export.py`),",
             "decomposed by PyTorch's own decompositions (`torch._decomp`) down to the ops below, so any",
             "torch function that decomposes to them is supported, with PyTorch's own gradient. An op",
             "outside this list is an `UnsupportedOpError` at compile time naming the ATen op, the",
             "source line and the module.", "",
             "Torch functions captured as another: `F.dropout` as `aten.native_dropout` (one op with its",
             "mask), `F.ctc_loss` as `poptorch_lite.ctc_loss` (`compiler/library.py`), `F.grid_sample` and",
             "`torch.grid_sampler*` as gathers with their weights (`compiler/sampling.py`: their gradients",
             "are the composition's), `torch.cov` and `torch.corrcoef` as ATen composes them without its",
             "data-dependent check (`compiler/export.py`); attention runs",
             "PyTorch's math backend (matmuls, softmax, dropout). `nn.LSTM`, `nn.GRU` and `nn.RNN`",
             "(`torch.lstm`, `gru`, `rnn_tanh`, `rnn_relu`) are one `poptorch_lite.*_layer` op per layer",
             "and direction, each a device loop over the time steps, with its backward op",
             "(`compiler/recurrent.py`). PopTorch's `for_loop`, `cond`, `nop`, `dynamic_slice` and",
             "`dynamic_update` are ops of their own; a loop or branch body is the ops between its",
             "markers (`compiler/control_flow.py`).", "",
             "Measured with `benchmarks/opinfo_coverage.py` (PyTorch's OpInfo database, float32 samples,",
             "against eager PyTorch, 2026-11-28): 627 of 673 ops pass forward (93.2%), 500 of 519 ops with",
             "a gradient pass backward (96.3%). What fails: complex dtypes and FFTs (18 of the fft ops, stft, complex,",
             "polar, view_as_complex, cfloat, cdouble, chalf, linalg.eig, eigvals; not IPU dtypes, as in",
             "PopTorch), bfloat16, sparse tensors (3), ops whose output shape depends on the data",
             "(nonzero, argwhere, masked_select, unique, unique_consecutive, tensor_split with a tensor of",
             "indices: refused as in PopTorch), ops returning no tensor (item, equal, allclose,",
             "broadcast_shapes), the singular and eigen vectors of svd and eigh (a sign per vector differs",
             "from the LAPACK PyTorch links; their values, and everything composed of them, pass), CTC loss",
             "with reduction 'none' (refused as in PopTorch), hash_tensor, and the backward of samples with",
             "empty outputs (pdist, lstsq: zero-sized tensors are refused as in PopTorch).", "",
             "| ATen op | lowered to (IR / ipusim ops) |", "|---|---|"]
    lines += [f"| `{op}` | {how} |" for op, how in ops_table()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":   # the package's module: the families in modules of their own register into its table
    from poptorch_lite.compiler import aten as _registered
    print(_registered.ops_markdown(), end="")
