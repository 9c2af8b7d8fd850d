"""Device control flow: loops and branches whose bodies are compiled once and run on the device.

PopTorch's ``for_loop``, ``cond``, ``nop``, ``dynamic_slice`` and ``dynamic_update``, and the
loop the recurrent layers (:mod:`.recurrent`) run over time steps, from capture to ipusim:

- **Capture.** ``poptorch.for_loop(count, body, inputs)`` is traced as markers around one trace
  of its body, as PopTorch traces it: ``loop_begin(inputs)`` gives the body its loop-carried
  values (copies: inputs are passed by value), the body's ops follow, ``loop_end(outputs,
  carried, count)`` gives the loop's results. ``cond`` is ``if_begin(condition)``, the then
  body, ``if_else(then outputs)``, the else body, ``if_end(else outputs, then outputs)``. The
  bodies run under the capture's annotator, so their ops carry their own blocks and source
  lines, and nested loops and branches nest.
- **IR.** The ATen lowering (:mod:`.aten`) turns the ops between the markers into the body of
  one IR node: ``loop`` (attrs: count, body nodes, carried values, their new values) or ``if``
  (then and else bodies and their results). The node's inputs are the initial carried values
  and every outer value the bodies read (weights, constants, activations), so placement,
  channels and weight placement see it as one op; a value made inside a body may not be used
  outside it.
- **ipusim.** A ``loop`` is one ``Repeat`` over its body lowered once: the carried values are
  tensors of their own, initialised before the loop and updated in place on their tiles: the op
  making a new value writes it into the carried tensor when that can be done (an elementwise op
  after the last read of the old value; a ``dynamic_update`` of a buffer nothing else reads, laid
  out for slicing), else the new value is copied onto it at the end of the iteration. Outer
  tensors a body slices dynamically are laid out for slicing once, before the loop. An ``if`` is
  an ``If`` on the condition's device value, each branch copying its results into the outputs.
  Cycles are the body's times the count (``Repeat``), memory keeps loop-crossing tensors live
  over the whole body.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx

import ipusim as ip
from ipusim.ops import dynamic as dyn
from ipusim.ops import elementwise as ew
from ipusim.ops import random as rnd

from ..api.errors import Error
from ..api.ops import _as_list
from .ir import VIEW_OPS, Node, Value, flatten_values

# =========================================================================================
# Capture: marker ops around the bodies, and the traced forms of PopTorch's functions
# =========================================================================================


@torch.library.custom_op("poptorch_lite::loop_begin", mutates_args=())
def loop_begin(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The loop-carried values a loop body starts from: copies of the loop's inputs."""
    return [t.clone() for t in inputs]


@loop_begin.register_fake
def _loop_begin_fake(inputs):
    return [torch.empty_like(t) for t in inputs]


@torch.library.custom_op("poptorch_lite::loop_end", mutates_args=())
def loop_end(outputs: list[torch.Tensor], carried: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The results of a loop whose body, from `carried` (`loop_begin`'s), makes `outputs`."""
    return [t.clone() for t in outputs]


@loop_end.register_fake
def _loop_end_fake(outputs, carried, count):
    return [torch.empty_like(t) for t in outputs]


@torch.library.custom_op("poptorch_lite::if_begin", mutates_args=())
def if_begin(condition: torch.Tensor) -> torch.Tensor:
    """Opens the then body of a branch on `condition` (a copy of it, which the branch reads)."""
    return condition.clone()


@if_begin.register_fake
def _if_begin_fake(condition):
    return torch.empty_like(condition)


@torch.library.custom_op("poptorch_lite::if_else", mutates_args=())
def if_else(then_outputs: list[torch.Tensor], condition: torch.Tensor) -> list[torch.Tensor]:
    """Closes the then body (its results) and opens the else body."""
    return [t.clone() for t in then_outputs]


@if_else.register_fake
def _if_else_fake(then_outputs, condition):
    return [torch.empty_like(t) for t in then_outputs]


@torch.library.custom_op("poptorch_lite::if_end", mutates_args=())
def if_end(else_outputs: list[torch.Tensor], then_outputs: list[torch.Tensor],
           condition: torch.Tensor) -> list[torch.Tensor]:
    """Closes the else body: the branch's results."""
    return [t.clone() for t in else_outputs]


@if_end.register_fake
def _if_end_fake(else_outputs, then_outputs, condition):
    return [torch.empty_like(t) for t in else_outputs]


@torch.library.custom_op("poptorch_lite::nop", mutates_args=())
def nop(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@nop.register_fake
def _nop_fake(x):
    return torch.empty_like(x)


nop.register_autograd(lambda ctx, grad: nop(grad), setup_context=lambda ctx, inputs, output: None)


def _start(start: torch.Tensor) -> int:
    return int(start.reshape(-1)[0])


@torch.library.custom_op("poptorch_lite::dynamic_slice", mutates_args=())
def dynamic_slice(x: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """`size` rows of `x` along `dim` from `start` (wrapping round, as on the device), every `step`-th."""
    n = x.shape[dim]
    first = _start(start)
    first = first if 0 <= first < n else 0
    rows = (torch.arange(0, size, step) + first) % n
    return x.index_select(dim, rows)


@dynamic_slice.register_fake
def _dynamic_slice_fake(x, dim, start, size, step):
    shape = list(x.shape)
    shape[dim] = -(-size // step)
    return x.new_empty(shape)


@torch.library.custom_op("poptorch_lite::dynamic_update", mutates_args=())
def dynamic_update(x: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor) -> torch.Tensor:
    """A copy of `x` with `src` written along `dim` from `start` (wrapping round, as on the device)."""
    n = x.shape[dim]
    first = _start(start)
    first = first if 0 <= first < n else 0
    rows = (torch.arange(src.shape[dim]) + first) % n
    return x.index_copy(dim, rows, src)


@dynamic_update.register_fake
def _dynamic_update_fake(x, src, dim, start):
    return torch.empty_like(x)


def _slice_setup(ctx, inputs, output):
    x, dim, start, size, step = inputs
    ctx.save_for_backward(start)
    ctx.attrs = (x.shape, dim, size, step)


def _slice_backward(ctx, grad):
    (start,), (shape, dim, size, step) = ctx.saved_tensors, ctx.attrs
    if step != 1:   # the taken rows back in their places among `size`
        rows = list(shape)
        rows[dim] = size
        grad = grad.new_zeros(rows).slice_scatter(grad, dim, 0, size, step)
    return dynamic_update(grad.new_zeros(shape), grad, dim, start), None, None, None, None


dynamic_slice.register_autograd(_slice_backward, setup_context=_slice_setup)


def _update_setup(ctx, inputs, output):
    x, src, dim, start = inputs
    ctx.save_for_backward(start)
    ctx.attrs = (dim, src.shape[dim])


def _update_backward(ctx, grad):
    (start,), (dim, size) = ctx.saved_tensors, ctx.attrs
    shape = list(grad.shape)
    shape[dim] = size
    return (dynamic_update(grad, grad.new_zeros(shape), dim, start), dynamic_slice(grad, dim, start, size, 1), None,
            None)


dynamic_update.register_autograd(_update_backward, setup_context=_update_setup)


def _same_types(what: str, got: list, want: list) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor):
            raise Error(f"{what} returned a {type(g).__name__} at position {i}; it must return tensors")
        if g.shape != w.shape or g.dtype != w.dtype:
            raise Error(f"{what} returned a tensor of shape {list(g.shape)} and type {g.dtype} at position {i} "
                        f"where {list(w.shape)} and {w.dtype} are expected: the tensors a device loop or "
                        "branch carries keep their shapes and types")


def traced_for_loop(count: int, body, inputs: list) -> list:
    """``poptorch.for_loop`` in the capture: the body traced once between loop markers."""
    if not inputs:
        raise Error("poptorch.for_loop needs at least one input tensor: the loop carries its inputs from one "
                    "iteration to the next")
    carried = loop_begin(list(inputs))
    outputs = _as_list(body(*carried))
    if len(outputs) != len(inputs):
        raise Error(f"the body of poptorch.for_loop returned {len(outputs)} tensors for {len(inputs)} inputs; it "
                    "must return one tensor per input, of the same shape and type")
    _same_types("the body of poptorch.for_loop", outputs, carried)
    return loop_end(outputs, carried, int(count))


def traced_cond(condition: torch.Tensor, then_body, then_inps: list, else_body, else_inps: list) -> list:
    """``poptorch.cond`` in the capture: both bodies traced between branch markers."""
    if condition.numel() != 1:
        raise Error(f"poptorch.cond needs a condition of one element, got shape {list(condition.shape)}")
    flag = if_begin(condition)
    then_out = _as_list(then_body(*[t.clone() for t in then_inps]))
    closed = if_else(then_out, flag)
    else_out = _as_list(else_body(*[t.clone() for t in else_inps]))
    if len(then_out) != len(else_out):
        raise Error(f"poptorch.cond: the then body returns {len(then_out)} tensors and the else body "
                    f"{len(else_out)}; both must return the same number of tensors")
    _same_types("the else body of poptorch.cond", else_out, then_out)
    return if_end(else_out, closed, flag)


def traced_nop(x: torch.Tensor) -> torch.Tensor:
    return nop(x)


def traced_dynamic_slice(x: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``poptorch.dynamic_slice`` in the capture: PopTorch's compile-time checks, then the op."""
    if size == 0:
        raise Error("The start and end of a slice must be different.")
    if size < 0:
        raise Error("Taking a slice of a tensor with the end less than the start is not supported.")
    if step < 1:
        raise Error("Slicing step must be at least 1")
    dim = _dim(x, dim)
    if x.shape[dim] % size:
        raise Error(f"The size of the slice ({size}) must be a factor of the slicing dimension ({x.shape[dim]}).")
    return dynamic_slice(x, dim, _start_tensor(start), size, step)


def traced_dynamic_update(x: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                          size: int) -> torch.Tensor:
    """``poptorch.dynamic_update`` in the capture: PopTorch's compile-time checks, then the op."""
    if size == 0:
        raise Error("The start and end of a slice must be different.")
    if size < 0:
        raise Error("Taking a slice of a tensor with the end less than the start is not supported.")
    dim = _dim(x, dim)
    if src.shape[dim] != size or size > x.shape[dim]:
        raise Error(f"dynamic_update: the source has {src.shape[dim]} rows along dimension {dim} and the size is "
                    f"{size}; the source must have `size` rows, at most the {x.shape[dim]} of the input")
    return dynamic_update(x, src, dim, _start_tensor(start))


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise Error(f"Dimension {dim} is out of range for a tensor of shape {list(x.shape)}")
    return dim % x.dim()


def _start_tensor(start: torch.Tensor) -> torch.Tensor:
    if start.dtype.is_floating_point or start.dtype == torch.bool:
        raise Error(f"Expected integer typed start tensor, got {start.dtype}")
    if start.numel() != 1:
        raise Error(f"The start of a dynamic slice must be one element, got shape {list(start.shape)}")
    return start.reshape(1)


# =========================================================================================
# IR: regions of the ATen graph become the bodies of loop and if nodes
# =========================================================================================
@dataclass
class Region:
    """A body being lowered: the IR node list it interrupted, and (loops) its carried values."""
    kind: str                       # "for_loop", "then", "else"
    outer: list
    inits: list
    carried: list
    then: tuple | None = None       # (then nodes, then results) while the else body is lowered


def open_region(c, kind: str, inits=(), carried=(), then=None) -> None:
    """Emit the IR nodes lowered from now on into a new body (`close_region` ends it)."""
    c.__dict__.setdefault("regions", []).append(Region(kind, c.ir.nodes, list(inits), list(carried), then))
    c.ir.nodes = []


def close_region(c, kind: str) -> tuple[Region, list]:
    regions = c.__dict__.get("regions") or []
    if not regions or regions[-1].kind != kind:
        raise c.error(f"the capture of a device {kind} body is out of order (its markers do not nest)")
    region = regions.pop()
    body, c.ir.nodes = c.ir.nodes, region.outer
    return region, body


def free_values(bodies: list[list[Node]], results: list, own: list[Value]) -> list[Value]:
    """The values the bodies (and their results) read that they do not make: outer values."""
    made = {v.id for v in own} | {v.id for body in bodies for n in body for v in n.outputs}
    out = {}
    for v in [v for body in bodies for n in body for v in n.inputs] + [r for r in results if isinstance(r, Value)]:
        if v.id not in made:
            out.setdefault(v.id, v)
    return list(out.values())


def _same_site(c, body: list[Node], what: str) -> None:
    t = c.template
    for n in body:
        if (n.ipu, n.stage) != (t.ipu, t.stage):
            raise c.error(f"the body of {what} runs on IPU {t.ipu} (stage {t.stage}), but its op {n.op} at {n.source} "
                          f"is placed on IPU {n.ipu} (stage {n.stage}): a device loop or branch runs on one IPU; "
                          "put the whole call in one block")
        n.block, n.phase, n.pass_ = t.block, t.phase, t.pass_


def emit_loop(c, count: int, inits: list, carried: list[Value], results: list[Value], body: list[Node],
              what: str) -> list[Value]:
    """A `loop` node running `body` `count` times: `carried` (body-side values) start as `inits`
    and take `results` after each iteration; returns the final values. An init of None leaves
    its carried tensor as it is (a buffer the body writes before it reads it)."""
    _same_site(c, body, what)
    for p, r in zip(carried, results):
        if tuple(p.shape) != tuple(r.shape) or p.dtype != r.dtype:
            raise c.error(f"the body of {what} makes {r} for the carried {p}: the values a loop carries keep their "
                          "shapes and types")
    given = [v for v in inits if v is not None]
    inputs = given + [v for v in free_values([body], results, carried) if not any(v is g for g in given)]
    initial = [None if v is None else next(i for i, g in enumerate(inputs) if g is v) for v in inits]
    return c.emit("loop", inputs, [(p.shape, p.dtype) for p in carried], count=int(count), body=body,
                  carried=list(carried), results=list(results), initial=initial, what=what)


def loop(c, count: int, inits: list, step, what: str) -> list[Value]:
    """Build a loop from a Python function: `step(carried)` emits one iteration's IR (with the
    lowerer `c`) and returns the carried values' new values. An init is a Value, or a (shape,
    dtype) pair for a buffer the body fills (never read before it is written)."""
    carried = [Value(tuple(v[0]), np.dtype(v[1]), f"buffer{i}") if isinstance(v, tuple) else
               Value(v.shape, v.dtype, f"carried{i}") for i, v in enumerate(inits)]
    saved, c.ir.nodes = c.ir.nodes, []
    try:
        results = list(step(carried))
    finally:
        body, c.ir.nodes = c.ir.nodes, saved
    return emit_loop(c, count, [None if isinstance(v, tuple) else v for v in inits], carried, results, body, what)


def body_nodes(n: Node):
    """The nodes a loop or if node runs (recursively), else nothing."""
    for key in ("body", "then", "else"):
        for inner in n.attrs.get(key, ()) if n.op in ("loop", "if") else ():
            yield inner
            yield from body_nodes(inner)


def check_scopes(ir) -> None:
    """No value made inside a loop or branch body is used outside it."""
    def visit(nodes: list[Node], visible: set):
        for n in nodes:
            for v in n.inputs:
                if v.id in hidden and v.id not in visible:
                    raise Error(f"a value made inside the body of {hidden[v.id]} is used outside it by {n.op} at "
                                f"{n.source}: return it from the body to use it outside")
            if n.op in ("loop", "if"):
                for key in ("body", "then", "else"):
                    inner = n.attrs.get(key)
                    if inner is not None:
                        own = {v.id for m in inner for v in m.outputs} | {v.id for v in n.attrs.get("carried", ())}
                        visit(inner, visible | own)
            visible |= {v.id for v in n.outputs}

    hidden = {}
    for n in ir.nodes:
        for inner in body_nodes(n):
            for v in inner.outputs:
                hidden[v.id] = n.attrs.get("what", n.op)
    visit(ir.nodes, set())
    results = flatten_values(ir.outputs) + ([ir.loss] if ir.loss is not None else []) + list(ir.grads.values())
    for v in results:
        if v.id in hidden:
            raise Error(f"a value made inside the body of {hidden[v.id]} is an output of the model: return it from "
                        "the body to use it outside")


# ---- ATen lowerings of the markers and ops (registered in aten.LOWERINGS) -------------------------
ATEN: dict = {}
"""ATen op packet -> lowering to IR, with its `doc` (docs/ops.md) and `raw` flag, as `aten.lowers` registers."""


def aten_lowering(packet, doc: str):
    def deco(fn):
        fn.doc, fn.raw = doc, False
        ATEN[packet] = fn
        return fn
    return deco


_ops = torch.ops.poptorch_lite


@aten_lowering(_ops.loop_begin, doc="opens a loop body (poptorch.for_loop): its carried values")
def _loop_begin(c, inputs):
    carried = [Value(v.shape, v.dtype, f"carried{i}") for i, v in enumerate(inputs)]
    open_region(c, "for_loop", inits=inputs, carried=carried)
    return carried


@aten_lowering(_ops.loop_end, doc="loop (ipusim Repeat over the body lowered once, carried tensors updated in place)")
def _loop_end(c, outputs, carried, count):
    # (`carried` names the body's carried values for the capture; functionalisation replaces those
    # the body updates in place by their new values, so the region's own are used)
    region, body = close_region(c, "for_loop")
    return emit_loop(c, count, region.inits, region.carried, list(outputs), body, "poptorch.for_loop()")


@aten_lowering(_ops.if_begin, doc="opens the then body of a branch (poptorch.cond)")
def _if_begin(c, condition):
    open_region(c, "then")
    return condition


@aten_lowering(_ops.if_else, doc="closes the then body, opens the else body")
def _if_else(c, then_outputs, condition):
    _, then_body = close_region(c, "then")
    open_region(c, "else", then=(then_body, list(then_outputs)))
    return list(then_outputs)


@aten_lowering(_ops.if_end, doc="if (ipusim If on the condition's device value: one branch runs)")
def _if_end(c, else_outputs, then_outputs, condition):
    region, else_body = close_region(c, "else")
    then_body, then_results = region.then
    else_results = list(else_outputs)
    what = "poptorch.cond()"
    _same_site(c, then_body, what)
    _same_site(c, else_body, what)
    if condition.numel != 1:
        raise c.error(f"poptorch.cond needs a condition of one element, got shape {list(condition.shape)}")
    inputs = [condition] + [v for v in free_values([then_body, else_body], then_results + else_results, [])
                            if v is not condition]
    return c.emit("if", inputs, [(v.shape, v.dtype) for v in then_results], then=then_body, **{"else": else_body},
                  then_results=then_results, else_results=else_results, what=what)


@aten_lowering(_ops.nop, doc="copy (poptorch.nop: a copy the compiler keeps)")
def _nop(c, x):
    return c.one("copy", [x], x.shape, x.dtype)


def _offset(c, start: Value) -> Value:
    return c.reshape(c.cast(start, np.int32), (1,))


@aten_lowering(_ops.dynamic_slice, doc="dynamic_slice (poptorch.dynamic_slice: the start read on the device); a "
                                       "strided view for a step")
def _dynamic_slice(c, x, dim, start, size, step):
    shape = x.shape[:dim] + (int(size),) + x.shape[dim + 1:]
    y = c.one("dynamic_slice", [x, _offset(c, start)], shape, x.dtype, dim=int(dim), size=int(size))
    if step == 1:
        return y
    key = (slice(None),) * dim + (slice(0, int(size), int(step)),)
    return c.one("slice", [y], np.empty(shape, np.bool_)[key].shape, x.dtype, key=key)


@aten_lowering(_ops.dynamic_update, doc="dynamic_update (poptorch.dynamic_update: the start read on the device)")
def _dynamic_update(c, x, src, dim, start):
    return c.one("dynamic_update", [x, c.cast(src, x.dtype), _offset(c, start)], x.shape, x.dtype, dim=int(dim))


# =========================================================================================
# ipusim: loops as Repeat, branches as If (registered in lowering.LOWER)
# =========================================================================================
IR: dict = {}
"""IR op -> lowering to ipusim, as `lowering.lowers` registers."""


def ir_lowering(*ops):
    def deco(fn):
        for op in ops:
            IR[op] = fn
        return fn
    return deco


def lower_body(ctx, nodes: list[Node], env: dict, prog: ip.Sequence, into: dict | None = None):
    """Lower `nodes` into `prog`, their inputs from `env` (value id -> tensor), which receives
    their outputs. A node in `into` (node id -> tensor) makes its result in that tensor: a
    dynamic update in place in its base, an elementwise op into its `out`."""
    from .lowering import LOWER, CompileError, Context
    sub = Context(ctx.lowering, ctx.graph, prog)
    sub.random_ops = ctx.random_ops
    sub.in_place = into or {}
    for m in nodes:
        try:
            ins = [env[v.id] for v in m.inputs]
        except KeyError:
            raise CompileError(f"op {m.op} at {m.source} in a loop or branch body reads a value the body cannot "
                               "see") from None
        lower = LOWER.get(m.op)
        if lower is None:
            raise CompileError(f"op {m.op} (at {m.source}) has no lowering to ipusim")
        sub.name = f"{ctx.name}/{m.op}"
        target = sub.in_place.get(id(m))
        if target is not None and m.op == "unary":
            outs = [ew.unary(sub.graph, m.attrs["fn"], ins[0], prog, sub.name, scale=m.attrs.get("scale", 1.0),
                             bias=m.attrs.get("bias", 0.0), out=target)]
        elif target is not None and m.op == "binary":
            outs = [ew.binary(sub.graph, m.attrs["fn"], ins[0], ins[1], prog, sub.name, out=target)]
        else:
            outs = lower(sub, m, ins)
        for v, t in zip(m.outputs, outs):
            if t is not None:
                env[v.id] = t
    drawn = sub.random_ops - ctx.random_ops
    ctx.random_ops = sub.random_ops
    return drawn


def written_in_place(body: list[Node], carried: list[Value], results: list[Value]) -> dict[int, int]:
    """The nodes that can make a carried value's new value in its own tensor (node id -> slot):
    a dynamic update of the carried value that nothing else reads, or an elementwise op that
    runs after every read of the carried value (and of its views). Neither when the old value
    is itself a result (it would be read after it is overwritten)."""
    position = {id(m): i for i, m in enumerate(body)}
    alias = {p.id: p.id for p in carried}            # value id -> the carried value it views
    last_read: dict[int, int] = {}
    readers: dict[int, int] = {}
    for i, m in enumerate(body):
        for v in m.inputs:
            if v.id in alias:
                last_read[alias[v.id]] = i
                readers[alias[v.id]] = readers.get(alias[v.id], 0) + 1
        if m.op in VIEW_OPS and m.inputs[0].id in alias:
            alias[m.outputs[0].id] = alias[m.inputs[0].id]
    in_results = {alias.get(r.id, r.id) for r in results}
    out = {}
    for k, (p, r) in enumerate(zip(carried, results)):
        m = r.producer
        if m is None or id(m) not in position or p.id in in_results or sum(x is r for x in results) != 1:
            continue
        if m.op == "dynamic_update" and m.inputs[0] is p and readers.get(p.id) == 1:
            out[id(m)] = k
        elif m.op in ("unary", "binary") and last_read.get(p.id, -1) <= position[id(m)] \
                and tuple(r.shape) == tuple(p.shape) and r.dtype == p.dtype:
            out[id(m)] = k
    return out


def _state(g: ip.Graph, v: Value, name: str, dim: int | None) -> ip.Tensor:
    """A tensor for a carried value: laid out for slicing along `dim` when a dynamic update writes
    it, else spread over the tiles in vector grains (a step's work is small: spread, it runs on
    many tiles at once)."""
    if dim is not None:
        return dyn.sliceable(g, v.dtype, v.shape, dim, name)
    t = g.addVariable(v.dtype, v.shape, name, category="activations", always_live=False)
    g.map_linearly(t, grain=dyn.GRAIN, min_elements_per_tile=dyn.GRAIN)
    return t


@ir_lowering("loop")
def _loop(ctx, n: Node, ins):
    a, g = n.attrs, ctx.graph
    carried, results, body = a["carried"], a["results"], a["body"]
    env = {v.id: t for v, t in zip(n.inputs, ins)}
    # new values made in their carried tensor: a buffer a dynamic update writes is laid out for it
    written = written_in_place(body, carried, results)
    dims = {k: m.attrs["dim"] for m in body for k in [written.get(id(m))] if k is not None
            and m.op == "dynamic_update"}
    state = []
    for k, (p, i) in enumerate(zip(carried, a["initial"])):
        t = _state(g, p, f"{ctx.name}/carried{k}", dims.get(k))
        if i is not None:
            ctx.prog.add(ip.Copy(ins[i], t))
        env[p.id] = t
        state.append(t)
    # outer tensors the body slices dynamically are laid out for it once, before the loop
    outer = {v.id for v in n.inputs}
    for m in body:
        if m.op == "dynamic_slice" and m.inputs[0].id in outer:
            env[m.inputs[0].id] = dyn.laid_out(g, ctx.prog, env[m.inputs[0].id], m.attrs["dim"],
                                               f"{ctx.name}/sliceable")
    prog = ip.Sequence(name=f"{ctx.name}/body")
    if lower_body(ctx, body, env, prog, {node: state[k] for node, k in written.items()}):
        rnd.advance_seed(g, ctx.lowering.seed(g.ipu), prog, name=f"{ctx.name}/advance_seed")
    # the new values replace the old at the end of the iteration, all at once: one that is (a view
    # of) a carried tensor is copied aside before any carried tensor is written
    values = [env[r.id] for r in results]
    for k, v in enumerate(values):
        if v is not state[k] and any(v.var is s.var for s in state):
            aside = g.clone(state[k], f"{ctx.name}/next{k}", category="activations", always_live=False)
            prog.add(ip.Copy(v, aside))
            values[k] = aside
    for v, s in zip(values, state):
        if v is not s:
            prog.add(ip.Copy(v, s))
    ctx.prog.add(ip.Repeat(int(a["count"]), prog))
    return state


@ir_lowering("if")
def _if(ctx, n: Node, ins):
    a, g = n.attrs, ctx.graph
    outs = []
    for i, v in enumerate(n.outputs):
        t = g.addVariable(v.dtype, v.shape, f"{ctx.name}/result{i}", category="activations", always_live=False)
        g.map_linearly(t, grain=4, min_elements_per_tile=64)
        outs.append(t)
    branches = []
    for key in ("then", "else"):
        env = {v.id: t for v, t in zip(n.inputs, ins)}
        prog = ip.Sequence(name=f"{ctx.name}/{key}")
        if lower_body(ctx, a[key], env, prog):
            rnd.advance_seed(g, ctx.lowering.seed(g.ipu), prog, name=f"{ctx.name}/{key}/advance_seed")
        for r, t in zip(a[f"{key}_results"], outs):
            prog.add(ip.Copy(env[r.id], t))
        branches.append(prog)
    predicate = ins[0].reshape(1)
    ctx.prog.add(ip.If(predicate, *branches))
    return outs


@ir_lowering("dynamic_slice")
def _dynamic_slice_ir(ctx, n: Node, ins):
    return [dyn.dynamic_slice(ctx.graph, ins[0], ins[1], n.attrs["dim"], n.attrs["size"], ctx.prog, ctx.name)]


@ir_lowering("dynamic_update")
def _dynamic_update_ir(ctx, n: Node, ins):
    base, src, offset = ins
    dim = n.attrs["dim"]
    if id(n) not in getattr(ctx, "in_place", {}):   # a new tensor: the base copied into it, then updated
        out = dyn.sliceable(ctx.graph, base.dtype, base.shape, dim, ctx.name)
        ctx.prog.add(ip.Copy(base, out))
        base = out
    return [dyn.dynamic_update(ctx.graph, base, src, offset, dim, ctx.prog, ctx.name)]
