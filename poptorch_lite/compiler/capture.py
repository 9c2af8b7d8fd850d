"""The torch.fx capture behind :func:`op_placement`: trace a model with torch.fx and record the
block of every node. (The compiler captures through PyTorch 2's stack: :mod:`.export`.)

:func:`capture` runs ``torch.fx`` symbolic tracing with :class:`BlockTracer`, which
keeps block annotations active (see ``poptorch_lite.api.blocks``) and stores on every
node ``node.meta["block"]``: the :class:`BlockRef` active when the node was created
(``DEFAULT_REGION`` before the first block; None for nodes, such as the output,
created after a block closed). Op nodes also get ``node.meta["source"]``, the
user's ``file:line`` that issued them. Standard ``torch.nn`` layers stay leaf
modules (one ``call_module`` node each); ``BeginBlock`` works on them too. A
stateless module created inside ``forward`` (``nn.L1Loss()(x, y)``) is traced
through.

An op issued after a ``with Block`` closed and before the next block starts is a
:class:`BlockError` naming the op and its source line, as in PopTorch. One
exception: taking an item of a multi-output op (``a, b = torch.split(x, n)``) is
no computation and goes with the op that produced the tuple.

:func:`place_graph` places a captured graph under an execution strategy and checks
that data flows forward through stages (pipelines) or phases (phased execution).
:func:`op_placement` does both and returns, for every op, its block, stage, IPU and
phase: what PopTorch only prints in its debug log, here as data.
"""

from __future__ import annotations

import operator
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_leaves

from ..api import arguments
from ..api.blocks import BlockError, BlockRef, BlockTrace, block_annotation, tracing_blocks
from ..api.strategies import ExecutionStrategy, PipelinedExecution, Placement, check_data_flow

OP_KINDS = ("call_module", "call_function", "call_method")

_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def user_source() -> str:
    """``file:line`` of the innermost caller outside torch and poptorch_lite."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def op_label(node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> str:
    """A short name for an op node: module path and type, function or method name."""
    if node.op == "call_module":
        if root is None:
            return str(node.target)
        return f"{node.target} ({type(root.get_submodule(node.target)).__name__})"
    if node.op == "call_method":
        return f".{node.target}()"
    return f"{getattr(node.target, '__name__', str(node.target))}()"


def describe_op(node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> str:
    """An op for error messages: 'module layer1.conv (Conv2d)', 'function relu()', ..."""
    kind = {"call_module": "module", "call_method": "method", "call_function": "function"}
    return f"{kind[node.op]} {op_label(node, root)}"


class BlockTracer(torch.fx.Tracer):
    """An fx Tracer that records the active block on every node it creates."""

    def __init__(self, trace: BlockTrace, call: arguments.CallArguments):
        super().__init__()
        self._trace = trace
        self._call = call

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """One placeholder per tensor of the call; `forward` runs on the call rebuilt around them."""
        placeholders = [self.create_proxy("placeholder", name, (), {}) for name in self._call.names]
        args, kwargs = self._call.with_tensors(placeholders)
        root = self.root

        def call_forward():
            return root.forward(*args, **kwargs)
        return call_forward, []

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["block"] = self._trace.active
        if kind not in OP_KINDS:
            return node
        node.meta["source"] = user_source()
        if self._trace.active is None:
            if not _unpacks_a_node(node):
                raise outside_block_error(node, self.root, self._trace.last_closed)
            # Picking an item of a multi-output op is no computation: it goes with
            # the op, once the capture has confirmed that the op returns a tuple.
            node.meta["block"] = node.args[0].meta["block"]
            node.meta["unpacks_after"] = self._trace.last_closed
        return node

    def call_module(self, m, forward, args, kwargs):
        hook = block_annotation(m)
        if hook is not None:
            hook.start()
        try:
            self.path_of_module(m)
        except NameError:
            # A module made inside forward (e.g. nn.L1Loss()(x, y)) is not part of
            # the model: trace through it, which is only sound if it has no state.
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
                raise TypeError(
                    f"{type(m).__name__} is created inside forward at {user_source()} and "
                    "has parameters or buffers; create it in __init__ so that it is "
                    "part of the model"
                ) from None
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def _unpacks_a_node(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op in OP_KINDS
    )


def outside_block_error(
    node: torch.fx.Node, root: torch.nn.Module, closed: Optional[BlockRef]
) -> BlockError:
    """The error for an op issued after a block closed and before the next started."""
    if closed is None:
        closed_text, fix = "a block had closed", "wrap it in a `with Block(...)`"
    else:
        closed_text = f"block {closed} had closed"
        fix = f"wrap it in `with Block({closed.user_id!r}):` (the block that closed before it)"
    return BlockError(
        f"{describe_op(node, root)} at {node.meta['source']} is outside any Block. "
        "Ops before the first block run in stage 0 on IPU 0, but once a block has "
        f"started every op must belong to one, and {closed_text} when this op ran. "
        f"To place it, {fix} or start a block with Block.start(...)."
    )


def runs_in_half(module: torch.nn.Module, half_input: bool) -> bool:
    """PopTorch's half semantics: a layer given a float16 input while its parameters are float32
    runs in float16, its parameters cast to float16 for the op (they stay float32 in the model
    and are updated in float32)."""
    return half_input and any(p.dtype == torch.float32 for p in module.parameters())


class MixedPrecisionShapeProp(ShapeProp):
    """fx's ShapeProp, running the layers that `runs_in_half` in float16 as the device does."""

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        half_input = any(getattr(x, "dtype", None) == torch.float16 for x in tree_leaves((args, kwargs)))
        if not runs_in_half(module, half_input):
            return super().call_module(target, args, kwargs)
        half = {n: p.half() if p.dtype == torch.float32 else p for n, p in module.named_parameters()}
        return torch.func.functional_call(module, half, args, kwargs)


def capture(model: torch.nn.Module, *example_inputs, **example_kwargs) -> torch.fx.GraphModule:
    """Trace ``model`` with its blocks; return the fx GraphModule.

    ``forward`` is called as a user calls it (keywords, defaults, ``*args`` and ``**kwargs``,
    tensors nested in tuples, lists, dicts and custom types: see ``poptorch_lite.api.arguments``).
    Each tensor of the call is a placeholder, in the order of ``arguments.bind``; everything
    else (None, numbers, missing inputs with defaults) is fixed, so ``forward(x, labels=None)``
    called as ``capture(model, x)`` traces the inference branch and ``capture(model, x, y)`` the
    training branch. Nodes get ``meta["tensor_meta"]`` from running the graph on the example
    inputs.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    call = arguments.bind(model.forward, example_inputs, example_kwargs)
    with tracing_blocks() as trace:
        root_hook = block_annotation(model)
        if root_hook is not None:
            root_hook.start()
        tracer = BlockTracer(trace, call)
        attributes = set(vars(model))
        graph = tracer.trace(model)
    graph_module = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    for name in set(vars(model)) - attributes:
        # A tensor made in forward: fx keeps it on the model, and the graph module holds it as a
        # buffer. It is a constant of the graph, neither a weight nor the model's attribute.
        constant = getattr(model, name)
        delattr(model, name)
        del graph_module._buffers[name]
        setattr(graph_module, name, constant)
    MixedPrecisionShapeProp(graph_module).propagate(*(t for _, t in call.tensors))
    for node in graph.nodes:
        if "unpacks_after" in node.meta:
            produced = node.args[0].meta.get("tensor_meta")
            if isinstance(produced, TensorMetadata) or not isinstance(produced, (tuple, list)):
                raise outside_block_error(node, graph_module, node.meta["unpacks_after"])
    return graph_module


def traced_blocks(graph: torch.fx.Graph) -> list[BlockRef]:
    """The blocks holding ops, in order of their first op."""
    return list(dict.fromkeys(n.meta["block"] for n in graph.nodes if n.op in OP_KINDS))


def place_graph(graph_module: torch.fx.GraphModule, strategy: ExecutionStrategy) -> Placement:
    """Place a captured graph's blocks and check that data flows forward.

    An op may only use results of its own or an earlier stage (pipelined and
    sharded execution) or phase (phased execution).
    """
    placement = strategy.place(traced_blocks(graph_module.graph))
    for node in graph_module.graph.nodes:
        if node.op not in OP_KINDS:
            continue
        for producer in node.all_input_nodes:
            if producer.op in OP_KINDS:
                check_data_flow(placement.schedule_kind, describe_op(node, graph_module), node.meta["source"],
                                placement[node.meta["block"]], describe_op(producer, graph_module),
                                placement[producer.meta["block"]])
    return placement


@dataclass(frozen=True)
class OpPlacement:
    """Where one op of the captured graph runs."""

    node: str
    op: str
    block: Optional[str]
    stage: int
    ipu: int
    phase: Optional[int]
    source: str


@dataclass(frozen=True)
class PlacementTable:
    """Every op of a captured model with its block, stage, IPU and phase."""

    strategy: ExecutionStrategy
    placement: Placement
    rows: tuple[OpPlacement, ...]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        phased = self.placement.schedule_kind.endswith("phased")
        header = ["node", "op", "block", "stage", "ipu"] + (["phase"] if phased else [])
        lines = [
            [r.node, r.op, "-" if r.block is None else r.block, str(r.stage), str(r.ipu)]
            + ([str(r.phase)] if phased else [])
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]
        text = [repr(self.strategy)]
        for row in [header] + lines:
            text.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(text)


def op_placement(
    model: torch.nn.Module,
    strategy: Optional[ExecutionStrategy] = None,
    *example_inputs,
    **example_kwargs,
) -> PlacementTable:
    """Capture ``model`` on the example inputs and place every op under ``strategy``.

    ``strategy`` defaults to ``PipelinedExecution(AutoStage.SameAsIpu)``, PopTorch's
    default. ``print(op_placement(...))`` shows the table.
    """
    strategy = PipelinedExecution() if strategy is None else strategy
    if not isinstance(strategy, ExecutionStrategy):
        raise TypeError(f"op_placement expects an ExecutionStrategy, got {strategy!r}")
    graph_module = capture(model, *example_inputs, **example_kwargs)
    placement = place_graph(graph_module, strategy)
    rows = []
    for node in graph_module.graph.nodes:
        if node.op not in OP_KINDS:
            continue
        placed = placement[node.meta["block"]]
        rows.append(
            OpPlacement(
                node=node.name,
                op=op_label(node, graph_module),
                block=placed.block.user_id,
                stage=placed.stage,
                ipu=placed.ipu,
                phase=placed.phase,
                source=node.meta["source"],
            )
        )
    return PlacementTable(strategy, placement, tuple(rows))
